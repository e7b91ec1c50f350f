"""Triton RMSNorm with the residual add fused in: one program per row.

The row's ``h = x + residual`` is rounded to the model dtype (it is the next residual), its
mean square taken in float32, and ``h * rsqrt(ms + eps)`` rounded to the model dtype before
the weight multiplies it: the reference's two roundings, so bf16/fp16 outputs match it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagelm.backends.kernels.common import (
    allow_next_kernel,
    is_interpreted,
    pdl_supported,
    round_to,
    wait_for_previous_kernel,
)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [rows, hidden], contiguous
    residual_out_ptr,  # [rows, hidden], contiguous; HAS_RESIDUAL only
    x_ptr,  # [outer, inner, hidden], last dim contiguous
    residual_ptr,  # same layout as x; HAS_RESIDUAL only
    weight_ptr,
    num_inner,
    stride_x_outer,
    stride_x_inner,
    stride_res_outer,
    stride_res_inner,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    outer = (row // num_inner).to(tl.int64)
    inner = (row % num_inner).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size

    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + outer * stride_res_outer + inner * stride_res_inner
        res = tl.load(residual_row + cols, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + res.to(tl.float32), x.dtype, INTERPRETED)  # the next residual
        tl.store(residual_out_ptr + row.to(tl.int64) * hidden_size + cols, x, mask=mask)

    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=0) / hidden_size
    normed = round_to(h * tl.math.rsqrt(mean_square + eps), x.dtype, INTERPRETED)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)  # exact for bf16/fp16 operands: one rounding
    out = round_to(out, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + row.to(tl.int64) * hidden_size + cols, out, mask=mask)


INTERPRETED = is_interpreted(_rms_norm_kernel)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[outer, inner, hidden]`` with a contiguous last dim, copying only when the
    leading dims cannot be described by two strides (the per-head view of a fused qkv can)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.reshape(-1, t.shape[-1]).unsqueeze(1)


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`pagelm.models.ops.reference.rms_norm`; the outputs are new tensors."""
    hidden_size = x.shape[-1]
    assert weight.shape == (hidden_size,) and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.numel() == 0:
        return out, (x if residual is None else x + residual)
    x_rows = _as_rows(x)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual_rows = _as_rows(residual)
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        # Unused by the kernel (HAS_RESIDUAL is off); x is the next residual as it is.
        residual_rows, residual_out = x_rows, x
    block = triton.next_power_of_2(hidden_size)
    use_pdl = not INTERPRETED and pdl_supported(x.device)
    _rms_norm_kernel[(x_rows.shape[0] * x_rows.shape[1],)](
        out,
        residual_out,
        x_rows,
        residual_rows,
        weight,
        x_rows.shape[1],
        x_rows.stride(0),
        x_rows.stride(1),
        residual_rows.stride(0),
        residual_rows.stride(1),
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        USE_PDL=use_pdl,
        INTERPRETED=INTERPRETED,
        num_warps=_num_warps(block),
        launch_pdl=use_pdl,
    )
    return out, residual_out
