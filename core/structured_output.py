"""The structured-output (guided decoding) contract (version 2): what the engine asks of a
guided-decoding plugin, and nothing about how it is done.

A plugin registers a ``StructuredOutputBackend`` class with
``pagelm_register_structured_output_backends``; ``structured_output_backend=<name>`` picks it.
The class checks requests where they arrive (cheap, no tokenizer) and builds the engine
core's ``StructuredOutputManager`` (``make_manager``), the one object the scheduler talks to::

    Scheduler.add_request        submit(request)        True: its grammar is ready now
                                                        False: compiling, it waits outside the queue
    Scheduler.schedule           poll(timeout)          compiled requests join the queue, failed ones end
    SchedulerOutput.grammar_bitmask = manager.grammar_bitmask   the runner calls it after the forward pass
    Scheduler.update_from_output accept_tokens(request, tokens) for each guided request, then
                                 prepare_bitmask()      the next step's grammar work starts now
                                 validate_drafts(request, drafts)   the drafts it may verify
    request finished or aborted  release(request)

How grammars compile, are cached, advanced and turned into bitmask rows (threads, a process)
is the plugin's: the built-in manager (``pagelm.plugins.structured_output``) does it for any
grammar library that implements its grammar-level ABCs (xgrammar is one). The bitmask's
layout: ``pagelm.sample.bitmask``. Version 1 of this contract: ``docs/plugins.md``, migration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from pagelm.config import EngineConfig
    from pagelm.request import Request
    from pagelm.sampling_params import GuidedDecodingParams


class StructuredOutputManager(ABC):
    """The engine core's guided decoding: one per engine, used by the step loop's thread only.

    It owns each guided request's grammar from ``submit`` to ``release`` and sets
    ``request.grammar`` (opaque to the core: the scheduler only checks that it is set) once
    the grammar is ready, or ``request.error`` when it fails. No call may wait for the device;
    ``poll`` and ``grammar_bitmask`` are the only ones that may wait for grammar work."""

    @abstractmethod
    def submit(self, request: "Request") -> bool:
        """A guided request arrived: True if its grammar is ready now (``request.grammar``
        set), False if it is being prepared (``poll`` reports it later). Must not block the
        step loop on a compile."""

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> tuple[list["Request"], list["Request"]]:
        """The requests whose grammar became ready (``request.grammar`` set) and those that
        failed (``request.error`` set) since the last call. ``timeout`` > 0: the engine has
        nothing else to do, so wait up to that long for one instead of spinning."""

    @property
    @abstractmethod
    def has_pending(self) -> bool:
        """Whether ``poll`` has anything to report, ever (checked every step: keep it cheap)."""

    @property
    @abstractmethod
    def num_waiting_for_grammar(self) -> int:
        """Requests submitted and not yet reported by ``poll`` (the waiting-requests metric)."""

    @abstractmethod
    def accept_tokens(self, request: "Request", token_ids: list[int]) -> None:
        """Tokens ``request`` sampled this step (never its EOS: that ends it). They may be
        applied later, by ``prepare_bitmask`` or ``grammar_bitmask``; a token the grammar
        rejects sets ``request.error`` (the scheduler then fails the request)."""

    @abstractmethod
    def prepare_bitmask(self) -> None:
        """The step's tokens are all in: start the next step's grammar work now (it may run
        beside the step loop until ``grammar_bitmask`` collects it)."""

    @abstractmethod
    def grammar_bitmask(self, request_ids: list[str], drafts: Sequence[Sequence[int]] | None = None) -> "torch.Tensor":
        """The allowed tokens of each request's next sample, row ``i`` for ``request_ids[i]``,
        an int32 CPU tensor (pinned on CUDA machines) that stays unchanged until the step's
        next host sync. With ``drafts`` (``drafts[i]``: what ``request_ids[i]`` verifies, as
        ``validate_drafts`` allowed) request ``i`` owns ``1 + len(drafts[i])`` consecutive
        rows, the ``j``-th allowing what may follow its first ``j`` drafts, and its grammar is
        left where it was. A request released since it was scheduled gets a row of ones."""

    @abstractmethod
    def validate_drafts(self, request: "Request", drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` that ``request``'s grammar allows after the
        tokens it sampled, cut before any EOS, the grammar left where it was: a draft it
        rejects could never be emitted, so neither it nor any after it is verified."""

    @abstractmethod
    def release(self, request: "Request") -> None:
        """``request`` left the engine (finished, aborted, failed or while it was waiting)."""

    def shutdown(self) -> None:
        """The engine is shutting down: stop threads and processes."""


class StructuredOutputBackend(ABC):
    """What a guided-decoding plugin registers. Its class methods run where requests arrive
    (the API process) and must be cheap; ``make_manager`` runs once, in the engine core.

    To plug in a grammar library, subclass ``pagelm.plugins.structured_output.GrammarBackend``
    (``compile`` a constraint into a matcher): its ``make_manager`` builds the built-in
    manager around it. Implement ``make_manager`` yourself only to replace that machinery."""

    name: ClassVar[str]

    @classmethod
    def validate(cls, config: "EngineConfig") -> list[str]:
        """Problems with using this backend under ``config`` (e.g. its library is missing).
        Checked when the first guided request arrives, so an engine that never sees one does
        not need the library."""
        return []

    @classmethod
    def validate_request(cls, params: "GuidedDecodingParams") -> None:
        """Raise ``ValueError`` naming the field (``guided_decoding.regex: ...``) when the
        constraint is malformed or unsupported: a quick syntax check before the request is
        queued. Anything it misses fails the request when its grammar is prepared."""

    @classmethod
    @abstractmethod
    def make_manager(
        cls, config: "EngineConfig", vocab_size: int, eos_token_ids: frozenset[int], *,
        device: "torch.device", async_scheduling: bool,
    ) -> StructuredOutputManager:
        """The engine core's manager. ``vocab_size`` is the model's (the logits' width, maybe
        more than the tokenizer's); ``eos_token_ids`` end a sequence, so a grammar allows
        them exactly where it is complete (the scheduler ends a guided request on one);
        ``device`` and ``async_scheduling`` say how the engine runs (a pinned bitmask on
        CUDA; the next step's forward pass queued before this one's tokens are known)."""
