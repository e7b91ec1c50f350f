"""The ``Attention`` module models call as ``self.attn(q, k, v)``."""

from __future__ import annotations

import torch
from torch import nn

from pagelm.attention.backend import AttentionImpl, AttentionSpec, QKRotary
from pagelm.attention.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention over the engine's KV cache. The model only declares the shape; the
    runner binds a backend implementation and this layer's cache tensor after building the
    model (``bind_attention``), so model code never names a backend."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.spec = AttentionSpec(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        self.layer_idx = -1
        self.impl: AttentionImpl | None = None
        self.kv_cache: torch.Tensor | None = None

    @property
    def fuses_rotary(self) -> bool:
        """Whether ``forward`` takes ``rotary=`` (the bound impl applies q/k norm and RoPE)."""
        return self.impl is not None and self.impl.fuses_rotary

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: QKRotary | None = None
    ) -> torch.Tensor:
        assert self.impl is not None and self.kv_cache is not None, "attention layer is not bound"
        metadata = get_forward_context().attn_metadata
        if rotary is None:
            return self.impl.forward(q, k, v, self.kv_cache, metadata)
        return self.impl.forward(q, k, v, self.kv_cache, metadata, rotary=rotary)


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]
