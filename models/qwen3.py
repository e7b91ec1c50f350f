"""Qwen3: Llama with an RMSNorm over each q and k head before rotary (``q_norm``/``k_norm``,
weight ``[head_dim]``), an explicit ``head_dim`` and Qwen's sliding-window rule."""

from __future__ import annotations

import torch

from pagelm.models.layers import RMSNorm
from pagelm.models.llama import LlamaAttention, LlamaForCausalLM
from pagelm.models.qwen2 import qwen_sliding_window


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    @staticmethod
    def sliding_window(config, layer_idx: int) -> int | None:
        return qwen_sliding_window(config, layer_idx)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_heads, _ = self.q_norm(q.view(q.shape[0], -1, self.head_dim))
        k_heads, _ = self.k_norm(k.view(k.shape[0], -1, self.head_dim))
        return q_heads.view_as(q), k_heads.view_as(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
