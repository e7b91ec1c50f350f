"""The speculative proposer contract: after each step's forward pass and verification, a
proposer drafts up to ``k`` tokens per request; the next step verifies them in the same
flattened batch as everything else::

    step t   | r0: prefill chunk ....... | r1: x  d1 d2 d3 | r2: x |       target forward
                                              ^  ^  ^  ^
                                 rejection sampler: accepts d1 d2, resamples d3's slot
             proposer.propose(batch)  ->  r1: [e1 e2 e3], r2: [f1 f2 f3]   drafts for step t+1

Proposers are plugins (``pagelm_register_proposers``); ``speculative_config={"method": name}``
selects one. A proposer only proposes: verification (``pagelm.sample.rejection_sampler``)
is the core's, and it is lossless whatever the drafts are, so a bad proposer costs speed,
never correctness.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from pagelm.attention import Attention, CommonAttentionMetadata

if TYPE_CHECKING:
    from pagelm.config import EngineConfig


@dataclass
class ProposalBatch:
    """One step, as a proposer sees it after verification. Row ``i`` is the ``i``-th request
    of the step's batch (every scheduled request, also those that get no drafts)::

        flattened step:  | r0 tokens ........ | r1: x d1 d2 d3 | r2: x |
        last_token_index            r0 ^             ^ (d2 accepted)  ^
        next_token_ids     next prompt token    token sampled after d2   sampled token

    ``token_ids``/``num_tokens`` are the host-side history (``None`` unless the proposer sets
    ``uses_token_ids``); the rest describes the target's forward pass, for model-based
    proposers (EAGLE) that read its hidden states and write their own KV at its slots.
    """

    req_ids: list[str]
    # [n] at most this many drafts for request i; 0: none (unfinished prefill chunk, backed
    # off after rejected drafts (adaptive drafting), or no room left before
    # max_model_len / max_tokens). A proposer does no drafting work for such a request.
    max_num_drafts: np.ndarray
    # [n, width] int32, prompt + every accepted output token, zero padded; and [n] lengths.
    token_ids: np.ndarray | None
    num_tokens: np.ndarray
    # The target's forward pass: flattened inputs [T], their positions [T], its last hidden
    # states [T, hidden] (after the final norm), and the step's attention layout (None for a
    # proposer that sets ``uses_target_pass = False``).
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
    # [n] each request's ``SamplingParams.extra_args`` (per-request data for plugins; None
    # where the request has none). The engine always fills it.
    extra_args: list[dict[str, Any] | None] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def decode_attention_metadata(self, index: np.ndarray, positions: np.ndarray) -> Any:
        """The backend's metadata for a pass of one token per request: request
        ``index[j]`` of the batch at ``positions[j]`` (a draft model's autoregressive steps).
        Those positions must lie within the slots the scheduler reserved
        (``Proposer.num_lookahead_slots`` past the step's tokens)."""
        common = decode_attention_metadata(
            self.block_table_cpu, self.rows[index], positions, self.block_size, self.hidden_states.device
        )
        return self.build_attention_metadata(common)


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
    return CommonAttentionMetadata(
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs,
        max_query_len=1,
        max_seq_len=max_seq_len,
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_cpu.to(device),
        block_table=table_cpu.to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_cpu,
        block_size=block_size,
        block_table_cpu=table_cpu,
    )


class Proposer(ABC):
    """Drafts tokens for speculative decoding. One instance per engine, built after the target
    model is loaded and before the KV cache is sized.

    Subclasses set ``name`` and implement ``propose``; a proposer with its own attention
    layers (a draft model) returns them from ``attention_layers`` so the engine sizes and
    binds their KV caches (the same block ids as the target's), and reserves
    ``num_lookahead_slots`` KV slots past each step's tokens for the positions it writes
    while drafting.
    """

    name: ClassVar[str] = ""
    # Whether ``propose`` reads ``ProposalBatch.token_ids`` (the runner then keeps a host
    # token table for it).
    uses_token_ids: ClassVar[bool] = True
    # Whether ``propose`` must see every step, also one in which no request may draft (a draft
    # model keeps its KV cache in step with the target's). A proposer that only drafts sets
    # it False: such steps skip it, and may run ahead under async scheduling, which the
    # engine then keeps on whenever nobody may draft in the next step.
    needs_every_step: ClassVar[bool] = True
    # Whether ``propose`` reads the target's forward pass (``input_ids``, ``positions``,
    # ``hidden_states``, ``common``: a draft model does). False leaves them None and saves
    # building them on the device every step.
    uses_target_pass: ClassVar[bool] = True

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
        """KV slots, past a step's scheduled tokens, that ``propose`` writes (its own KV at
        draft positions). 0 for proposers without attention layers."""
        return 0

    def attention_layers(self) -> list[Attention]:
        """The proposer's own paged attention layers (a draft model's); none by default."""
        return []

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> list[list[int]]:
        """Draft token ids for every request of ``batch``, in its order: at most
        ``batch.max_num_drafts[i]`` for request ``i`` (``[]``: no drafts). Called once per
        step, after verification, for every step (also those with nothing to draft, so a
        draft model can keep its KV cache in step with the target's), unless
        ``needs_every_step`` is False."""
