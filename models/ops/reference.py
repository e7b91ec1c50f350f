"""The torch definitions of the fused ops: the CPU path, and what the Triton kernels are
tested against. The math is Hugging Face's, so bf16 models round the same way."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (in the model dtype), then ``(weight * norm(h), h)``.

    Normalised in float32, rounded to the model dtype, then scaled in the model dtype.
    """
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    return weight * normed, x


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox (rotate-half) RoPE on ``[num_tokens, heads * head_dim]`` q and k, out of place.

    ``cos_sin_cache`` is float32 ``[max_position, rotary_dim]``: cos of each frequency, then
    sin. The first ``rotary_dim`` dims of each head rotate in float32; the rest pass through.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rotary_dim / 2]
    # Both halves in one multiply-add, ``x * [cos, cos] + [x2, x1] * [-sin, sin]``: the same
    # products and sums as ``[x1 cos - x2 sin, x2 cos + x1 sin]`` (negation is exact), so the
    # same bits, in a third fewer ops (what a CPU decode step of a few tokens pays for).
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
    return _rotate(q, cos, sin, head_dim, rotary_dim), _rotate(k, cos, sin, head_dim, rotary_dim)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotary_dim: int
) -> torch.Tensor:
    heads = x.view(x.shape[0], -1, head_dim)
    part = heads[..., :rotary_dim].float()
    x1, x2 = part.chunk(2, dim=-1)
    rotated = (part * cos + torch.cat([x2, x1], dim=-1) * sin).to(x.dtype)
    if rotary_dim < head_dim:
        rotated = torch.cat([rotated, heads[..., rotary_dim:]], dim=-1)
    return rotated.view_as(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over the fused ``[gate | up]`` last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
