"""Triton GEMV for batch-1 decode: ``y = x W^T (+ b)`` with ``x`` one row.

At batch 1 a projection reads its whole weight to do 2 FLOPs per element, so the only thing
that matters is how close the read gets to the memory roofline. cuBLAS's GEMM kernels pick
64-wide tiles for these shapes and leave the small projections of a small model (4-12 MB
each) at a fraction of HBM bandwidth. Here every program owns a few output rows and streams
their weights in wide, coalesced chunks; the grid is sized so that every SM has several
programs in flight, which is what keeps enough loads outstanding to saturate HBM::

    W [N, K]   program p: rows [p*BLOCK_N, (p+1)*BLOCK_N), all of K in chunks of BLOCK_K
    x [1, K]   read by every program (tiny, stays in L2)
    y [1, N]   float32 accumulation, one rounding to the output dtype

Measured on an H200 (bf16, graph-replayed): Qwen3-0.6B's o_proj 12.4 us on cuBLAS -> 2.9 us,
down_proj 6.1 -> 3.7, qkv 3.7 -> 3.6, gate_up 4.9 -> 4.4; on 8B-sized weights the two are
even. Launched with programmatic dependent launch (``triton_common``), the first chunk of
weights streams in while the previous kernel finishes. From two rows on, cuBLAS's kernels read the weights once for all rows and this kernel's
broadcast tile does not pay, so the dispatch sends only single rows here.

Two prologues fuse the op that feeds a projection into it, one launch fewer each:
``silu_input`` takes ``x`` as a fused ``[gate | up]`` activation of width 2K and applies
``silu(gate) * up`` while loading it (the MLP's down projection); ``norm`` applies the
decoder's RMSNorm, with its residual add, to ``x`` (the qkv and gate_up projections). Both
round where the separate ops round, so the operand is bit-identical to theirs.

``prefetch`` names the weight the *next* projection will read (the model links each
projection to the one after it, ``pagelm.models.layers.link_weight_prefetch``): each program
asks the copy engine to pull its share of the first ``PAGELM_L2_PREFETCH_MB`` (default 1) of
that weight into L2 (``cp.async.bulk.prefetch.L2``, Hopper) and goes on, so the next kernel's
first wave of loads hits L2 instead of waiting on HBM. Only a kernel with a small weight of
its own does it: those are latency-bound and leave HBM idle, where a large one is already
at bandwidth and the extra reads only slow it. Measured on an H100 at batch 1: qwen3-0.6b
1,016 -> 1,036 tok/s with 1 MB (prefetching whole weights, 16 MB, was 6% *slower*: the reads
it adds delay the kernel issuing them more than L2 hits save the next; a chain of the 0.6B's
GEMVs over weights already in L2 is only 12% faster than over HBM: the kernels' fixed costs,
not the reads, are most of their time).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagelm.backends.kernels.common import allow_next_kernel, is_interpreted, pdl_supported, round_to, wait_for_previous_kernel

# The most bytes of the next projection's weight one GEMV pulls into L2 (0: none), and the
# largest weight of its own with which a GEMV prefetches at all.
L2_PREFETCH_BYTES = int(float(os.environ.get("PAGELM_L2_PREFETCH_MB", "1")) * 2**20) // 16 * 16
PREFETCH_MAX_WEIGHT_BYTES = 16 * 2**20
# A program whose rows of the weight take at most this many bytes, with K a power of two,
# loads them in one chunk, all before its PDL wait, instead of 1024-wide chunks of which only
# the first is loaded before it (the rest's HBM latency then follows the wait). Llama-3.2-1B's
# qkv and o (K=2048): +2% at batch 1 on an H200. Not with a padded K (Qwen3-0.6B's down,
# 3072 -> 4096: -9%), nor at 32 KB (the 1B's gate_up: the gain gone). 0 turns it off.
WHOLE_K_BYTES = int(os.environ.get("PAGELM_GEMV_WHOLE_K_BYTES", "16384"))


@triton.jit
def _prefetch_l2(address, size):
    """``[address, address + size)`` into L2, asked of the copy engine by the program's first
    thread; nothing waits for it (sm_90's ``cp.async.bulk.prefetch``: 16-byte aligned, a
    multiple of 16 bytes)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred pf_first; .reg .u32 pf_tid; mov.u32 pf_tid, %tid.x; setp.eq.u32 pf_first, pf_tid, 0; "
        "mov.u32 $0, 0; @pf_first cp.async.bulk.prefetch.L2.global [$1], $2; }",
        "=r,l,r",
        [address, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _gemv_kernel(
    y_ptr,  # [N]
    x_ptr,  # [K] (or [2K] with SILU_INPUT), contiguous
    w_ptr,  # [N, K], last dim contiguous
    b_ptr,  # [N] or a dummy
    residual_ptr,  # NORM with HAS_RESIDUAL: [K], added to x before the norm
    residual_out_ptr,  # NORM with HAS_RESIDUAL: [K], x + residual (the next residual)
    norm_weight_ptr,  # NORM: [K]
    prefetch_address,  # PREFETCH: the first byte of the next projection's weight
    prefetch_bytes,  # PREFETCH: how many of its bytes to prefetch, a multiple of 16
    prefetch_chunk,  # PREFETCH: bytes per program, a multiple of 16
    send_ptr,  # ALL_REDUCE: in the other rank's memory, where this rank's partial sums go
    recv_ptr,  # ALL_REDUCE: here, where the other rank's arrive (both 64-bit words, zero between calls)
    eps,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    SILU_INPUT: tl.constexpr,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PREFETCH: tl.constexpr,
    ALL_REDUCE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    rk = tl.arange(0, BLOCK_K)
    # The first chunk of weights is loaded before waiting for the kernel that writes x: the
    # read that dominates this kernel starts while that one is still draining.
    if EVEN_K:  # no column mask: the loads stay fully vectorised
        w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None], other=0.0)
    else:
        w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    if PREFETCH:  # this program's share of the next projection's weight
        start = tl.program_id(0).to(tl.int64) * prefetch_chunk
        size = tl.minimum(prefetch_bytes - start, prefetch_chunk)
        if size > 0:
            _prefetch_l2(prefetch_address + start, size.to(tl.int32))
    wait_for_previous_kernel(USE_PDL)
    if NORM:  # the row's mean square first (x is tiny: every program reads all of it)
        sum_squares = 0.0
        for k0 in range(0, K, BLOCK_K):
            h = _input_chunk(x_ptr, residual_ptr, k0 + tl.arange(0, BLOCK_K), K, HAS_RESIDUAL, EVEN_K, INTERPRETED)
            if HAS_RESIDUAL:
                if tl.program_id(0) == 0:
                    rk = k0 + tl.arange(0, BLOCK_K)
                    tl.store(residual_out_ptr + rk, h, mask=rk < K)
            hf = h.to(tl.float32)
            sum_squares += tl.sum(hf * hf, axis=0)
        rstd = tl.math.rsqrt(sum_squares / K + eps)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if NORM:  # rounded twice, as the RMSNorm op rounds: normalised, then scaled
            h = _input_chunk(x_ptr, residual_ptr, rk, K, HAS_RESIDUAL, EVEN_K, INTERPRETED)
            normed = round_to(h.to(tl.float32) * rstd, h.dtype, INTERPRETED)
            if EVEN_K:
                nw = tl.load(norm_weight_ptr + rk)
            else:
                nw = tl.load(norm_weight_ptr + rk, mask=rk < K, other=0.0)
            x = round_to(normed.to(tl.float32) * nw.to(tl.float32), h.dtype, INTERPRETED)
        elif EVEN_K:
            x = tl.load(x_ptr + rk)
        else:
            x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
        if SILU_INPUT:  # x is the gate half; silu(gate) * up rounds as the eager op does
            if EVEN_K:
                up = tl.load(x_ptr + K + rk)
            else:
                up = tl.load(x_ptr + K + rk, mask=rk < K, other=0.0)
            g = x.to(tl.float32)
            if INTERPRETED:
                exp_neg = tl.exp(-g)
            else:
                exp_neg = libdevice.exp(-g)
            silu = round_to(tl.math.div_rn(g, 1.0 + exp_neg), up.dtype, INTERPRETED)
            x = round_to(silu.to(tl.float32) * up.to(tl.float32), up.dtype, INTERPRETED)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        next_k = rk + BLOCK_K  # the next chunk (nothing past K: the last one loads nothing)
        w = tl.load(w_rows + next_k[None, :], mask=n_mask[:, None] & (next_k < K)[None, :], other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if ALL_REDUCE:
        # Each partial is rounded to the model dtype first, as the unfused path rounds the
        # projection's output before its all-reduce; ``a + b`` is ``b + a``, so both ranks
        # hold the same bits.
        part = round_to(acc, y_ptr.dtype.element_ty, INTERPRETED)
        other = _exchange_tile(part, send_ptr, recv_ptr, BLOCK_N)
        acc = part.to(tl.float32) + other.to(tl.float32)
    tl.store(y_ptr + rn, round_to(acc, y_ptr.dtype.element_ty, INTERPRETED), mask=n_mask)


@triton.jit
def _exchange_tile(part, send_ptr, recv_ptr, BLOCK_N: tl.constexpr):
    """The other tensor-parallel rank's tile for this rank's ``part`` (16-bit values): the
    tile goes into the other rank's receive buffer, then the program waits for the other
    rank's same program to do the same here.

    The flag travels with the data, as in NCCL's low-latency protocol: each pair of values
    is one 64-bit word with a 1 in its high half, so a word that reads non-zero there has
    arrived whole (an aligned 8-byte store lands at once), and no fence has to order data
    before a separate flag. The program polls its words until all have arrived, then zeroes
    them for the next exchange through this buffer. (A flag per tile raised after the data,
    with a system-scope release and a remote atomic, made a llama-3.1-8b TP=2 batch-1 step
    3.81 ms against 3.55 ms this way, on two H100s.)"""
    half: tl.constexpr = BLOCK_N // 2
    words = tl.program_id(0).to(tl.int64) * half + tl.arange(0, half)
    bits = part.to(tl.uint16, bitcast=True).to(tl.uint64)
    even, odd = tl.split(tl.reshape(bits, (half, 2)))
    packed = even | (odd << 16) | (1 << 32)
    send = send_ptr.to(tl.pointer_type(tl.uint64))
    recv = recv_ptr.to(tl.pointer_type(tl.uint64))
    # One aligned 64-bit store per word (Triton stores each element once, however many
    # threads hold a copy: a late duplicate could land after the other rank zeroed it).
    tl.store(send + words, packed)
    got = tl.load(recv + words, volatile=True)
    while tl.min((got >> 32).to(tl.uint32), axis=0) == 0:
        got = tl.load(recv + words, volatile=True)
    # Each warp polls its own copy of the words: none may zero them before all have seen
    # them arrive.
    tl.debug_barrier()
    tl.store(recv + words, tl.zeros_like(got))
    low = got & 0xFFFFFFFF
    other = tl.reshape(tl.join(low & 0xFFFF, low >> 16), (BLOCK_N,))
    return other.to(tl.uint16).to(part.dtype, bitcast=True)


@triton.jit
def _input_chunk(x_ptr, residual_ptr, rk, K, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x + residual`` over columns ``rk``, rounded to the model dtype (the next residual)."""
    if EVEN_K:
        x = tl.load(x_ptr + rk)
    else:
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
    if HAS_RESIDUAL:
        if EVEN_K:
            r = tl.load(residual_ptr + rk)
        else:
            r = tl.load(residual_ptr + rk, mask=rk < K, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype, INTERPRETED)
    return x


INTERPRETED = is_interpreted(_gemv_kernel)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)``, from a sweep on an H200 over the projections of
    Qwen3-0.6B, Llama-3.2-1B and Llama-3.1-8B: few rows per program for narrow outputs (so
    the grid still covers every SM several times), 8 for wide ones; 1024-wide chunks of K
    (they won that sweep, before PDL), except all of K in one chunk when it is a power of two
    and the program's rows fit ``WHOLE_K_BYTES`` (all of them then loaded before the PDL
    wait, session 35)."""
    block_n = 2 if n <= 1024 else 4 if n <= 3072 else 8
    if k == triton.next_power_of_2(k) and block_n * k * 2 <= WHOLE_K_BYTES:
        return block_n, k, 4
    return block_n, min(triton.next_power_of_2(k), 1024), 4


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_input: bool = False,
    norm: tuple[torch.Tensor, float, torch.Tensor | None] | None = None,
    config: tuple[int, int, int] | None = None,
    prefetch: torch.Tensor | None = None,
    all_reduce: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x [1, K] @ weight[N, K]^T + bias``. With ``silu_input``, ``x`` is ``[1, 2K]`` and
    ``silu_and_mul(x)`` is the operand. With ``norm=(norm_weight, eps, residual)`` the
    operand is ``rms_norm(x + residual)`` and the result is ``(y, x + residual)``, the sum
    being the next residual (``x`` itself when ``residual`` is None). ``prefetch``: a
    contiguous weight to pull into L2 meanwhile (the next projection's; a hint, Hopper only).

    ``all_reduce=(send, recv)`` returns the sum of ``y`` over two tensor-parallel ranks
    instead of this rank's ``y`` (no bias: a row-parallel layer adds it after the sum).
    ``send`` lives in the other rank's memory, ``recv`` in this one's, each at least 4 bytes
    per output value (rounded up to whole tiles) and all zero between calls. Each program trades its tile with the same program on the other rank
    (``_exchange_tile``), so the all-reduce costs no kernel of its own and no grid-wide
    barrier. Both ranks must make the same call, and two calls in a row must not use the
    same buffers: the other rank may write its next partials into a buffer as soon as it
    has passed the exchange, before this rank has read it. The caller alternates two
    (``pagelm.distributed.fused_all_reduce_buffers``)."""
    n, k = weight.shape
    assert x.shape == (1, 2 * k if silu_input else k), (x.shape, weight.shape, silu_input)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    assert not (silu_input and norm is not None)
    assert all_reduce is None or bias is None, "a row-parallel layer adds its bias after the all-reduce"
    block_n, block_k, num_warps = config or gemv_config(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    use_pdl = not INTERPRETED and pdl_supported(x.device)
    norm_weight, eps, residual = norm if norm is not None else (weight, 0.0, None)
    residual_out = x if residual is None else torch.empty_like(x)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    num_programs = triton.cdiv(n, block_n)
    prefetch_bytes = 0
    own_bytes = weight.numel() * weight.element_size()
    if prefetch is not None and L2_PREFETCH_BYTES and use_pdl and own_bytes <= PREFETCH_MAX_WEIGHT_BYTES and prefetch.is_contiguous():
        prefetch_bytes = min(prefetch.numel() * prefetch.element_size(), L2_PREFETCH_BYTES) // 16 * 16
    prefetch_chunk = (-(-prefetch_bytes // num_programs) + 15) // 16 * 16
    if all_reduce is not None:
        send, recv = all_reduce
        assert x.element_size() == 2 and block_n % 2 == 0, "the exchange packs pairs of 16-bit values"
        # A 64-bit word per two values of every program's tile.
        assert min(send.numel() * send.element_size(), recv.numel() * recv.element_size()) >= num_programs * block_n * 4
    else:
        send = recv = y
    _gemv_kernel[(num_programs,)](
        y,
        x,
        weight,
        bias if bias is not None else weight,
        residual if residual is not None else x,
        residual_out,
        norm_weight,
        prefetch.data_ptr() if prefetch_bytes else 0,
        prefetch_bytes,
        prefetch_chunk,
        send,
        recv,
        eps,
        n,
        k,
        weight.stride(0),
        HAS_BIAS=bias is not None,
        SILU_INPUT=silu_input,
        NORM=norm is not None,
        HAS_RESIDUAL=residual is not None,
        PREFETCH=prefetch_bytes > 0,
        ALL_REDUCE=all_reduce is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        USE_PDL=use_pdl,
        INTERPRETED=INTERPRETED,
        num_warps=num_warps,
        launch_pdl=use_pdl,
    )
    return y if norm is None else (y, residual_out)
