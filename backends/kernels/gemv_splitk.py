"""Split-K Triton GEMV for decode at 1..8 rows: ``y = x W^T (+ b)``, ``W`` in torch Linear
layout ``[N, K]`` (bf16/fp16, also fp32), float32 accumulation.

A 4-12 MB projection split only along N gives too few programs to keep every SM's loads in
flight (qkv of Qwen3-0.6B: 4,096 rows), so K is split too and the grid covers the SMs
several times over. Two stages, no atomics, so the result is the same every run (greedy
ids stay reproducible)::

    stage 1, program (i, s):  rows [i*BLOCK_N, (i+1)*BLOCK_N) x columns of split s
        W[N, K]  ->  partial[s, M, N] (float32)       one chunk of BLOCK_K columns at a time
    stage 2: y[M, N] = sum_s partial[s] (+ bias)       fixed order, one rounding

One row sums ``w * x`` over K on the CUDA cores; 2..8 rows pad to 16 and use ``tl.dot``
(the tensor cores), which reads each weight tile once for every row. With one split the
first stage writes ``y`` itself. Both stages use programmatic dependent launch as the other
decode kernels do (``triton_common``): stage 1 loads its first weight chunk before waiting
for the kernel that writes ``x``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagelm.backends.kernels.common import allow_next_kernel, is_interpreted, pdl_supported, round_to, wait_for_previous_kernel

MAX_ROWS = 8


@triton.jit
def _gemv_splitk_kernel(
    out_ptr,  # SPLIT_K == 1: y [M, N] in x's dtype; else partial [SPLIT_K, M, N] float32
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] or a dummy (read only with SPLIT_K == 1)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    K_PER_SPLIT,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 1, or 16 for tl.dot
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: every split ends on a chunk boundary
    FP32_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_mask = rn < N
    m_mask = rm < M
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if EVEN_K:  # lets the compiler see the column masks constant over 16-byte vectors
        k_end = tl.multiple_of(k_end, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    rk = k_start + tl.arange(0, BLOCK_K)
    # Weights are never written: the first chunk streams in while the previous kernel drains.
    w = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk < k_end)[None, :], other=0.0)
    wait_for_previous_kernel(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None] & (rk < k_end)[None, :], other=0.0)
        if BLOCK_M == 1:
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        elif FP32_DOT or INTERPRETED:  # the interpreter's bf16 dot is wrong; exact in fp32
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        next_k = rk + BLOCK_K  # the next chunk of this split (past its end: nothing loaded)
        w = tl.load(w_rows + next_k[None, :], mask=n_mask[:, None] & (next_k < k_end)[None, :], other=0.0)
    mask = m_mask[:, None] & n_mask[None, :]
    offsets = rm[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offsets, round_to(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    else:
        tl.store(out_ptr + pid_k * M * N + offsets, acc, mask=mask)


@triton.jit
def _reduce_splits_kernel(
    y_ptr,  # [M, N]
    partial_ptr,  # [SPLIT_K, M, N] float32
    b_ptr,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # always the same order: reproducible
        acc += tl.load(partial_ptr + s * M * N + offsets, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, round_to(acc, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


INTERPRETED = is_interpreted(_gemv_splitk_kernel)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100's count: the CPU tests exercise the same grids
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_splitk_config(m: int, n: int, k: int, num_sms: int = 132) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, split_k, num_warps)`` for ``[m, k] x [n, k]^T``.

    The weight read is everything: aim for >= 4 programs per SM, each streaming 16-48 KB of
    weights in 512 B-per-row chunks (BLOCK_K 256 at 2 bytes), and split K only as far as the
    grid needs; more splits cost a bigger partial buffer for the second stage to read."""
    block_k = 512 if k >= 4096 else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = 32 if n >= 2048 else 16
    if m > 1:  # tl.dot tiles: 16-row weight tiles keep the dot's registers small
        block_n = max(block_n, 16)
    return block_n, block_k, split_k_for(n, k, block_n, block_k, num_sms), 4


def split_k_for(n: int, k: int, block_n: int, block_k: int, num_sms: int, programs_per_sm: int = 4) -> int:
    """How many splits of K give ``programs_per_sm`` programs per SM (at most one per chunk)."""
    n_blocks = triton.cdiv(n, block_n)
    chunks = triton.cdiv(k, block_k)
    wanted = min(chunks, max(1, triton.cdiv(programs_per_sm * num_sms, n_blocks)))
    chunks_per_split = max(1, chunks // wanted)  # rounded down: at least the splits wanted
    return triton.cdiv(chunks, chunks_per_split)


def gemv_splitk(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` with ``1 <= M <= 8``, deterministic."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS and weight.shape == (n, k), (x.shape, weight.shape)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and x.dtype == weight.dtype
    block_n, block_k, split_k, num_warps = config or gemv_splitk_config(m, n, k, _num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    use_pdl = not INTERPRETED and pdl_supported(x.device)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    dummy_bias = bias if bias is not None else weight
    _gemv_splitk_kernel[(triton.cdiv(n, block_n), split_k)](
        out,
        x,
        weight,
        dummy_bias,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        k_per_split,
        HAS_BIAS=bias is not None,
        BLOCK_M=1 if m == 1 else 16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        EVEN_K=k % block_k == 0,
        FP32_DOT=x.dtype == torch.float32,
        USE_PDL=use_pdl,
        INTERPRETED=INTERPRETED,
        num_warps=num_warps,
        launch_pdl=use_pdl,
    )
    if split_k > 1:
        block = 1024
        _reduce_splits_kernel[(triton.cdiv(m * n, block),)](
            y,
            out,
            dummy_bias,
            m,
            n,
            HAS_BIAS=bias is not None,
            SPLIT_K=split_k,
            BLOCK=block,
            USE_PDL=use_pdl,
            INTERPRETED=INTERPRETED,
            num_warps=4,
            launch_pdl=use_pdl,
        )
    return y
