"""EAGLE draft heads (Li et al., 2024): one decoder layer that predicts the target's next
hidden state from its current one and the embedding of the token that follows it::

    target hidden f_p ─┐
                       ├─ concat ─ fc ─ decoder layer ─► g_p  ≈ f_{p+1} ─ target lm_head ─► token p+2
    embed(t_{p+1}) ────┘        (2h -> h)   (own KV cache)

The embedding and the LM head are the target's. The standard checkpoint layout is a
directory with a Llama-style ``config.json`` (``num_hidden_layers: 1``) and weights named
``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ... (``fc.bias``, ``embed_tokens.weight``
and ``layers.0.input_layernorm.weight`` only in some checkpoints: the loader sets the
``eagle_*`` config flags from the names it finds). As in the reference implementation, layer
0 has no input norm and the output is not normalised.

One head class per decoder architecture, registered as ``Eagle<architecture>``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagelm.models.layers import FusedColumnLinear, Linear
from pagelm.models.llama import LlamaAttention, LlamaDecoderLayer, MistralAttention
from pagelm.models.qwen2 import Qwen2Attention
from pagelm.models.qwen3 import Qwen3Attention
from pagelm.models.weights import PACKED_MODULES_MAPPING, load_packed_weights


class _ResidualOnly(nn.Module):
    """Layer 0's input norm, which EAGLE drops: only the residual sum passes through."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else x + residual
        return h, h


class EagleLlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, bias=bool(getattr(config, "eagle_fc_bias", False)))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.attention_cls) for i in range(config.num_hidden_layers)
        )
        if not getattr(config, "eagle_input_layernorm", False):
            self.layers[0].input_layernorm = _ResidualOnly()
        # The target's embedding (share_embedding), unless the checkpoint brings its own.
        self.embed_tokens: nn.Module | None = None
        if getattr(config, "eagle_own_embedding", False):
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)

    def share_embedding(self, embedding: nn.Module) -> None:
        self.embed_tokens = embedding

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]``: token ``p+1`` at position ``p``, paired with the
        (target's, or this head's previous) hidden state of position ``p`` ``[T, hidden]``."""
        embeds = self.embed_tokens(input_ids)
        h = self.fc(torch.cat([embeds, hidden_states.to(embeds.dtype)], dim=-1))
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        return h + residual

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Some checkpoints prefix "model."; an lm_head is the target's (ours is never loaded).
        renamed = ((name.removeprefix("model."), tensor) for name, tensor in weights)
        skip = ("rotary_emb.inv_freq", "lm_head.") + (() if self.config_has_own_embedding else ("embed_tokens.",))
        return load_packed_weights(self, renamed, skip=skip)

    @property
    def config_has_own_embedding(self) -> bool:
        return bool(getattr(self.config, "eagle_own_embedding", False))

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Weights under the standard EAGLE names (fused q/k/v and gate/up split back),
        without a shared embedding: what ``load_weights`` reads."""
        unpacked = {(fused, shard): name for name, (fused, shard) in PACKED_MODULES_MAPPING.items()}
        out: dict[str, torch.Tensor] = {}
        for module_name, module in self.named_modules():
            if module_name.startswith("embed_tokens") and not self.config_has_own_embedding:
                continue
            prefix, _, leaf = module_name.rpartition(".")
            for param_name, param in module.named_parameters(recurse=False):
                data = param.detach().contiguous()
                if isinstance(module, FusedColumnLinear) and (leaf, next(iter(module.shard_offsets))) in unpacked:
                    for shard, (offset, size) in module.shard_offsets.items():
                        name = ".".join(filter(None, [prefix, unpacked[(leaf, shard)], param_name]))
                        out[name] = data.narrow(0, offset, size).contiguous()
                else:
                    out[".".join(filter(None, [module_name, param_name]))] = data
        return out


class EagleMistralForCausalLM(EagleLlamaForCausalLM):
    attention_cls = MistralAttention


class EagleQwen2ForCausalLM(EagleLlamaForCausalLM):
    attention_cls = Qwen2Attention


class EagleQwen3ForCausalLM(EagleLlamaForCausalLM):
    attention_cls = Qwen3Attention


EAGLE_HEADS = (EagleLlamaForCausalLM, EagleMistralForCausalLM, EagleQwen2ForCausalLM, EagleQwen3ForCausalLM)
