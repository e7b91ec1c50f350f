"""Loading Hugging Face checkpoint tensors into pagelm models, whose q/k/v and gate/up
projections are fused into one parameter each."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# checkpoint module name -> (fused module name, shard id in the fused parameter)
PACKED_MODULES_MAPPING: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one), casting dtype/device."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def load_packed_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: dict[str, tuple[str, str | int]] = PACKED_MODULES_MAPPING,
    skip: tuple[str, ...] = (),
) -> set[str]:
    """Load ``(name, tensor)`` pairs into ``model``; return the parameter names loaded.

    A name whose module (the component before ``.weight``/``.bias``) is in
    ``packed_modules_mapping`` goes to its shard of the fused parameter through that
    parameter's ``weight_loader(param, tensor, shard_id)``. Names containing any of ``skip``
    are ignored; any other name without a parameter is an error, since silently dropping a
    weight would leave random values in the model.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(s in name for s in skip):
            continue
        parts = name.split(".")
        shard_id = None
        if len(parts) >= 2 and parts[-2] in packed_modules_mapping:
            parts[-2], shard_id = packed_modules_mapping[parts[-2]]
        param_name = ".".join(parts)
        param = params.get(param_name)
        if param is None:
            raise KeyError(
                f"checkpoint weight {name!r} has no matching parameter in {type(model).__name__} "
                f"(looked for {param_name!r})"
            )
        weight_loader = getattr(param, "weight_loader", None)
        if weight_loader is not None:
            weight_loader(param, tensor, shard_id)
        else:
            assert shard_id is None, f"{param_name} is not a fused parameter"
            default_weight_loader(param, tensor)
        loaded.add(param_name)
    return loaded
