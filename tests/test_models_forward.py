"""pagelm's model architectures give the same prefill logits as transformers' own models
built from the same tiny random config and weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from pagelm.attention import AttentionImpl, ForwardContext, attention_layers, forward_context
from pagelm.models import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from pagelm.registry import Registry

PROMPT_LEN = 24
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)


class PrefillSDPAImpl(AttentionImpl):
    """Causal attention over the current tokens of one sequence, ignoring the KV cache:
    enough to check the model code while the paged backends are tested on their own."""

    def forward(self, query, key, value, kv_cache, metadata):
        spec = self.spec
        num_tokens = query.shape[0]
        q = query.view(num_tokens, spec.num_heads, spec.head_dim).transpose(0, 1)
        k = key.view(num_tokens, spec.num_kv_heads, spec.head_dim).transpose(0, 1)
        v = value.view(num_tokens, spec.num_kv_heads, spec.head_dim).transpose(0, 1)
        i = torch.arange(num_tokens).unsqueeze(1)
        j = torch.arange(num_tokens).unsqueeze(0)
        visible = j <= i
        if spec.sliding_window is not None:
            visible &= j > i - spec.sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=spec.scale, enable_gqa=True)
        return out.transpose(0, 1).reshape(num_tokens, spec.num_heads * spec.head_dim)


CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, LlamaForCausalLM, {}),
    "llama-bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        LlamaForCausalLM,
        dict(attention_bias=True, mlp_bias=True),
    ),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        LlamaForCausalLM,
        dict(rope_parameters=LLAMA3_ROPE),
    ),
    "llama-tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        LlamaForCausalLM,
        dict(tie_word_embeddings=True),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        MistralForCausalLM,
        dict(sliding_window=None),
    ),
    "mistral-sliding-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        MistralForCausalLM,
        dict(sliding_window=7),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, Qwen2ForCausalLM, {}),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        Qwen3ForCausalLM,
        dict(head_dim=32),
    ),
}


def build_pair(name: str):
    config_cls, hf_cls, pagelm_cls, overrides = CASES[name]
    config = config_cls(**TINY, **overrides, attn_implementation="eager")
    torch.manual_seed(0)
    hf_model = hf_cls(config).eval()
    # Norm weights are ones after init; randomise them so a missing norm would show.
    with torch.no_grad():
        for param_name, param in hf_model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
    model = pagelm_cls(config)
    loaded = model.load_weights(hf_model.state_dict().items())
    assert loaded == {param_name for param_name, _ in model.named_parameters()}
    for layer in attention_layers(model):
        layer.impl = PrefillSDPAImpl(layer.spec)
        layer.kv_cache = torch.empty(0)
    return hf_model, model


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_prefill_logits_match_transformers(name: str) -> None:
    hf_model, model = build_pair(name)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, TINY["vocab_size"], (PROMPT_LEN,), generator=generator)
    expected = hf_model(input_ids.unsqueeze(0)).logits[0]
    with forward_context(ForwardContext(attn_metadata=None)):
        hidden = model(input_ids, torch.arange(PROMPT_LEN))
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_sliding_window_changes_logits_beyond_the_window() -> None:
    """The sliding-window case is only a real check if the window actually bites."""
    hf_windowed, _ = build_pair("mistral-sliding-window")
    config = transformers.MistralConfig(**{**hf_windowed.config.to_dict(), "sliding_window": None})
    hf_full = transformers.MistralForCausalLM(config).eval()
    hf_full.load_state_dict(hf_windowed.state_dict())
    input_ids = torch.arange(PROMPT_LEN).unsqueeze(0)
    windowed, full = hf_windowed(input_ids).logits[0], hf_full(input_ids).logits[0]
    window = hf_windowed.config.sliding_window
    torch.testing.assert_close(windowed[:window], full[:window])
    assert not torch.allclose(windowed[window:], full[window:], atol=1e-3)


def test_qwen2_sliding_window_only_with_use_sliding_window() -> None:
    config = transformers.Qwen2Config(**TINY, sliding_window=8, max_window_layers=1)
    windows = [layer.spec.sliding_window for layer in attention_layers(Qwen2ForCausalLM(config))]
    assert windows == [None, None]
    config = transformers.Qwen2Config(**TINY, sliding_window=8, max_window_layers=1, use_sliding_window=True)
    windows = [layer.spec.sliding_window for layer in attention_layers(Qwen2ForCausalLM(config))]
    assert windows == [None, 8]


def test_construction_honours_default_dtype_and_keeps_rope_cache_float32() -> None:
    config = transformers.LlamaConfig(**TINY)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cpu"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_unexpected_checkpoint_weight_is_an_error() -> None:
    model = LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    with pytest.raises(KeyError, match="model.layers.0.self_attn.rope_scale"):
        model.load_weights([("model.layers.0.self_attn.rope_scale.weight", torch.zeros(1))])


def test_hook_registers_the_four_architectures_their_eagle_heads_llava_and_qwen2_vl() -> None:
    import pagelm.models

    registry = Registry("model")
    pagelm.models.pagelm_register_models(registry)
    archs = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    vision = ["LlavaForConditionalGeneration", "Qwen2VLForConditionalGeneration"]
    assert registry.names() == sorted(archs + [f"Eagle{a}" for a in archs] + vision)
