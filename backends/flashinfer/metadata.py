"""FlashInfer's per-step work: wrappers planned once per step by the metadata builder and run
by every layer.

One set of wrappers per distinct layer shape (``AttentionSpec``; a model has one, unless it
mixes sliding-window and full layers), all sharing one float workspace allocated once:

* ``decode``:  ``BatchDecodeWithPagedKVCacheWrapper`` for the step's leading one-token
  requests (tensor-core kernels when a KV head serves >= 4 query heads);
* ``prefill``: ``BatchPrefillWithPagedKVCacheWrapper`` (FA2) for the rest: prefills, chunked
  prefills over a cached prefix, speculative verification;
* ``shared``:  cascade attention's top level, a prefill wrapper over the common prefix with
  every query token of the step as one non-causal row. The two levels meet in
  ``merge_state_in_place``, which is what ``MultiLevelCascadeAttentionWrapper`` does; its levels
  pick their kernels with ``backend="auto"`` (FA3 on Hopper: another JIT module and a 64 MiB
  index buffer per level), so pagelm composes the same two levels from its FA2 wrappers;
* ``graph_decode[size]``: a decode wrapper per captured batch size, in CUDA-graph mode (fixed
  index buffers), planned again before every replay by ``prepare_cudagraph_replay``;
* ``graph_shared[size]``: with cascade attention on (``cascade_min_blocks``: the setting
  ``plugin_config["flashinfer"]["cascade_attention_min_blocks"] > 0``), the shared level of a ``"cascade"`` graph variant per size: a prefill wrapper in CUDA-graph
  mode whose one row is the batch's ``size`` query tokens over the common prefix. A decode
  batch with a common prefix replays that variant (the decode wrapper then planned over each
  request's own pages after the prefix); others replay the plain graph.

Page indices are uploaded once per step (one pinned copy); ``indptr`` and ``last_page_len``
stay on the host, where ``plan`` wants them (it copies them to the device itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagelm.attention import AttentionMetadataBuilder, AttentionSpec, CommonAttentionMetadata
from pagelm.backends.flashinfer.layout import (
    PageTable,
    common_prefix_blocks,
    padded_decode_table,
    shared_prefix_table,
    step_layout,
)

KV_LAYOUT = "NHD"  # the cache is [num_blocks, 2, block_size, num_kv_heads, head_dim]
WORKSPACE_BYTES = 256 << 20  # split-KV partials; FlashInfer recommends >= 128 MiB
INT_WORKSPACE_BYTES = 8 << 20  # the size each FlashInfer wrapper allocates for its own
# Tensor-core decode (the prefill kernel on one-token rows) pays off once a KV head is shared
# by enough query heads to fill an MMA tile; below that the CUDA-core decode kernel is faster.
TENSOR_CORE_MIN_GROUP = 4
# A decode batch that could replay a CUDA graph gives it up for cascade attention (which runs
# eagerly) only when cascade spares at least this much KV reading per step: the shared prefix
# read once instead of once per request. 4 GiB is ~1.4 ms of HBM on an H100, more than an
# eager step's launch overhead on a small model (a few ms of host time hidden behind that).
CASCADE_GRAPH_MIN_SAVED_BYTES = 4 << 30


def cascade_min_blocks(config: Any) -> Any:
    """The cascade threshold as set: ``plugin_config["flashinfer"]["cascade_attention_min_blocks"]``.
    When every request of a step shares at least this many leading, already-cached KV blocks
    (many requests over one system prompt), they are attended once for the whole batch. 0
    (the default) turns it off: on the H100 it pays only with large batches over a long
    prefix (docs/benchmarks.md). Checked by the backend's ``validate``."""
    section = config.plugin_config.get("flashinfer") or {}
    return section.get("cascade_attention_min_blocks", 0) if isinstance(section, dict) else section


@dataclass(frozen=True)
class LayerPlan:
    """The wrappers a layer runs this step (None: that part of the batch is empty)."""

    decode: Any | None  # over tokens [0, num_decode_tokens)
    prefill: Any | None  # over tokens [num_decode_tokens, num_actual_tokens)
    shared: Any | None  # cascade top level, over every token


@dataclass
class FlashInferMetadata:
    num_actual_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    plans: dict[AttentionSpec, LayerPlan]  # by layer shape

    @property
    def cascade(self) -> bool:
        return any(p.shared is not None for p in self.plans.values())


class ShapeGroup:
    """The wrappers of every layer with one ``AttentionSpec``, and how to plan them."""

    def __init__(self, flashinfer, spec: AttentionSpec, dtype: torch.dtype, workspace: torch.Tensor) -> None:
        self.fi = flashinfer
        self.spec = spec
        self.dtype = dtype
        self.workspace = workspace
        self.use_tensor_cores = spec.num_heads // spec.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        # FlashInfer's window is inclusive of the query's own position: w keys = w - 1 to the left.
        self.window_left = spec.sliding_window - 1 if spec.sliding_window else -1
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, KV_LAYOUT, use_tensor_cores=self.use_tensor_cores
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, KV_LAYOUT, backend="fa2")
        self.shared = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, KV_LAYOUT, backend="fa2")
        self.graph_decode: dict[int, Any] = {}
        self.graph_shared: dict[int, Any] = {}
        self._graph_int_workspace: torch.Tensor | None = None
        self._plan_read: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan was read

    def _plan(self, wrapper, *args, **kwargs) -> None:
        """``wrapper.plan``, once the GPU has read the wrapper's previous plan: ``plan`` writes
        its tile schedule into a pinned host buffer and queues an asynchronous copy from it, so a
        second plan in one step (a draft model's passes build metadata again) must not overwrite
        that buffer before the first copy ran. Once per step this never waits: the step's host
        sync has long passed it."""
        read = self._plan_read.get(id(wrapper))
        if read is not None:
            read.synchronize()
        wrapper.plan(*args, **kwargs)
        if self.workspace.is_cuda:
            read = read or torch.cuda.Event()
            read.record()
            self._plan_read[id(wrapper)] = read

    def _common_args(self, block_size: int) -> tuple:
        s = self.spec
        return (s.num_heads, s.num_kv_heads, s.head_dim, block_size)

    def _host(self, array: np.ndarray) -> torch.Tensor:
        """A host tensor for ``plan``, which reads it there and copies it to the device
        asynchronously: pinned (from torch's caching host allocator, which keeps it alive until
        the copy has run) so that the copy never waits for the stream."""
        t = torch.from_numpy(array)
        return t.pin_memory() if self.workspace.is_cuda else t

    def plan_decode(self, wrapper, table: PageTable, indices: torch.Tensor, block_size: int) -> None:
        self._plan(
            wrapper, self._host(table.indptr), indices, self._host(table.last_page_len),
            *self._common_args(block_size),
            pos_encoding_mode="NONE", window_left=self.window_left, q_data_type=self.dtype,
            kv_data_type=self.dtype, sm_scale=self.spec.scale,
        )

    def plan_prefill(
        self, wrapper, qo_indptr: np.ndarray, table: PageTable, indices: torch.Tensor, block_size: int, causal: bool
    ) -> None:
        self._plan(
            wrapper, self._host(qo_indptr), self._host(table.indptr), indices,
            self._host(table.last_page_len), *self._common_args(block_size),
            causal=causal, pos_encoding_mode="NONE", sm_scale=self.spec.scale, window_left=self.window_left,
            q_data_type=self.dtype, kv_data_type=self.dtype,
        )

    def graph_wrapper(self, size: int, max_blocks_per_req: int, device: torch.device):
        """The CUDA-graph decode wrapper for ``size`` requests, made on first use. Its index
        buffers are fixed (the graph reads them), sized for ``size`` full-width rows."""
        if size not in self.graph_decode:
            wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, KV_LAYOUT, use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(size * max_blocks_per_req, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device),
            )
            # The graphs of one shape share an int workspace (the plan's tile schedule): only
            # the size about to replay is planned into it, right before it replays.
            if self._graph_int_workspace is None:
                self._graph_int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            wrapper.reset_workspace_buffer(self.workspace, self._graph_int_workspace)
            self.graph_decode[size] = wrapper
        return self.graph_decode[size]

    def graph_shared_wrapper(self, size: int, max_blocks_per_req: int, device: torch.device):
        """The cascade graphs' shared level for ``size`` query tokens, made on first use: one
        non-causal row (every query token of the batch) over up to a full block-table row."""
        if size not in self.graph_shared:
            int32 = dict(dtype=torch.int32, device=device)
            self.graph_shared[size] = self.fi.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, KV_LAYOUT, use_cuda_graph=True, backend="fa2",
                qo_indptr_buf=torch.zeros(2, **int32),
                paged_kv_indptr_buf=torch.zeros(2, **int32),
                paged_kv_indices_buf=torch.zeros(max_blocks_per_req, **int32),
                paged_kv_last_page_len_buf=torch.zeros(1, **int32),
            )
        return self.graph_shared[size]


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """Plans the step's wrappers once (``build``), or the graph wrapper of a captured size
    (``build_for_cudagraph`` at capture, ``prepare_cudagraph_replay`` before each replay)."""

    workspace_bytes: int = WORKSPACE_BYTES
    cascade_graph_min_saved_bytes: int = CASCADE_GRAPH_MIN_SAVED_BYTES

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: dict[AttentionSpec, ShapeGroup] = {}
        self.workspace: torch.Tensor | None = None
        self.kv_bytes_per_token = 0  # K and V of one token, all layers
        self.num_cascade_steps = 0  # steps that ran cascade attention (read by tests)
        self.num_graph_plans = 0  # graph wrapper plans: one per captured size, then one per replay
        self.cascade_min_blocks = 0  # off until configure() reads the setting

    def configure(self, config: Any) -> None:
        self.cascade_min_blocks = cascade_min_blocks(config)

    def bind_layers(self, specs: Sequence[AttentionSpec], dtype: torch.dtype) -> None:
        try:
            import flashinfer
        except ImportError as e:  # installed (validate passed) but broken, e.g. built for another torch
            raise RuntimeError(
                f"attention backend 'flashinfer' could not import flashinfer ({e}); reinstall it with "
                "pip install 'pagelm[flashinfer]' or choose attention_backend='triton'"
            ) from e

        if self.workspace is None:
            self.workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        for spec in dict.fromkeys(specs):
            group = self.groups.get(spec)
            if group is None or group.dtype != dtype:
                self.groups[spec] = ShapeGroup(flashinfer, spec, dtype, self.workspace)
        self.kv_bytes_per_token = sum(2 * s.num_kv_heads * s.head_dim * dtype.itemsize for s in specs)

    @property
    def cascade_allowed(self) -> bool:
        """A window could hide part of the shared prefix from some queries: no cascade then."""
        return all(g.window_left < 0 for g in self.groups.values())

    def _num_common_blocks(self, common: CommonAttentionMetadata, table: np.ndarray) -> int:
        """Cascade's shared prefix for the ``len(table)`` real requests of this step, from the
        host copies the runner gives (no device read): what every request had computed
        before the step is its ``seq_len`` less its query length. Nothing to do when off."""
        if not self.cascade_min_blocks or not self.cascade_allowed:
            return 0
        n, qsl = len(table), common.query_start_loc_cpu.numpy()
        computed = common.seq_lens_cpu.numpy()[:n] - (qsl[1 : n + 1] - qsl[:n])  # (np.diff: 4x slower)
        return common_prefix_blocks(table, computed, common.block_size, self.cascade_min_blocks)

    # ---- eager steps ---------------------------------------------------------------------
    def build(self, common: CommonAttentionMetadata) -> FlashInferMetadata:
        assert self.groups, "bind_layers() must be called before build()"
        bs = common.block_size
        table = self._host_block_table(common, common.num_reqs)
        num_common = self._num_common_blocks(common, table)
        layout = step_layout(common.query_start_loc_cpu.numpy(), common.seq_lens_cpu.numpy(), table, bs, num_common)
        decode_idx, prefill_idx, shared_idx = self._upload_indices([layout.decode, layout.prefill, layout.shared])
        plans = {}
        for spec, g in self.groups.items():
            if layout.decode is not None:
                g.plan_decode(g.decode, layout.decode, decode_idx, bs)
            if layout.prefill is not None:
                g.plan_prefill(g.prefill, layout.prefill_qo_indptr, layout.prefill, prefill_idx, bs, causal=True)
            if layout.shared is not None:
                everyone = np.array([0, common.num_actual_tokens], dtype=np.int32)
                g.plan_prefill(g.shared, everyone, layout.shared, shared_idx, bs, causal=False)
            plans[spec] = LayerPlan(
                g.decode if layout.decode is not None else None,
                g.prefill if layout.prefill is not None else None,
                g.shared if layout.shared is not None else None,
            )
        self.num_cascade_steps += layout.shared is not None
        return FlashInferMetadata(common.num_actual_tokens, layout.num_decode_tokens, common.slot_mapping, plans)

    # ---- CUDA graphs ---------------------------------------------------------------------
    def cudagraph_variants(self, config) -> tuple[str, ...]:
        """With cascade attention on, a ``"cascade"`` graph per size beside the plain one."""
        cascade = self.cascade_min_blocks > 0 and self.cascade_allowed
        return ("", "cascade") if cascade else ("",)

    def build_for_cudagraph(self, common: CommonAttentionMetadata, variant: str = "") -> FlashInferMetadata:
        """Every row a decode through the graph wrapper of this size (and, for the
        ``"cascade"`` variant, the shared level over a common prefix); the plan made here (on
        the capture's dummy rows, a one-block prefix) is redone with real rows before every
        replay."""
        assert self.groups, "bind_layers() must be called before graph capture"
        size, width = common.num_reqs, common.block_table.shape[1]
        cascade = variant == "cascade"
        for g in self.groups.values():
            g.graph_wrapper(size, width, self.device)
            if cascade:
                g.graph_shared_wrapper(size, width, self.device)
        # At capture every row is padding; a cascade capture plans a one-block prefix (block 0).
        self._plan_graph(common, 0 if cascade else size, num_common_prefix_blocks=1 if cascade else 0)
        plans = {
            spec: LayerPlan(g.graph_decode[size], None, g.graph_shared[size] if cascade else None)
            for spec, g in self.groups.items()
        }
        return FlashInferMetadata(size, size, common.slot_mapping, plans)

    def prepare_cudagraph_replay(self, common: CommonAttentionMetadata, num_reqs: int) -> bool | str:
        """Plan the graphs of ``common.num_reqs`` (the captured size) for this step's
        ``num_reqs`` real decodes: the cascade variant when the batch shares a prefix (and that
        variant was captured), the plain one otherwise. Without cascade graphs, a batch whose
        shared prefix is worth it runs eagerly, where cascade reads the prefix once."""
        size = common.num_reqs
        num_common = self._num_common_blocks(common, self._host_block_table(common, num_reqs))
        if num_common and all(size in g.graph_shared for g in self.groups.values()):
            self._plan_graph(common, num_reqs, num_common_prefix_blocks=num_common)
            self.num_cascade_steps += 1
            return "cascade"
        if num_common:
            prefix_tokens = num_common * common.block_size
            saved = (num_reqs - 1) * prefix_tokens * self.kv_bytes_per_token
            if saved >= self.cascade_graph_min_saved_bytes:
                return False
        self._plan_graph(common, num_reqs)
        return True

    def _plan_graph(self, common: CommonAttentionMetadata, num_reqs: int, num_common_prefix_blocks: int = 0) -> None:
        """Plan the graph wrappers of ``common.num_reqs``: each row's pages after the first
        ``num_common_prefix_blocks`` (padding rows: one key in block 0), and with a common
        prefix the shared level, every query row over those blocks."""
        size, bs, skip = common.num_reqs, common.block_size, num_common_prefix_blocks
        block_table = self._host_block_table(common, num_reqs)
        seq_lens = common.seq_lens_cpu.numpy()[:size].astype(np.int64)
        if skip:
            seq_lens = seq_lens.copy()
            seq_lens[:num_reqs] -= skip * bs
        table = padded_decode_table(block_table[:, skip:], seq_lens, bs, size)
        shared = None
        if skip:  # at capture (no real rows) the prefix is block 0
            shared = shared_prefix_table(block_table[0, :skip] if num_reqs else np.zeros(skip), bs)
        indices, shared_indices = self._upload_indices([table, shared])
        everyone = np.array([0, size], dtype=np.int32)
        for g in self.groups.values():
            g.plan_decode(g.graph_decode[size], table, indices, bs)
            if skip:
                g.plan_prefill(g.graph_shared[size], everyone, shared, shared_indices, bs, causal=False)
        self.num_graph_plans += 1

    # ---- host data -----------------------------------------------------------------------
    def _host_block_table(self, common: CommonAttentionMetadata, num_rows: int) -> np.ndarray:
        """The first ``num_rows`` rows of the block table on the host (the runner's copy; a
        device read, which syncs, only where none was given: graph capture, tests)."""
        if common.block_table_cpu is not None:
            return common.block_table_cpu.numpy()[:num_rows]
        return common.block_table[:num_rows].cpu().numpy()

    def _upload_indices(self, tables: list[PageTable | None]) -> list[torch.Tensor | None]:
        """Every table's page indices in one host-to-device copy; a device view per table."""
        present = [t.indices for t in tables if t is not None]
        host = torch.from_numpy(np.concatenate(present) if present else np.zeros(0, dtype=np.int32))
        if self.device.type == "cuda":
            # A pinned copy from torch's caching host allocator, which keeps it alive until the
            # asynchronous copy has read it.
            device = host.pin_memory().to(self.device, non_blocking=True)
        else:
            device = host.to(self.device)
        views, offset = [], 0
        for t in tables:
            if t is None:
                views.append(None)
                continue
            views.append(device[offset : offset + len(t.indices)])
            offset += len(t.indices)
        return views
