"""CUDA graphs for decode steps: one graph per captured batch size, replayed with the batch
padded up to the next captured size.

A decode step's kernels have fixed shapes for a given batch size, so the whole step (every
layer's projections, norms, rotary, KV store and attention, and the LM head) is recorded once
and replayed with a single launch; Python and kernel-launch overhead, which dominate
small-batch decode, disappear.

Host work per replay is kept to one host-to-device copy and one device copy. A decode needs
only each request's next token id, its ``seq_len`` and its block-table row: the graph itself
derives ``positions = seq_len - 1``, ``slot_mapping`` (from the block table) and the
attention's ``seq_lens``, so those never cross the bus::

    pinned staging (int64):  | input_ids [R] | seq_lens [R] | block rows [n x cols] |
                                                  0 = padding row: slot -1, attends 1 key

The attention backend's ``build_for_cudagraph`` makes its host-side choices from the batch
size alone; ``prepare_cudagraph_replay`` (optional) lets it refresh its own buffers per step.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from pagelm.attention import AttentionMetadataBuilder, CommonAttentionMetadata, ForwardContext, forward_context
from pagelm.worker.input_buffers import InputBuffers

logger = logging.getLogger("pagelm")


def capture_sizes(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, capped at ``max_num_seqs``
    (which is always included) and at the token budget."""
    limit = min(max_num_seqs, max_num_tokens)
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, limit + 1, 16))
    return sorted({s for s in sizes if s <= limit} | {limit})


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        buffers: InputBuffers,
        builder: AttentionMetadataBuilder,
        sizes: list[int],
        max_seq_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.builder = builder
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.block_table = buffers.block_table  # shared with eager steps: full-width rows
        r, max_blocks = self.max_size, buffers.max_blocks_per_req
        device = buffers.device
        self.staging = torch.zeros(2 * r + r * max_blocks, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.staging_np = self.staging.numpy()
        self.staging_dev = torch.zeros_like(self.staging, device=device)
        # Written by the graph from the staging copy.
        self.input_ids = torch.zeros(r, dtype=torch.int64, device=device)
        self.positions = torch.zeros(r, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(r, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(r, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device)
        self._seq_lens_host = torch.ones(r, dtype=torch.int32)
        self._qsl_host = torch.arange(r + 1, dtype=torch.int32)
        self._builder_prepares = getattr(
            type(builder), "prepare_cudagraph_replay", AttentionMetadataBuilder.prepare_cudagraph_replay
        ) is not AttentionMetadataBuilder.prepare_cudagraph_replay
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds ``num_reqs`` decodes (None: run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def common_metadata(self, size: int, seq_lens_cpu: torch.Tensor | None = None) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=self._qsl_host[: size + 1],
            seq_lens_cpu=self._seq_lens_host[:size] if seq_lens_cpu is None else seq_lens_cpu,
            block_size=self.block_size,
        )

    # ---- per step ------------------------------------------------------------------------
    def load(
        self, input_ids: list[int], seq_lens: np.ndarray, block_rows: np.ndarray, size: int,
        num_common_prefix_blocks: int = 0,
    ) -> bool:
        """Stage one decode batch of ``n = len(input_ids)`` requests padded to ``size``.
        False: the attention backend declined the graph for this batch (run it eagerly)."""
        n, cols = block_rows.shape
        r, host = self.max_size, self.staging_np
        host[:n] = input_ids
        host[n:size] = 0
        host[r : r + n] = seq_lens
        host[r + n : r + size] = 0
        end = 2 * r + n * cols
        host[2 * r : end] = block_rows.reshape(-1)
        self.staging_dev[:end].copy_(self.staging[:end], non_blocking=True)
        self.block_table[:n, :cols].copy_(self.staging_dev[2 * r : end].view(n, cols), non_blocking=True)
        if not self._builder_prepares:
            return True
        seq_lens_cpu = torch.ones(size, dtype=torch.int32)
        seq_lens_cpu[:n] = torch.from_numpy(np.asarray(seq_lens, dtype=np.int32))
        common = self.common_metadata(size, seq_lens_cpu)
        common.block_table_cpu = torch.from_numpy(block_rows)
        common.num_common_prefix_blocks = num_common_prefix_blocks
        return self.builder.prepare_cudagraph_replay(common, n)

    def replay(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the graph for ``size`` (inputs already loaded): ``(hidden, logits)``."""
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size]

    # ---- capture -------------------------------------------------------------------------
    def _derive_inputs(self, size: int) -> None:
        """In-graph: the decode inputs that follow from (token, seq_len, block table)."""
        r, bs = self.max_size, self.block_size
        raw_seq_lens = self.staging_dev[r : r + size]
        self.input_ids[:size].copy_(self.staging_dev[:size])
        positions = (raw_seq_lens - 1).clamp_(min=0)
        self.positions[:size].copy_(positions)
        self.seq_lens[:size].copy_(raw_seq_lens.clamp(min=1))
        block = self.block_table[:size].gather(1, (positions // bs)[:, None])[:, 0].long()
        slots = torch.where(raw_seq_lens > 0, block * bs + positions % bs, -1)
        self.slot_mapping[:size].copy_(slots)

    def _step(self, size: int, md) -> tuple[torch.Tensor, torch.Tensor]:
        self._derive_inputs(size)
        with forward_context(ForwardContext(attn_metadata=md)):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
        return hidden, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        self.staging_dev.zero_()  # every row a padding row: nothing is stored while capturing
        # Largest first: smaller graphs reuse the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            md = self.builder.build_for_cudagraph(self.common_metadata(size))
            self._step(size, md)  # warm-up: autotuning and lazy allocations happen outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._step(size, md)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes, time.perf_counter() - start
        )
