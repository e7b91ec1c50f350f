"""xgrammar as pagelm's guided-decoding backend: JSON schemas, regexes, choices and EBNF
grammars compiled with xgrammar's ``GrammarCompiler`` against the model's vocabulary, one
``GrammarMatcher`` per request, advanced and filled in batches by ``BatchGrammarMatcher``
(calls that release the GIL).

xgrammar is imported only when a guided request arrives (``pip install 'pagelm[xgrammar]'``),
so this module loads, and the engine starts, without it.

Settings (``plugin_config={"xgrammar": {...}}``): ``any_whitespace`` (default true: JSON may
use any whitespace between tokens, as models trained on pretty-printed JSON expect),
``max_whitespace_cnt`` (default none: no bound on one whitespace run),
``compile_threads`` (default 8: threads one compile may use) and ``fill_threads`` (threads
that fill a batch's bitmask rows; default 4, fewer on machines with fewer than 8 cores:
measured on an H100 host, 64 rows of a 128k vocabulary take 0.30 ms on one thread, 0.21 ms
on 4 and 0.43 ms on 8, as more threads cost more to hand the rows out than they save).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pagelm import hookimpl
from pagelm.sampling_params import GuidedDecodingParams
from pagelm.plugins.structured_output.backend import GrammarBackend
from pagelm.plugins.structured_output.grammar import CompiledGrammar, StructuredOutputGrammar

PAGELM_PLUGIN_API = "2.25"

_SETTINGS = {"any_whitespace": bool, "max_whitespace_cnt": int, "compile_threads": int, "fill_threads": int}
_DEFAULT_FILL_THREADS = 4
_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar", "choice": "choice"}
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# Schema keywords whose values are data, not schemas (left as they are).
_LITERAL_KEYWORDS = {"enum", "const", "default", "examples", "required"}


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        for i, token in enumerate(token_ids):
            if not self.matcher.accept_token(token):
                if i:
                    self.matcher.rollback(i)
                return False
        return True

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XgrammarCompiledGrammar(CompiledGrammar):
    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled

    @property
    def memory_size_bytes(self) -> int:
        return self.compiled.memory_size_bytes

    def new_grammar(self) -> XgrammarGrammar:
        import xgrammar as xgr

        return XgrammarGrammar(xgr.GrammarMatcher(self.compiled))


class XgrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, config, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        super().__init__(config, tokenizer, vocab_size, eos_token_ids)
        import xgrammar as xgr

        settings = config.plugin_config.get(self.name) or {}
        self.any_whitespace = settings.get("any_whitespace", True)
        self.max_whitespace_cnt = settings.get("max_whitespace_cnt")
        info = _tokenizer_info(xgr, tokenizer, vocab_size, sorted(eos_token_ids))
        # The manager caches compiled grammars (bounded by memory); xgrammar's own cache is off.
        self.compiler = xgr.GrammarCompiler(
            info, max_threads=settings.get("compile_threads", 8), cache_enabled=False
        )
        fill_threads = settings.get("fill_threads")
        if fill_threads is None:
            fill_threads = max(1, min(_DEFAULT_FILL_THREADS, (os.cpu_count() or 2) // 2))
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=fill_threads)

    @classmethod
    def validate(cls, config) -> list[str]:
        problems = []
        if importlib.util.find_spec("xgrammar") is None:
            problems.append("xgrammar is not installed (pip install 'pagelm[xgrammar]')")
        settings = config.plugin_config.get(cls.name) or {}
        for key, value in settings.items():
            kind = _SETTINGS.get(key)
            if kind is None:
                problems.append(f"plugin_config.xgrammar: unknown setting {key!r}; known: {sorted(_SETTINGS)}")
            elif value is not None and type(value) is not kind:
                problems.append(f"plugin_config.xgrammar.{key} must be a {kind.__name__}, got {value!r}")
            elif key in ("compile_threads", "fill_threads") and value is not None and value < 1:
                problems.append(f"plugin_config.xgrammar.{key} must be >= 1, got {value!r}")
        return problems

    @classmethod
    def validate_request(cls, params: GuidedDecodingParams) -> None:
        import xgrammar as xgr

        kind = params.kind
        with _as_value_error(kind):
            if kind == "json":
                xgr.Grammar.from_json_schema(json_schema_for_xgrammar(params.spec))
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)

    def compile(self, params: GuidedDecodingParams) -> XgrammarCompiledGrammar:
        kind, c = params.kind, self.compiler
        json_options = dict(any_whitespace=self.any_whitespace, max_whitespace_cnt=self.max_whitespace_cnt)
        with _as_value_error(kind):
            if kind == "json":
                compiled = c.compile_json_schema(json_schema_for_xgrammar(params.spec), **json_options)
            elif kind == "json_object":  # any object: a schema without strict mode's closed objects
                compiled = c.compile_json_schema('{"type": "object"}', strict_mode=False, **json_options)
            elif kind == "regex":
                compiled = c.compile_regex(params.regex)
            elif kind == "choice":
                compiled = c.compile_grammar(choice_grammar(params.choice))
            else:
                compiled = c.compile_grammar(params.grammar)
        return XgrammarCompiledGrammar(compiled)

    def batch_accept_tokens(
        self, grammars: Sequence[StructuredOutputGrammar], token_ids: Sequence[Sequence[int]]
    ) -> list[bool]:
        if len(grammars) == 1 or any(len(tokens) != 1 for tokens in token_ids):  # one, or drafts: a loop
            return super().batch_accept_tokens(grammars, token_ids)
        import xgrammar as xgr

        # One call that drops the GIL (a rejected token leaves its matcher as it was).
        return xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in grammars], [t[0] for t in token_ids])

    def fill_bitmasks(
        self, grammars: Sequence[StructuredOutputGrammar], bitmask: torch.Tensor, rows: Sequence[int] | None = None
    ) -> None:
        if len(grammars) == 1:
            grammars[0].fill_bitmask(bitmask, 0 if rows is None else rows[0])
        else:
            indices = None if rows is None else list(rows)
            self.batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, indices)

    @classmethod
    def offload(cls, config, vocab_size: int, eos_token_ids: frozenset[int], rows: int, *, pin_memory: bool):
        """The grammar process: xgrammar's batch calls release the GIL but need it around
        them, which slowed every stage of the step loop beside them (see grammar_process)."""
        from pagelm.plugins.structured_output.grammar_process import GrammarProcess

        return GrammarProcess(cls, config, vocab_size, eos_token_ids, rows, pin_memory=pin_memory)


def json_schema_for_xgrammar(spec: str) -> str:
    """Work around xgrammar 0.2.8 compiling a string's ``minLength``/``maxLength`` to
    ``[^"\\\r\n]{m,n}``, which lets raw control characters (a tab) into the string: invalid
    JSON. Such strings get the equivalent ``pattern`` of printable, unescaped characters."""
    return json.dumps(_bounded_strings_as_patterns(json.loads(spec)))


def _bounded_strings_as_patterns(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _LITERAL_KEYWORDS else _bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = rf'^[^"\\\x00-\x1f]{{{low},{high}}}$'
    return out


def choice_grammar(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are valid in xgrammar's EBNF literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _tokenizer_info(xgr: Any, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary, with special tokens (BOS, pad, chat markers) blanked:
    xgrammar would otherwise read ``<|im_start|>`` as text and allow it inside JSON strings,
    and the detokenizer drops it. EOS stays allowed where the grammar ends (stop tokens)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids or None)
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return info  # its encoded vocab is not get_vocab(); keep xgrammar's own reading
    special = {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    special |= set(tokenizer.all_special_ids)
    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special:
            encoded[i] = token
    return xgr.TokenizerInfo(
        encoded, info.vocab_type, vocab_size=vocab_size, stop_token_ids=info.stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )


@contextlib.contextmanager
def _as_value_error(kind: str) -> Iterator[None]:
    """xgrammar's RuntimeErrors -> ``ValueError("guided_decoding.<field>: invalid ...: why")``."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError) as exc:
        why = _LOCATION.sub("", str(exc).strip()) or type(exc).__name__
        raise ValueError(f"guided_decoding.{kind}: invalid {_WHAT.get(kind, kind)}: {why}") from None


@hookimpl
def pagelm_register_structured_output_backends(registry) -> None:
    registry.add(XgrammarBackend.name, XgrammarBackend)
