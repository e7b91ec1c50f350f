"""Triton kernel that scatters this step's K/V into the paged cache through ``slot_mapping``.

One program per token copies its ``[num_kv_heads, head_dim]`` tile of K and of V to
``cache[block, offset]`` with ``block, offset = divmod(slot, block_size)``. A negative slot
marks a padding token (e.g. a CUDA-graph batch padded to a captured size) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagelm.backends.kernels.common import allow_next_kernel, is_interpreted, pdl_supported, wait_for_previous_kernel


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
    wait_for_previous_kernel(USE_PDL)  # K/V come from the kernels just before
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
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
