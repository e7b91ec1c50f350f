"""Pipeline-parallel helpers for the models: which decoder layers this stage holds, and the
placeholder standing where a layer (or the embedding, norm, LM head) lives on another stage.

A model split over stages keeps its module names (``model.layers.5`` stays ``model.layers.5``
on the stage that holds it), so the checkpoint's names still find their parameters and a
stage simply skips the weights of layers it does not hold.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagelm.distributed import parallel_state


def stage_layer_range(num_layers: int) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers this stage holds: an even split, the first
    ``num_layers % pp`` stages one layer more (the last stage also runs the LM head)."""
    state = parallel_state()
    pp, stage = state.pp_size, state.pp_rank
    if num_layers < pp:
        raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


class MissingLayer(nn.Module):
    """Stands where a module lives on another pipeline stage: no parameters, never run."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def held_by_this_stage(name: str, layer_range: tuple[int, int], first: bool, last: bool) -> bool:
    """Whether checkpoint weight ``name`` belongs to this stage (decoder layers by index; the
    embedding on the first stage; the final norm and LM head on the last)."""
    match = _LAYER_RE.search(name)
    if match is not None:
        return layer_range[0] <= int(match.group(1)) < layer_range[1]
    if "embed_tokens" in name:
        return first
    if name.startswith(("model.norm.", "lm_head.")):
        return last
    return True


def empty_intermediate(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Buffers for what the built-in models pass between stages: hidden states and residual."""
    return {
        "hidden_states": torch.empty(num_tokens, hidden_size, dtype=dtype, device=device),
        "residual": torch.empty(num_tokens, hidden_size, dtype=dtype, device=device),
    }
