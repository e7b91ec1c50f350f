"""What the fused-op kernels share: rounding float32 results to the model dtype, and
programmatic dependent launch."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# ``PAGELM_DISABLE_PDL=1``: launch every kernel plainly (to measure what overlap buys).
PDL_DISABLED = os.environ.get("PAGELM_DISABLE_PDL", "0").lower() in ("1", "true", "on", "yes")


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


# ---- programmatic dependent launch (Hopper and later) ---------------------------------------
# A kernel launched with ``launch_pdl=True`` may start while the previous kernel on the stream
# is still finishing: its launch and whatever it does before ``wait_for_previous_kernel``
# overlap the predecessor's tail, a large part of a 2-4 us kernel at batch 1. Every kernel of
# the decode path is launched so (norms, projections, rotary, KV store, attention) and lets
# its successor launch early (``allow_next_kernel``). The GEMV loads its first weight chunk
# before waiting (weights are never written); rotary, the K/V store and attention read the
# step's metadata before waiting (positions, slot mapping, sequence and query lengths, block
# table). That is safe because no kernel that lets its successor launch early writes
# metadata: it is written by host copies and by kernels that do not call
# ``allow_next_kernel`` (the graph-input and draft-input kernels), and a kernel launched
# after one of those starts only once it has finished. A new kernel that writes metadata
# must not call ``allow_next_kernel`` either. Those reads bypass L1 (``.cg``): a line
# cached there by the previous step's replay of the same kernel could be stale, and only the
# wait orders L1 with other SMs' writes. Every program of
# such a kernel must pass the wait before it finishes: a kernel that finished without
# waiting would let its own successor run ahead of the kernel before it.


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()


@triton.jit
def allow_next_kernel(USE_PDL: tl.constexpr):
    """Let the next kernel start launching (it still waits for this one's results)."""
    if USE_PDL:
        gdc_launch_dependents()


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA on compute capability 9.0+ (not the interpreter)."""
    return (
        not PDL_DISABLED
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
    )
