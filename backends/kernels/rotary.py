"""Triton neox (rotate-half) RoPE, in place on q and k: one program per token.

q and k are usually column slices of the fused qkv projection, so a token's row may be wider
than its heads (``stride_q_tok >= num_heads * head_dim``). The program loads its position's cos
and sin once and rotates ``BLOCK_H`` heads of q, then of k, at a time::

    head h of token t:  | x1 (rotary_dim/2) | x2 (rotary_dim/2) | pass-through |
                        -> x1 cos - x2 sin,   x2 cos + x1 sin      (untouched)

The products and sums are separate float32 roundings, as in the eager torch reference (the
launch turns off fusing them into FMAs), so float32 results match it exactly.
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
def norm_rotate(x1, x2, cos, sin, norm_w_ptr, eps, dims, HALF: tl.constexpr, INTERPRETED: tl.constexpr,
                NORM: tl.constexpr):
    """Rotated halves ``(x1 cos - x2 sin, x2 cos + x1 sin)`` of ``[heads, HALF_PAD]`` tiles, in
    their dtype; with ``NORM``, each head (``x1 | x2``, the whole head) is RMS-normalised and
    scaled by the weight at ``norm_w_ptr`` first. Shared with the backends' rotary + KV store
    kernel, so both round alike."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if NORM:
        # Per-head RMSNorm first (Qwen3's q_norm / k_norm; rotary covers the whole head):
        # normalise in float32, round to the model dtype, scale by the weight in that
        # dtype, exactly the steps of the eager RMSNorm the rotation would otherwise read.
        inv_rms = 1.0 / tl.sqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)
        w1 = tl.load(norm_w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        a = round_to(round_to(a * inv_rms[:, None], x1.dtype, INTERPRETED).to(tl.float32) * w1,
                     x1.dtype, INTERPRETED).to(tl.float32)
        b = round_to(round_to(b * inv_rms[:, None], x1.dtype, INTERPRETED).to(tl.float32) * w2,
                     x1.dtype, INTERPRETED).to(tl.float32)
    return round_to(a * cos - b * sin, x1.dtype, INTERPRETED), round_to(b * cos + a * sin, x1.dtype, INTERPRETED)


@triton.jit
def _rotate_heads(
    x_ptr, stride_tok, stride_head, num_heads, tok, cos, sin, norm_w_ptr, eps,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRETED: tl.constexpr,
    NORM: tl.constexpr,
):
    dims = tl.arange(0, HALF_PAD)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
        first = x_ptr + tok * stride_tok + heads[:, None].to(tl.int64) * stride_head + dims[None, :]
        x1 = tl.load(first, mask=mask, other=0.0)
        x2 = tl.load(first + HALF, mask=mask, other=0.0)
        o1, o2 = norm_rotate(x1, x2, cos, sin, norm_w_ptr, eps, dims, HALF, INTERPRETED, NORM)
        tl.store(first, o1, mask=mask)
        tl.store(first + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,  # [max_position, 2 * HALF] float32: cos then sin
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    num_q_heads,
    num_k_heads,
    q_norm_w_ptr,
    k_norm_w_ptr,
    eps,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERPRETED: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    # The position and its cos/sin before waiting: positions are the step's metadata, written
    # before its first layer (``pagelm.backends.kernels.common``).
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok, cache_modifier=".cg").to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    cache_row = cos_sin_ptr + pos * (2 * HALF)
    cos = tl.load(cache_row + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(cache_row + HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    wait_for_previous_kernel(USE_PDL)  # q and k come from the projection just before
    _rotate_heads(
        q_ptr, stride_q_tok, stride_q_head, num_q_heads, tok, cos, sin, q_norm_w_ptr, eps,
        HALF, HALF_PAD, BLOCK_H, INTERPRETED, NORM,
    )
    _rotate_heads(
        k_ptr, stride_k_tok, stride_k_head, num_k_heads, tok, cos, sin, k_norm_w_ptr, eps,
        HALF, HALF_PAD, BLOCK_H, INTERPRETED, NORM,
    )


INTERPRETED = is_interpreted(_rotary_kernel)

# Elements of one tensor a program holds at once: BLOCK_H heads of HALF_PAD dims.
_TILE = 2048


def _heads(x: torch.Tensor, num_tokens: int, head_dim: int) -> torch.Tensor:
    """``[num_tokens, heads, head_dim]`` view of flattened (or already split) q or k."""
    assert x.stride(-1) == 1, "rotary needs each head's dims contiguous"
    return x.view(num_tokens, -1, head_dim)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`pagelm.models.ops.reference.rotary_embedding`, but rotates q and k
    in place and returns them. ``qk_norm=(q_weight, k_weight, eps)`` first applies a per-head
    RMSNorm (one launch instead of three; needs ``rotary_dim == head_dim``)."""
    num_tokens = positions.numel()
    assert positions.is_contiguous() and q.shape[0] == k.shape[0] == num_tokens
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[-1] == rotary_dim
    assert cos_sin_cache.is_contiguous() and rotary_dim % 2 == 0 and rotary_dim <= head_dim
    if num_tokens == 0:
        return q, k
    assert qk_norm is None or rotary_dim == head_dim, "fused q/k norm needs full-head rotary"
    q_heads, k_heads = _heads(q, num_tokens, head_dim), _heads(k, num_tokens, head_dim)
    q_norm_w, k_norm_w, eps = qk_norm if qk_norm is not None else (q_heads, k_heads, 0.0)
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(q_heads.shape[1], k_heads.shape[1])), max(1, _TILE // half_pad))
    use_pdl = not INTERPRETED and pdl_supported(q.device)
    _rotary_kernel[(num_tokens,)](
        q_heads,
        k_heads,
        positions,
        cos_sin_cache,
        q_heads.stride(0),
        q_heads.stride(1),
        k_heads.stride(0),
        k_heads.stride(1),
        q_heads.shape[1],
        k_heads.shape[1],
        q_norm_w,
        k_norm_w,
        eps,
        HALF=half,
        HALF_PAD=half_pad,
        BLOCK_H=block_h,
        INTERPRETED=INTERPRETED,
        NORM=qk_norm is not None,
        USE_PDL=use_pdl,
        num_warps=4,
        enable_fp_fusion=False,
        launch_pdl=use_pdl,
    )
    return q, k
