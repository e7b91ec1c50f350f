"""CUDA graphs for decode steps: one graph per captured batch size, replayed with the batch
padded up to the next captured size.

A decode step's kernels have fixed shapes for a given batch size, so the whole model forward
(every layer's projections, norms, rotary, KV store and attention) is recorded once and
replayed with a single launch; Python and kernel-launch overhead, which dominate small-batch
decode, disappear. What changes between replays lives in the runner's persistent
``InputBuffers``; the attention backend's ``build_for_cudagraph`` makes its host-side choices
from the batch size alone.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

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
    sizes = sorted({s for s in sizes if s <= limit} | {limit})
    return sizes


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
        self.buffers = buffers
        self.builder = builder
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._metadata: dict[int, object] = {}
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds ``num_reqs`` decodes (None: run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def common_metadata(self, size: int) -> CommonAttentionMetadata:
        b = self.buffers
        return CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_seq_len,
            query_start_loc=b.query_start_loc.device[: size + 1],
            seq_lens=b.seq_lens.device[:size],
            block_table=b.block_table[:size],
            slot_mapping=b.slot_mapping.device[:size],
            query_start_loc_cpu=b.query_start_loc.host[: size + 1],
            seq_lens_cpu=b.seq_lens.host[:size],
            block_size=self.block_size,
        )

    def fill_padding(self, num_reqs: int, size: int) -> None:
        """Rows ``num_reqs:size`` become harmless decodes: one key at block 0, nothing stored."""
        b = self.buffers
        b.input_ids.np[num_reqs:size] = 0
        b.positions.np[num_reqs:size] = 0
        b.slot_mapping.np[num_reqs:size] = -1
        b.seq_lens.np[num_reqs:size] = 1
        b.query_start_loc.np[: size + 1] = range(size + 1)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        b = self.buffers
        pool = torch.cuda.graph_pool_handle()
        # Largest first: smaller graphs reuse the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            self.fill_padding(0, size)
            b.block_table[:size].zero_()
            for pair in (b.input_ids, b.positions, b.slot_mapping, b.seq_lens):
                pair.upload(size)
            b.query_start_loc.upload(size + 1)
            md = self.builder.build_for_cudagraph(self.common_metadata(size))
            self._metadata[size] = md
            run: Callable[[], torch.Tensor] = lambda: self._forward(size, md)  # noqa: E731
            run()  # warm-up: autotuning, lazy allocations and lazy module state happen outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = run()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s", self.sizes, time.perf_counter() - start
        )

    def _forward(self, size: int, md) -> torch.Tensor:
        b = self.buffers
        with forward_context(ForwardContext(attn_metadata=md)):
            return self.model(b.input_ids.device[:size], b.positions.device[:size])

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph for ``size`` (inputs already uploaded); returns its hidden states."""
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size]
