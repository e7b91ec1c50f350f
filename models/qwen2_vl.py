"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): a vision transformer for images of any
size (``pagelm.models.qwen2_vl_vision``) and a Qwen2 language model with M-RoPE.

An image of ``h x w`` patches (after ``Qwen2VLImageProcessor``'s resize between
``min_pixels`` and ``max_pixels``) becomes ``h * w / merge**2`` embeddings; the prompt's
``<|image_pad|>`` (between ``<|vision_start|>`` and ``<|vision_end|>``) is expanded to that
many placeholders. M-RoPE gives each token three positions (temporal, height, width)::

    tokens     | text: 0 1 2 | image 2 x 3 merged patches        | text           |
    temporal   |  0 1 2      | 3 3 3 3 3 3                       | 6 7 ...        |
    height     |  0 1 2      | 3 3 3 4 4 4                       | 6 7 ...        |
    width      |  0 1 2      | 3 4 5 3 4 5                       | 6 7 ...        |

Text after an image continues from the image's largest position + 1, so a token past the
prompt sits at its index + ``delta`` (``delta = max position + 1 - prompt length``, <= 0).
The runner asks ``get_input_positions`` once per request (``pagelm.multimodal.RequestPositions``)
and feeds ``[3, n]`` positions to steps covering a prompt with images, ``[n]`` otherwise.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pagelm.models.layers import MRotaryEmbedding
from pagelm.models.qwen2 import Qwen2Attention, Qwen2ForCausalLM
from pagelm.models.qwen2_vl_vision import Qwen2VisionTransformer
from pagelm.models.vlm import LanguageModelDelegate
from pagelm.models.weights import default_weight_loader
from pagelm.multimodal import MultiModalFeature, MultiModalProcessor, RequestPositions, SupportsMultiModal


class Qwen2VLProcessor(MultiModalProcessor):
    """The checkpoint's ``Qwen2VLImageProcessor`` (``preprocessor_config.json``: resize to
    multiples of ``patch_size * merge_size`` within ``min_pixels .. max_pixels``, normalise,
    patchify) and one ``<|image_pad|>`` per merged patch."""

    def __init__(self, model_dir: Path, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer)
        from transformers import Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        vision = hf_config.vision_config
        self.merge_size = vision.spatial_merge_size
        if (self.image_processor.merge_size, self.image_processor.patch_size) != (self.merge_size, vision.patch_size):
            raise ValueError(
                f"preprocessor_config.json (merge_size {self.image_processor.merge_size}, patch_size "
                f"{self.image_processor.patch_size}) does not match the vision tower ({self.merge_size}, {vision.patch_size})"
            )
        self._token_id = hf_config.image_token_id
        if tokenizer is not None:
            start, pad, end = tokenizer.convert_ids_to_tokens(
                [hf_config.vision_start_token_id, self._token_id, hf_config.vision_end_token_id]
            )
            self.placeholder_text = start + pad + end  # what Qwen2-VL's chat template writes per image
        else:
            self.placeholder_text = "<|vision_start|><|image_pad|><|vision_end|>"

    @property
    def placeholder_token_id(self) -> int:
        return self._token_id

    def preprocess(self, image) -> dict[str, torch.Tensor]:
        out = self.image_processor(images=[image], return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"][0].long()}

    def num_embeddings(self, data: dict[str, torch.Tensor]) -> int:
        return int(data["image_grid_thw"].prod()) // self.merge_size**2

    def dummy_inputs(self, num_embeddings: int) -> list[dict[str, torch.Tensor]]:
        """Images as large as ``max_pixels`` allows (near-square grids of merged patches)
        until ``num_embeddings`` are made; the last one takes what is left."""
        vision, m = self.hf_config.vision_config, self.merge_size
        size = self.image_processor.size
        max_pixels = getattr(self.image_processor, "max_pixels", None) or size["longest_edge"]
        largest = max(1, max_pixels // (vision.patch_size * m) ** 2)
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        out = []
        while num_embeddings > 0:
            n = min(num_embeddings, largest)
            h = math.isqrt(n)
            w = n // h
            out.append({
                "pixel_values": torch.zeros(h * w * m * m, patch_dim),
                "image_grid_thw": torch.tensor([1, h * m, w * m]),
            })
            num_embeddings -= h * w
        return out


def mrope_positions(
    num_tokens: int, features: list[MultiModalFeature], merge_size: int
) -> tuple[np.ndarray, int]:
    """``([3, num_tokens] int64, delta)``: each token's (temporal, height, width) position,
    as Hugging Face's ``get_rope_index`` lays them out, and the shift of the tokens after."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    next_pos, text_start = 0, 0  # the next text position; where the text before an image starts
    for f in features:
        n = f.offset - text_start
        out[:, text_start : f.offset] = np.arange(next_pos, next_pos + n)
        next_pos += n
        t, h, w = (int(x) for x in f.data["image_grid_thw"])
        h, w = h // merge_size, w // merge_size
        grid = np.indices((t, h, w)).reshape(3, -1)
        assert grid.shape[1] == f.length, f"image {f.identifier}: {grid.shape[1]} positions != {f.length} placeholders"
        out[:, f.offset : f.end] = grid + next_pos
        next_pos += max(h, w)
        text_start = f.end
    out[:, text_start:] = np.arange(next_pos, next_pos + num_tokens - text_start)
    next_pos += num_tokens - text_start
    return out, next_pos - num_tokens


class Qwen2VLAttention(Qwen2Attention):
    rotary_cls = MRotaryEmbedding


class Qwen2VLLanguageModel(Qwen2ForCausalLM):
    """Qwen2 with M-RoPE: ``positions`` is ``[n]`` or ``[3, n]`` (``MRotaryEmbedding``)."""

    attention_cls = Qwen2VLAttention


class Qwen2VLForConditionalGeneration(LanguageModelDelegate, nn.Module, SupportsMultiModal):
    multimodal_processor = Qwen2VLProcessor
    position_rows = 3

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text_config = copy.copy(config.text_config)
        # transformers 5 keeps the tie on the outer config (Qwen2-VL-2B ties, 7B does not).
        text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.visual = Qwen2VisionTransformer(config.vision_config)
        self.language_model = Qwen2VLLanguageModel(text_config)
        self.merge_size = config.vision_config.spatial_merge_size

    def get_multimodal_embeddings(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """All the images through the tower at once (each attends only to itself)."""
        grids = [tuple(int(x) for x in f.data["image_grid_thw"]) for f in features]
        pixels = torch.cat([f.data["pixel_values"] for f in features])
        embeds = self.visual(pixels, grids)
        return list(embeds.split([f.length for f in features]))

    def get_input_positions(self, num_prompt_tokens: int, features: list[MultiModalFeature]) -> RequestPositions:
        positions, delta = mrope_positions(num_prompt_tokens, features, self.merge_size)
        return RequestPositions(positions, delta)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names of both layouts: transformers 5's ``model.visual.*``,
        ``model.language_model.*``, ``lm_head.*``, and the hub's older ``visual.*``,
        ``model.*`` (the language model), ``lm_head.*``."""
        params = dict(self.named_parameters())
        language, loaded = [], set()
        for name, tensor in weights:
            name = name.removeprefix("model.") if name.startswith("model.visual.") else name
            if not name.startswith("visual."):
                language.append((name.replace("model.language_model.", "model.", 1), tensor))
                continue
            if name not in params:
                raise KeyError(f"checkpoint weight {name!r} has no matching parameter in Qwen2-VL's vision tower")
            default_weight_loader(params[name], tensor)
            loaded.add(name)
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(language)}
        return loaded
