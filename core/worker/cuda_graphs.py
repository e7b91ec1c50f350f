"""CUDA graphs for decode steps: one graph per captured batch size, replayed with the batch
padded up to the next captured size. A runner captures steps of ``q`` query tokens per
request: ``q = 1`` for plain decode, ``q = 1 + k`` for speculative verification (each
request's last known token and up to ``k`` drafts; ``pagelm.worker.spec_decode``).

A decode step's kernels have fixed shapes for a given batch size, so the whole step (every
layer's projections, norms, rotary, KV store and attention, and the LM head over every query
token) is recorded once and replayed with a single launch; Python and kernel-launch overhead,
which dominate small-batch decode, disappear.

Host work per replay is kept to one host-to-device copy and one device copy. A step needs
only each request's query token ids, its ``seq_len`` and its block-table row: the graph itself
derives ``positions = seq_len - q + j``, ``slot_mapping`` (from the block table) and the
attention's ``seq_lens``, so those never cross the bus::

    pinned staging (int64):  | input_ids [R x q] | seq_lens [R] | block rows [n x cols] |
                               -1 = padding token   0 = padding request: slots -1, attends 1 key

A request's tokens are the last ``q`` positions up to its ``seq_len``. One with fewer real
tokens (fewer drafts this step) is padded in front::

    1 draft, q = 4, seq_len s:   input_ids | -1   -1   x    d1  |
                                 positions | s-4  s-3  s-2  s-1 |   slots | -1 -1 ok ok |

The padding tokens sit on positions the request has already cached: they store nothing
(slot -1), their logits rows are ignored, and the real tokens attend causally to the cache,
which still holds those positions' keys. Padding in front rather than behind keeps every
position below ``seq_len``, so inside the request's allocated blocks and ``max_model_len``
(positions below 0, a prompt shorter than ``q``, are clamped to 0; no real token sees them).

A model with positions of its own (M-RoPE, ``position_offsets=True``) also stages one offset
per request, its ``delta``: the graph feeds the model ``positions + delta`` while the slots
still follow ``positions`` (a decode token past a prompt with images sits at its index + delta)::

    pinned staging (int64):  | input_ids [R x q] | seq_lens [R] | deltas [R] | block rows [n x cols] |

A verification graph whose drafts the previous proposal left on the device (``draft_source``,
the ``DraftStore``'s ids) stages, for each input position, where its draft is kept (-1: the
staged id stands); the graph gathers them into the ids before it derives the rest, so the
drafts never reach the host before the step::

    pinned staging (int64):  | input_ids [R x q] | seq_lens [R] | draft sources [R x q] | block rows [n x cols] |

A verification graph also judges greedy requests (``verdict``): after the LM head it writes
each row's argmax and whether that equals the next row's input token (a draft), and where a
gathered draft lay outside the vocabulary. A step whose requests all take the argmax of raw
logits reads that ``[3, n * q]`` tensor alone: no logits rows, no drafts on the host. The
argmax costs one read of the step's logits also in steps that sample instead.

The attention backend's ``build_for_cudagraph`` makes its host-side choices from the batch
size (and ``q``) alone; ``prepare_cudagraph_replay`` (optional) lets it refresh its own
buffers per step.

Under pipeline parallelism (``stage``: the runner's ``PipelineStage``) each stage captures its
own part of the decode step; the sends and receives stay outside the graphs. A stage after
the first reads the previous stage's output (hidden states and residual) from persistent
``intermediate`` buffers, which ``PipelineStage.replay`` receives the step's real rows into
before replaying; a stage before the last ends with its output (those same named tensors,
the graph's outputs, no logits), whose real rows are copied and sent on::

    stage 0:  staging -> [embed, layers 0..k) -> out{hidden, residual} --send n rows-->
    stage 1:  --recv n rows--> intermediate{hidden, residual} -> [layers k..L, norm, LM head] -> logits
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from pagelm.attention import AttentionMetadataBuilder, CommonAttentionMetadata, ForwardContext, forward_context
from pagelm.kernels import fused_kernel
from pagelm.worker.input_buffers import InputBuffers

logger = logging.getLogger("pagelm")


def capture_sizes(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, capped at ``max_num_seqs``
    (which is always included) and at the token budget."""
    limit = min(max_num_seqs, max_num_tokens)
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, limit + 1, 16))
    return sorted({s for s in sizes if s <= limit} | {limit})


# Staged in place of a token id: a padding token (stores nothing; its logits row is ignored).
PAD_TOKEN = -1


class CudaGraphRunner:
    """The graphs of one query length ``q`` (1: decode; ``1 + k``: verification), one per
    batch size in ``sizes``, over persistent buffers of their own (the block table is shared)."""

    def __init__(
        self,
        model: nn.Module,
        buffers: InputBuffers,
        builder: AttentionMetadataBuilder,
        sizes: list[int],
        max_seq_len: int,
        block_size: int,
        query_len: int = 1,
        variants: tuple[str, ...] = ("",),
        position_offsets: bool = False,
        stage=None,
        draft_source: tuple[torch.Tensor, int] | None = None,
    ) -> None:
        self.model = model
        # Pipeline parallelism: this rank's PipelineStage (None: the whole model is here).
        self.stage = stage
        # Graphs per size: the plain one (""), and any the backend asked for (cudagraph_variants).
        self.variants = variants
        self._variant = ""
        self.builder = builder
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.query_len = q = query_len
        self.block_table = buffers.block_table  # shared with eager steps: full-width rows
        r, max_blocks = self.max_size, buffers.max_blocks_per_req
        device = buffers.device
        self.position_offsets = position_offsets
        # Verification graphs: drafts kept on the device (``DraftStore.ids``, flat) and the
        # vocabulary they are clamped into; the graph gathers them from staged indices.
        self.draft_source = draft_source
        # Where the draft sources and the block rows start in the staging (after the deltas,
        # when there are any).
        self._sources_at = r * q + r + (r if position_offsets else 0)
        self._rows_at = self._sources_at + (r * q if draft_source is not None else 0)
        self.staging = torch.zeros(self._rows_at + r * max_blocks, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.staging_np = self.staging.numpy()
        self.staging_dev = torch.zeros_like(self.staging, device=device)
        # Written by the graph from the staging copy.
        self.input_ids = torch.zeros(r * q, dtype=torch.int64, device=device)
        self.positions = torch.zeros(r * q, dtype=torch.int64, device=device)
        # What the model's rotary reads: ``positions`` + each request's delta (position_offsets).
        self.rope_positions = (
            torch.zeros(r * q, dtype=torch.int64, device=device) if position_offsets else self.positions
        )
        self.slot_mapping = torch.zeros(r * q, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(r, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(r + 1, dtype=torch.int32, device=device) * q
        self._position_offsets = torch.arange(q, dtype=torch.int64, device=device) - q  # j - q
        self._seq_lens_host = torch.ones(r, dtype=torch.int32)
        self._qsl_host = torch.arange(r + 1, dtype=torch.int32) * q
        self._builder_prepares = getattr(
            type(builder), "prepare_cudagraph_replay", AttentionMetadataBuilder.prepare_cudagraph_replay
        ) is not AttentionMetadataBuilder.prepare_cudagraph_replay
        # A stage after the first: the previous stage's output, received before each replay.
        self.intermediate: dict[str, torch.Tensor] | None = None
        if stage is not None and not stage.is_first:
            self.intermediate = model.make_empty_intermediate_tensors(r * q, stage.dtype, device)
            for t in self.intermediate.values():
                t.zero_()  # the padding rows are read (and ignored): finite values
        # Verification graphs (q > 1, the whole model here): the step's greedy verdict, worked
        # out in the graph so that a step of greedy requests reads one small tensor and never
        # its drafts (``verdict``).
        self._verdict = torch.zeros((3, r * q), dtype=torch.int64, device=device) if q > 1 and stage is None else None
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds ``num_reqs`` requests (None: run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def common_metadata(self, size: int, seq_lens_cpu: torch.Tensor | None = None) -> CommonAttentionMetadata:
        """The layout of ``size`` requests of ``q`` tokens each, over the graph's buffers."""
        q = self.query_len
        return CommonAttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size * q,
            max_query_len=q,
            max_seq_len=self.max_seq_len,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[: size * q],
            query_start_loc_cpu=self._qsl_host[: size + 1],
            seq_lens_cpu=self._seq_lens_host[:size] if seq_lens_cpu is None else seq_lens_cpu,
            block_size=self.block_size,
        )

    # ---- per step ------------------------------------------------------------------------
    def load(
        self, input_ids, seq_lens: np.ndarray, block_rows: np.ndarray, size: int, deltas: np.ndarray | None = None,
        drafts: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> bool:
        """Stage ``n = len(block_rows)`` requests padded to ``size``: ``input_ids`` holds
        ``q`` ids per request (``PAD_TOKEN`` in front of a request with fewer), ``seq_lens``
        each request's length after this step, ``deltas`` (``position_offsets`` only) the
        shift of each request's rotary positions, ``drafts`` (``draft_source`` only) a pair
        ``(at, sources)``: the graph puts ``draft_source[sources]`` at the flat input positions
        ``at`` (staged there as padding). False: the attention backend declined the graph for
        this batch (run it eagerly)."""
        n, cols = block_rows.shape
        q, r, host = self.query_len, self.max_size, self.staging_np
        rq = r * q  # where seq_lens start
        host[: n * q] = input_ids
        host[n * q : size * q] = PAD_TOKEN
        host[rq : rq + n] = seq_lens
        host[rq + n : rq + size] = 0
        if self.position_offsets:
            host[rq + r : rq + r + n] = 0 if deltas is None else deltas
            host[rq + r + n : rq + r + size] = 0
        if self.draft_source is not None:
            sources = host[self._sources_at : self._sources_at + size * q]
            sources[:] = -1  # a staged id, not a draft kept on the device
            if drafts is not None:
                sources[drafts[0]] = drafts[1]
        rows_at = self._rows_at
        end = rows_at + n * cols
        host[rows_at:end] = block_rows.reshape(-1)
        self.staging_dev[:end].copy_(self.staging[:end], non_blocking=True)
        self.block_table[:n, :cols].copy_(self.staging_dev[rows_at:end].view(n, cols), non_blocking=True)
        self._variant = ""
        if not self._builder_prepares:
            return True
        seq_lens_cpu = torch.ones(size, dtype=torch.int32)
        seq_lens_cpu[:n] = torch.from_numpy(np.asarray(seq_lens, dtype=np.int32))
        common = self.common_metadata(size, seq_lens_cpu)
        common.block_table_cpu = torch.from_numpy(block_rows)
        choice = self.builder.prepare_cudagraph_replay(common, n)
        if choice is False:
            return False
        if isinstance(choice, str):
            assert choice in self.variants, f"the backend chose graph variant {choice!r}, captured: {self.variants}"
            self._variant = choice
        return True

    def feed_input_ids(self, index: torch.Tensor, token_ids: torch.Tensor) -> None:
        """After ``load``, before ``replay``: overwrite the staged input ids at ``index`` (flat:
        ``request * q + j``) device to device. Async scheduling feeds a decode the token its
        previous step sampled, which the host has not seen yet."""
        self.staging_dev.index_copy_(0, index, token_ids)

    def replay(self, size: int) -> tuple:
        """Run the graph for ``size`` (inputs already loaded): ``(hidden, logits)``, one row
        per query token (``size * q`` rows); on a pipeline stage before the last ``(its
        output tensors by name, None)``."""
        key = (size, self._variant)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key]

    def verdict(self, num_tokens: int) -> torch.Tensor | None:
        """After a verification replay, ``[3, num_tokens]``: per row ``j`` of the step, the
        argmax of its logits; whether that equals the input token at ``j + 1`` (row ``j``'s
        draft, when the next row is the same request's); and whether the draft gathered into
        row ``j`` from ``draft_source`` lay outside the vocabulary (it was clamped). A greedy
        request with ``d`` drafts from row ``f`` accepts the leading run of matches in rows
        ``f .. f + d - 1``, then emits the argmax of the row after it. None: no verdict (a
        one-token graph, or a pipeline stage)."""
        return None if self._verdict is None else self._verdict[:, :num_tokens]

    # ---- capture -------------------------------------------------------------------------
    def _judge(self, num_tokens: int, logits: torch.Tensor) -> None:
        """In-graph, after the LM head: rows 0 and 1 of ``verdict``."""
        verdict = self._verdict
        best = logits.argmax(dim=-1)
        verdict[0, :num_tokens].copy_(best)
        verdict[1, : num_tokens - 1].copy_(best[:-1] == self.input_ids[1:num_tokens])

    def _derive_inputs(self, size: int, use_triton: bool | None = None) -> None:
        """In-graph: the step's inputs that follow from (tokens, seq_len, block table). One
        fused kernel on CUDA (``derive_step_inputs``), the same math in torch ops elsewhere."""
        q, bs = self.query_len, self.block_size
        rq, num_tokens = self.max_size * q, size * q
        fused = self.staging_dev.is_cuda if use_triton is None else use_triton
        self._gather_drafts(num_tokens, fused)
        derive_step_inputs = fused_kernel("derive_step_inputs") if fused else None
        if derive_step_inputs is not None:
            derive_step_inputs(
                self.staging_dev, self.block_table, self.input_ids, self.positions, self.seq_lens,
                self.slot_mapping, size=size, query_len=q, seq_lens_offset=rq, block_size=bs,
            )
            self._shift_positions(size)
            return
        tokens = self.staging_dev[:num_tokens].view(size, q)
        raw_seq_lens = self.staging_dev[rq : rq + size]
        positions = (raw_seq_lens[:, None] + self._position_offsets).clamp_(min=0)
        self.input_ids[:num_tokens].copy_(tokens.clamp(min=0).view(-1))
        self.positions[:num_tokens].copy_(positions.view(-1))
        self.seq_lens[:size].copy_(raw_seq_lens.clamp(min=1))
        block = self.block_table[:size].gather(1, positions // bs).long()
        real = (tokens >= 0) & (raw_seq_lens > 0)[:, None]
        slots = torch.where(real, block * bs + positions % bs, -1)
        self.slot_mapping[:num_tokens].copy_(slots.view(-1))
        self._shift_positions(size)

    def _gather_drafts(self, num_tokens: int, fused: bool) -> None:
        """In-graph, with ``draft_source``: the staged ids where a source is given replaced by
        the draft there, clamped into the vocabulary (an out-of-range id is reported from the
        host's copy, and must not reach an embedding). One kernel when ``fused`` and one is
        registered (``gather_drafts``, 2.25: in torch ops, 10 on the verification's path)."""
        if self.draft_source is None:
            return
        source, vocab_size = self.draft_source
        at = self._sources_at
        gather = fused_kernel("gather_drafts") if fused else None
        if gather is not None:
            out_of_vocab = None if self._verdict is None else self._verdict[2, :num_tokens]
            gather(self.staging_dev, source, out_of_vocab, sources_offset=at, num_tokens=num_tokens, vocab_size=vocab_size)
            return
        sources = self.staging_dev[at : at + num_tokens]
        drafts = source[sources.clamp(min=0)]
        if self._verdict is not None:  # row 2 of the verdict: the host names the proposer
            self._verdict[2, :num_tokens].copy_((sources >= 0) & ((drafts < 0) | (drafts >= vocab_size)))
        drafts.clamp_(0, vocab_size - 1)
        staged = self.staging_dev[:num_tokens]
        staged.copy_(torch.where(sources >= 0, drafts, staged))

    def _shift_positions(self, size: int) -> None:
        """In-graph, with ``position_offsets``: the rotary positions, each request's
        positions plus its staged delta."""
        if not self.position_offsets:
            return
        q, rq = self.query_len, self.max_size * self.query_len
        deltas = self.staging_dev[rq + self.max_size : rq + self.max_size + size]
        shifted = self.positions[: size * q].view(size, q) + deltas[:, None]
        self.rope_positions[: size * q].copy_(shifted.view(-1))

    def _step(self, size: int, md) -> tuple:
        self._derive_inputs(size)
        num_tokens = size * self.query_len
        with forward_context(ForwardContext(attn_metadata=md)):
            if self.stage is None:
                hidden = self.model(self.input_ids[:num_tokens], self.rope_positions[:num_tokens])
            else:
                inputs = None if self.intermediate is None else {
                    name: t[:num_tokens] for name, t in self.intermediate.items()
                }
                hidden = self.model(self.input_ids[:num_tokens], self.rope_positions[:num_tokens], inputs)
                if not self.stage.is_last:
                    return hidden, None
        logits = self.model.compute_logits(hidden)
        if self._verdict is not None:
            self._judge(num_tokens, logits)
        return hidden, logits

    @torch.inference_mode()
    def capture(self, pool: tuple[int, int] | None = None) -> tuple[int, int]:
        """Capture every size into ``pool`` (a new one if None: the graphs of several runners
        may share one, since they never replay at once); returns the pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        # A capture stream of this runner's GPU: torch's default one is made once per process,
        # on the GPU current then, and entering it makes that GPU current (two data-parallel
        # replicas of one process would capture the second's graphs on the first's GPU).
        stream = torch.cuda.Stream(self.staging_dev.device)
        self.staging_dev.zero_()  # every row a padding row: nothing is stored while capturing
        # Largest first: smaller graphs reuse the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            for variant in self.variants:
                common = self.common_metadata(size)
                md = (
                    self.builder.build_for_cudagraph(common)
                    if variant == ""
                    else self.builder.build_for_cudagraph(common, variant=variant)
                )
                self._step(size, md)  # warm-up: autotuning and lazy allocations happen outside capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[(size, variant)] = self._step(size, md)
                self.graphs[(size, variant)] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured CUDA graphs for batch sizes %s x %d query token(s) in %.1f s",
            self.sizes, self.query_len, time.perf_counter() - start,
        )
        return pool
