"""The built-in model loaders (``ModelLoader``, ``pagelm.model_loader``): the architecture
looked up in the model registry, weights from one ``model.safetensors`` or the shards listed in
``model.safetensors.index.json`` (``auto``, ``safetensors``), or random (``dummy``). Both take
hub ids as well as local directories (``pagelm.models.hub``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig

from pagelm.config import EngineConfig
from pagelm.model_loader import ModelLoader
from pagelm.models.hub import resolve_model
from pagelm.models.layers import link_weight_prefetch
from pagelm.plugin_manager import get_plugin_manager


class SafetensorsLoader(ModelLoader):
    """``load_format`` ``auto`` and ``safetensors``: the checkpoint's weights."""

    @classmethod
    def resolve(cls, model: str) -> str:
        return resolve_model(model)

    @classmethod
    def load(cls, config: EngineConfig, hf_config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
        path = Path(config.model).expanduser()
        model = _build(hf_config, device, dtype)
        loaded = model.load_weights(iterate_weights(path))
        # named_parameters() lists a tied lm_head once, under the embedding's name.
        missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
        if missing:
            raise ValueError(f"weights missing from {path}: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        link_weight_prefetch(model)
        return model.eval()


class DummyLoader(SafetensorsLoader):
    """``load_format="dummy"``: random weights of the config's shapes, for benchmarks."""

    @classmethod
    def load(cls, config: EngineConfig, hf_config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
        model = _build(hf_config, device, dtype)
        _init_dummy(model, seed=config.seed)
        link_weight_prefetch(model)
        return model.eval()


def model_class_for(hf_config: PretrainedConfig) -> type[nn.Module]:
    registry = get_plugin_manager().collect("model architecture")
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in registry:
            return registry.get(arch)
    raise ValueError(
        f"model architecture(s) {archs} are not supported; registered: {', '.join(registry.names())}"
    )


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters created inside are ``dtype`` (the model is built directly in it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (use load_format='dummy' for random weights)")
    return files


def iterate_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_tensor(path: Path, name: str) -> torch.Tensor | None:
    """One tensor of the checkpoint at ``path`` by name (read alone, the rest never loaded);
    None when no shard has it."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return None


def _build(hf_config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    cls = model_class_for(hf_config)
    with torch.device(device), default_dtype(dtype):
        return cls(hf_config)


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights with the config's shapes (benchmarks): small uniform values keep
    activations finite in any dtype. Drawn on the parameters' own device (an 8B model in
    seconds on a GPU) from one seeded generator, so a seed gives the same model every run."""
    gens: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        param.uniform_(-1e-3, 1e-3, generator=gen)
