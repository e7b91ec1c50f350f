"""Triton kernels that scatter this step's K/V into the paged cache through ``slot_mapping``.

One program per token copies its ``[num_kv_heads, head_dim]`` tile of K and of V to
``cache[block, offset]`` with ``block, offset = divmod(slot, block_size)``. A negative slot
marks a padding token (e.g. a CUDA-graph batch padded to a captured size) and is skipped.

``rotary_store_kv`` does the model's q/k work in the same program (``QKRotary``): per-head
RMSNorm of q and k where the model has one (Qwen3), neox RoPE, q rotated in place, K written
to the cache already rotated. One launch per layer where the decode path took two (q/k norm
+ rotary, then the store), or four without the fused rotary (norms, rotary, store)::

    token t:  q heads  -> norm? -> rotate -> q (in place)
              k heads  -> norm? -> rotate -> key_cache[slot]      (k itself is left as it was)
              v heads  ------------------->  value_cache[slot]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagelm.attention import QKRotary
from pagelm.backends.kernels.common import allow_next_kernel, is_interpreted, pdl_supported, wait_for_previous_kernel
from pagelm.backends.kernels.rotary import norm_rotate


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_tok,
    stride_value_tok,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok, cache_modifier=".cg").to(tl.int64)  # the step's metadata: before the wait
    wait_for_previous_kernel(USE_PDL)  # K/V come from the kernels just before
    if slot < 0:
        return
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    src = heads[:, None] * HEAD_DIM + dims[None, :]
    dst = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    k = tl.load(key_ptr + tok.to(tl.int64) * stride_key_tok + src, mask=mask)
    v = tl.load(value_ptr + tok.to(tl.int64) * stride_value_tok + src, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


INTERPRETED = is_interpreted(_store_kv_kernel)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim], rows may be strided
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    num_kv_heads: int,
    head_dim: int,
) -> None:
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "K/V rows must be contiguous"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    use_pdl = not INTERPRETED and pdl_supported(key_cache.device)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        USE_PDL=use_pdl,
        launch_pdl=use_pdl,
    )


@triton.jit
def _rotary_store_kv_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    positions_ptr,
    cos_sin_ptr,  # [max_position, 2 * HALF] float32: cos then sin
    q_norm_w_ptr,
    k_norm_w_ptr,
    eps,
    num_slots,  # tokens with a slot; rows past it (graph padding beyond the batch) only rotate q
    stride_query_tok,
    stride_key_tok,
    stride_value_tok,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim / 2
    HALF_PAD: tl.constexpr,
    TAIL_PAD: tl.constexpr,  # head_dim - rotary_dim dims passed through, padded; 0: none
    HEAD_PAD: tl.constexpr,
    Q_BLOCK_H: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    # The step's metadata (position, slot) and the position's cos/sin before the wait
    # (``pagelm.backends.kernels.common``); q/k/v after it.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok, cache_modifier=".cg").to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    in_half = dims < HALF
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + dims, mask=in_half, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + dims, mask=in_half, other=0.0)[None, :]
    slot = tl.load(slot_mapping_ptr + tok, mask=tok < num_slots, other=-1, cache_modifier=".cg").to(tl.int64)
    wait_for_previous_kernel(USE_PDL)  # q/k/v come from the projection just before

    # q: Q_BLOCK_H heads at a time, in place (a head's pass-through dims stay where they are).
    for h0 in range(0, NUM_HEADS, Q_BLOCK_H):
        heads = h0 + tl.arange(0, Q_BLOCK_H)
        mask = (heads < NUM_HEADS)[:, None] & in_half[None, :]
        first = query_ptr + tok * stride_query_tok + heads[:, None] * HEAD_DIM + dims[None, :]
        q1, q2 = norm_rotate(
            tl.load(first, mask=mask, other=0.0), tl.load(first + HALF, mask=mask, other=0.0),
            cos, sin, q_norm_w_ptr, eps, dims, HALF, INTERPRETED, NORM,
        )
        tl.store(first, q1, mask=mask)
        tl.store(first + HALF, q2, mask=mask)

    if slot >= 0:
        kv_heads = tl.arange(0, KV_HEADS_PAD)
        head_ok = (kv_heads < NUM_KV_HEADS)[:, None]
        dst = (
            (slot // BLOCK_SIZE) * stride_cache_block
            + (slot % BLOCK_SIZE) * stride_cache_slot
            + kv_heads[:, None] * stride_cache_head
        )
        src = tok * stride_key_tok + kv_heads[:, None] * HEAD_DIM
        mask = head_ok & in_half[None, :]
        k1, k2 = norm_rotate(
            tl.load(key_ptr + src + dims[None, :], mask=mask, other=0.0),
            tl.load(key_ptr + src + HALF + dims[None, :], mask=mask, other=0.0),
            cos, sin, k_norm_w_ptr, eps, dims, HALF, INTERPRETED, NORM,
        )
        tl.store(key_cache_ptr + dst + dims[None, :], k1, mask=mask)
        tl.store(key_cache_ptr + dst + HALF + dims[None, :], k2, mask=mask)
        if TAIL_PAD > 0:
            tail = tl.arange(0, TAIL_PAD)
            tail_mask = head_ok & (tail < HEAD_DIM - 2 * HALF)[None, :]
            k_tail = tl.load(key_ptr + src + 2 * HALF + tail[None, :], mask=tail_mask)
            tl.store(key_cache_ptr + dst + 2 * HALF + tail[None, :], k_tail, mask=tail_mask)
        head_dims = tl.arange(0, HEAD_PAD)
        v_mask = head_ok & (head_dims < HEAD_DIM)[None, :]
        v_src = value_ptr + tok * stride_value_tok + kv_heads[:, None] * HEAD_DIM + head_dims[None, :]
        tl.store(value_cache_ptr + dst + head_dims[None, :], tl.load(v_src, mask=v_mask), mask=v_mask)


# Elements of q one program holds at once: Q_BLOCK_H heads of HALF_PAD dims.
_Q_TILE = 2048


def rotary_store_kv(
    query: torch.Tensor,  # [num_tokens, num_heads * head_dim], rows may be strided; rotated in place
    key: torch.Tensor,  # [>= num_slots, num_kv_heads * head_dim], left as it is
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_slots] int64, num_slots <= num_tokens
    rotary: QKRotary,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """``rotary`` applied to q (in place, returned) and k, and K/V stored at ``slot_mapping``,
    in one launch: what ``store_kv`` after the model's q/k norm and rotary would leave."""
    positions, cos_sin = rotary.positions, rotary.cos_sin_cache
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return query
    rotary_dim = cos_sin.shape[-1]
    norm = rotary.q_norm_weight is not None
    assert positions.dim() == 1 and positions.is_contiguous() and query.shape[0] == num_tokens
    assert slot_mapping.shape[0] <= num_tokens and key.shape[0] >= slot_mapping.shape[0]
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and (rotary_dim == head_dim or not norm)
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1, "q/k/v rows must be contiguous"
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(half)
    tail = head_dim - rotary_dim
    use_pdl = not INTERPRETED and pdl_supported(key_cache.device)
    _rotary_store_kv_kernel[(num_tokens,)](
        query,
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        positions,
        cos_sin,
        rotary.q_norm_weight if norm else cos_sin,
        rotary.k_norm_weight if norm else cos_sin,
        rotary.eps,
        slot_mapping.shape[0],
        query.stride(0),
        key.stride(0),
        value.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=half_pad,
        TAIL_PAD=triton.next_power_of_2(tail) if tail else 0,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        Q_BLOCK_H=min(triton.next_power_of_2(num_heads), max(1, _Q_TILE // half_pad)),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=key_cache.shape[1],
        INTERPRETED=INTERPRETED,
        NORM=norm,
        USE_PDL=use_pdl,
        num_warps=4,
        enable_fp_fusion=False,
        launch_pdl=use_pdl,
    )
    return query
