"""Tiny Hugging Face model directories built locally, for tests and demos.

Everything here works offline: the tokenizer is trained on Python's own standard library
sources, and the model weights come from a seeded random init. The directories look exactly
like hub checkpoints (config.json, safetensors, tokenizer files, generation_config.json), so the
engine's loaders are exercised on the same path as a real model.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order

# ChatML; with ``tools`` it renders them, the assistant's earlier calls and the tool results
# the way Qwen 2.5's template does (Hermes ``<tool_call>`` blocks). Without tools it renders
# exactly the plain ChatML turns.
CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\nCall one with <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant' }}{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\n<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else (call['function']['arguments'] | tojson) }}{{ '}\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response id=\"' + (message.get('tool_call_id') or '') + '\">\n' "
    "+ message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed, sorted list of stdlib sources: the corpus (and so the vocab) is the same every run.
# Files missing from a given Python build are skipped, so the vocab is stable per interpreter.
CORPUS_FILES = sorted([
    "bisect.py",
    "colorsys.py",
    "fnmatch.py",
    "heapq.py",
    "json/decoder.py",
    "json/encoder.py",
    "shlex.py",
    "string.py",
    "textwrap.py",
])

# Multi-byte UTF-8 (2, 3 and 4 byte sequences), repeated so BPE learns merges inside them
# rather than leaving every such character as raw byte tokens.
MULTIBYTE_LINES = [
    "Café crème, naïve façade, Straße, Ærø, smørrebrød, jalapeño.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji: 🙂 🚀 🎉 👍🏽 ❤️ — “quotes” and ‘more’ … ±∞ ≤ ≥ ≠ €",
]

ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS_FILES if (stdlib / name).is_file()]
    return texts + MULTIBYTE_LINES * 50


def train_bpe_tokenizer(texts: list[str], vocab_size: int, split_pattern: str | None = None) -> Tokenizer:
    """The one tiny-tokenizer builder (tests, the demo model): byte-level BPE trained on
    ``texts``, with the ChatML specials. ``split_pattern``: a regex that pre-splits the text
    (the demo model's code-aware pieces) instead of GPT-2's byte-level regex."""
    tokenizer = Tokenizer(models.BPE())
    if split_pattern is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # The full byte alphabet guarantees any UTF-8 text encodes, whatever the corpus holds.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def chatml_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """``tokenizer`` as a Hugging Face tokenizer with the ChatML specials and chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # Written as an explicit null: AutoTokenizer loads qwen2 dirs as Qwen2Tokenizer, whose
        # default unk "<|endoftext|>" would otherwise be added as token 512, past the model vocab.
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
    )


@functools.lru_cache(maxsize=None)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train once per vocab size per process; kept as JSON so every caller gets a fresh object."""
    return train_bpe_tokenizer(_corpus(), vocab_size).to_str()


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train (or reuse) a byte-level BPE tokenizer with ChatML specials and save it to ``out_dir``."""
    tokenizer = chatml_tokenizer(Tokenizer.from_str(_trained_tokenizer_json(vocab_size)))
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def _tiny_config(arch: str, tokenizer: PreTrainedTokenizerFast, dtype: torch.dtype, overrides: dict[str, Any]) -> PretrainedConfig:
    config_cls, _ = ARCHS[arch]
    kwargs: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # The default 0.02 makes a 2-layer random model collapse onto one token under greedy
        # decoding; a wider init gives varied outputs, which tests of sampling need.
        initializer_range=0.1,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32  # deliberately != hidden / heads, as in real Qwen3 checkpoints
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    config.dtype = dtype
    return config


def _shard_size(model: PreTrainedModel) -> int:
    """A shard size that splits the checkpoint into a handful of files."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return max(total // 4, largest)


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tokenizer_vocab_size: int = 512,
    **config_overrides: Any,
) -> Path:
    """Write a randomly initialised ``arch`` checkpoint, its tokenizer and generation config to ``out_dir``.

    ``config_overrides`` go straight into the HF config (e.g. ``tie_word_embeddings=True``,
    ``sliding_window=16``). Same arguments -> byte-identical weights.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, tokenizer_vocab_size)
    config = _tiny_config(arch, tokenizer, dtype, config_overrides)

    torch.manual_seed(seed)
    model = ARCHS[arch][1](config).to(dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    max_shard_size = _shard_size(model) if sharded else "1GB"
    model.save_pretrained(out, max_shard_size=max_shard_size)
    # save_pretrained skips generation_config.json when it equals the model defaults; engines
    # read EOS from it, so always write it.
    model.generation_config.save_pretrained(out)
    return out


_TINY_DIRS: dict[tuple, Path] = {}


def tiny_model_dir(arch: str, tmp_root: str | Path, **kw: Any) -> Path:
    """Build ``build_tiny_model(arch, **kw)`` under ``tmp_root`` once per process and reuse it.

    Meant for a session-scoped pytest fixture: pass ``tmp_path_factory.getbasetemp()``.
    """
    key = (arch, str(tmp_root), tuple(sorted((k, repr(v)) for k, v in kw.items())))
    path = _TINY_DIRS.get(key)
    if path is None or not (path / "config.json").is_file():
        digest = hashlib.sha1(repr(key).encode()).hexdigest()[:10]
        path = build_tiny_model(Path(tmp_root) / f"tiny-{arch}-{digest}", arch, **kw)
        _TINY_DIRS[key] = path
    return path


# --------------------------------------------------------------------------------------------
# Vision-language model
# --------------------------------------------------------------------------------------------

IMAGE_TOKEN = "<image>"


def random_image(seed: int, height: int, width: int) -> "Image.Image":
    """An RGB image of seeded random pixels (a test's image input; its content is irrelevant)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def build_tiny_llava(out_dir: str | Path, *, seed: int = 0, image_size: int = 28, patch_size: int = 7,
                     dtype: torch.dtype = torch.float32) -> Path:
    """A random LLaVA checkpoint: a 3-layer CLIP vision tower (``image_size / patch_size``
    squared embeddings per image, 16 by default), the projector, a 2-layer Llama; its tokenizer
    has ``<image>`` as a special token, and ``preprocessor_config.json`` is CLIP's image
    processor at ``image_size``."""
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = chatml_tokenizer(Tokenizer.from_str(_trained_tokenizer_json(512)))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.save_pretrained(str(out))
    text_config = _tiny_config("llama", tokenizer, dtype, {})
    vision_config = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        image_size=image_size, patch_size=patch_size, projection_dim=32, initializer_range=0.1,
    )
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
    )
    config.dtype = dtype
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
    ).save_pretrained(str(out))
    return out


VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
# One image in a Qwen2-VL prompt, as its chat template writes it.
QWEN2_VL_IMAGE = VISION_START + IMAGE_PAD + VISION_END


def build_tiny_qwen2_vl(out_dir: str | Path, *, seed: int = 0, patch_size: int = 7,
                        min_pixels: int = 28 * 28, max_pixels: int = 14 * 14 * 20,
                        dtype: torch.dtype = torch.float32, **config_overrides: Any) -> Path:
    """A random Qwen2-VL checkpoint: a 2-block vision transformer (``patch_size`` 7, 2 x 2
    merge: one embedding per 14 x 14 pixels, images resized to 4 .. 20 of them), a 2-layer
    Qwen2 with M-RoPE (``mrope_section`` [2, 3, 3] of 8 frequencies); its tokenizer has
    Qwen2-VL's vision specials, and ``preprocessor_config.json`` is Qwen2-VL's image processor
    with those pixel bounds. ``config_overrides`` go into ``Qwen2VLConfig`` (e.g.
    ``tie_word_embeddings=True``, as Qwen2-VL-2B has)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = chatml_tokenizer(Tokenizer.from_str(_trained_tokenizer_json(512)))
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    tokenizer.save_pretrained(str(out))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    text_config = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=512, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    vision_config = dict(
        depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=patch_size,
        spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.1,
    )
    config = Qwen2VLConfig(
        text_config=text_config, vision_config=vision_config, image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        **config_overrides,
    )
    config.dtype = dtype
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size, merge_size=2, temporal_patch_size=2,
    ).save_pretrained(str(out))
    return out
