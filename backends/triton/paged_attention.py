"""Triton paged attention for variable-length queries over the paged KV cache.

One kernel serves decode, prefill and chunked prefill on a cached prefix in the same batch.
Query ``i`` of a request with ``seq_len`` tokens and ``query_len`` new ones sits at position
``seq_len - query_len + i``; it sees every cached key and the new keys up to itself::

    keys ->    | cached prefix (ctx_len) | new tokens (query_len) |
    q@ctx+0    [ x x x x x x x x x x x x   x . . . ]
    q@ctx+3    [ x x x x x x x x x x x x   x x x x ]

A program owns one *q-block* (``BLOCK_Q`` consecutive query tokens of one request) and one
KV head, and computes all ``GROUP = num_heads // num_kv_heads`` query heads that share it,
so its tile of ``BLOCK_M`` rows (a power of two; ``BLOCK_Q = BLOCK_M // GROUP``) reuses each
K/V tile it loads for every head of the group (GQA)::

    row r -> query token q_block_start + r // GROUP, query head kv_head * GROUP + r % GROUP
             (rows past BLOCK_Q * GROUP, or past the request's last token, are masked)

It walks the request's keys in tiles of ``TILE_N`` positions, gathering each key's block
through the block table (so ``TILE_N`` need not match the cache's block size), with an
online softmax (running max ``m``, sum ``l``, unnormalised ``acc``) in float32.

Grid of the main launch: ``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads)``; a program
finds its request by binary search over ``query_start_loc`` (request ``i``'s q-blocks start
at ``query_start_loc[i] // BLOCK_Q + i``), which needs no per-step host work and fits any
batch; the few programs past the end of a request return at once.

Split-K decode: a decode (query_len 1) at long context is one q-block, so on its own it would
occupy ``num_kv_heads`` programs. The split launch gives each decode ``num_splits`` programs
over consecutive ranges of KV tiles; each writes its partial ``(m, l, acc)`` to a scratch
buffer, and the last of them to finish merges them::

    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,   M = max_s m_s

Each (query token, KV head) has an int32 counter in a persistent buffer, zero between
launches. A program stores its partials, then adds 1 to its counter (a CTA barrier first, so
every thread's stores are ordered before the release of the atomic); the program that reads
``num_splits - 1`` back is the last, sees every partial (acquire), merges them for the
group's query heads and sets the counter back to 0 for the next launch (the next layer or
step). So decode attention is one launch, with nothing to reset from the host: it is safe to
capture in a CUDA graph. (A program that returns early, past its request's query tokens, does
so in every split of its row, which then never touches its counter.) The merge is the same
arithmetic, on the same tile shapes, as ``_reduce_splits_kernel``, the separate reduce launch
(compiled into another kernel, an element now and then rounds the other way, the same one
every launch). The reduce launch stays the default: on an H100 the fused merge was 8% slower
(docs/benchmarks.md); ``PAGELM_SPLIT_REDUCE_FUSION=1`` turns it on.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagelm.backends.kernels.common import allow_next_kernel, pdl_supported, wait_for_previous_kernel

# ``PAGELM_SPLIT_REDUCE_FUSION=1``: split-K decode merges its partials in the split kernel's
# last program instead of a second launch (``_reduce_splits_kernel``). Opt-in: the GPU runs
# found it race-free (tests/test_triton_gpu.py) but 8% slower on qwen3-0.6b at batch 1 (its
# last program merges a group's heads serially; docs/benchmarks.md).
SPLIT_REDUCE_FUSION_DISABLED = os.environ.get("PAGELM_SPLIT_REDUCE_FUSION", "0").lower() not in (
    "1", "true", "on", "yes"
)


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """The last request whose first q-block (``query_start_loc[i] // BLOCK_Q + i``) is at
    or before ``pid``."""
    lo = pid * 0  # a tensor, so the result has one type whether or not the loop runs
    hi = num_reqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid, cache_modifier=".cg") // BLOCK_Q + mid
        at_or_before = first <= pid
        lo = tl.where(at_or_before, mid, lo)
        hi = tl.where(at_or_before, hi, mid)
    return lo


@triton.jit
def _dot(a, b, EXACT_FP32: tl.constexpr, DOT_FP32: tl.constexpr):
    # EXACT_FP32: float32 operands multiplied in full precision (not TF32), so float32 models
    # match the reference. DOT_FP32: only under the CPU interpreter, whose dot cannot
    # multiply bfloat16 operands.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif EXACT_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _merge_splits(
    out_ptr,
    partial_m_ptr,
    partial_l_ptr,
    partial_acc_ptr,
    decode,  # request * SPLIT_Q + token: the split launch's program id 0
    head,
    tok,  # the query token's row in ``out``
    num_heads,
    num_splits,
    stride_out_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CACHE: tl.constexpr,  # load modifier: ".cg" reads partials other SMs wrote from L2
):
    """One query head's output from its ``num_splits`` partials."""
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    row = (decode * num_splits + splits).to(tl.int64) * num_heads + head
    m = tl.load(partial_m_ptr + row, mask=split_valid, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(partial_l_ptr + row, mask=split_valid, other=0.0, cache_modifier=CACHE)
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM
    acc = tl.load(
        partial_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
        cache_modifier=CACHE,
    )
    # Empty splits (m = -inf) get weight 0. Every split is empty only for a padding token of
    # a CUDA-graph batch (no key at or before its position): it gets zeros, not NaN.
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(l * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    out_row = tok * stride_out_tok + head * HEAD_DIM
    tl.store(out_ptr + out_row + dims, out.to(out_ptr.dtype.element_ty), mask=dim_valid)


# The batch size is not specialised on (Triton otherwise compiles a variant for a value of 1
# and for multiples of 16): a batch size first seen mid-run would compile a new variant inside
# a step, over a second each (2.4 s of a 10 s nano-vllm run on an H100, docs/benchmarks.md).
# ``num_splits`` stays specialised (the merge's loads are vectorised by it); the eager steps'
# split counts are powers of two, whose variants ``build_kernels`` compiles at start-up.
PER_STEP_ARGS = ("num_reqs", "skip_decodes", "stride_block_table")


@triton.jit(do_not_specialize=PER_STEP_ARGS)
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    decode_req_idx_ptr,  # SPLIT: program -> request
    partial_m_ptr,  # SPLIT: [rows, num_heads] f32, row = decode * num_splits + split
    partial_l_ptr,
    partial_acc_ptr,  # SPLIT: [rows, num_heads, HEAD_DIM] f32
    split_counter_ptr,  # FUSE_REDUCE: [decodes, num_kv_heads] i32, zero between launches
    num_reqs,
    num_heads,
    num_splits,
    skip_decodes,  # 1: decodes go through the split launch this step (main launch only)
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    sliding_window,
    stride_query_tok,
    stride_out_tok,
    stride_block_table,  # not specialised either: the engine's table width is not a layer's business
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SPLIT_Q: tl.constexpr,  # SPLIT: query tokens per request (1 + drafts when verifying)
    FUSE_REDUCE: tl.constexpr,  # SPLIT: the last program of a (token, KV head) merges
    SPLITS_PAD: tl.constexpr,  # FUSE_REDUCE: num_splits rounded up to a power of two
    USE_WINDOW: tl.constexpr,
    EXACT_FP32: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)  # the output projection may start loading its weights
    # The step's metadata (request index, query and sequence lengths, block table) is read
    # before waiting for the kernel just before, from L2 (``.cg``): it was written before this
    # step's first layer by a kernel or copy that lets nothing after it start early (see
    # ``pagelm.backends.kernels.common``), so only q and this step's K/V wait. At batch 1
    # that takes three or four dependent loads off each layer's critical path.
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if SPLIT:  # one query token per program: pid = request * SPLIT_Q + token
        req = tl.load(decode_req_idx_ptr + pid // SPLIT_Q, cache_modifier=".cg")
        q_block_start = pid % SPLIT_Q
    else:
        req = _find_request(query_start_loc_ptr, num_reqs, pid, BLOCK_Q)
        q_block_start = (pid - (tl.load(query_start_loc_ptr + req, cache_modifier=".cg") // BLOCK_Q + req)) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + req, cache_modifier=".cg")
    q_len = tl.load(query_start_loc_ptr + req + 1, cache_modifier=".cg") - q_start
    if q_block_start >= q_len:
        wait_for_previous_kernel(USE_PDL)  # every program waits before it finishes
        return
    if not SPLIT:  # (the split launch's code stays free of this branch)
        if skip_decodes != 0 and q_len == 1:
            wait_for_previous_kernel(USE_PDL)
            return
    seq_len = tl.load(seq_lens_ptr + req, cache_modifier=".cg")
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_block_start + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM
    q_row = (q_start + tok).to(tl.int64) * stride_query_tok + head * HEAD_DIM

    # Keys this q-block can see: [kv_start, kv_end), cut into TILE_N-wide tiles.
    kv_end = ctx_len + tl.minimum(q_block_start + BLOCK_Q, q_len)
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(ctx_len + q_block_start - sliding_window + 1, 0)
    num_tiles = tl.cdiv(kv_end - kv_start, TILE_N)
    tile_lo = 0
    tile_hi = num_tiles
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_block_table
    # Each tile's blocks are looked up one tile ahead (the first before the wait), so that a
    # tile's K/V loads do not wait for its block-table load.
    k_pos = kv_start + tile_lo * TILE_N + tl.arange(0, TILE_N)
    next_block = tl.load(
        block_table_row + k_pos // BLOCK_SIZE, mask=(k_pos < kv_end) & (k_pos < kv_start + tile_hi * TILE_N), other=0,
        cache_modifier=".cg",
    )
    wait_for_previous_kernel(USE_PDL)  # q and this step's K/V are written just before
    q = tl.load(
        query_ptr + q_row[:, None] + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0
    )
    for t in range(tile_lo, tile_hi):
        k_pos = kv_start + t * TILE_N + tl.arange(0, TILE_N)
        k_valid = k_pos < kv_end
        block = next_block.to(tl.int64)
        k_next = k_pos + TILE_N
        next_block = tl.load(block_table_row + k_next // BLOCK_SIZE, mask=k_next < kv_end, other=0)
        kv_offset = (
            block * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_slot + kv_head * stride_cache_head
        )
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offset[None, :] + dims[:, None], mask=tl.trans(kv_mask), other=0.0)
        v = tl.load(value_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        s = _dot(q, k, EXACT_FP32, DOT_FP32) * scale_log2  # [BLOCK_M, TILE_N]
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead so
        # exp2 gives 0 rather than NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m - m_shift)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, EXACT_FP32, DOT_FP32)
        m = m_new

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        row = (pid * num_splits + split).to(tl.int64) * num_heads + head
        tl.store(partial_m_ptr + row, m, mask=row_valid)
        tl.store(partial_l_ptr + row, l, mask=row_valid)
        tl.store(partial_acc_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
        if FUSE_REDUCE:
            # Every thread's partials are stored before thread 0's release (the atomic).
            tl.debug_barrier()
            counter = split_counter_ptr + pid * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                # The last split of this (token, KV head): the others' partials are visible.
                tl.store(counter, 0)  # ready for the next launch
                tok_row = (q_start + q_block_start).to(tl.int64)
                for g in range(GROUP):
                    _merge_splits(
                        out_ptr, partial_m_ptr, partial_l_ptr, partial_acc_ptr, pid, kv_head * GROUP + g,
                        tok_row, num_heads, num_splits, stride_out_tok,
                        HEAD_DIM, HEAD_PAD, SPLITS_PAD, ".cg",
                    )
    else:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        out_row = (q_start + tok).to(tl.int64) * stride_out_tok + head * HEAD_DIM
        tl.store(out_ptr + out_row[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    partial_m_ptr,
    partial_l_ptr,
    partial_acc_ptr,
    decode_req_idx_ptr,
    query_start_loc_ptr,
    num_heads,
    num_splits,
    stride_out_tok,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLIT_Q: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    decode = tl.program_id(0)  # request * SPLIT_Q + token, as in the split launch
    head = tl.program_id(1)
    # The step's metadata before the wait, the partials after it (as in the split kernel).
    req = tl.load(decode_req_idx_ptr + decode // SPLIT_Q, cache_modifier=".cg")
    tok = (tl.load(query_start_loc_ptr + req, cache_modifier=".cg") + decode % SPLIT_Q).to(tl.int64)
    wait_for_previous_kernel(USE_PDL)
    _merge_splits(
        out_ptr, partial_m_ptr, partial_l_ptr, partial_acc_ptr, decode, head, tok, num_heads, num_splits,
        stride_out_tok, HEAD_DIM, HEAD_PAD, SPLITS_PAD, "",
    )


# True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import).
INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    tile_n: int
    num_warps: int
    num_stages: int


def tile_config(group: int, head_dim: int, max_query_len: int, split: bool = False) -> TileConfig:
    """Decode-like batches use the smallest MMA tile (16 rows) and 32-key tiles (finer split-K
    ranges); longer queries use 64 rows so each K/V tile serves more queries. Rows must hold at
    least one token's group. ``split``: for the split-K launch (the same tiles today)."""
    head_pad = triton.next_power_of_2(head_dim)
    if max_query_len * group <= 16:
        block_m, tile_n = 16, 32
    elif head_pad <= 128:
        block_m, tile_n = 64, 64
    else:
        block_m, tile_n = 32, 32
    block_m = max(block_m, triton.next_power_of_2(group))
    return TileConfig(block_m, tile_n, num_warps=4, num_stages=2 if head_pad > 128 else 3)


@dataclass
class SplitScratch:
    """Persistent float32 partials for split-K decode, shared by every layer of one shape."""

    m: torch.Tensor  # [max_rows, num_heads]
    l: torch.Tensor  # [max_rows, num_heads]
    acc: torch.Tensor  # [max_rows, num_heads, head_dim]
    # [max_rows, num_heads] int32: splits finished per (token, KV head); the fused merge
    # leaves every counter at zero when its launch ends.
    counter: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, num_heads: int, head_dim: int, device: torch.device) -> "SplitScratch":
        f32 = torch.float32
        return cls(
            torch.empty(max_rows, num_heads, dtype=f32, device=device),
            torch.empty(max_rows, num_heads, dtype=f32, device=device),
            torch.empty(max_rows, num_heads, head_dim, dtype=f32, device=device),
            torch.zeros(max_rows, num_heads, dtype=torch.int32, device=device),
        )


def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim], rows may be strided
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    *,
    num_reqs: int,
    num_tokens: int,
    max_query_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None,
    skip_decodes: bool = False,
) -> None:
    """Attention for every request's q-blocks, written straight to ``out`` (decodes too,
    unless ``skip_decodes``: then the split launch owns them)."""
    group = num_heads // num_kv_heads
    cfg = tile_config(group, head_dim, max_query_len)
    block_q = cfg.block_m // group
    grid = (num_tokens // block_q + num_reqs, num_kv_heads, 1)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        query_start_loc, out, out, out, query_start_loc,  # split-only pointers: unused here
        num_reqs, num_heads, 1, int(skip_decodes), scale * math.log2(math.e), sliding_window or 0,
        query.stride(0), out.stride(0), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        **_constexprs(group, head_dim, key_cache, cfg, block_q, query.dtype, sliding_window),
        SPLIT=False,
        SPLIT_Q=1,
        FUSE_REDUCE=False,
        SPLITS_PAD=2,
    )


def split_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    decode_req_idx: torch.Tensor,  # [num_decodes] int32: the requests with query_len 1
    scratch: SplitScratch,
    *,
    num_decodes: int,
    num_splits: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None,
    query_len: int = 1,
    fuse_reduce: bool | None = None,
) -> None:
    """Flash-decoding: ``num_splits`` programs per (query token, KV head), whose partials the
    last one to finish merges (``fuse_reduce``, by default when
    ``PAGELM_SPLIT_REDUCE_FUSION=1``; otherwise a second, reduce launch).
    ``query_len`` tokens per request (> 1: speculative verification, every request with
    exactly that many; token ``j`` sees the keys up to its own position)."""
    if fuse_reduce is None:
        fuse_reduce = not SPLIT_REDUCE_FUSION_DISABLED
    rows = num_decodes * query_len
    assert rows * num_splits <= scratch.m.shape[0]
    group = num_heads // num_kv_heads
    cfg = tile_config(group, head_dim, max_query_len=1, split=True)
    splits_pad = triton.next_power_of_2(max(num_splits, 2))
    _paged_attention_kernel[(rows, num_kv_heads, num_splits)](
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        decode_req_idx, scratch.m, scratch.l, scratch.acc, scratch.counter,
        num_decodes, num_heads, num_splits, 0, scale * math.log2(math.e), sliding_window or 0,
        query.stride(0), out.stride(0), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        **_constexprs(group, head_dim, key_cache, cfg, 1, query.dtype, sliding_window),
        SPLIT=True,
        SPLIT_Q=query_len,
        FUSE_REDUCE=fuse_reduce,
        SPLITS_PAD=splits_pad,
    )
    if fuse_reduce:
        return
    use_pdl = not INTERPRETED and pdl_supported(out.device)
    _reduce_splits_kernel[(rows, num_heads)](
        out, scratch.m, scratch.l, scratch.acc, decode_req_idx, query_start_loc,
        num_heads, num_splits, out.stride(0),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        SPLITS_PAD=splits_pad,
        SPLIT_Q=query_len,
        USE_PDL=use_pdl,
        launch_pdl=use_pdl,
    )


def _constexprs(group, head_dim, key_cache, cfg: TileConfig, block_q, dtype, sliding_window) -> dict:
    use_pdl = not INTERPRETED and pdl_supported(key_cache.device)
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        # tl.dot needs every dimension >= 16.
        HEAD_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=cfg.block_m,
        BLOCK_Q=block_q,
        TILE_N=cfg.tile_n,
        USE_WINDOW=sliding_window is not None,
        EXACT_FP32=dtype == torch.float32,
        DOT_FP32=INTERPRETED and dtype == torch.bfloat16,
        USE_PDL=use_pdl,
        launch_pdl=use_pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def build_kernels(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    sliding_window: int | None,
    split_counts: tuple[int, ...],
    scratch: SplitScratch,
    device: torch.device,
) -> None:
    """Compile every variant of the kernels a step of this layer shape can launch, by running
    each once on a few dummy tokens: the main launch with the decode-sized and the
    prefill-sized tile (``tile_config``), and split-K decode with its reduce at each of
    ``split_counts``. Called while the engine starts, so that no step meets a variant first
    and waits over a second for Triton to build it. (CUDA-graph capture builds the graphs'
    own split counts.) The dummy tensors have the real ones' strides per block and per
    token, so they take the same specialisations."""
    group = num_heads // num_kv_heads
    prefill_len = 16 // group + 1  # max_query_len * group > 16: the prefill-sized tile
    num_blocks = -(-prefill_len // block_size)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device).view(1, -1)
    query = torch.zeros(prefill_len, num_heads * head_dim, dtype=dtype, device=device)
    out = torch.empty_like(query)
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 scale=head_dim ** -0.5, sliding_window=sliding_window)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    for query_len in (1, prefill_len):
        paged_attention(out, query, cache[0], cache[1], block_table, i32(query_len), i32(0, query_len),
                        num_reqs=1, num_tokens=query_len, max_query_len=query_len, **shape)
    decode_req_idx = i32(0)
    for num_splits in split_counts:
        split_decode_attention(out, query, cache[0], cache[1], block_table, i32(1), i32(0, 1), decode_req_idx,
                               scratch, num_decodes=1, num_splits=num_splits, **shape)
