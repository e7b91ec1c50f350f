"""CLIP's vision transformer, as vision-language models use it: the hidden states of one
layer (LLaVA: the second to last), so only the layers up to it are built and run.

Images are encoded whole (no paged KV cache): ``[num_images, 3, H, W]`` -> patch embeddings
plus a class token, pre-norm encoder layers with full attention over each image's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size, bias=False
        )
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        embeddings = torch.cat([cls, patches], dim=1)
        return embeddings + self.position_embedding.weight[: embeddings.shape[1]]


class CLIPAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = nn.Sequential()
        self.mlp.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.mlp.act = ACT2FN[config.hidden_act]
        self.mlp.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionTower(nn.Module):
    """The embeddings, the pre-norm and the first ``num_layers`` encoder layers: the output
    is Hugging Face's ``hidden_states[num_layers]`` (no post-norm: no feature layer uses it)."""

    def __init__(self, config, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.layers:
            x = layer(x)
        return x


def feature_layer_count(vision_config, feature_layer: int) -> int:
    """Encoder layers to run for ``hidden_states[feature_layer]`` (index 0: the embeddings)."""
    total = vision_config.num_hidden_layers
    n = feature_layer if feature_layer >= 0 else total + 1 + feature_layer
    if not 0 <= n <= total:
        raise ValueError(f"vision_feature_layer={feature_layer} is outside the {total}-layer vision tower")
    return n
