"""The grammar-level contract of the built-in structured-output manager: a grammar library
plugs in by subclassing ``GrammarBackend`` (``backend.py``), which compiles a request's constraint
(``GuidedDecodingParams``) into a ``CompiledGrammar`` (expensive, shared, cached by the
manager), and each request walks its own ``StructuredOutputGrammar`` (a matcher) over the
tokens it samples::

    backend.compile(params) -> CompiledGrammar --new_grammar()--> StructuredOutputGrammar
       (worker thread, cached)                                     (one per request)

    each step, on a worker thread from the moment the previous step's tokens are known
    (``prepare_bitmask``), batched over the requests:
                backend.batch_accept_tokens(grammars, last_sampled)    the previous step's tokens
                backend.fill_bitmasks(grammars, bitmask)               the tokens allowed next

The batch calls should release the GIL while they work, so the step loop runs meanwhile.
``GrammarBackend.make_manager`` (the core's ``StructuredOutputBackend`` contract) builds the
``GrammarManager`` around the backend, so a library needs nothing else.

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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
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
    asks for the same constraint, and kept in the manager's cache."""

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
    built-in one is xgrammar's grammar process, ``grammar_process``). It is an
    accelerator, not the owner: the manager still compiles every grammar and keeps its own
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
