"""Llama, and the decoder blocks Mistral, Qwen2 and Qwen3 reuse.

Inputs are flattened: every request's tokens sit on one token axis with no batch dim, and
``positions`` holds each token's absolute position in its own request. The ``Attention``
layer finds which tokens belong to which request through the forward context.

Architectures differ only in their attention module, so each one is a subclass of
``LlamaAttention`` plus a ``LlamaForCausalLM`` subclass naming it in ``attention_cls``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagelm.attention import Attention, QKRotary
from pagelm.distributed import parallel_state
from pagelm.models import ops
from pagelm.models.layers import (
    MergedColumnLinear,
    ParallelLMHead,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagelm.models.pipeline import MissingLayer, empty_intermediate, held_by_this_stage, stage_layer_range
from pagelm.models.weights import load_packed_weights


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    rotary_cls: type[RotaryEmbedding] = RotaryEmbedding

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        attention_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, num_heads, num_kv_heads, bias=self.qkv_bias(config)
        )
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias=attention_bias)
        self.rotary_emb = self.rotary_cls.from_config(config, self.head_dim)
        # This rank's heads (all of them without tensor parallelism).
        self.attn = Attention(
            self.qkv_proj.q_size // self.head_dim,
            self.head_dim,
            self.qkv_proj.kv_size // self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=self.sliding_window(config, layer_idx),
        )

    @staticmethod
    def qkv_bias(config) -> bool:
        return getattr(config, "attention_bias", False)

    @staticmethod
    def sliding_window(config, layer_idx: int) -> int | None:
        """Window for this layer (key j visible to query i iff ``i - window < j <= i``)."""
        return None

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook run on q/k before rotary (Qwen3's per-head norms); identity for Llama."""
        return q, k

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, input_norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over ``input_norm(hidden_states, residual)``; returns its output and the
        next residual. The norm runs inside the qkv projection."""
        (q, k, v), residual = self.qkv_proj.forward_normed(input_norm, hidden_states, residual)
        rotary = self.backend_rotary(positions)
        if rotary is not None:
            # The backend norms and rotates q and k in the kernel that stores K/V.
            return self.o_proj(self.attn(q, k, v, rotary=rotary)), residual
        q, k = self.position_qk(positions, q, k)
        return self.o_proj(self.attn(q, k, v)), residual

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """``(q_weight, k_weight, eps)`` of the per-head RMSNorm ``normalize_qk`` applies, for
        a backend that applies it itself; None: no q/k norm (``normalize_qk`` is the identity)."""
        return None

    def backend_rotary(self, positions: torch.Tensor) -> QKRotary | None:
        """``position_qk`` as data, when the bound attention backend applies it itself
        (``Attention.fuses_rotary``): plain RoPE at 1-D positions (M-RoPE's are 1-D at text
        and decode tokens), and a q/k norm only over whole-head rotary. None: the model runs
        ``position_qk`` (a subclass whose ``position_qk`` does other math overrides this too)."""
        rope = self.rotary_emb
        if ops.ROTARY_KV_FUSION_DISABLED or not self.attn.fuses_rotary or positions.dim() != 1:
            return None
        norm = self.qk_norm()
        if norm is None:
            if type(self).normalize_qk is not LlamaAttention.normalize_qk:
                return None  # a q/k normalisation the backend was not told about
            return QKRotary(positions, rope.cos_sin_cache)
        if rope.rotary_dim != rope.head_dim:
            return None
        return QKRotary(positions, rope.cos_sin_cache, *norm)

    def position_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """What q and k go through before attention: the model's q/k normalisation (none
        here), then rotary."""
        q, k = self.normalize_qk(q, k)
        return self.rotary_emb(positions, q, k)


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}: only silu is implemented")
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [config.intermediate_size] * 2, bias=bias)
        # Site 1: the all-reduces of o_proj (site 0) and down_proj alternate (RowParallelLinear).
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, reduce_site=1)

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor, input_norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP over ``input_norm(hidden_states, residual)``, and the next residual. At
        batch 1 that is two kernels: the norm inside gate_up, silu(gate) * up inside down."""
        gate_up, residual = self.gate_up_proj.forward_normed(input_norm, hidden_states, residual)
        d = self.down_proj
        if parallel_state().tp_size == 1:
            return ops.silu_and_mul_linear(gate_up, d.weight, d.bias, prefetch=d.prefetch_next), residual
        return d.project_and_reduce(gate_up, silu_input=True), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention_cls(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual)``; their sum is the layer's output, added lazily
        by the next norm so the add fuses with it."""
        hidden_states, residual = self.self_attn(positions, hidden_states, residual, self.input_layernorm)
        return self.mlp(hidden_states, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    """The decoder stack; under pipeline parallelism this stage's slice of it. The first
    stage embeds, the last one applies the final norm; the others take and return the
    hidden states and residual (``intermediate_tensors``)."""

    def __init__(self, config, attention_cls: type[LlamaAttention]) -> None:
        super().__init__()
        state = parallel_state()
        self.first, self.last = state.is_first_stage, state.is_last_stage
        self.start, self.end = stage_layer_range(config.num_hidden_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size) if self.first else MissingLayer()
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attention_cls) if self.start <= i < self.end else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        # A plain tuple (not a registered module): iterated every step without slicing.
        self.stage_layers = tuple(self.layers[self.start : self.end])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.last else MissingLayer()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: dict | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        if intermediate_tensors is None:
            hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.stage_layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not self.last:
            return {"hidden_states": hidden_states, "residual": residual}
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    # Splits into pipeline stages (``forward`` takes and returns intermediate tensors).
    supports_pipeline_parallel = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_cls)
        last = self.model.last
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if last else MissingLayer()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings and last and self.model.first:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: dict | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """``input_ids``/``positions``: ``[num_tokens]``; returns ``[num_tokens, hidden]``, or
        on a pipeline stage before the last the tensors the next stage takes. ``inputs_embeds``
        (a vision-language model's merged embeddings) replaces the lookup."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def make_empty_intermediate_tensors(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> dict:
        """Buffers the previous pipeline stage's output is received into."""
        return empty_intermediate(num_tokens, self.config.hidden_size, dtype, device)

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding (shared with an EAGLE draft head)."""
        return self.model.embed_tokens

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 (sampling wants full precision)."""
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face checkpoint tensors (this pipeline stage's); returns the
        parameter names filled."""
        m = self.model
        # A tied LM head on a last stage that does not hold the embedding loads its own copy.
        head_copies_embedding = self.tie_word_embeddings and m.last and not m.first

        def stage_weights():
            for name, tensor in weights:
                # Older checkpoints store rotary inv_freq buffers; a tied lm_head is the embedding.
                if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if head_copies_embedding and name == "model.embed_tokens.weight":
                    yield "lm_head.weight", tensor
                elif held_by_this_stage(name, (m.start, m.end), m.first, m.last):
                    yield name, tensor

        return load_packed_weights(self, stage_weights())


class MistralAttention(LlamaAttention):
    @staticmethod
    def sliding_window(config, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)


class MistralForCausalLM(LlamaForCausalLM):
    attention_cls = MistralAttention
