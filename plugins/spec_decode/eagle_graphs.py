"""CUDA graphs of an EAGLE head's drafting passes after the first: for each captured batch
size, one graph runs passes ``2..k`` back to back (each pass one token per drafting request,
decode-shaped), so a step's drafting costs one replay instead of ``k - 1`` eager passes of
a decoder layer and the LM head each.

What a replay needs is staged in one pinned host buffer and copied once; the first pass's
output (each drafting request's head hidden state ``g`` and its first draft ``d1``) is copied
into the graph's input buffers device to device::

    pinned staging (int64):  | p* [R] | max drafts [R] | block rows [n x cols] |
                               0 = padding request (max drafts 0)
    device inputs:           tokens [R] = d1,  hidden [R, h] = g

    pass j (1 <= j < k), in-graph:  position p* + j;  a request with max drafts > j stores its
    head KV at that position's slot and attends up to it; any other row (padding, or a request
    that needs fewer drafts) stores nothing (slot -1) and attends one key
    drafts [R, k]:  | d1 | d2 .. dk |   read for the real rows, each cut to its max drafts

Positions are clamped below ``max_model_len``, so a row past its drafts never indexes outside
its block-table row or the rotary cache. The attention metadata is built once per size
(``build_for_cudagraph``) over the graph's own ``seq_lens`` / ``slot_mapping`` / block
table, which each pass rewrites in-graph: a backend that plans on the host before a replay
(``prepare_cudagraph_replay``: FlashInfer) cannot follow that, and keeps the passes eager.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagelm.attention import AttentionMetadataBuilder, CommonAttentionMetadata, ForwardContext, forward_context
from pagelm.spec_decode import DraftGraphSetup

logger = logging.getLogger("pagelm")


def replays_without_host_planning(builder: AttentionMetadataBuilder) -> bool:
    """Whether ``builder``'s graph metadata follows device buffers alone (no
    ``prepare_cudagraph_replay``), so that passes inside one graph may rewrite them."""
    method = getattr(type(builder), "prepare_cudagraph_replay", AttentionMetadataBuilder.prepare_cudagraph_replay)
    return method is AttentionMetadataBuilder.prepare_cudagraph_replay


class EagleDraftGraphs:
    """Passes ``2..k`` of an EAGLE head for batches of up to ``max(sizes)`` drafting requests."""

    def __init__(
        self,
        head: nn.Module,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        setup: DraftGraphSetup,
        sizes: list[int],
        num_drafts: int,
        hidden_size: int,
        dtype: torch.dtype,
    ) -> None:
        assert num_drafts >= 2, "a graph of the passes after the first needs k >= 2"
        self.head = head
        self.compute_logits = compute_logits
        self.builder = setup.builder
        self.sizes = sorted(sizes)
        self.num_drafts = num_drafts
        self.max_model_len = setup.max_model_len
        self.block_size = setup.block_size
        r, device = self.max_size, setup.device
        self.staging = torch.zeros(2 * r + r * setup.max_blocks_per_req, dtype=torch.int64,
                                   pin_memory=device.type == "cuda")
        self.staging_np = self.staging.numpy()
        self.staging_dev = torch.zeros_like(self.staging, device=device)
        self.tokens = torch.zeros(r, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(r, hidden_size, dtype=dtype, device=device)
        self.drafts = torch.zeros(r, num_drafts, dtype=torch.int64, device=device)
        # The attention layout, rewritten in-graph by every pass.
        self.positions = torch.zeros(r, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(r, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((r,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(r, setup.max_blocks_per_req, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)
        self._qsl_host = torch.arange(r + 1, dtype=torch.int32)
        self._seq_lens_host = torch.ones(r, dtype=torch.int32)
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

    # ---- per step ------------------------------------------------------------------------
    def load(
        self, tokens: torch.Tensor, hidden: torch.Tensor, last_positions: np.ndarray, max_drafts: np.ndarray,
        block_rows: np.ndarray, size: int,
    ) -> None:
        """Stage ``n = len(last_positions)`` drafting requests padded to ``size``: their first
        drafts ``tokens`` [n] and head hidden states ``hidden`` [n, h] (device), their last
        verified positions ``p*``, how many drafts each wants (>= 1), and their block-table
        rows [n, cols] (covering ``p* + max_drafts - 1``)."""
        n, cols = block_rows.shape
        r, host = self.max_size, self.staging_np
        host[:n] = last_positions
        host[n:size] = 0
        host[r : r + n] = max_drafts
        host[r + n : r + size] = 0
        end = 2 * r + n * cols
        host[2 * r : end] = block_rows.reshape(-1)
        self.staging_dev[:end].copy_(self.staging[:end], non_blocking=True)
        self.block_table[:n, :cols].copy_(self.staging_dev[2 * r : end].view(n, cols), non_blocking=True)
        self.tokens[:n].copy_(tokens)
        self.hidden[:n].copy_(hidden)

    def replay(self, size: int) -> torch.Tensor:
        """Run the passes for ``size`` (inputs loaded): the drafts ``[size, k]``."""
        self.graphs[size].replay()
        self.num_replays += 1
        return self.drafts[:size]

    # ---- capture -------------------------------------------------------------------------
    def _step(self, size: int, md) -> torch.Tensor:
        """Passes ``2..k`` over the loaded inputs (what a graph records)."""
        r, bs = self.max_size, self.block_size
        last_positions = self.staging_dev[:size]
        max_drafts = self.staging_dev[r : r + size]
        tokens, hidden = self.tokens[:size], self.hidden[:size]
        self.drafts[:size, 0].copy_(tokens)
        for j in range(1, self.num_drafts):
            positions = (last_positions + j).clamp(max=self.max_model_len - 1)
            drafting = max_drafts > j
            block = self.block_table[:size].gather(1, (positions // bs)[:, None]).squeeze(1).long()
            self.positions[:size].copy_(positions)
            self.seq_lens[:size].copy_(torch.where(drafting, positions + 1, 1))
            self.slot_mapping[:size].copy_(torch.where(drafting, block * bs + positions % bs, -1))
            with forward_context(ForwardContext(attn_metadata=md)):
                hidden = self.head(tokens, self.positions[:size], hidden)
            tokens = self.compute_logits(hidden).argmax(dim=-1)
            self.drafts[:size, j].copy_(tokens)
        return self.drafts[:size]

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Capture every size into ``pool`` (the target's graphs' pool), largest first."""
        start = time.perf_counter()
        self.staging_dev.zero_()  # every row padding: nothing is stored while capturing
        for size in reversed(self.sizes):
            md = self.builder.build_for_cudagraph(self.common_metadata(size))
            self._step(size, md)  # warm-up outside the capture (autotuning, lazy allocations)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(size, md)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs of the EAGLE head's drafting passes 2..%d for batch sizes %s in %.1f s",
            self.num_drafts, self.sizes, time.perf_counter() - start,
        )
