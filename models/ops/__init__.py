"""Fused decoder-layer ops: RMSNorm with the residual add, rotary embedding, SiLU-and-mul,
and the projections of batch-1 decode (a Triton GEMV, optionally with SiLU-and-mul
fused into its input).

Each op runs a fused kernel on CUDA tensors and its torch reference (``pagelm.models.ops.reference``)
everywhere else. The kernels come from plugins through the kernel registry
(``pagelm.kernels``; the built-in ones are Triton, ``pagelm.backends.kernels``) and are
imported on first use, so this package imports without Triton. ``PAGELM_DISABLE_FUSED_OPS=1`` (read at import) keeps CUDA on the references too;
``use_triton=True`` forces the kernels, as the CPU tests do under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os

import torch

from pagelm.models.ops import reference
from pagelm.kernels import fused_kernel

FUSED_OPS_DISABLED = os.environ.get("PAGELM_DISABLE_FUSED_OPS", "0").lower() in ("1", "true", "on", "yes")
TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None
# ``PAGELM_DISABLE_GEMV=1`` keeps decode projections on cuBLAS (to compare the two).
GEMV_DISABLED = os.environ.get("PAGELM_DISABLE_GEMV", "0").lower() in ("1", "true", "on", "yes")
# An attention backend that says so (``fuses_rotary``) runs the q/k norm and rotary in its K/V
# store kernel: one launch fewer per layer. On by default since a GPU run checked the fused
# kernel with both built-in backends (session 23); ``PAGELM_ROTARY_KV_FUSION=0`` turns it off.
ROTARY_KV_FUSION_DISABLED = FUSED_OPS_DISABLED or os.environ.get(
    "PAGELM_ROTARY_KV_FUSION", "1"
).lower() in ("0", "false", "off", "no")


def fused_ops_enabled(x: torch.Tensor) -> bool:
    """Whether the ops run their Triton kernels on ``x`` by default."""
    return x.is_cuda and TRITON_AVAILABLE and not FUSED_OPS_DISABLED


def _kernel(name: str, x: torch.Tensor, use_triton: bool | None):
    """The fused kernel ``name`` for ``x`` (``use_triton``: force it on or off), or None:
    run the reference."""
    if not (fused_ops_enabled(x) if use_triton is None else use_triton):
        return None
    return fused_kernel(name)


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
    kernel = _kernel("rms_norm", x, use_triton)
    if kernel is not None:
        return kernel(x, weight, eps, residual)
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
    kernel = _kernel("rotary_embedding", q, use_triton)
    if kernel is not None:
        return kernel(positions, q, k, cos_sin_cache, head_dim, rotary_dim)
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
    kernel = _kernel("rotary_embedding", q, use_triton) if rotary_dim == head_dim else None
    if kernel is not None:
        return kernel(positions, q, k, cos_sin_cache, head_dim, rotary_dim, qk_norm=(q_weight, k_weight, eps))
    num_tokens = q.shape[0]
    q_heads, _ = reference.rms_norm(q.reshape(num_tokens, -1, head_dim), q_weight, eps)
    k_heads, _ = reference.rms_norm(k.reshape(num_tokens, -1, head_dim), k_weight, eps)
    return reference.rotary_embedding(
        positions, q_heads.view(num_tokens, -1), k_heads.view(num_tokens, -1), cos_sin_cache, head_dim, rotary_dim
    )


def silu_and_mul(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = x.chunk(2, dim=-1)``."""
    kernel = _kernel("silu_and_mul", x, use_triton)
    if kernel is not None:
        return kernel(x)
    return reference.silu_and_mul(x)


def _gemv(x: torch.Tensor, weight: torch.Tensor, use_triton: bool | None):
    """The GEMV kernel where it applies to ``x @ weight.T`` (one contiguous bf16/fp16 row),
    else None."""
    if use_triton is None:
        use_triton = fused_ops_enabled(x) and not GEMV_DISABLED
    applies = (
        use_triton
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )
    return fused_kernel("gemv") if applies else None


def _optional_kwargs(gemv, prefetch: torch.Tensor | None, all_reduce: tuple | None = None) -> dict:
    """The GEMV's optional arguments: ``prefetch`` (plugin API 2.20), passed only when there
    is a weight to prefetch and the registered kernel takes it (one written before 2.20 still
    runs); ``all_reduce`` (2.21), which callers pass only where ``fuses_all_reduce`` said so."""
    kwargs = {"prefetch": prefetch} if prefetch is not None and _takes(gemv, "prefetch") else {}
    if all_reduce is not None:
        assert _takes(gemv, "all_reduce"), "fuses_all_reduce(x, weight) is False"
        kwargs["all_reduce"] = all_reduce
    return kwargs


@functools.cache
def _takes(gemv, keyword: str) -> bool:
    """Whether the registered GEMV accepts ``keyword`` (an optional argument added after 2.0)."""
    parameters = inspect.signature(gemv).parameters.values()
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in parameters)


def fuses_all_reduce(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight, all_reduce=...)`` (and ``silu_and_mul_linear``) can sum
    over the ranks inside the projection: the GEMV applies to ``x`` and the registered one
    takes ``all_reduce`` (plugin API 2.21)."""
    gemv = _gemv(x, weight, None)
    return gemv is not None and _takes(gemv, "all_reduce")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    prefetch: torch.Tensor | None = None,
    all_reduce: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``F.linear``; a single row (batch-1 decode, bf16/fp16) on CUDA takes the Triton GEMV,
    which reads small weights at close to HBM bandwidth where cuBLAS's tiles do not.
    ``prefetch``: the next projection's weight, which the GEMV may pull into L2 meanwhile.
    ``all_reduce``: the exchange buffers of a row-parallel projection whose GEMV sums the
    output over two ranks (``pagelm.distributed.fused_all_reduce_buffers``); only where
    ``fuses_all_reduce`` says so."""
    gemv = _gemv(x, weight, use_triton)
    if gemv is not None:
        return gemv(x, weight, bias, **_optional_kwargs(gemv, prefetch, all_reduce))
    assert all_reduce is None, "fuses_all_reduce(x, weight) is False"
    return torch.nn.functional.linear(x, weight, bias)


def silu_and_mul_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    prefetch: torch.Tensor | None = None,
    all_reduce: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight, bias)``: the MLP's activation and down projection;
    one kernel (the activation computed while loading) where the GEMV applies.
    ``all_reduce`` as for ``linear``."""
    gemv = _gemv(x, weight, use_triton)
    if gemv is not None:
        return gemv(x, weight, bias, silu_input=True, **_optional_kwargs(gemv, prefetch, all_reduce))
    assert all_reduce is None, "fuses_all_reduce(x, weight) is False"
    return linear(silu_and_mul(x, use_triton=use_triton), weight, bias, use_triton=use_triton)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    use_triton: bool | None = None,
    prefetch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``normed, h = rms_norm(x, norm_weight, eps, residual)``; returns ``(linear(normed,
    weight, bias), h)``. One kernel where the GEMV applies (the norm in its prologue)."""
    gemv = _gemv(x, weight, use_triton) if residual is None or residual.stride(-1) == 1 else None
    if gemv is not None:
        return gemv(x, weight, bias, norm=(norm_weight, eps, residual), **_optional_kwargs(gemv, prefetch))
    normed, h = rms_norm(x, norm_weight, eps, residual, use_triton=use_triton)
    return linear(normed, weight, bias, use_triton=use_triton), h


__all__ = [
    "FUSED_OPS_DISABLED",
    "ROTARY_KV_FUSION_DISABLED",
    "fused_ops_enabled",
    "fuses_all_reduce",
    "linear",
    "qk_norm_rotary_embedding",
    "reference",
    "rms_norm",
    "rms_norm_linear",
    "rotary_embedding",
    "silu_and_mul",
    "silu_and_mul_linear",
]
