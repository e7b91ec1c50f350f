"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and
a Llama-family language model.

An image becomes ``(image_size / patch_size)**2`` embeddings (the class token dropped, with
``vision_feature_select_strategy="default"``), the hidden states of one vision layer
(``vision_feature_layer``, -2 for LLaVA-1.5) through the projector; the prompt's ``<image>``
token is expanded to that many placeholder positions (``LlavaProcessor``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from pagelm.multimodal import MultiModalFeature, MultiModalProcessor, SupportsMultiModal
from pagelm.models.clip import CLIPVisionTower, feature_layer_count
from pagelm.models.llama import LlamaForCausalLM, MistralForCausalLM
from pagelm.models.qwen2 import Qwen2ForCausalLM
from pagelm.models.vlm import LanguageModelDelegate
from pagelm.models.weights import default_weight_loader

# text_config.model_type -> the language model
_LANGUAGE_MODELS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}


class LlavaProcessor(MultiModalProcessor):
    """The checkpoint's own image processor (``preprocessor_config.json``: CLIP's resize,
    center crop and normalisation) and one ``<image>`` placeholder per embedding."""

    def __init__(self, model_dir: Path, hf_config: Any, tokenizer: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer)
        from transformers import CLIPImageProcessorPil

        self.image_processor = CLIPImageProcessorPil.from_pretrained(str(model_dir))
        self._token_id = _image_token_id(hf_config)
        if tokenizer is not None:
            self.placeholder_text = tokenizer.convert_ids_to_tokens(self._token_id)
        self.patch_size = hf_config.vision_config.patch_size
        self.with_cls = hf_config.vision_feature_select_strategy == "full"
        self.image_size = hf_config.vision_config.image_size

    @property
    def placeholder_token_id(self) -> int:
        return self._token_id

    def preprocess(self, image) -> dict[str, torch.Tensor]:
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
        return {"pixel_values": pixels.float()}

    def num_embeddings(self, data: dict[str, torch.Tensor]) -> int:
        h, w = data["pixel_values"].shape[-2:]
        return (h // self.patch_size) * (w // self.patch_size) + self.with_cls


    def dummy_inputs(self, num_embeddings: int) -> list[dict[str, torch.Tensor]]:
        """As many images as fit: every image is the tower's ``image_size`` square."""
        per_image = (self.image_size // self.patch_size) ** 2 + self.with_cls
        pixels = torch.zeros(3, self.image_size, self.image_size)
        return [{"pixel_values": pixels} for _ in range(num_embeddings // per_image)]


def _image_token_id(hf_config) -> int:
    token_id = getattr(hf_config, "image_token_id", None)
    return token_id if token_id is not None else hf_config.image_token_index


class LlavaProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        text_hidden = config.text_config.hidden_size
        self.linear_1 = nn.Linear(config.vision_config.hidden_size, text_hidden, bias=bias)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LanguageModelDelegate, nn.Module, SupportsMultiModal):
    multimodal_processor = LlavaProcessor

    def __init__(self, config) -> None:
        super().__init__()
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError("vision_feature_layer must be one layer index (lists of layers are not supported)")
        if config.vision_config.model_type not in ("clip_vision_model", "clip"):
            raise ValueError(f"LLaVA's vision tower must be CLIP, got {config.vision_config.model_type!r}")
        text_type = config.text_config.model_type
        if text_type not in _LANGUAGE_MODELS:
            raise ValueError(f"LLaVA's language model must be one of {sorted(_LANGUAGE_MODELS)}, got {text_type!r}")
        self.config = config
        self.select_cls = config.vision_feature_select_strategy == "full"
        self.vision_tower = CLIPVisionTower(
            config.vision_config, feature_layer_count(config.vision_config, config.vision_feature_layer)
        )
        self.multi_modal_projector = LlavaProjector(config)
        self.language_model = _LANGUAGE_MODELS[text_type](config.text_config)

    def get_multimodal_embeddings(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Images of one size (CLIP crops them all alike) go through the tower as one batch."""
        device = self.multi_modal_projector.linear_1.weight.device
        pixels = torch.stack([f.data["pixel_values"] for f in features]).to(device)
        hidden = self.vision_tower(pixels)
        if not self.select_cls:
            hidden = hidden[:, 1:]
        return list(self.multi_modal_projector(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint names of both layouts (transformers 5's ``model.vision_tower.*``,
        ``model.language_model.*``, and the older ``vision_tower.vision_model.*``,
        ``language_model.model.*``); vision layers past the feature layer are skipped."""
        params = dict(self.named_parameters())
        language, loaded = [], set()
        for name, tensor in weights:
            if name.startswith("model.") and not name.startswith("model.language_model."):
                name = name.removeprefix("model.")
            if name.startswith(("model.language_model.", "language_model.", "lm_head.")):
                name = name.replace("model.language_model.", "model.", 1).replace("language_model.", "", 1)
                language.append((name, tensor))
                continue
            name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
            name = name.replace("vision_tower.encoder.layers.", "vision_tower.layers.", 1)
            if name not in params:
                if name.startswith("vision_tower.") and ("post_layernorm" in name or ".layers." in name
                                                          or "position_ids" in name):
                    continue  # layers past the feature layer; the unused post-norm
                raise KeyError(f"checkpoint weight {name!r} has no matching parameter in LLaVA")
            default_weight_loader(params[name], tensor)
            loaded.add(name)
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(language)}
        return loaded
