"""The structured-output plugin contract: a backend compiles a request's constraint
(``GuidedDecodingParams``) into a ``CompiledGrammar`` (expensive, shared, cached by the core),
and each request walks its own ``StructuredOutputGrammar`` (a matcher) over the tokens it
samples::

    backend.compile(params) -> CompiledGrammar --new_grammar()--> StructuredOutputGrammar
       (worker thread, cached)                                     (one per request)

    each step, on a worker thread from the moment the previous step's tokens are known
    (``prepare_bitmask``), batched over the requests:
                backend.batch_accept_tokens(grammars, last_sampled)    the previous step's tokens
                backend.fill_bitmasks(grammars, bitmask)               the tokens allowed next

The batch calls should release the GIL while they work, so the step loop runs meanwhile.

A backend gets the engine's EOS ids as its stop tokens and must allow them exactly where the
grammar is complete: the scheduler ends a guided request when it samples one (reason "stop").

The bitmask is xgrammar's layout: ``int32 [rows, ceil(vocab_size / 32)]``, bit ``j % 32`` of
word ``j // 32`` set when token ``j`` is allowed.

Speculative decoding uses ``validate_tokens`` (how many leading drafts the grammar accepts,
without moving: the rest are dropped before verification) and, for the rows of the drafts
kept, ``batch_accept_tokens`` / ``fill_bitmasks`` one draft position at a time, then
``rollback`` over them: only the tokens the rejection sampler emits advance the grammar.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.sampling_params import GuidedDecodingParams


class StructuredOutputGrammar(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``. If one is not allowed, return False and leave the state
        as it was before the call."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of the int32 CPU ``bitmask``."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token (EOS) has been accepted (for
        draft checks: the step loop itself ends a request on the EOS it samples)."""

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar accepts, state unchanged
        (for checking speculative drafts). Backends may override with a cheaper check."""
        accepted = 0
        for token in token_ids:
            if not self.accept_tokens([token]):
                break
            accepted += 1
        if accepted:
            self.rollback(accepted)
        return accepted


class CompiledGrammar(ABC):
    """A constraint compiled against the model's vocabulary; shared by every request that
    asks for the same constraint, and kept in the core's cache."""

    @property
    @abstractmethod
    def memory_size_bytes(self) -> int:
        """What it holds in memory (the cache is bounded by the sum of these)."""

    @abstractmethod
    def new_grammar(self) -> StructuredOutputGrammar:
        """A fresh matcher at the start of the grammar, for one request."""


class GrammarOffload(ABC):
    """Somewhere other than the engine core's threads to advance the guided requests' grammars
    and fill their bitmask rows: a mirror of each request's grammar, addressed by slot (the
    built-in one is xgrammar's grammar process, ``pagelm.plugins.structured_output``). It is an
    accelerator, not the owner: the engine core still compiles every grammar and keeps its own
    matchers, fills the rows the offload leaves, and does all the work itself once the offload
    stops (``result`` returning ``None``). Used by the step loop's thread only; every method
    but ``wait_ready`` and ``result`` returns without waiting."""

    # int32 [rows, ceil(vocab_size / 32)]: the rows ``step`` fills, where the runner reads them.
    bitmask: torch.Tensor

    @abstractmethod
    def wait_ready(self, timeout: float) -> bool:
        """Whether it takes requests, waiting up to ``timeout`` seconds (0: just check)."""

    @abstractmethod
    def add(self, slot: int, params: "GuidedDecodingParams") -> None:
        """Mirror a new request's grammar as ``slot``."""

    @abstractmethod
    def release(self, slot: int) -> None:
        """The request in ``slot`` left the engine."""

    @abstractmethod
    def step(self, slots: list[int], tokens: list[list[int]]) -> None:
        """Advance ``slots[i]`` by ``tokens[i]`` and fill bitmask row ``i`` (slot ``-1``: a
        request it does not mirror, row left). ``result`` reports what was done."""

    @abstractmethod
    def result(self) -> tuple[list[int] | None, list[int]]:
        """Wait for the last ``step``: the rows it left unfilled and the rows whose tokens the
        grammar rejected (``None`` for the first: the offload stopped, every row is left)."""

    @abstractmethod
    def close(self) -> None:
        """Stop; the engine core is shutting down."""


class StructuredOutputBackend(ABC):
    """A guided-decoding library. Registered with ``pagelm_register_structured_output_backends``
    and chosen with ``structured_output_backend=<name>``.

    The class side runs wherever requests arrive (the API process): ``validate`` and
    ``validate_request`` must be cheap and need no tokenizer. An instance is built once per
    engine, in a compile worker thread, when the first guided request arrives.
    """

    name: ClassVar[str]

    def __init__(self, config: "EngineConfig", tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        """``tokenizer``: the model's Hugging Face tokenizer; ``vocab_size``: the model's
        (logits width, possibly larger than the tokenizer's); ``eos_token_ids``: the tokens
        that end a sequence, allowed only where the grammar is complete."""
        self.config = config
        self.vocab_size = vocab_size

    @classmethod
    def validate(cls, config: "EngineConfig") -> list[str]:
        """Problems with using this backend under ``config`` (e.g. its library is missing).
        Checked when the first guided request arrives, so an engine that never sees one does
        not need the library."""
        return []

    @classmethod
    def validate_request(cls, params: "GuidedDecodingParams") -> None:
        """Raise ``ValueError`` naming the field (``guided_decoding.regex: ...``) when the
        constraint is malformed or unsupported. A quick syntax check, before the request is
        queued; anything it misses fails the request when it compiles."""

    @abstractmethod
    def compile(self, params: "GuidedDecodingParams") -> CompiledGrammar:
        """Compile a constraint (runs in a worker thread). Raise ``ValueError`` with a clear
        message when it cannot be compiled."""

    def batch_accept_tokens(
        self, grammars: Sequence[StructuredOutputGrammar], token_ids: Sequence[Sequence[int]]
    ) -> list[bool]:
        """``grammars[i].accept_tokens(token_ids[i])`` for each ``i``; override with one call
        that releases the GIL."""
        return [grammar.accept_tokens(tokens) for grammar, tokens in zip(grammars, token_ids)]

    def fill_bitmasks(
        self, grammars: Sequence[StructuredOutputGrammar], bitmask: torch.Tensor, rows: Sequence[int] | None = None
    ) -> None:
        """Fill row ``rows[i]`` (default ``i``) of ``bitmask`` from ``grammars[i]``; override
        to batch (threads, the GIL released)."""
        for grammar, row in zip(grammars, range(len(grammars)) if rows is None else rows):
            grammar.fill_bitmask(bitmask, row)

    def shutdown(self) -> None:
        """Release threads or other resources."""

    @classmethod
    def offload(
        cls, config: "EngineConfig", vocab_size: int, eos_token_ids: frozenset[int], rows: int, *, pin_memory: bool
    ) -> GrammarOffload | None:
        """A ``GrammarOffload`` for ``structured_output_process``, with a ``rows``-row bitmask
        (pinned for CUDA uploads with ``pin_memory``); None (the default): this backend has
        none, the engine core's worker thread does the work. Called by the engine core when
        its first guided request arrives."""
        return None


def build_backend(
    backend_cls: type[StructuredOutputBackend], config: "EngineConfig", vocab_size: int, eos_token_ids: frozenset[int]
) -> StructuredOutputBackend:
    """A backend instance with the model's tokenizer (the engine core and the grammar process
    each build one)."""
    problems = backend_cls.validate(config)
    if problems:
        raise ValueError(f"structured_output_backend={backend_cls.name!r}: " + "; ".join(problems))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model, trust_remote_code=config.trust_remote_code)
    return backend_cls(config, tokenizer, vocab_size, eos_token_ids)
