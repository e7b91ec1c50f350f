"""The attention backend contract, split in three as in vLLM V1: a static description
(``AttentionBackend``), a metadata builder run once per step (``AttentionMetadataBuilder``)
and an implementation run per layer (``AttentionImpl``)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from pagelm.config import EngineConfig


class GraphSupport(enum.Enum):
    """Which steps a backend lets the runner capture in CUDA graphs."""

    # Every step runs eagerly.
    NEVER = "never"
    # One-token decode batches (no host syncs or value-dependent shapes in forward, and the
    # builder implements ``build_for_cudagraph``); speculative verification runs eagerly.
    DECODE_ONLY = "decode_only"
    # Also uniform batches of q = 1 + k query tokens per request (speculative verification).
    ALWAYS = "always"


@dataclass(frozen=True)
class AttentionSpec:
    """Shape of one attention layer, taken from the model's ``Attention`` module."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None


@dataclass
class CommonAttentionMetadata:
    """Per-step batch layout shared by every backend. Requests are flattened into one token
    axis; request ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``::

        tokens:  | r0 prefill chunk ......... | r1 | r2 | r3 |
        query_start_loc = [0, 9, 10, 11, 12]   seq_lens = [9+c0, 41, 17, 5]

    ``seq_lens`` counts cached + new tokens; ``slot_mapping[t] = block_id * block_size +
    offset`` is where token ``t``'s K/V goes; ``block_table[i, j]`` is request ``i``'s ``j``-th
    block. The ``*_cpu`` copies let Python-side code read shapes without a device sync.
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor  # [num_reqs] int32, device
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_size: int
    # Host copy of the block table's rows, as many columns as the longest request uses (None:
    # not provided, e.g. at graph capture; read ``block_table`` then, which syncs).
    block_table_cpu: torch.Tensor | None = None


class AttentionMetadataBuilder(ABC):
    """Built once per engine; ``build`` turns the runner's common metadata into whatever the
    backend's kernels want, once per step, never per layer."""

    def configure(self, config: "EngineConfig") -> None:
        """The engine's config, given once right after the builder is made: a backend reads
        its own settings here (``config.plugin_config[name]``). Default: nothing."""

    def bind_layers(self, specs: Sequence[AttentionSpec], dtype: torch.dtype) -> None:
        """The model's attention layers (one spec per layer, in order) and the KV cache dtype,
        given by the runner whenever it allocates the KV cache, before any ``build`` or graph
        capture. For builders that plan kernels per layer shape (FlashInfer's ``plan``) and
        allocate workspaces once. Default: nothing."""

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """Return the backend's metadata object, handed to every layer this step."""

    def build_for_cudagraph(self, common: CommonAttentionMetadata) -> Any:
        """Metadata for a decode batch captured in a CUDA graph (``num_reqs`` = the padded
        batch size, one query token each). The graph replays whatever host-side choices were
        made at capture, so they may depend on ``num_reqs`` only, never on ``seq_lens``; the
        device tensors in ``common`` are the runner's persistent buffers, refilled before
        every replay. Padding rows have ``seq_len`` 1 and slot -1 (nothing stored).
        Only backends whose ``graph_support`` is not ``NEVER`` are asked.

        Backends with ``graph_support = GraphSupport.ALWAYS`` are also asked for speculative
        verification graphs: ``max_query_len = q > 1`` tokens per request,
        ``query_start_loc = arange * q``, ``max_seq_len = max_model_len``. A request's tokens
        are the last ``q`` positions before its ``seq_len``; padding tokens (slot -1) come
        first, on positions already cached, so causal attention over the cache stays exact
        for the real ones."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def cudagraph_variants(self, config) -> tuple[str, ...]:
        """The kinds of one-token decode graph to capture per batch size: ``""`` is the plain
        one, built by ``build_for_cudagraph(common)``. A backend with a batch shape worth a
        graph of its own (FlashInfer's cascade attention over a shared prefix) names it here;
        it is then built by ``build_for_cudagraph(common, variant=name)`` and chosen per step
        by ``prepare_cudagraph_replay`` returning its name. Default: the plain one."""
        return ("",)

    def prepare_cudagraph_replay(self, common: CommonAttentionMetadata, num_reqs: int) -> bool | str:
        """Called before every replay of a captured graph, outside it. ``common`` describes
        the padded batch about to replay (``common.num_reqs`` = the captured size; rows from
        ``num_reqs`` on are padding, ``seq_len`` 1) with this step's host copies
        (``seq_lens_cpu``, and ``block_table_cpu`` for the ``num_reqs`` real rows). A backend
        whose kernels read per-step host work from buffers of its own (FlashInfer's ``plan``)
        refreshes them here. Return False to run the step eagerly through ``build`` instead
        (e.g. a batch that wants a kernel the graph did not capture), or the name of a
        ``cudagraph_variants`` graph to replay that one. Default: replay the plain graph."""
        return True


@dataclass(frozen=True)
class QKRotary:
    """What q and k still need before attention, for an impl with ``fuses_rotary``: an
    optional per-head RMSNorm (Qwen3's ``q_norm``/``k_norm``, weights ``[head_dim]``), then
    neox RoPE over each head's first ``rotary_dim`` dims (``cos_sin_cache`` float32
    ``[max_position, rotary_dim]``, cos then sin) at ``positions`` (``[num_tokens]``)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 0.0


class AttentionImpl(ABC):
    """One per attention layer: writes this step's K/V through ``slot_mapping`` into the
    paged cache, then attends over the cache through the block table."""

    # True: ``forward`` also takes ``rotary=QKRotary`` (q and k not yet normed or rotated) and
    # applies it itself, e.g. in the kernel that stores K/V. Models check it per call.
    fuses_rotary: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        kv_cache: torch.Tensor,  # this layer's cache, in the backend's layout
        metadata: Any,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Store key/value at ``slot_mapping``, then attend causally over the paged cache."""


class AttentionBackend(ABC):
    """Static description of an attention backend, registered by name through the
    ``pagelm_register_attention_backends`` hook and chosen with ``attention_backend=``."""

    name: ClassVar[str]
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    # None: any head size.
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supports_sliding_window: ClassVar[bool] = False
    # Which steps may be captured in CUDA graphs (see GraphSupport and build_for_cudagraph).
    graph_support: ClassVar[GraphSupport] = GraphSupport.NEVER
    # attention_backend="auto": device type -> priority (highest valid backend wins). A device
    # type not listed: auto never picks this backend there (name it explicitly instead).
    auto_priority: ClassVar[dict[str, int]] = {}

    @classmethod
    def validate(
        cls, config: "EngineConfig", spec: AttentionSpec, dtype: torch.dtype, device: torch.device
    ) -> list[str]:
        """Problems that make this backend unusable for the model/config (empty: fine)."""
        problems = []
        if device.type not in cls.supported_devices:
            problems.append(f"attention backend {cls.name!r} does not run on {device.type}")
        if dtype not in cls.supported_dtypes:
            problems.append(f"attention backend {cls.name!r} does not support dtype {dtype}")
        if cls.supported_head_sizes is not None and spec.head_dim not in cls.supported_head_sizes:
            problems.append(
                f"attention backend {cls.name!r} supports head sizes {cls.supported_head_sizes}, "
                f"the model has {spec.head_dim}"
            )
        if spec.sliding_window is not None and not cls.supports_sliding_window:
            problems.append(f"attention backend {cls.name!r} does not support sliding-window attention")
        return problems

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache tensor."""

    @classmethod
    @abstractmethod
    def make_metadata_builder(cls, device: torch.device) -> AttentionMetadataBuilder: ...

    @classmethod
    @abstractmethod
    def make_impl(cls, spec: AttentionSpec) -> AttentionImpl: ...
