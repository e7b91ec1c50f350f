"""The speculative proposer contract (version 2): what the engine calls after each step to
get the next step's drafts, and what it hands over; nothing about how drafts are made.

After each step's forward pass and verification the engine hands the proposer the step
(``FinishedStep``) and verifies whatever drafts come back in the next step, in the same
flattened batch as everything else::

    step t   | r0: prefill chunk ....... | r1: x  d1 d2 d3 | r2: x |       target forward
                                              ^  ^  ^  ^
                                 rejection sampler: accepts d1 d2, resamples d3's slot
             proposer.propose_step(step) ->  r1: [e1 e2 e3], r2: [f1 f2 f3]   drafts for step t+1

Proposers are plugins (``pagelm_register_proposers``); ``speculative_config={"method": name}``
selects one. A proposer only proposes: verification (``pagelm.sample.rejection_sampler``)
is the core's, and it is lossless whatever the drafts are, so a bad proposer costs speed,
never correctness. The engine checks every proposal (one list of in-vocabulary ids per
request, else a ``PluginError`` naming the proposer) and cuts drafts that would not fit
``max_tokens`` / ``max_model_len``.

How to draft (which requests, how many, adaptive back-off, a token history) is the plugin's:
``pagelm.plugins.spec_decode.DraftProposer`` does it for any proposer that implements
``propose(batch)`` over a ``ProposalBatch`` (the built-in ``ngram`` and ``eagle`` do).

A proposer whose drafts are made on the device may return them there (``DeviceDrafts``,
plugin API 2.19): the engine then does not wait for them. They go into the next step's
verification by a device copy, and reach the host with that step's verified tokens, so the
host schedules and stages the next step while the drafting runs::

    host    verify t sync | stage drafting | schedule t+1, stage verify t+1 | ... sync
    device  [verify t]      [drafting t ............][verify t+1 ..........]

The engine keeps them on the device when nothing on the host must read them first (one
GPU, no guided request, no penalty reading the drafts as output history); otherwise it
reads them at once, as it reads lists.

Version 1 had ``propose(ProposalBatch)``, the drafting and ``ProposalBatch`` here;
``docs/plugins.md`` has the migration note.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch
from torch import nn

from pagelm.attention import Attention, AttentionMetadataBuilder, CommonAttentionMetadata, GraphSupport
from pagelm.registry import PluginError

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.sampling_params import SamplingParams


class RequestView(Protocol):
    """A running request as the model runner keeps it (read only: the runner owns it). The
    same object stays on its block-table ``row`` until the request finishes or is preempted;
    a request resumed after preemption comes back as a new object."""

    req_id: str
    row: int
    token_ids: list[int]  # prompt + outputs; past a step in flight, placeholders
    output_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: "SamplingParams"


@dataclass(kw_only=True)
class TargetPass:
    """The target's forward pass of a step, for a proposer that reads it (a draft model
    writes its own KV at the step's slots and drafts from the target's hidden states)::

        flattened step:  | r0 tokens ........ | r1: x d1 d2 d3 | r2: x |
        last_token_index            r0 ^             ^ (d2 accepted)  ^
        next_token_ids     next prompt token    token sampled after d2   sampled token
    """

    # Flattened inputs [T], their positions [T], the last hidden states [T, hidden] (after the
    # final norm), and the step's attention layout; all None for a proposer that sets
    # ``uses_target_pass = False`` (they cost device copies every step).
    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    hidden_states: torch.Tensor | None
    common: CommonAttentionMetadata | None
    # [n] flat index (into the T tokens) of each request's last verified position, its
    # position in the sequence, and the token that follows it (all known to the host).
    last_token_index: np.ndarray
    last_token_position: np.ndarray
    next_token_ids: np.ndarray
    # Each request's KV blocks: ``block_table_cpu[rows[i]]`` (the runner's CPU table).
    block_table_cpu: np.ndarray
    rows: np.ndarray
    block_size: int
    # The attention backend's metadata for a ``CommonAttentionMetadata`` (once per pass).
    build_attention_metadata: Callable[[CommonAttentionMetadata], Any]

    def decode_attention_metadata(self, index: np.ndarray, positions: np.ndarray) -> Any:
        """The backend's metadata for a pass of one token per request: request
        ``index[j]`` of the batch at ``positions[j]`` (a draft model's autoregressive steps).
        Those positions must lie within the slots the scheduler reserved
        (``Proposer.num_lookahead_slots`` past the step's tokens)."""
        common = decode_attention_metadata(
            self.block_table_cpu, self.rows[index], positions, self.block_size, self.hidden_states.device
        )
        return self.build_attention_metadata(common)


@dataclass
class FinishedStep:
    """One step after verification, as the engine hands it to ``Proposer.propose_step``.
    Row ``i`` is the ``i``-th request of the step's batch (every scheduled request)."""

    requests: Sequence[RequestView]
    rows: np.ndarray  # [n] block-table rows: per-request state a proposer keeps is keyed by them
    num_drafts: np.ndarray  # [n] drafts this step verified
    num_sampled: np.ndarray  # [n] tokens it emitted (accepted drafts + 1; 0: a prefill chunk that stops short)
    num_tokens: np.ndarray  # [n] tokens known after it (prompt + accepted outputs)
    max_model_len: int
    # The next step is launched already (async scheduling): drafts would come too late, so
    # the engine wants none, and ``target`` is None unless the proposer sets
    # ``needs_ahead_target``. It launched it only because ``may_draft`` said nobody may draft.
    ahead: bool
    # Builds ``target`` (the engine's; None: the step has none for this proposer).
    make_target: Callable[[], TargetPass | None] = field(default=lambda: None, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @cached_property
    def target(self) -> TargetPass | None:
        """The target's forward pass (``TargetPass``), built when first read: a step in which
        the proposer drafts for nobody and follows nothing (adaptive drafting backed everyone
        off) does not pay for it."""
        return self.make_target()


@dataclass
class DeviceDrafts:
    """Drafts left on the device (plugin API 2.19): request ``i``'s are
    ``token_ids[i, :num_drafts[i]]``. ``token_ids`` is an integer tensor on the target's
    device with one row per request of the step; the engine copies what it keeps before it
    launches anything else, so it may be a view of a graph's output buffer. Ids outside the
    vocabulary are reported (``PluginError``) when the drafts reach the host with the next
    step's verification, and clamped into it on the device before that step reads them."""

    token_ids: torch.Tensor  # [n, width]
    num_drafts: np.ndarray  # [n], each <= width

    def tolist(self) -> list[list[int]]:
        """The drafts as host lists (waits for the device)."""
        width = int(self.num_drafts.max()) if len(self.num_drafts) else 0
        rows = self.token_ids[:, :width].tolist() if width else [[] for _ in range(len(self.num_drafts))]
        return [row[:c] for row, c in zip(rows, self.num_drafts.tolist())]


@dataclass(frozen=True)
class DraftGraphSetup:
    """What a proposer gets to capture CUDA graphs of its own device work (a draft model's
    drafting passes), after the target's graphs are captured: on CUDA only, never with
    ``enforce_eager``, and not under pipeline parallelism. A proposer's graph runs over
    persistent buffers of its own, with attention metadata from
    ``builder.build_for_cudagraph`` over them (one query token per request, or ``q`` where
    ``graph_support`` is ``ALWAYS``; padding rows slot -1, padding requests ``seq_len`` 1),
    as the target's decode and verification graphs do."""

    builder: AttentionMetadataBuilder  # the runner's (the attention backend's)
    # The backend's: ``ALWAYS`` also builds graph metadata of ``q > 1`` tokens per request
    # (as for the target's verification graphs), ``DECODE_ONLY`` of one token only.
    graph_support: GraphSupport
    # Batch sizes worth a graph (the target's decode sizes, ascending); a batch is padded up.
    sizes: list[int]
    max_model_len: int
    block_size: int
    max_blocks_per_req: int  # a block-table row's width
    device: torch.device
    # The memory pool of the target's graphs: share it (graphs that never replay at once may).
    pool: Any
    # Plugin API 2.23: the target's verification graph of each captured batch size, by size:
    # where a replay leaves its step (``VerificationBuffers``). A proposer graph replayed
    # right after one may read them in-graph instead of having them copied in from the
    # host (empty: no verification graphs, or none a proposer may read).
    verify_buffers: dict[int, VerificationBuffers] = field(default_factory=dict)


@dataclass(frozen=True)
class VerificationBuffers:
    """One verification graph's persistent tensors (plugin API 2.23): after its replay for
    ``n`` requests of ``q`` tokens each (``n`` up to its size, padded in front as
    ``pagelm.worker.cuda_graphs`` describes), the first ``n * q`` rows hold the step's input
    ids, positions, KV slots and the target's hidden states, and the first ``n`` entries of
    ``seq_lens`` each request's length. The same tensors every replay (a graph's inputs and
    outputs live at fixed addresses), so a graph captured over them reads each step's.
    Between replays a proposer may write them (the next replay rewrites them all)."""

    input_ids: torch.Tensor  # [size * q] int64
    positions: torch.Tensor  # [size * q] int64
    hidden_states: torch.Tensor  # [size * q, hidden]
    slot_mapping: torch.Tensor  # [size * q] int64
    seq_lens: torch.Tensor  # [size] int32


def decode_attention_metadata(
    block_table_cpu: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int, device: torch.device
) -> CommonAttentionMetadata:
    """Layout of a pass with one query token per request: request ``j`` (block-table row
    ``rows[j]``) at ``positions[j]``, attending to every position up to it."""
    num_reqs = len(rows)
    positions = np.asarray(positions, dtype=np.int64)
    seq_lens = (positions + 1).astype(np.int32)
    max_seq_len = int(seq_lens.max())
    table = np.ascontiguousarray(block_table_cpu[rows, : -(-max_seq_len // block_size)])
    slots = table[np.arange(num_reqs), positions // block_size].astype(np.int64) * block_size + positions % block_size
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32)
    seq_lens_cpu = torch.from_numpy(seq_lens)
    table_cpu = torch.from_numpy(table)
    # Copies that do not wait for the stream (a blocking one from pageable memory would).
    return CommonAttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs,
        max_query_len=1,
        max_seq_len=max_seq_len,
        query_start_loc=query_start_loc.to(device, non_blocking=True),
        seq_lens=seq_lens_cpu.to(device, non_blocking=True),
        block_table=table_cpu.to(device, non_blocking=True),
        slot_mapping=torch.from_numpy(slots).to(device, non_blocking=True),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_cpu,
        block_size=block_size,
        block_table_cpu=table_cpu,
    )


class Proposer(ABC):
    """Drafts tokens for speculative decoding. One instance per engine, built after the target
    model is loaded and before the KV cache is sized.

    Subclasses set ``name`` and implement ``propose_step`` (or, more simply, subclass
    ``pagelm.plugins.spec_decode.DraftProposer`` and implement ``propose``); a proposer with
    its own attention layers (a draft model) returns them from ``attention_layers`` so the
    engine sizes and binds their KV caches (the same block ids as the target's), and
    reserves ``num_lookahead_slots`` KV slots past each step's tokens for the positions it
    writes while drafting.
    """

    name: ClassVar[str] = ""
    # Whether ``propose_step`` must see every step's tokens before the next step is scheduled
    # (a draft model keeps its KV cache in step with the target's). False lets the engine run
    # a step ahead under async scheduling whenever ``may_draft`` says nobody may draft;
    # ``propose_step`` then sees that step with ``ahead`` set.
    needs_every_step: ClassVar[bool] = True
    # Whether steps the engine runs ahead (``FinishedStep.ahead``) still come with their
    # ``target``: the runner keeps the forward pass of a step in flight when it launches the
    # next one. A draft model with a KV cache of its own sets it, with ``needs_every_step =
    # False``, to write its KV for every step while the engine schedules ahead wherever
    # ``may_draft`` says nobody may draft. Needs ``uses_target_pass``.
    needs_ahead_target: ClassVar[bool] = False
    # Whether ``propose_step`` reads the target's forward pass (``TargetPass.input_ids``,
    # ``positions``, ``hidden_states``, ``common``: a draft model does). False leaves them
    # None and saves building them on the device every step.
    uses_target_pass: ClassVar[bool] = True
    # Under pipeline parallelism only the last stage has the target's hidden states: a
    # proposer that reads the target pass is built there alone (its ``target`` holds that
    # stage's layers, the final norm and ``compute_logits``, not the embedding), and its
    # drafts are sent to rank 0. True says it works so; False refuses it under pipeline
    # parallelism at start-up. Proposers that do not read the target pass run on every rank.
    supports_pipeline_parallel: ClassVar[bool] = False

    def __init__(self, config: "EngineConfig", target: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.speculative = config.speculative
        assert self.speculative is not None, "a proposer needs speculative_config"
        self.num_speculative_tokens = self.speculative.num_speculative_tokens
        self.device = device
        self.dtype = dtype

    @classmethod
    def validate(cls, config: "EngineConfig") -> list[str]:
        """Problems with ``config.speculative`` for this proposer (empty: fine). Runs at engine
        start-up, before any weight is loaded."""
        return []

    @classmethod
    def num_lookahead_slots(cls, config: "EngineConfig") -> int:
        """KV slots, past a step's scheduled tokens, that ``propose_step`` writes (its own KV
        at draft positions). 0 for proposers without attention layers."""
        return 0

    def attention_layers(self) -> list[Attention]:
        """The proposer's own paged attention layers (a draft model's); none by default."""
        return []

    @abstractmethod
    def propose_step(self, step: FinishedStep) -> "list[list[int]] | DeviceDrafts":
        """Draft token ids for the next step, for every request of ``step`` in its order
        (``[]``: no drafts; all ``[]`` when ``step.ahead``), as host lists or, made on the
        device, as ``DeviceDrafts`` (2.19), which the engine need not wait for. Called once per step, after
        verification: every step, unless ``needs_every_step`` is False (then steps the engine
        runs ahead are handed over with ``ahead`` set, after the fact)."""

    def capture_cuda_graphs(self, setup: DraftGraphSetup) -> None:
        """Capture CUDA graphs of the proposer's device work, to replay in ``propose_step``
        (EAGLE: its drafting passes). Called once at start-up when the engine
        uses CUDA graphs; otherwise the proposer runs eagerly. Default: none."""

    def release_cuda_graphs(self) -> None:
        """Drop the graphs ``capture_cuda_graphs`` made (the engine is shutting down: every
        graph goes before the process group). Default: nothing to drop."""

    def may_draft(self, requests: Sequence[RequestView]) -> bool:
        """Whether the proposal after the step in flight may give any of ``requests`` (every
        running request) drafts. False lets the engine schedule the next step before the
        one in flight is finished (async scheduling). Conservative by default.

        ``requests`` is the same list object from step to step until a request joins or
        leaves, and is never changed in place (2.24); ``skip_ahead`` and ``step_skipped``
        get that list too when the step covers every running request in its order. A
        proposer may recognise an unchanged set by the list's identity instead of by its
        requests (``DraftProposer`` does, in a stretch where every request is backed off)."""
        return True

    def skip_ahead(self, requests: Sequence[RequestView]) -> bool:
        """Asked right after ``may_draft`` returned False, with the requests of the step in
        flight, each of which samples in it (2.22): whether that step's proposal can be left
        out. It gets no drafts; True says it also has nothing to follow (no KV of a draft
        model to write, as for ``needs_ahead_target`` with every request backed off). A
        question only: the proposer's state must not change here. The engine then keeps no
        forward pass for the step, and when it finishes the step it calls ``step_skipped``
        in place of ``propose_step`` (a step dropped meanwhile, after a failure, gets
        neither, on every rank alike). On a small model's GPU step (~0.4 ms of host time)
        such a proposal's host work was a third of the step. Default False."""
        return False

    def step_skipped(self, requests: Sequence[RequestView]) -> None:
        """A step whose proposal ``skip_ahead`` left out is finished (2.22): count it as
        ``propose_step`` would have (adaptive drafting's clock). Default: nothing to count."""


def proposer_name(proposer: Proposer) -> str:
    """How errors name a proposer: its registered name and its class."""
    return f"proposer {proposer.name!r} ({type(proposer).__module__}.{type(proposer).__qualname__})"


def checked_drafts(proposer: Proposer, drafts: Any, n: int, vocab_size: int) -> list[list[int]]:
    """``drafts`` as one list of token ids per request, or a ``PluginError`` naming the
    proposer and what is wrong (a few ints per request, checked in one numpy pass)."""
    if not isinstance(drafts, (list, tuple)) or len(drafts) != n:
        got = f"{len(drafts)} lists" if isinstance(drafts, (list, tuple)) else repr(drafts)[:80]
        raise PluginError(f"{proposer_name(proposer)}: propose() must return one list of draft ids per request ({n}), got {got}")
    if not all(isinstance(d, (list, tuple, np.ndarray)) for d in drafts):
        raise PluginError(f"{proposer_name(proposer)}: propose() returned a draft that is not a list of token ids: {drafts!r:.200}")
    drafts = [list(d) for d in drafts]
    check_draft_ids(proposer, [t for d in drafts for t in d], vocab_size)
    return drafts


def check_draft_ids(proposer: Proposer, flat: Sequence[int], vocab_size: int) -> None:
    """A ``PluginError`` naming the proposer unless every id of ``flat`` is an in-vocabulary int."""
    if not len(flat):
        return
    ids = np.asarray(flat)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise PluginError(f"{proposer_name(proposer)}: propose() returned draft ids that are not integers: {list(flat[:16])!r:.200}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise PluginError(
            f"{proposer_name(proposer)}: propose() returned draft ids outside the vocabulary [0, {vocab_size}): {list(flat[:16])}"
        )


def checked_device_drafts(proposer: Proposer, drafts: DeviceDrafts, n: int, device: torch.device) -> DeviceDrafts:
    """``drafts`` if its shapes are what ``DeviceDrafts`` says (its ids are checked when they
    reach the host), else a ``PluginError`` naming the proposer."""
    ids, counts = drafts.token_ids, np.asarray(drafts.num_drafts)
    problem = None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != n:
        problem = f"token_ids must be a [{n}, width] tensor, got {getattr(ids, 'shape', type(ids).__name__)}"
    elif ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        problem = f"token_ids must hold integers, got {ids.dtype}"
    elif ids.device.type != device.type:
        problem = f"token_ids must be on {device}, got {ids.device}"
    elif counts.shape != (n,) or counts.dtype.kind not in "iu" or (n and not 0 <= min(c := counts.tolist()) <= max(c) <= ids.shape[1]):
        problem = f"num_drafts must be [{n}] ints within [0, {ids.shape[1]}], got {counts!r:.120}"
    if problem is not None:
        raise PluginError(f"{proposer_name(proposer)}: propose() returned DeviceDrafts whose {problem}")
    return drafts if counts is drafts.num_drafts and counts.dtype == np.int64 else DeviceDrafts(ids, counts.astype(np.int64))
