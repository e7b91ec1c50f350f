"""The model-loader contract: where the model for a ``load_format`` lives (before the
tokenizer is read) and the built model on the engine core's device. The built-in loaders
(``auto``, ``safetensors``, ``dummy``) are ``pagelm.models.loader``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from pagelm.config import EngineConfig


class ModelLoader(ABC):
    @classmethod
    def resolve(cls, model: str) -> str:
        """The local directory holding ``model`` (config.json, tokenizer files). This default
        takes local directories only; a loader that downloads (the built-in ones fetch
        Hugging Face hub ids) overrides it."""
        path = Path(model).expanduser()
        if path.is_dir():
            return str(path)
        raise FileNotFoundError(
            f"model={model!r} is not a local model directory (expected config.json, *.safetensors "
            "and tokenizer files, as written by save_pretrained)"
        )

    @classmethod
    @abstractmethod
    def load(
        cls, config: EngineConfig, hf_config: PretrainedConfig, device: torch.device, dtype: torch.dtype
    ) -> nn.Module:
        """The model for the directory ``config.model``, built on ``device`` in ``dtype``, in
        eval mode; an error naming what is missing when it cannot be built."""
