"""CUDA graphs of an EAGLE head's drafting, one graph per captured batch size, in two kinds:

* ``query_len=None``: passes ``2..k`` (each one token per drafting request, decode-shaped)
  back to back, after an eager first pass: ``k - 1`` eager passes of a decoder layer and the
  LM head become one replay. Used after any step the graph below does not fit.
* ``query_len=q`` (``1 + k``): the first pass too, over a step of ``q`` tokens per request
  (a verification step, replayed by the target's verification graph), then passes ``2..k``:
  the whole proposal is one replay.

What a replay needs from the host is staged in one pinned buffer and copied once. Pass 1
reads the target's pass (its input ids, positions, hidden states, slots, ``seq_lens``) where
the verification graph of the same size left it when that ran the step
(``DraftGraphSetup.verify_buffers``, plugin API 2.23: nothing is copied), else from the
graph's own buffers, which ``load_step`` fills device to device::

    pinned staging (int64):  | p* [R] | max drafts [R] | last index [R] | next token [R] | real [R] | block rows [n x cols] |
                               p*: a request's last verified position; last index: its flat row
                               in the step; real 0: a padding request (its rows store nothing)

    pass 1 (query_len=q), in-graph:  token p+1 at each row p (the token sampled after p*
        at p*'s row), the target's hidden state of p -> g; g at each last index -> d1
    pass j (1 <= j < k), in-graph:   position p* + j; a request with max drafts > j stores
        its head KV at that position's slot and attends up to it; any other row (padding,
        or a request that wants fewer drafts) stores nothing (slot -1) and attends one key
    drafts [R, k]:  | d1 | d2 .. dk |   read for the drafting rows, each cut to its max drafts

On CUDA what the graph derives between passes is one kernel each (``draft_step_inputs``
before pass 1, ``draft_pass_inputs`` before each later one; plugin API 2.25): in torch ops
it was 40 of a proposal's 102 kernels on the demo model at batch 1 (k = 3).

Positions are clamped below ``max_model_len``, so a row past its drafts never indexes outside
its block-table row or the rotary cache. The attention metadata is built once per size
(``build_for_cudagraph``) over the graph's own ``seq_lens`` / ``slot_mapping`` / block
table, which each pass rewrites in-graph: a backend that plans on the host before a replay
(``prepare_cudagraph_replay``: FlashInfer) cannot follow that, and keeps the passes eager.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagelm.attention import AttentionMetadataBuilder, CommonAttentionMetadata, ForwardContext, forward_context
from pagelm.kernels import fused_kernel
from pagelm.spec_decode import DraftGraphSetup, TargetPass, VerificationBuffers

logger = logging.getLogger("pagelm")

# The staging's per-request fields, in order (each ``R`` long), then the block rows.
_LAST_POSITION, _MAX_DRAFTS, _LAST_INDEX, _NEXT_TOKEN, _REAL = range(5)


def replays_without_host_planning(builder: AttentionMetadataBuilder) -> bool:
    """Whether ``builder``'s graph metadata follows device buffers alone (no
    ``prepare_cudagraph_replay``), so that passes inside one graph may rewrite them."""
    method = getattr(type(builder), "prepare_cudagraph_replay", AttentionMetadataBuilder.prepare_cudagraph_replay)
    return method is AttentionMetadataBuilder.prepare_cudagraph_replay


def uniform_query_len(target: TargetPass) -> int | None:
    """``q`` when every request of the step has exactly ``q`` tokens (a verification graph
    step has ``1 + k``, padded in front), else None."""
    common = target.common
    if common is None or target.positions is None or target.positions.dim() != 1:
        return None
    q = common.max_query_len
    return q if common.num_actual_tokens == common.num_reqs * q else None


# A step's pass, field by field (``VerificationBuffers``): ``seq_lens`` has a row per request,
# the others one per token.
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(VerificationBuffers))


class EagleDraftGraphs:
    """An EAGLE head's drafting for batches of up to ``max(sizes)`` requests: passes ``2..k``,
    or with ``query_len`` the first pass over ``query_len`` tokens per request and then those;
    ``kv_only``: the first pass alone, for a step after which nobody drafts (the head's KV
    must still follow every step)."""

    def __init__(
        self,
        head: nn.Module,
        argmax: Callable[[torch.Tensor], torch.Tensor],
        setup: DraftGraphSetup,
        sizes: list[int],
        num_drafts: int,
        hidden_size: int,
        dtype: torch.dtype,
        query_len: int | None = None,
        kv_only: bool = False,
        sources: dict[int, VerificationBuffers] | None = None,
    ) -> None:
        assert num_drafts >= 2 or query_len is not None, "passes 2..k alone need k >= 2"
        assert query_len is not None or not kv_only, "kv_only is the first pass alone: it needs query_len"
        self.kv_only = kv_only
        self.head = head
        # Hidden states [n, h] -> draft token ids [n] (``DraftLMHead.argmax``: over the
        # head's draft vocabulary when it has one, mapped back to target ids in-graph).
        self.argmax = argmax
        self.builder = setup.builder
        self.sizes = sorted(sizes)
        self.num_drafts = num_drafts
        self.max_model_len = setup.max_model_len
        self.block_size = setup.block_size
        self.query_len = query_len
        r, device = self.max_size, setup.device
        self._rows_at = 5 * r
        self.staging = torch.zeros(self._rows_at + r * setup.max_blocks_per_req, dtype=torch.int64,
                                   pin_memory=device.type == "cuda")
        self.staging_np = self.staging.numpy()
        self.staging_dev = torch.zeros_like(self.staging, device=device)
        # Passes 2..k start from the first draft and its hidden state (loaded, or pass 1's).
        self.tokens = torch.zeros(r, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(r, hidden_size, dtype=dtype, device=device)
        self.drafts = torch.zeros(r, num_drafts, dtype=torch.int64, device=device)
        # The one-token passes' attention layout, rewritten in-graph by every pass.
        self.positions = torch.zeros(r, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(r, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((r,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(r, setup.max_blocks_per_req, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)
        self._qsl_host = torch.arange(r + 1, dtype=torch.int32)
        self._seq_lens_host = torch.ones(r, dtype=torch.int32)
        if query_len is not None:  # the first pass's inputs: the target's step, copied in
            q = query_len
            self.step_input_ids = torch.zeros(r * q, dtype=torch.int64, device=device)
            self.step_positions = torch.zeros(r * q, dtype=torch.int64, device=device)
            self.step_hidden = torch.zeros(r * q, hidden_size, dtype=dtype, device=device)
            self.step_slot_mapping = torch.full((r * q,), -1, dtype=torch.int64, device=device)
            self.step_seq_lens = torch.ones(r, dtype=torch.int32, device=device)
            self.step_query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device) * q
            self._step_qsl_host = torch.arange(r + 1, dtype=torch.int32) * q
            self.head_input_ids = torch.zeros(r * q, dtype=torch.int64, device=device)  # pass 1's (fused path)
            # The same five, as pass 1 reads them.
            self._own = VerificationBuffers(
                self.step_input_ids, self.step_positions, self.step_hidden, self.step_slot_mapping, self.step_seq_lens
            )
        # Per size: the verification graph of that size, whose step pass 1 copies in-graph
        # into the step_* buffers above (``DraftGraphSetup.verify_buffers``): after a
        # verification graph step nothing is copied from the host (``load_step``).
        self.sources = {
            size: b for size, b in (sources or {}).items()
            if query_len is not None and size in self.sizes and b.input_ids.shape[0] == size * query_len
            and b.hidden_states.shape[1:] == (hidden_size,) and b.hidden_states.dtype == dtype
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds ``num_reqs`` requests (None: run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def common_metadata(self, size: int) -> CommonAttentionMetadata:
        """The one-token passes' layout."""
        return CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=self._qsl_host[: size + 1],
            seq_lens_cpu=self._seq_lens_host[:size],
            block_size=self.block_size,
        )

    def step_common_metadata(self, size: int) -> CommonAttentionMetadata:
        """The first pass's layout: ``q`` tokens per request (as a verification graph's)."""
        q = self.query_len
        return CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size * q,
            max_query_len=q,
            max_seq_len=self.max_model_len,
            query_start_loc=self.step_query_start_loc[: size + 1],
            seq_lens=self.step_seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.step_slot_mapping[: size * q],
            query_start_loc_cpu=self._step_qsl_host[: size + 1],
            seq_lens_cpu=self._seq_lens_host[:size],
            block_size=self.block_size,
        )

    # ---- per step ------------------------------------------------------------------------
    def _stage(self, fields: dict[int, np.ndarray], block_rows: np.ndarray, size: int) -> None:
        """Write the per-request ``fields`` of ``n = len(block_rows)`` requests (0 for the
        padding up to ``size``) and their block rows, and copy them to the device."""
        n, cols = block_rows.shape
        r, host = self.max_size, self.staging_np
        for field in range(5):
            at = field * r
            host[at : at + n] = fields.get(field, 0)
        if size > n:  # the padding requests
            for field in range(5):
                host[field * r + n : field * r + size] = 0
            if self.query_len is not None:  # a padding request's last index: its own last row
                at = _LAST_INDEX * r
                host[at + n : at + size] = np.arange(n, size) * self.query_len + self.query_len - 1
        end = self._rows_at + n * cols
        host[self._rows_at : end] = block_rows.reshape(-1)
        self.staging_dev[:end].copy_(self.staging[:end], non_blocking=True)
        self.block_table[:n, :cols].copy_(self.staging_dev[self._rows_at : end].view(n, cols), non_blocking=True)

    def load(
        self, tokens: torch.Tensor, hidden: torch.Tensor, last_positions: np.ndarray, max_drafts: np.ndarray,
        block_rows: np.ndarray, size: int,
    ) -> None:
        """Passes 2..k: stage ``n = len(last_positions)`` drafting requests padded to ``size``:
        their first drafts ``tokens`` [n] and head hidden states ``hidden`` [n, h] (device),
        their last verified positions ``p*``, how many drafts each wants (>= 1), and their
        block-table rows [n, cols] (covering ``p* + max_drafts - 1``)."""
        n = len(last_positions)
        self._stage({_LAST_POSITION: last_positions, _MAX_DRAFTS: max_drafts}, block_rows, size)
        self.tokens[:n].copy_(tokens)
        self.hidden[:n].copy_(hidden)

    def load_step(self, target: TargetPass, max_drafts: np.ndarray, block_rows: np.ndarray, size: int) -> None:
        """The whole proposal (``query_len``): stage the step's ``n`` requests padded to
        ``size`` (``max_drafts`` 0: pass 1 only) and copy its pass into the graph's buffers.
        ``block_rows`` [n, cols] cover each request's ``seq_len`` and ``p* + k - 1``."""
        n = len(max_drafts)
        num_tokens = n * self.query_len
        self._stage({
            _LAST_POSITION: target.last_token_position, _MAX_DRAFTS: max_drafts,
            _LAST_INDEX: target.last_token_index, _NEXT_TOKEN: target.next_token_ids, _REAL: 1,
        }, block_rows, size)
        common = target.common
        step = VerificationBuffers(
            target.input_ids, target.positions, target.hidden_states, common.slot_mapping, common.seq_lens
        )
        # Where the graph reads the step from: the verification graph's buffers when one of
        # this size ran it (then the step is there already), else this graph's own.
        into = self.sources.get(size) or self._own
        for name in _STEP_FIELDS:
            value, dst, rows = getattr(step, name), getattr(into, name), n if name == "seq_lens" else num_tokens
            if value.data_ptr() != dst.data_ptr():
                dst[:rows].copy_(value[:rows])

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph for ``size`` (inputs loaded): the drafts ``[size, k]``."""
        self.graphs[size].replay()
        self.num_replays += 1
        return self.drafts[:size]

    # ---- capture -------------------------------------------------------------------------
    def _field(self, field: int, size: int) -> torch.Tensor:
        at = field * self.max_size
        return self.staging_dev[at : at + size]

    def _first_pass(self, size: int, md, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Pass 1 over the loaded step: each request's first draft and head hidden state
        (None with ``kv_only``: the head's KV is all it leaves). The step is read where the
        verification graph's replay left it (``sources``), else from this graph's own copy."""
        q = self.query_len
        num_tokens = size * q
        step = self.sources.get(size) or self._own
        last_index, real = self._field(_LAST_INDEX, size), self._field(_REAL, size)
        fused = self.staging_dev.is_cuda if use_triton is None else use_triton
        draft_step_inputs = fused_kernel("draft_step_inputs") if fused else None
        if draft_step_inputs is not None:  # one kernel (``pagelm.backends.kernels.draft_inputs``)
            draft_step_inputs(
                step.input_ids, step.slot_mapping, step.seq_lens, last_index, self._field(_NEXT_TOKEN, size), real,
                self.head_input_ids, self.step_slot_mapping, self.step_seq_lens, size=size, query_len=q,
            )
            input_ids = self.head_input_ids[:num_tokens]
        else:
            padding = real == 0
            # A padding request stores nothing and attends one key.
            slots = step.slot_mapping[:num_tokens].view(size, q).masked_fill(padding[:, None], -1)
            self.step_slot_mapping[:num_tokens].copy_(slots.view(-1))
            self.step_seq_lens[:size].copy_(step.seq_lens[:size].masked_fill(padding, 1))
            input_ids = torch.roll(step.input_ids[:num_tokens].clamp(min=0), -1)  # position p reads token p+1
            input_ids.index_copy_(0, last_index, self._field(_NEXT_TOKEN, size))
        with forward_context(ForwardContext(attn_metadata=md)):
            hidden = self.head(input_ids, step.positions[:num_tokens], step.hidden_states[:num_tokens])
        if self.kv_only:
            return None
        hidden = hidden.index_select(0, last_index)
        return self.argmax(hidden), hidden

    def _step(self, size: int, md, step_md=None) -> torch.Tensor:
        """What a graph records: pass 1 (``query_len``) or the loaded first drafts, then
        passes ``2..k``; the drafts ``[size, k]``."""
        if self.kv_only:
            self._first_pass(size, step_md)
            return self.drafts[:size]
        if self.query_len is None:
            tokens, hidden = self.tokens[:size], self.hidden[:size]
        else:
            tokens, hidden = self._first_pass(size, step_md)
        last_positions = self._field(_LAST_POSITION, size)
        max_drafts = self._field(_MAX_DRAFTS, size)
        self.drafts[:size, 0].copy_(tokens)
        for j in range(1, self.num_drafts):
            self._pass_inputs(size, j, last_positions, max_drafts)
            with forward_context(ForwardContext(attn_metadata=md)):
                hidden = self.head(tokens, self.positions[:size], hidden)
            tokens = self.argmax(hidden)
            self.drafts[:size, j].copy_(tokens)
        return self.drafts[:size]

    def _pass_inputs(self, size: int, j: int, last_positions, max_drafts, use_triton: bool | None = None) -> None:
        """In-graph, before pass ``j``: its positions, ``seq_lens`` and slots. One fused
        kernel on CUDA (``draft_pass_inputs``), the same math in torch ops elsewhere."""
        fused = self.staging_dev.is_cuda if use_triton is None else use_triton
        draft_pass_inputs = fused_kernel("draft_pass_inputs") if fused else None
        if draft_pass_inputs is not None:
            draft_pass_inputs(
                last_positions, max_drafts, self.block_table, self.positions, self.seq_lens, self.slot_mapping,
                size=size, j=j, max_model_len=self.max_model_len, block_size=self.block_size,
            )
            return
        bs = self.block_size
        positions = (last_positions + j).clamp(max=self.max_model_len - 1)
        drafting = max_drafts > j
        block = self.block_table[:size].gather(1, (positions // bs)[:, None]).squeeze(1).long()
        self.positions[:size].copy_(positions)
        self.seq_lens[:size].copy_(torch.where(drafting, positions + 1, 1))
        self.slot_mapping[:size].copy_(torch.where(drafting, block * bs + positions % bs, -1))

    def metadata(self, size: int) -> tuple:
        """The backend's metadata of the one-token passes and (``query_len``) of pass 1."""
        md = self.builder.build_for_cudagraph(self.common_metadata(size))
        step_md = None if self.query_len is None else self.builder.build_for_cudagraph(self.step_common_metadata(size))
        return md, step_md

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Capture every size into ``pool`` (the target's graphs' pool), largest first."""
        start = time.perf_counter()
        self.staging_dev.zero_()  # every row padding: nothing is stored while capturing
        stream = torch.cuda.Stream(self.staging_dev.device)  # this GPU's (see pagelm.worker.cuda_graphs)
        for size in reversed(self.sizes):
            md = self.metadata(size)
            self._step(size, *md)  # warm-up outside the capture (autotuning, lazy allocations)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._step(size, *md)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs of the EAGLE head's drafting (%s) for batch sizes %s in %.1f s",
            "passes 2..%d" % self.num_drafts if self.query_len is None
            else f"pass 1 alone (the head's KV), after {self.query_len}-token steps" if self.kv_only
            else f"every pass, after {self.query_len}-token steps",
            self.sizes, time.perf_counter() - start,
        )
