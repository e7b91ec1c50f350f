"""The ``flashinfer`` attention backend: FlashInfer's paged-KV wrappers (FA2 prefill,
tensor-core decode for GQA, cascade attention over a shared prefix) behind pagelm's contract.

Per layer: store this step's K/V through ``slot_mapping`` (pagelm's Triton store kernel, which
skips the padding rows of a graph batch; with the model's q/k norm and rotary in the same
launch when it hands them over, ``QKRotary``), then ``run`` the wrappers the builder planned for the
step (``metadata.py``). The cache is FlashInfer's NHD layout, K and V of a block side by side::

    kv_cache[block, 0 | 1, offset, kv_head, :]      [num_blocks, 2, block_size, kv_heads, head_dim]

This module does not import FlashInfer: the plugin registers (and ``validate`` says what is
missing) on machines without it or without a GPU. FlashInfer is imported when layers are bound.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from pagelm.attention import AttentionBackend, AttentionImpl, AttentionSpec, GraphSupport, QKRotary
from pagelm.backends.flashinfer.metadata import FlashInferMetadata, FlashInferMetadataBuilder, cascade_min_blocks

if TYPE_CHECKING:
    from pagelm.config import EngineConfig

INSTALL_HINT = "pip install 'pagelm[flashinfer]'"
MIN_COMPUTE_CAPABILITY = (8, 0)  # bf16 kernels: Ampere or newer


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_kv_heads: int, head_dim: int,
) -> None:
    """Write token ``t``'s K/V to ``kv_cache[slot // block_size, :, slot % block_size]``;
    negative slots (padding) are skipped."""
    if kv_cache.is_cuda:
        from pagelm.backends.triton.kv_store import store_kv as triton_store_kv

        triton_store_kv(key, value, kv_cache[:, 0], kv_cache[:, 1], slot_mapping, num_kv_heads, head_dim)
        return
    # CPU: only tests get here (with a stand-in for FlashInfer); a mask is fine off the GPU.
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[keep].view(-1, num_kv_heads, head_dim)
    kv_cache[blocks, 1, offsets] = value[keep].view(-1, num_kv_heads, head_dim)


def rotary_store_kv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor, rotary: QKRotary, spec: AttentionSpec,
) -> torch.Tensor:
    """``rotary`` applied to q and k, then ``store_kv``; returns q. On CUDA one Triton launch
    (the triton backend's, on this layout's K and V halves) that rotates q in place."""
    if kv_cache.is_cuda:
        from pagelm.backends.triton.kv_store import rotary_store_kv as triton_rotary_store_kv

        return triton_rotary_store_kv(
            query, key, value, kv_cache[:, 0], kv_cache[:, 1], slot_mapping, rotary,
            spec.num_heads, spec.num_kv_heads, spec.head_dim,
        )
    # CPU (tests): the model's eager math, out of place.
    query = _norm_rotate(query, rotary.q_norm_weight, rotary, spec.head_dim)
    key = _norm_rotate(key, rotary.k_norm_weight, rotary, spec.head_dim)
    n = slot_mapping.shape[0]
    store_kv(key[:n], value[:n], kv_cache, slot_mapping, spec.num_kv_heads, spec.head_dim)
    return query


def _norm_rotate(x: torch.Tensor, norm_weight: torch.Tensor | None, rotary: QKRotary, head_dim: int) -> torch.Tensor:
    """Per-head RMSNorm (normalised in float32, scaled in the model dtype), then neox RoPE
    over the first ``rotary_dim`` dims of each head in float32."""
    heads = x.reshape(x.shape[0], -1, head_dim)
    if norm_weight is not None:
        heads = norm_weight * torch.nn.functional.rms_norm(heads.float(), (heads.shape[-1],), eps=rotary.eps).to(x.dtype)
    rotary_dim = rotary.cos_sin_cache.shape[-1]
    cos, sin = rotary.cos_sin_cache[rotary.positions].unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = heads[..., :rotary_dim].float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, heads[..., rotary_dim:]], dim=-1).reshape(x.shape)


class FlashInferAttentionImpl(AttentionImpl):
    # The model's q/k norm and rotary run in the K/V store kernel (the triton backend's).
    fuses_rotary = True

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._merge_state_in_place = None

    def forward(self, query, key, value, kv_cache, metadata: FlashInferMetadata, rotary: QKRotary | None = None):
        spec, md = self.spec, metadata
        n, nd = md.num_actual_tokens, md.num_decode_tokens
        if rotary is None:
            store_kv(key[:n], value[:n], kv_cache, md.slot_mapping[:n], spec.num_kv_heads, spec.head_dim)
        else:
            query = rotary_store_kv(query, key, value, kv_cache, md.slot_mapping[:n], rotary, spec)
        q = query[:n].view(n, spec.num_heads, spec.head_dim)  # rows may be strided: FlashInfer takes strides
        out = torch.empty(query.shape[0], spec.num_heads, spec.head_dim, dtype=query.dtype, device=query.device)
        plan = md.plans[spec]
        # Cascade: each request's own KV first, with its log-sum-exp, then the shared prefix
        # for every token at once, merged in.
        lse = torch.empty(n, spec.num_heads, dtype=torch.float32, device=query.device) if plan.shared else None
        for wrapper, lo, hi in ((plan.decode, 0, nd), (plan.prefill, nd, n)):
            if wrapper is not None:
                part_lse = None if lse is None else lse[lo:hi]
                wrapper.run(q[lo:hi], kv_cache, out=out[lo:hi], lse=part_lse, return_lse=lse is not None)
        if plan.shared is not None:
            shared_out, shared_lse = plan.shared.run(q, kv_cache, return_lse=True)
            self._merge(out[:n], lse, shared_out, shared_lse)
        return out.view(-1, spec.num_heads * spec.head_dim)

    def _merge(self, out, lse, other_out, other_lse) -> None:
        if self._merge_state_in_place is None:
            from flashinfer import merge_state_in_place

            self._merge_state_in_place = merge_state_in_place
        self._merge_state_in_place(out, lse, other_out, other_lse)


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supported_dtypes = (torch.float16, torch.bfloat16)
    supported_head_sizes = (64, 128, 256)
    supported_devices = ("cuda",)
    supports_sliding_window = True
    # Its graph wrappers are decode wrappers (one query token per request): verification
    # steps of speculative decoding run eagerly, through the prefill wrapper.
    graph_support = GraphSupport.DECODE_ONLY
    # Wins large offline batches; one config key away (attention_backend="flashinfer").
    auto_priority = {"cuda": 200}

    @classmethod
    def validate(
        cls, config: "EngineConfig", spec: AttentionSpec, dtype: torch.dtype, device: torch.device
    ) -> list[str]:
        problems = super().validate(config, spec, dtype, device)
        if device.type != "cuda":
            problems.append(
                f"attention backend {cls.name!r} needs an NVIDIA GPU of compute capability "
                f"{_cc(MIN_COMPUTE_CAPABILITY)}+"
            )
        elif torch.cuda.is_available():
            cc = torch.cuda.get_device_capability(device)
            if cc < MIN_COMPUTE_CAPABILITY:
                problems.append(
                    f"attention backend {cls.name!r} needs compute capability {_cc(MIN_COMPUTE_CAPABILITY)}+, "
                    f"{torch.cuda.get_device_name(device)} has {_cc(cc)}"
                )
        if not flashinfer_installed():
            problems.append(f"attention backend {cls.name!r} needs the flashinfer package: {INSTALL_HINT}")
        if spec.num_heads % spec.num_kv_heads:
            problems.append(f"num_heads={spec.num_heads} is not a multiple of num_kv_heads={spec.num_kv_heads}")
        min_blocks = cascade_min_blocks(config)
        if type(min_blocks) is not int or min_blocks < 0:
            problems.append(
                "plugin_config['flashinfer']['cascade_attention_min_blocks'] must be an integer >= 0 "
                f"(0 = off), got {min_blocks!r}"
            )
        return problems

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim):
        return (num_blocks, 2, block_size, num_kv_heads, head_dim)

    @classmethod
    def make_metadata_builder(cls, device: torch.device) -> FlashInferMetadataBuilder:
        return FlashInferMetadataBuilder(device)

    @classmethod
    def make_impl(cls, spec: AttentionSpec) -> FlashInferAttentionImpl:
        return FlashInferAttentionImpl(spec)


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"
