"""Built-in benchmark models: the shapes of real checkpoints as Hugging Face ``config.json``
dicts, run with random weights (``load_format="dummy"``) and no tokenizer, so a benchmark needs
no download. ``--model qwen3-0.6b`` in a benchmark materialises the preset as a directory
holding only ``config.json``::

    ~/.cache/pagelm/presets/qwen3-0.6b/config.json

The values are those of the published checkpoints' ``config.json`` (Qwen/Qwen3-0.6B,
meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B), in the hub's own spelling
(``rope_theta`` and ``rope_scaling``), so they load exactly as a downloaded directory would.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 151936,
}

_LLAMA3_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        **_LLAMA3_COMMON,
        "head_dim": 64,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "rope_scaling": _llama3_rope(32.0),
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        **_LLAMA3_COMMON,
        "head_dim": 128,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "rope_scaling": _llama3_rope(8.0),
        "tie_word_embeddings": False,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "tie_word_embeddings": False,
    },
}

# LLaVA-1.5-7B (llava-hf/llava-1.5-7b-hf): CLIP ViT-L/14 at 336 px (576 embeddings an image),
# Vicuna-7B (Llama-2 shapes). Its directory also gets CLIP's preprocessor_config.json.
PRESETS["llava-1.5-7b"] = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "image_token_index": 32000,
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "torch_dtype": "float16",
    "text_config": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "vocab_size": 32064, "rope_theta": 10000.0, "torch_dtype": "float16",
    },
    "vision_config": {
        "model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
        "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5, "projection_dim": 768,
    },
}
# Qwen2-VL-2B (Qwen/Qwen2-VL-2B-Instruct): a 32-block, 1280-wide vision transformer (14 px
# patches, 2 x 2 merge: a 640x480 image is 391 embeddings) and a 28-layer Qwen2 (1536 wide,
# GQA 12/2, tied embedding) with M-RoPE. Its directory also gets Qwen2-VL's
# preprocessor_config.json (min/max pixels of the released checkpoint).
PRESETS["qwen2-vl-2b"] = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "image_token_id": 151655, "video_token_id": 151656,
    "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 8960, "max_position_embeddings": 32768,
    "max_window_layers": 28, "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_channels": 3, "hidden_size": 1536,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "quick_gelu",
    },
}
PRESET_FILES: dict[str, dict[str, dict[str, Any]]] = {
    "qwen2-vl-2b": {
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056,
            "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    },
    "llava-1.5-7b": {
        "preprocessor_config.json": {
            "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 336},
            "resample": 3, "do_center_crop": True, "crop_size": {"height": 336, "width": 336},
            "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True,
        },
    },
}


# ``--model demo``: the built-in demo model (pagelm.plugins.demo.model), e.g. to measure an EAGLE
# head trained for it by ``pagelm train-eagle``.
DEMO = "demo"


def default_presets_dir() -> Path:
    from pagelm.plugins.demo.model import default_cache_dir

    return default_cache_dir() / "presets"


def materialize(name: str, root: Path | None = None) -> Path:
    """The directory of preset ``name`` (``config.json`` only), written if missing or stale."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    path = (root or default_presets_dir()) / name
    for filename, content in {"config.json": PRESETS[name], **PRESET_FILES.get(name, {})}.items():
        text = json.dumps(content, indent=2, sort_keys=True) + "\n"
        target = path / filename
        if not target.exists() or target.read_text() != text:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / f".{filename}.{os.getpid()}.tmp"
            tmp.write_text(text)
            tmp.replace(target)  # atomic: concurrent benchmarks never read half a file
    return path


def resolve_bench_model(
    model: str, engine_kwargs: dict[str, Any], root: Path | None = None
) -> tuple[str, dict[str, Any]]:
    """``--model`` as a directory and the engine arguments to run it with: a preset name turns
    into its directory with random weights and no tokenizer (flags given explicitly win);
    ``demo`` into the built-in demo model's (trained weights and tokenizer; trained on first
    use)."""
    if model == DEMO:
        from pagelm.plugins.demo.model import ensure_demo_model

        return str(ensure_demo_model()), dict(engine_kwargs)
    if model in PRESETS:
        return str(materialize(model, root)), {"load_format": "dummy", "skip_tokenizer_init": True, **engine_kwargs}
    if not Path(model).expanduser().is_dir():
        raise SystemExit(
            f"--model {model!r} is neither a model directory nor a preset ({', '.join(PRESETS)}) nor {DEMO!r}"
        )
    return model, dict(engine_kwargs)
