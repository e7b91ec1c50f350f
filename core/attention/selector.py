"""Choosing the attention backend: a named one is validated; ``"auto"`` takes, among every
registered backend (third-party ones included), the one with the highest
``auto_priority`` for the device type whose ``validate`` finds no problem with this model,
dtype and device."""

from __future__ import annotations

import logging

import torch

from pagelm.attention.backend import AttentionBackend, AttentionSpec

logger = logging.getLogger("pagelm")


def select_attention_backend(
    config, registry, spec: AttentionSpec, dtype: torch.dtype, device: torch.device
) -> type[AttentionBackend]:
    name = config.attention_backend
    if name != "auto":
        cls = registry.get(name)  # unknown name: error listing the registered ones
        problems = cls.validate(config, spec, dtype, device)
        if problems:
            raise ValueError(f"attention_backend={name!r}: " + "; ".join(problems))
        return cls
    tried = []
    for cls in auto_candidates(registry, device):
        problems = cls.validate(config, spec, dtype, device)
        if not problems:
            logger.info("attention_backend=auto: using %r on %s", cls.name, device.type)
            return cls
        tried.append(f"{cls.name}: {'; '.join(problems)}")
    raise ValueError(
        f"attention_backend='auto' found no usable backend on {device.type}: " + (" | ".join(tried) or
        f"no registered backend declares an auto_priority for {device.type}")
    )


def auto_candidates(registry, device: torch.device) -> list[type[AttentionBackend]]:
    """The registered backends that ``auto`` may choose on ``device``, best first (ties by name)."""
    ranked = []
    for name in registry.names():
        cls = registry.get(name)
        priority = cls.auto_priority.get(device.type)
        if priority is not None:
            ranked.append((-priority, name, cls))
    return [cls for _, _, cls in sorted(ranked, key=lambda r: r[:2])]
