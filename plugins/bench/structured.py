"""``pagelm bench structured``: what guided decoding costs, in process (``LLM.generate``).

* **TPOT** (time per output token, mean over requests) of ``B`` requests decoding
  ``--output-len`` tokens at once, with a JSON schema and without, for each ``B`` in
  ``--batch-sizes``. The default schema forces a long document, so constrained requests run
  the full length like the unconstrained ones (EOS ignored); the schema is compiled before
  timing starts.
* **TTFT** of one request whose schema the engine has never seen (the compile is on the
  critical path) against the same schema once cached, and against no schema.

``--model`` is a model directory or a benchmark preset (random weights). Guided decoding
needs a tokenizer: a preset, or a model directory without one, gets a stand-in byte-level
tokenizer with the model's vocabulary size whose token strings are pieces of Python's standard
library sources, so xgrammar does the work a real vocabulary of that size costs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import sysconfig
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagelm.plugins.engine_args import add_engine_args, engine_kwargs

# A list of at least 64 records: far more than 256 tokens before the grammar can complete.
DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 24},
                    "email": {"type": "string", "pattern": "^[a-z]{3,12}@[a-z]{3,10}\\.(com|org|net)$"},
                    "score": {"type": "number", "minimum": 0, "maximum": 100},
                    "tags": {"type": "array", "items": {"enum": ["new", "vip", "churned", "trial"]}, "maxItems": 4},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                    },
                    "active": {"type": "boolean"},
                },
                "required": ["id", "name", "email", "score", "active"],
            },
        },
        "total": {"type": "integer"},
    },
    "required": ["records", "total"],
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "structured", help="guided decoding: TPOT with vs without a JSON schema, TTFT of a new vs cached schema",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory or benchmark preset")
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated batch sizes (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request (default: %(default)s)")
    p.add_argument("--schema", type=Path, help="JSON schema file (default: a list of 64+ records)")
    p.add_argument("--ttft-trials", type=int, default=3, help="never-seen schemas timed; median kept (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="runs per batch size; the fastest is kept (default: 1)")
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    add_engine_args(p)
    p.set_defaults(func=run)


@dataclass
class TPOTResult:
    batch_size: int
    tpot_ms: float
    tpot_schema_ms: float
    overhead: float  # tpot_schema / tpot - 1
    output_tokens: int  # per request, unconstrained run
    output_tokens_schema: float  # mean per request, constrained run


@dataclass
class TTFTResult:
    ttft_plain_ms: float
    ttft_new_schema_ms: float
    ttft_cached_schema_ms: float


def run(args: argparse.Namespace) -> int:
    from pagelm import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    schema = json.loads(args.schema.read_text()) if args.schema else DEFAULT_SCHEMA
    model, kwargs = _resolve_model(args.model, engine_kwargs(args))
    kwargs.setdefault("max_num_seqs", max(batch_sizes))
    kwargs.setdefault("max_model_len", args.input_len + args.output_len + 64)
    llm = LLM(model, **kwargs)
    print(f"model {args.model}: vocab {llm.engine.vocab_size}, device {llm.engine.core.device}, "
          f"backend {llm.config.structured_output_backend}")

    bench = _Bench(llm, args.input_len, args.output_len)
    bench.generate(2, schema)  # warm up: kernels, CUDA graphs, the backend, this schema's compile
    structured_output = llm.engine.core.structured_output  # the built-in GrammarManager's knobs, if it is one
    wait_for_process = getattr(structured_output, "wait_for_grammar_process", None)
    if wait_for_process is not None and wait_for_process(120):  # started by the first guided request
        bench.generate(2, schema)  # and this schema's compile there
    bench.generate(2, None)
    grammar_process = getattr(structured_output, "use_grammar_process", False)
    print(f"guided rows filled by {'a grammar process' if grammar_process else 'a worker thread'}")

    tpot = []
    for b in batch_sizes:
        plain = min((bench.tpot(b, None) for _ in range(args.repeats)), key=lambda r: r[0])
        guided = min((bench.tpot(b, schema) for _ in range(args.repeats)), key=lambda r: r[0])
        tpot.append(TPOTResult(b, plain[0] * 1e3, guided[0] * 1e3, guided[0] / plain[0] - 1, plain[1], guided[1]))

    trials = [bench.ttft(_fresh(schema)) for _ in range(args.ttft_trials)]
    ttft = TTFTResult(*(statistics.median(t[i] for t in trials) * 1e3 for i in range(3)))

    print("\nbatch  TPOT plain  TPOT schema  overhead  tokens/request (plain, schema)")
    for r in tpot:
        print(f"{r.batch_size:>5}  {r.tpot_ms:>7.3f} ms  {r.tpot_schema_ms:>8.3f} ms  {r.overhead:>+7.1%}  "
              f"{r.output_tokens}, {r.output_tokens_schema:.0f}")
    print(f"\nTTFT (batch 1, median of {args.ttft_trials}): no schema {ttft.ttft_plain_ms:.1f} ms, "
          f"new schema {ttft.ttft_new_schema_ms:.1f} ms, cached schema {ttft.ttft_cached_schema_ms:.1f} ms")
    if args.json:
        results = {"tpot": [asdict(r) for r in tpot], "ttft": asdict(ttft), "grammar_process": grammar_process}
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


class _Bench:
    def __init__(self, llm, input_len: int, output_len: int) -> None:
        self.llm, self.input_len, self.output_len = llm, input_len, output_len
        self._prompt = 0

    def _prompts(self, n: int) -> list[dict]:
        # Distinct prompts, so the prefix cache never serves one request from another.
        vocab = self.llm.engine.vocab_size
        out = []
        for _ in range(n):
            self._prompt += 1
            out.append({"prompt_token_ids": [(self._prompt * 7919 + i * 104729) % (vocab - 300) + 256 for i in range(self.input_len)]})
        return out

    def params(self, schema: dict | None, max_tokens: int):
        from pagelm import GuidedDecodingParams, SamplingParams

        guided = GuidedDecodingParams(json=schema) if schema is not None else None
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, guided_decoding=guided)

    def generate(self, n: int, schema: dict | None, max_tokens: int | None = None):
        params = self.params(schema, max_tokens or self.output_len)
        return self.llm.generate(self._prompts(n), params, use_tqdm=False)

    def tpot(self, batch_size: int, schema: dict | None) -> tuple[float, float]:
        """Mean time per output token after the first, and mean output tokens per request."""
        outs = self.generate(batch_size, schema)
        per_request = []
        for out in outs:
            m, n = out.metrics, len(out.outputs[0].token_ids)
            if n > 1:
                per_request.append((m.last_token_time - m.first_token_time) / (n - 1))
        tokens = statistics.mean(len(o.outputs[0].token_ids) for o in outs)
        return statistics.mean(per_request), tokens

    def ttft(self, schema: dict) -> tuple[float, float, float]:
        """TTFT with no schema, a never-seen schema, then the same schema again (cached)."""

        def one(s):
            out = self.generate(1, s, max_tokens=2)[0]
            return out.metrics.first_token_time - out.metrics.arrival_time

        return one(None), one(schema), one(schema)


def _fresh(schema: dict) -> dict:
    """``schema`` plus one property no cache has seen: a compile of the same size."""
    schema = copy.deepcopy(schema)
    if schema.get("type") == "object":
        schema.setdefault("properties", {})[f"run_{uuid.uuid4().hex[:8]}"] = {"type": "boolean"}
    else:
        schema = {"type": "object", "properties": {f"run_{uuid.uuid4().hex[:8]}": schema}}
    schema["required"] = list(schema["properties"])
    return schema


# ---- models without a tokenizer ---------------------------------------------------------------


def _resolve_model(model: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A preset or a directory; without tokenizer files, a stand-in tokenizer (see module doc)."""
    try:
        from pagelm.plugins.bench.presets import resolve_bench_model
    except ImportError:  # no presets in this build
        path = model
    else:
        path, kwargs = resolve_bench_model(model, kwargs)
    kwargs["skip_tokenizer_init"] = False  # guided decoding reads the vocabulary
    if kwargs.get("tokenizer") is None and not any(Path(path, f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        kwargs["tokenizer"] = str(standin_tokenizer(Path(path)))
    return path, kwargs


def standin_tokenizer(model_dir: Path, out_dir: Path | None = None) -> Path:
    """A byte-level BPE tokenizer with ``config.json``'s vocab size: the 256 byte tokens, the
    model's BOS/EOS/PAD ids as special tokens, and the commonest pieces of Python's standard
    library sources for the rest (no merges: it encodes byte by byte, decodes every id)."""
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config["vocab_size"]
    specials = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = config.get(key)
        for i in [ids] if isinstance(ids, int) else ids or []:
            specials[i] = f"<|{key.removesuffix('_token_id')}_{i}|>"
    if out_dir is None:
        from pagelm.plugins.demo.model import default_cache_dir

        tag = "-".join(str(i) for i in sorted(specials))
        out_dir = default_cache_dir() / "bench-tokenizers" / f"vocab{vocab_size}-special{tag}"
    if (out_dir / "tokenizer.json").exists():
        return out_dir

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    pieces = list(alphabet.values())
    seen = set(pieces)
    for piece in _stdlib_pieces(alphabet, vocab_size):
        if len(pieces) + len(specials) >= vocab_size:
            break
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    vocab, it = {}, iter(pieces)
    for i in range(vocab_size):
        token = specials.get(i) or next(it, None) or f"<|unused_{i}|>"
        vocab[token] = i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials.values()))
    named = {}
    for key in ("bos", "eos", "pad"):
        ids = config.get(f"{key}_token_id")
        ids = ids[0] if isinstance(ids, list) and ids else ids
        if ids is not None:
            named[f"{key}_token"] = specials[ids]
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **named)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    fast.save_pretrained(str(tmp))
    try:
        tmp.rename(out_dir)  # atomic: a concurrent run never reads half a tokenizer
    except OSError:  # another run got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies store)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _stdlib_pieces(alphabet: dict[int, str], vocab_size: int):
    """Pre-tokenizer pieces (GPT-2's split) of the stdlib sources, commonest first, then their
    prefixes: enough distinct strings for a large vocabulary, the same on every run."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    counts: Counter[str] = Counter()
    split = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\w+| ?\d+| ?[^\s\w]+|\s+""")
    for path in sorted(stdlib.glob("**/*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        for piece in split.findall(path.read_text(encoding="utf-8", errors="ignore")):
            counts["".join(alphabet[b] for b in piece.encode())] += 1
        if len(counts) > 4 * vocab_size:
            break
    ranked = sorted(counts, key=lambda p: (-counts[p], p))
    yield from ranked
    for piece in ranked:
        for end in range(2, len(piece)):
            yield piece[:end]
