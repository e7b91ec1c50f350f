"""The ``triton`` attention backend: Triton kernels for the paged KV cache.

Per layer, two launches (three when a step mixes prefills with split-K decodes) and no host
sync: ``store_kv`` scatters this step's K/V through ``slot_mapping`` (``rotary_store_kv``
when the model hands its q/k norm and rotary over, ``QKRotary``: they run in the same
launch); ``paged_attention`` serves every request's query tokens (prefill, chunked prefill,
decode); when the step has long-context decodes, those instead go through
``split_decode_attention`` (split-K over the KV sequence; the last split program of each
query token and KV head merges the partials, so it is one launch too). Every host-side
decision (which requests are decodes, how many splits) is made once per step by the
metadata builder.

This module does not import Triton: the plugin registers (and ``validate`` explains what is
missing) on machines without it. The kernels are imported when a layer is built.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagelm.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    GraphSupport,
    QKRotary,
)

if TYPE_CHECKING:
    from pagelm.backends.triton.paged_attention import SplitScratch
    from pagelm.config import EngineConfig

MAX_HEAD_DIM = 256


@dataclass
class TritonAttentionMetadata:
    """One step's batch, as the kernels take it. Decodes (query_len 1) run through the
    split-K launch when ``num_splits > 1``, and the main launch skips them::

        requests:        | r0 decode | r1 prefill chunk | r2 decode |
        decode_req_idx = [0, 2]   (main launch: r1 only)
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_splits: int  # 1: no split-K launch this step
    num_decodes: int  # requests in the split-K launch (0 when num_splits == 1)
    decode_req_idx: torch.Tensor | None  # [num_decodes] int32
    scratch: "ScratchPool"
    split_query_len: int = 1  # query tokens of each split-K request (1 + k: verification graphs)

    @property
    def run_main(self) -> bool:
        """False when every request is a split-K decode."""
        return self.num_decodes < self.num_reqs


class ScratchPool:
    """Split-K partials and merge counters, allocated once per (num_heads, head_dim) with room
    for ``max_rows = num_decodes * num_splits`` and reused by every layer and step (the
    layers run one after another on one stream; the counters are zero between launches)."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.device = device
        self._buffers: dict[tuple[int, int], SplitScratch] = {}

    def get(self, num_heads: int, head_dim: int) -> "SplitScratch":
        key = (num_heads, head_dim)
        if key not in self._buffers:
            from pagelm.backends.triton.paged_attention import SplitScratch

            self._buffers[key] = SplitScratch.allocate(self.max_rows, num_heads, head_dim, self.device)
        return self._buffers[key]


class TritonMetadataBuilder(AttentionMetadataBuilder):
    """Chooses, once per step, whether decodes split their KV range and into how many parts.

    A decode is split only when its context is long enough that each part still gets
    ``min_tokens_per_split`` keys, and only as far as needed to give ``target_programs``
    (per KV head) work items in total: a batch of many decodes fills the GPU on its own.
    ``num_decodes * num_splits`` never exceeds ``target_programs``, which sizes the scratch.
    """

    max_splits: int = 32
    min_tokens_per_split: int = 256

    def __init__(self, device: torch.device, target_programs: int | None = None) -> None:
        self.device = device
        if target_programs is None:
            # About one wave of programs per KV head; a small fixed number on the CPU interpreter.
            target_programs = (
                torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16
            )
        self.target_programs = max(target_programs, self.max_splits)
        self.scratch = ScratchPool(self.target_programs, device)
        self._block_size = 16  # the engine's, from configure()
        self._built: set[tuple] = set()  # (layer shape, dtype) whose kernels bind_layers built
        self._decode_req_idx = torch.zeros(self.target_programs, dtype=torch.int32, device=device)
        # Graphs keep their own (constant) index: eager steps rewrite the one above.
        self._graph_decode_req_idx = torch.arange(self.target_programs, dtype=torch.int32, device=device)

    def configure(self, config: "EngineConfig") -> None:
        self._block_size = config.block_size

    def bind_layers(self, specs, dtype: torch.dtype) -> None:
        """Build the kernels of every layer shape now (``build_kernels``), not in the first
        step that needs each variant: Triton compiles a variant the first time it runs, over a
        second on a fresh machine, and a step that waits for it stalls the whole batch."""
        from pagelm.backends.triton import paged_attention as pa

        if pa.INTERPRETED or self.device.type != "cuda":
            return  # the interpreter compiles nothing
        split_counts = tuple(1 << i for i in range(1, self.max_splits.bit_length()))
        for shape in sorted({(s.num_heads, s.num_kv_heads, s.head_dim, s.sliding_window) for s in specs},
                            key=repr):
            if (shape, dtype) in self._built:
                continue
            num_heads, num_kv_heads, head_dim, sliding_window = shape
            pa.build_kernels(
                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                block_size=self._block_size, sliding_window=sliding_window, split_counts=split_counts,
                scratch=self.scratch.get(num_heads, head_dim), device=self.device,
            )
            self._built.add((shape, dtype))

    def num_splits(self, num_decodes: int, max_decode_seq_len: int) -> int:
        """A power of two (so an eager step only meets split counts ``bind_layers`` built)."""
        if num_decodes == 0:
            return 1
        by_length = max_decode_seq_len // self.min_tokens_per_split
        by_occupancy = self.target_programs // num_decodes
        splits = max(1, min(self.max_splits, by_length, by_occupancy))
        return 1 << (splits.bit_length() - 1)

    def build_for_cudagraph(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """Every request has ``q = max_query_len`` tokens (1: decode; 1 + k: speculative
        verification). The split count depends on the batch size alone (a short sequence
        leaves some splits empty, which the reduce weighs 0); a verification step splits
        each of its tokens like a decode, so that a batch of one still fills the GPU. When
        the batch alone fills it (no splits), the main launch runs instead."""
        num_decodes, q = common.num_reqs, common.max_query_len
        num_splits = max(1, min(self.max_splits, self.target_programs // (num_decodes * q)))
        if num_splits == 1:
            return self._metadata(common, 1, 0, None)
        decode_req_idx = self._graph_decode_req_idx[:num_decodes]
        return self._metadata(common, num_splits, num_decodes, decode_req_idx, split_query_len=q)

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        query_lens = np.diff(common.query_start_loc_cpu.numpy())
        is_decode = query_lens == 1
        num_decodes = int(is_decode.sum())
        max_decode_seq_len = int(common.seq_lens_cpu.numpy()[is_decode].max()) if num_decodes else 0
        num_splits = self.num_splits(num_decodes, max_decode_seq_len)
        decode_req_idx = None
        if num_splits > 1:
            idx = torch.from_numpy(np.flatnonzero(is_decode).astype(np.int32))
            decode_req_idx = self._decode_req_idx[:num_decodes]
            decode_req_idx.copy_(idx, non_blocking=True)
        else:
            num_decodes = 0
        return self._metadata(common, num_splits, num_decodes, decode_req_idx)

    def _metadata(self, common, num_splits, num_decodes, decode_req_idx, split_query_len=1) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            num_reqs=common.num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            slot_mapping=common.slot_mapping,
            num_splits=num_splits,
            num_decodes=num_decodes,
            decode_req_idx=decode_req_idx,
            scratch=self.scratch,
            split_query_len=split_query_len,
        )


class TritonAttentionImpl(AttentionImpl):
    # The model's q/k norm and rotary run in the K/V store kernel (``rotary_store_kv``).
    fuses_rotary = True

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        from pagelm.backends.triton import kv_store, paged_attention

        self._kv_store = kv_store
        self._attn = paged_attention

    def forward(self, query, key, value, kv_cache, metadata: TritonAttentionMetadata, rotary: QKRotary | None = None):
        spec, md = self.spec, metadata
        num_tokens = md.num_actual_tokens
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if rotary is None:
            self._kv_store.store_kv(
                key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                md.slot_mapping[:num_tokens], spec.num_kv_heads, spec.head_dim,
            )
        else:
            query = self._kv_store.rotary_store_kv(
                query, key, value, key_cache, value_cache, md.slot_mapping[:num_tokens], rotary,
                spec.num_heads, spec.num_kv_heads, spec.head_dim,
            )
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape[0], spec.num_heads * spec.head_dim, dtype=query.dtype, device=query.device)
        shape = dict(
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            scale=spec.scale, sliding_window=spec.sliding_window,
        )
        tables = (key_cache, value_cache, md.block_table, md.seq_lens, md.query_start_loc)
        if md.run_main:
            self._attn.paged_attention(
                out, query, *tables,
                num_reqs=md.num_reqs, num_tokens=num_tokens, max_query_len=md.max_query_len,
                skip_decodes=md.num_splits > 1, **shape,
            )
        if md.num_splits > 1:
            self._attn.split_decode_attention(
                out, query, *tables, md.decode_req_idx, md.scratch.get(spec.num_heads, spec.head_dim),
                num_decodes=md.num_decodes, num_splits=md.num_splits, query_len=md.split_query_len, **shape,
            )
        return out


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_support = GraphSupport.ALWAYS
    # On an H200 (docs/benchmarks.md) triton decodes faster at batch 1 and 32 than flashinfer
    # (which re-plans before every graph replay) and needs no JIT compile on a fresh machine.
    auto_priority = {"cuda": 300}
    # CPU only under TRITON_INTERPRET=1 (tests, debugging); see validate().
    supported_devices = ("cuda", "cpu")
    supports_sliding_window = True

    @classmethod
    def validate(
        cls, config: "EngineConfig", spec: AttentionSpec, dtype: torch.dtype, device: torch.device
    ) -> list[str]:
        problems = super().validate(config, spec, dtype, device)
        if importlib.util.find_spec("triton") is None:
            problems.append(
                f"attention backend {cls.name!r} needs the triton package: pip install 'pagelm[triton]'"
            )
        if device.type == "cpu" and not interpreter_enabled():
            problems.append(
                f"attention backend {cls.name!r} runs on CUDA; on CPU only under TRITON_INTERPRET=1 "
                "(slow, for tests)"
            )
        if spec.head_dim > MAX_HEAD_DIM:
            problems.append(
                f"attention backend {cls.name!r} supports head_dim <= {MAX_HEAD_DIM}, "
                f"the model has {spec.head_dim}"
            )
        if spec.num_heads % spec.num_kv_heads:
            problems.append(f"num_heads={spec.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}")
        return problems

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim):
        # Each key one contiguous head_dim row (all heads of a token side by side), which is
        # what the kernels' gathers want.
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def make_metadata_builder(cls, device: torch.device) -> TritonMetadataBuilder:
        return TritonMetadataBuilder(device)

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> TritonAttentionImpl:
        return TritonAttentionImpl(spec)
