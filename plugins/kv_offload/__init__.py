"""The built-in second KV tier, ``cpu``: host memory behind the GPU pool for swap preemption
and prefix spill (``swap_space`` GiB; see docs/kv_offload.md)."""

from __future__ import annotations

import torch

from pagelm import hookimpl
from pagelm.config import EngineConfig
from pagelm.kv_offload import KVCopier, KVOffload, KVOffloadTier

PAGELM_PLUGIN_API = "2.25"


class CPUOffload(KVOffload):
    name = "cpu"

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        rates = config.plugin_config.get("kv_offload", {})
        if not isinstance(rates, dict):
            return [f"plugin_config['kv_offload'] must be a mapping, got {rates!r}"]
        unknown = sorted(set(rates) - {"copy_bytes_per_s", "device_flops"})
        if unknown:
            return [f"plugin_config['kv_offload'] has unknown keys {unknown}; known: copy_bytes_per_s, device_flops"]
        bad = [k for k, v in rates.items() if not (isinstance(v, (int, float)) and v > 0)]
        return [f"plugin_config['kv_offload'][{k!r}] must be a number > 0, got {rates[k]!r}" for k in bad]

    @classmethod
    def make_tier(cls, config: EngineConfig, num_blocks: int, block_bytes: int, flops_per_token: float) -> KVOffloadTier:
        from pagelm.plugins.kv_offload.cost import SwapCost
        from pagelm.plugins.kv_offload.tier import CPUTier

        device_type = config.resolved_device().type
        cost = SwapCost.for_device(device_type, block_bytes, flops_per_token, config.plugin_config.get("kv_offload", {}))
        return CPUTier(num_blocks, config.block_size, block_bytes, cost)

    @classmethod
    def make_copier(cls, config: EngineConfig, num_blocks: int, kv_caches: list[torch.Tensor], block_dim: int) -> KVCopier:
        from pagelm.plugins.kv_offload.copier import CPUCopier

        return CPUCopier(num_blocks, kv_caches, block_dim)


@hookimpl
def pagelm_register_kv_offload(registry) -> None:
    registry.add(CPUOffload.name, CPUOffload)
