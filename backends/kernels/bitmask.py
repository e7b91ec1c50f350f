"""The Triton kernel behind ``apply_token_bitmask`` on CUDA: one pass that writes ``-inf``
into the disallowed logits of the masked rows, reading only the packed bitmask (the allowed
logits are neither read nor written)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _mask_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr, logits_width, bitmask_width,
                 HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)  # bitmask row
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # Columns past the bitmask (a padded vocab) read as 0: never allowed.
    words = tl.load(bitmask_ptr + i * bitmask_stride + cols // 32, mask=cols // 32 < bitmask_width, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    out = logits_ptr + row * logits_stride + cols
    tl.store(out, tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
             mask=(cols < logits_width) & ~allowed)


# Built for the CPU interpreter (TRITON_INTERPRET=1 when this module was imported): tests.
INTERPRETED = not isinstance(_mask_kernel, triton.runtime.JITFunction)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """``logits`` [N, V] (any float dtype, last dim contiguous); ``bitmask`` int32 [n, W] on
    the same device; ``rows`` [n] (bitmask row ``i`` masks logits row ``rows[i]``) or None."""
    n = bitmask.shape[0]
    if n == 0:
        return
    assert logits.stride(-1) == 1 and bitmask.stride(-1) == 1
    grid = (n, triton.cdiv(logits.shape[-1], BLOCK))
    _mask_kernel[grid](
        logits, logits.stride(0), bitmask, bitmask.stride(0), rows if rows is not None else bitmask,
        logits.shape[-1], bitmask.shape[-1], HAS_ROWS=rows is not None, BLOCK=BLOCK,
    )
