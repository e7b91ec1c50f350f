"""Qwen2-VL's vision transformer: images of any size (multiples of ``patch_size *
spatial_merge_size``) as patches, 2-D rotary positions, full attention within each image, and
a merger that folds each ``merge x merge`` square of patches into one language-model embedding.

Inputs are what ``Qwen2VLImageProcessor`` makes of an image, concatenated over images::

    pixel_values  [sum of t*h*w patches, channels * temporal_patch * patch * patch]
                  (each image's patches in merge-block order: the m*m patches of one merged
                   embedding are consecutive)
    grid_thw      one (t, h, w) per image, in patches
    output        [sum of t*h*w / m**2, text hidden_size]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


def vision_rotary_positions(grid_thw: Sequence[Sequence[int]], merge: int) -> torch.Tensor:
    """``[num_patches, 2]``: each patch's (row, column) in its image, in the processor's
    merge-block order, repeated for every temporal slice."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        hw = torch.stack([rows, cols], dim=-1)  # [h, w, 2]
        hw = hw.reshape(h // merge, merge, w // merge, merge, 2).transpose(1, 2).reshape(-1, 2)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


class Qwen2VLPatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride and its input: one matmul with the flattened
    kernel (the checkpoint's ``proj.weight`` keeps its 5-D shape)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embed_dim = config.embed_dim
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.embed_dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.view(self.embed_dim, -1))


class Qwen2VLVisionAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.embed_dim // config.num_heads
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim, bias=True)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Each image attends to itself only: one call per image (no [n, n] mask to build). The
        # inputs are 4-D ([1, heads, patches, head_dim]): with 3-D ones torch's SDPA skips its
        # flash and memory-efficient kernels for the math one, whose [heads, n, n] float32
        # scores for a 16,384-embedding image (65,536 patches) would need 256 GiB.
        outs = [
            F.scaled_dot_product_attention(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None])[0]
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        out = torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1)
        return self.proj(out)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head in float32; ``cos``/``sin``: ``[n, head_dim / 2]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.attn = Qwen2VLVisionAttention(config)
        hidden = int(config.embed_dim * config.mlp_ratio)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(config.embed_dim, hidden)
        self.mlp.act = ACT2FN[config.hidden_act]
        self.mlp.fc2 = nn.Linear(hidden, config.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class Qwen2VLPatchMerger(nn.Module):
    """LayerNorm, then each ``m * m`` consecutive patches concatenated through a two-layer MLP
    into one embedding of the language model's width."""

    def __init__(self, config) -> None:
        super().__init__()
        self.merged_dim = config.embed_dim * config.spatial_merge_size**2
        self.ln_q = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(), nn.Linear(self.merged_dim, config.hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = Qwen2VLPatchEmbed(config)
        self.blocks = nn.ModuleList(Qwen2VLVisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen2VLPatchMerger(config)
        # Axial 2-D RoPE: a quarter of the head's frequencies per axis (rows, then columns).
        head_dim = config.embed_dim // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        exponents = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta**exponents, persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> torch.Tensor:
        device = self.inv_freq.device
        positions = vision_rotary_positions(grid_thw, self.spatial_merge_size).to(device)
        angles = (positions[..., None].float() * self.inv_freq).flatten(1)  # [n, head_dim / 2]: rows | columns
        cos, sin = angles.cos(), angles.sin()
        lengths = [t * h * w for t, h, w in grid_thw]
        x = self.patch_embed(pixel_values.to(device))
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)
