"""Qwen3: Llama with an RMSNorm over each q and k head before rotary (``q_norm``/``k_norm``,
weight ``[head_dim]``), an explicit ``head_dim`` and Qwen's sliding-window rule."""

from __future__ import annotations

import torch

from pagelm.models.layers import RMSNorm
from pagelm.models import ops
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

    def position_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q/k norm and rotary in one kernel on CUDA (three launches per layer become one)."""
        rope = self.rotary_emb
        if not ops.fused_ops_enabled(q) or rope.rotary_dim != rope.head_dim:
            return super().position_qk(positions, q, k)
        return ops.qk_norm_rotary_embedding(
            positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rope.cos_sin_cache,
            rope.head_dim,
        )

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_heads, _ = self.q_norm(q.view(q.shape[0], -1, self.head_dim))
        k_heads, _ = self.k_norm(k.view(k.shape[0], -1, self.head_dim))
        return q_heads.view_as(q), k_heads.view_as(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
