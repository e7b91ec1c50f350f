"""Triton SiLU-and-mul: ``[T, 2I] -> [T, I]``, ``silu(gate) * up``, in blocks of a row.

``silu`` is ``g / (1 + exp(-g))`` in float32 with an accurate exp and a correctly rounded
division (torch's CUDA kernel's math), rounded to the model dtype before the multiply by
``up``, as the eager reference rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagelm.backends.kernels.common import is_interpreted, round_to


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I], contiguous
    x_ptr,  # [T, 2I], last dim contiguous
    stride_x_tok,
    intermediate_size,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + tok * stride_x_tok + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + tok * stride_x_tok + intermediate_size + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if INTERPRETED:  # no libdevice there; numpy's exp is accurate anyway
        exp_neg = tl.exp(-g)
    else:  # tl.exp is the fast approximate one
        exp_neg = libdevice.exp(-g)
    silu = round_to(tl.math.div_rn(g, 1.0 + exp_neg), gate.dtype, INTERPRETED)
    out = silu.to(tl.float32) * up.to(tl.float32)  # exact for bf16/fp16 operands: one rounding
    out = round_to(out, out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(out_ptr + tok * intermediate_size + cols, out, mask=mask)


INTERPRETED = is_interpreted(_silu_and_mul_kernel)

_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`pagelm.models.ops.reference.silu_and_mul`."""
    assert x.shape[-1] % 2 == 0
    intermediate_size = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], intermediate_size, dtype=x.dtype, device=x.device)
    rows = x.reshape(-1, x.shape[-1]) if x.stride(-1) == 1 else x.contiguous().view(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(intermediate_size))
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(intermediate_size, block))](
        out,
        rows,
        rows.stride(0),
        intermediate_size,
        BLOCK=block,
        INTERPRETED=INTERPRETED,
        num_warps=4,
    )
    return out
