"""Qwen2: Llama with q/k/v biases, and sliding-window attention only where the config turns
it on (``use_sliding_window``) for the layers it names."""

from __future__ import annotations

from pagelm.models.llama import LlamaAttention, LlamaForCausalLM


def qwen_sliding_window(config, layer_idx: int) -> int | None:
    """Qwen's rule: a window only with ``use_sliding_window``, and only on layers that
    ``layer_types`` marks ``sliding_attention`` (configs without ``layer_types``: layers from
    ``max_window_layers`` on, which is how transformers fills ``layer_types``)."""
    if not getattr(config, "use_sliding_window", False):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        is_sliding = layer_types[layer_idx] == "sliding_attention"
    else:
        is_sliding = layer_idx >= getattr(config, "max_window_layers", 0)
    return getattr(config, "sliding_window", None) if is_sliding else None


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def qkv_bias(config) -> bool:
        return True

    @staticmethod
    def sliding_window(config, layer_idx: int) -> int | None:
        return qwen_sliding_window(config, layer_idx)


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
