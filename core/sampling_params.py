"""SamplingParams: how one prompt is decoded, with vLLM's names and validation."""

from __future__ import annotations

import copy
import dataclasses
import json as _json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

# Below this temperature a request is decoded greedily (argmax), as in vLLM.
SAMPLING_EPS = 1e-5
# Every integer parameter fits a signed 64-bit integer (as vLLM bounds them): it crosses the
# engine-core wire and becomes a torch.long. 2**63 used to pass and then crash the step.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# logit_bias values, as OpenAI bounds them: +-100 already makes a token certain or impossible.
MAX_LOGIT_BIAS = 100.0
# A request's bad_words after tokenization: at most this many token sequences, this many tokens
# in all (vLLM's VLLM_MAX_NUM_BAD_WORDS / VLLM_MAX_BAD_WORDS_TOTAL_TOKENS defaults).
MAX_BAD_WORDS, MAX_BAD_WORDS_TOKENS = 128, 1024


@dataclass
class GuidedDecodingParams:
    """An output constraint (vLLM's names); exactly one field is set.

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON object;
    ``regex``: the whole output matches it; ``choice``: the output is one of these strings;
    ``grammar``: an EBNF grammar (xgrammar's GBNF dialect, start rule ``root``).
    Malformed values raise ``ValueError`` naming the field; whether the backend can compile
    the constraint is checked when the request is added.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in GUIDED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"guided_decoding must set exactly one of {', '.join(GUIDED_KINDS)}; got {given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"guided_decoding.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("guided_decoding.json must be a JSON schema (an object)")
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"guided_decoding.json must be a dict or a JSON string, got {type(self.json).__name__}")
        if self.json_object not in (True, False):
            raise ValueError("guided_decoding.json_object must be a bool")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"guided_decoding.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("guided_decoding.choice must be a non-empty list of strings")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("guided_decoding.choice must hold non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in GUIDED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one canonical string: with ``kind``, the compiled-grammar cache key."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return _json.dumps(schema, separators=(",", ":"))  # key order matters: it is the output's
        if kind == "json_object":
            return ""
        if kind == "choice":
            return _json.dumps(self.choice)
        return getattr(self, kind)


# vLLM's newer name for the same constraint (``SamplingParams.structured_outputs``).
StructuredOutputsParams = GuidedDecodingParams


# The numeric parameters' allowed values: name -> (whether a value is allowed, the allowed
# values as an error message names them). Booleans and integers past int64 were refused before.
_PENALTY = (lambda v: -2.0 <= v <= 2.0, "in [-2, 2]")
_ALLOWED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: isinstance(v, int) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v: not v < 0.0, "a float >= 0"),
    "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 1, or 0 / -1 to disable"),
    "min_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "seed": (lambda v: v is None or isinstance(v, int), "an integer or None"),
    "presence_penalty": _PENALTY,
    "frequency_penalty": _PENALTY,
    "repetition_penalty": (lambda v: 0.0 < v and math.isfinite(v), "a finite float > 0"),
    "max_tokens": (lambda v: v is None or (isinstance(v, int) and v >= 1), "an integer >= 1 or None"),
    "min_tokens": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
}


@dataclass
class SamplingParams:
    """Per-request decoding parameters. Invalid values raise ``ValueError`` naming the
    parameter and its allowed range, at construction time, before any work is queued."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    # The top-k logprobs of each sampled / prompt token (with the token's own); -1: the whole
    # vocabulary, as in vLLM (resolved by ``num_logprobs`` where the vocabulary is known).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Structured output: constrain the text to a JSON schema, regex, choice or grammar.
    guided_decoding: GuidedDecodingParams | None = None
    # vLLM's newer name for guided_decoding: either may be given, both then hold the same.
    structured_outputs: GuidedDecodingParams | None = None
    # Logits processors applied to this request alone (vLLM's names; docs/sampling.md):
    # token id -> bias in [-100, 100], the only ids that may be sampled, words never generated.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Keep only the last k prompt tokens (-1: as many as the context leaves room for).
    truncate_prompt_tokens: int | None = None
    # Per-request data for plugins (vLLM's name): a policy or proposer reads
    # ``request.sampling_params.extra_args``. JSON-like values only: it crosses to the engine
    # core's process as msgpack.
    extra_args: dict[str, Any] | None = None
    # Filled by the engine from generation_config / tokenizer; not a user knob.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # bad_words as token sequences: the input processor tokenizes them (the engine core has
    # no tokenizer); they cross to the engine core and the ranks with the rest.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.guided_decoding, dict):  # from the engine-core wire format, YAML, JSON
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = GuidedDecodingParams(**self.structured_outputs)
        if self.structured_outputs is not None and self.guided_decoding not in (None, self.structured_outputs):
            raise ValueError("structured_outputs and guided_decoding are the same constraint: give one of them")
        self.guided_decoding = self.structured_outputs = self.guided_decoding or self.structured_outputs
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _token_keys(self.logit_bias)
        if isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) for w in self.bad_words):
            self.bad_words = list(dict.fromkeys(self.bad_words))  # vLLM drops repeats
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or (isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX):
                raise bad(name, f"an integer in [{INT64_MIN}, {INT64_MAX}]")
        if any(isinstance(t, int) and t > INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"a list of token ids <= {INT64_MAX}")

        for name, (allowed, what) in _ALLOWED.items():
            if not allowed(getattr(self, name)):
                raise bad(name, what)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < -1):
                raise bad(name, "an integer >= 0, -1 for the whole vocabulary, or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise bad("guided_decoding", "a GuidedDecodingParams or None")
        if self.extra_args is not None:
            _check_extra_args(self.extra_args)
        self._validate_logits_processors()

    def _validate_logits_processors(self) -> None:
        """logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens: their shapes and
        ranges (the vocabulary is the input processor's to check)."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
            for token, value in bias.items():
                if not _is_token_id(token):
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
                ):
                    raise ValueError(
                        f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r} for token {token}"
                    )
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, (list, tuple)) or not allowed or not all(_is_token_id(t) for t in allowed)
        ):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), got {allowed!r}")
        words = self.bad_words
        if words is not None and (not isinstance(words, list) or any(not isinstance(w, str) or not w for w in words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}")
        if self.bad_words_token_ids is not None:
            check_bad_words_token_ids(self.bad_words_token_ids)
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or 1 <= k <= INT64_MAX)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 (as many as fit), got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def bad_word_prefixes(self) -> list[list[int]]:
        """The bad words of more than one token: banning their last token depends on what the
        output ends with, so a step sampling this request reads its previous tokens."""
        return [w for w in self.bad_words_token_ids or () if len(w) > 1]

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def to_wire(self) -> dict:
        """Plain data for msgpack (another process, another rank); ``SamplingParams(**d)``
        rebuilds it. ``all_stop_token_ids`` is derived from ``stop_token_ids`` there again.
        A JSON schema goes as its JSON text: it may hold integers past 64 bits (valid JSON, an
        ``enum`` of 10**30), which msgpack cannot carry (that was a 500 at the server)."""
        data = dataclasses.asdict(self)
        del data["all_stop_token_ids"], data["structured_outputs"]  # the same as guided_decoding
        if self.logit_bias is not None:  # msgpack maps on the wire have string keys, as JSON's
            data["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.guided_decoding is not None and isinstance(self.guided_decoding.json, dict):
            data["guided_decoding"]["json"] = self.guided_decoding.spec
        return data


def num_logprobs(k: int | None, vocab_size: int) -> int | None:
    """How many top logprobs ``logprobs`` / ``prompt_logprobs`` = ``k`` asks for: -1 is vLLM's
    "the whole vocabulary", which only the engine (knowing the model) can turn into a number."""
    return vocab_size if k == -1 else k


def _is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX


def _token_keys(bias: dict) -> dict:
    """logit_bias keys as ints: JSON, YAML and the wire give them as strings ("50256"), as
    OpenAI's API does."""
    out = {}
    for key, value in bias.items():
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}") from None
        out[key] = value
    return out


def check_bad_words_token_ids(words: Any) -> None:
    if not isinstance(words, list) or not all(
        isinstance(w, list) and w and all(_is_token_id(t) for t in w) for w in words
    ):
        raise ValueError(f"bad_words_token_ids must be a list of non-empty token id lists, got {words!r}")
    if len(words) > MAX_BAD_WORDS or sum(map(len, words)) > MAX_BAD_WORDS_TOKENS:
        raise ValueError(
            f"bad_words must come to at most {MAX_BAD_WORDS} token sequences of {MAX_BAD_WORDS_TOKENS} "
            f"tokens in all once tokenized, got {len(words)} of {sum(map(len, words))}"
        )


def _check_extra_args(extra_args: Any) -> None:
    """``extra_args`` crosses to the engine core's process as msgpack: JSON values only, and
    integers within 64 bits (JSON can hold 2**70, msgpack cannot: it failed the request at
    the wire, after validation)."""
    if not isinstance(extra_args, dict) or not all(isinstance(k, str) for k in extra_args):
        raise ValueError(f"extra_args must be a dict with string keys, or None, got {extra_args!r}")
    try:
        _json.dumps(extra_args, allow_nan=False)
        msgpack.packb(extra_args)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(
            f"extra_args must hold JSON values only, integers within 64 bits (it crosses processes): {exc}"
        ) from None
