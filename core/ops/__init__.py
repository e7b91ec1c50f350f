"""Fused decoder-layer ops: RMSNorm with the residual add, rotary embedding, SiLU-and-mul.

Each op runs a Triton kernel on CUDA tensors and its torch reference (``pagelm.ops.reference``)
everywhere else. The kernels are imported on first use, so this package imports without
Triton. ``PAGELM_DISABLE_FUSED_OPS=1`` (read at import) keeps CUDA on the references too;
``use_triton=True`` forces the kernels, as the CPU tests do under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from pagelm.ops import reference

FUSED_OPS_DISABLED = os.environ.get("PAGELM_DISABLE_FUSED_OPS", "0").lower() in ("1", "true", "on", "yes")
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def fused_ops_enabled(x: torch.Tensor) -> bool:
    """Whether the ops run their Triton kernels on ``x`` by default."""
    return x.is_cuda and TRITON_AVAILABLE and not FUSED_OPS_DISABLED


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    return fused_ops_enabled(x) if use_triton is None else use_triton


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``; returns ``(weight * rms_norm(h), h)``. With ``residual=None``,
    ``h`` is ``x`` itself. Inputs are never modified."""
    if _use_triton(x, use_triton):
        from pagelm.ops import triton_rms_norm

        return triton_rms_norm.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE over the first ``rotary_dim`` dims of each head of ``[num_tokens, heads *
    head_dim]`` q and k. The kernel rotates q and k in place, the reference returns new
    tensors: callers use the returned pair and must not rely on either."""
    if _use_triton(q, use_triton):
        from pagelm.ops import triton_rotary

        return triton_rotary.rotary_embedding(positions, q, k, cos_sin_cache, head_dim, rotary_dim)
    return reference.rotary_embedding(positions, q, k, cos_sin_cache, head_dim, rotary_dim)


def qk_norm_rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3's ``q_norm``/``k_norm``), then full-head neox RoPE:
    one kernel on CUDA where the eager path takes three (small decode steps pay per launch)."""
    rotary_dim = cos_sin_cache.shape[-1]
    if _use_triton(q, use_triton) and rotary_dim == head_dim:
        from pagelm.ops import triton_rotary

        return triton_rotary.rotary_embedding(
            positions, q, k, cos_sin_cache, head_dim, rotary_dim, qk_norm=(q_weight, k_weight, eps)
        )
    num_tokens = q.shape[0]
    q_heads, _ = reference.rms_norm(q.reshape(num_tokens, -1, head_dim), q_weight, eps)
    k_heads, _ = reference.rms_norm(k.reshape(num_tokens, -1, head_dim), k_weight, eps)
    return reference.rotary_embedding(
        positions, q_heads.view(num_tokens, -1), k_heads.view(num_tokens, -1), cos_sin_cache, head_dim, rotary_dim
    )


def silu_and_mul(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = x.chunk(2, dim=-1)``."""
    if _use_triton(x, use_triton):
        from pagelm.ops import triton_activation

        return triton_activation.silu_and_mul(x)
    return reference.silu_and_mul(x)


__all__ = [
    "FUSED_OPS_DISABLED",
    "fused_ops_enabled",
    "qk_norm_rotary_embedding",
    "reference",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
