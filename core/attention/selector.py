"""Choosing the attention backend: a named one is validated, ``"auto"`` takes the first in
``AUTO_ORDER`` that is registered and valid for this model, dtype and device."""

from __future__ import annotations

import logging

import torch

from pagelm.attention.backend import AttentionBackend, AttentionSpec

logger = logging.getLogger("pagelm")

# Best first. On an H200 (docs/benchmarks.md) triton decodes faster at batch 1 and 32 than
# flashinfer (which re-plans before every graph replay) and needs no JIT compile on a fresh
# machine; flashinfer wins large offline batches and is one config key away.
AUTO_ORDER = {"cuda": ("triton", "flashinfer", "torch"), "cpu": ("torch",)}


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
    for candidate in AUTO_ORDER.get(device.type, ("torch",)):
        if candidate not in registry:
            continue
        cls = registry.get(candidate)
        problems = cls.validate(config, spec, dtype, device)
        if not problems:
            logger.info("attention_backend=auto: using %r on %s", candidate, device.type)
            return cls
        tried.append(f"{candidate}: {'; '.join(problems)}")
    raise ValueError("attention_backend='auto' found no usable backend: " + " | ".join(tried))
