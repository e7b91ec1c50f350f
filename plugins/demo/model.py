"""pagelm's built-in demo model: a few-million-parameter Llama and a byte-level BPE tokenizer,
trained in a couple of CPU minutes on the Python standard library and cached as a normal Hugging
Face directory, so ``pagelm`` runs with no MODEL argument and no network.

    ensure_demo_model()  ->  ~/.cache/pagelm/demo-llama-v1/   (trained once, reused afterwards)
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from filelock import FileLock
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pagelm.models.testing import IM_END, IM_START, chatml_tokenizer, train_bpe_tokenizer

# Bump the version whenever the recipe changes, so caches holding an older model are not reused.
DEMO_MODEL_NAME = "demo-llama-v1"
TRAINING_LOG = "training_log.json"

# Parts of the stdlib that are data more than code (codec tables, pydoc's topic text) or that
# a Python build may or may not ship (tests, site-packages).
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__phello__"}


# Pre-tokenization for code: a word keeps the space *after* it ("import ", "def ", "return "),
# and a newline keeps the indentation after it ("\n        "). GPT-2's rule glues the space to
# the next word instead, which leaves prompts such as "import " ending on a lone-space token
# the model has hardly seen.
CODE_SPLIT_PATTERN = r"\w+ ?|[^\s\w]+ ?|\n[ \t]*|\s+"


@dataclass(slots=True)
class DemoModelArgs:
    """Shape of the demo model; the defaults give ~2M parameters.

    Two layers, not four: on two CPU cores in ~150 s a 2-layer model takes ~1.6x the steps
    of a 4-layer one (~930 vs ~570 at bs 16 x 128) and ends lower (2.9 vs 3.6 nats/token).
    """

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024


# --------------------------------------------------------------------------------------------
# Cache location
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$PAGELM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagelm``, else ``~/.cache/pagelm``."""
    if os.environ.get("PAGELM_CACHE_DIR"):
        return Path(os.environ["PAGELM_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pagelm"


def ensure_demo_model(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the demo model's directory, training it first if the cache does not hold it.

    Training writes into a temporary sibling directory that is renamed into place at the end,
    so a killed run never leaves a half-written model; a file lock makes racing processes wait
    for the first one instead of training twice.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / DEMO_MODEL_NAME
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{DEMO_MODEL_NAME}.lock")):
        if final.is_dir():  # another process finished it while we waited
            return final
        # Holding the lock, any leftover temp dir is from a killed run.
        for stale in root.glob(f".{DEMO_MODEL_NAME}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_MODEL_NAME}-", dir=root))
        try:
            if progress:
                print(f"pagelm: training the demo model into {final} (once, about 3 minutes)", file=sys.stderr)
            train_demo_model(tmp, progress=progress)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# --------------------------------------------------------------------------------------------
# Corpus and tokenizer
# --------------------------------------------------------------------------------------------


def stdlib_sources(max_bytes: int) -> list[tuple[str, str]]:
    """``(relative path, source)`` of stdlib ``.py`` files, sorted by path, up to ``max_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in stdlib.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1]) and not p.name.startswith("_sysconfigdata")
    )
    # Take every k-th file so a small budget still spans the alphabet (asyncio .. zipfile).
    sizes = [p.stat().st_size for p in paths]
    stride = max(1, round(sum(sizes) / max_bytes))
    sources, total = [], 0
    for p in paths[::stride] + [p for i, p in enumerate(paths) if i % stride]:
        if total >= max_bytes:
            break
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        sources.append((p.relative_to(stdlib).as_posix(), text))
        total += len(text)
    return sources


def chat_examples(sources: list[tuple[str, str]], max_chars: int = 4000) -> list[str]:
    """ChatML conversations "user asks for a documented stdlib function, assistant writes it",
    so the model learns the template and to end its turn with ``<|im_end|>``."""
    chats = []
    for _, text in sources:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            # Top-level defs start at column 0, so whole lines are the exact source.
            code = "".join(lines[node.lineno - 1 : node.end_lineno]).rstrip() if doc else ""
            if not code or len(code) > max_chars:
                continue
            summary = doc.strip().splitlines()[0]
            request = f"Write a Python function {node.name}({ast.unparse(node.args)}): {summary}"
            chats.append(
                f"{IM_START}user\n{request}{IM_END}\n{IM_START}assistant\n```python\n{code}\n```{IM_END}\n"
            )
    return chats


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any UTF-8 text encodes) with bos/eos/pad, ChatML specials and template,
    pre-split into code-aware pieces (``CODE_SPLIT_PATTERN``)."""
    return chatml_tokenizer(train_bpe_tokenizer(texts, vocab_size, split_pattern=CODE_SPLIT_PATTERN))


def _token_stream(tokenizer: PreTrainedTokenizerFast, docs: list[str]) -> torch.Tensor:
    """Every document's tokens, each followed by EOS, as one 1-D tensor."""
    encodings = tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------------------------
# Model training
# --------------------------------------------------------------------------------------------


def _lr_scale(progress: float, warmup: float = 0.15, floor: float = 0.1) -> float:
    """Linear warmup, then cosine decay to ``floor`` x the peak; ``progress`` runs 0 -> 1."""
    if progress < warmup:
        return (progress + 1e-3) / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def _train_loop(
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    *,
    steps: int,
    seq_len: int,
    batch_size: int,
    lr: float,
    seed: int,
    time_budget_s: float | None,
    progress: bool,
) -> list[float]:
    """AdamW on random ``seq_len``-token windows of ``stream``; returns the loss of every step.

    The schedule advances by whichever budget (steps or seconds) is used up faster, so a slow
    machine still ends on a decayed learning rate. Bit-for-bit repeatable when the step budget
    binds (``time_budget_s=None`` makes sure of it).
    """
    assert stream.numel() > seq_len, "corpus shorter than one training window"
    windows = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )
    losses: list[float] = []
    start = time.perf_counter()
    model.train()
    with tqdm(total=steps, desc="training demo model", unit="step", disable=not progress) as bar:
        for step in range(steps):
            elapsed = time.perf_counter() - start
            if time_budget_s is not None and elapsed >= time_budget_s:
                break
            done = max(step / steps, elapsed / time_budget_s if time_budget_s else 0.0)
            for group in opt.param_groups:
                group["lr"] = lr * _lr_scale(done)
            starts = torch.randint(0, stream.numel() - seq_len, (batch_size,), generator=windows)
            batch = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
            loss = model(input_ids=batch, labels=batch).loss  # HF shifts the labels itself
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update(1)
    model.eval()
    return losses


def train_demo_model(
    out_dir: str | Path,
    *,
    steps: int = 800,
    seq_len: int = 128,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    time_budget_s: float | None = 140.0,
    progress: bool = True,
    model_args: DemoModelArgs | None = None,
    corpus_bytes: int = 3_000_000,
    num_threads: int = 2,
) -> Path:
    """Train the tokenizer and model from scratch and write a Hugging Face directory to ``out_dir``.

    Besides the usual files (config.json, model.safetensors, tokenizer files,
    generation_config.json) it writes ``training_log.json``: per-step losses, time, sizes.
    """
    args = model_args or DemoModelArgs()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    t0 = time.perf_counter()

    sources = stdlib_sources(corpus_bytes)
    chats = chat_examples(sources)
    docs = [text for _, text in sources] + chats
    tokenizer = train_tokenizer(docs, args.vocab_size)
    stream = _token_stream(tokenizer, docs)

    config = LlamaConfig(
        **asdict(args),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    prep_s = time.perf_counter() - t0
    losses = _train_loop(
        model, stream, steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr,
        seed=seed, time_budget_s=time_budget_s, progress=progress,
    )

    # Chat replies end at <|im_end|>, plain completions at the end-of-document token.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(str(out))
    log = {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "corpus_files": len(sources),
        "corpus_chars": sum(len(text) for _, text in sources),
        "chat_examples": len(chats),
        "stream_tokens": stream.numel(),
        "seed": seed,
        "steps": len(losses),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "prep_seconds": round(prep_s, 2),
        "total_seconds": round(time.perf_counter() - t0, 2),
        "losses": [round(x, 4) for x in losses],
    }
    (out / TRAINING_LOG).write_text(json.dumps(log, indent=1))
    return out
