"""``preemption_mode="auto"``: swap a victim out when copying its KV out and back costs less
time than recomputing it::

    copy      = 2 x blocks to copy x block bytes / copy bandwidth      (out now, in later)
    recompute = tokens not in the prefix cache x flops per token / device flops

Both rates are rough on purpose (the choice only has to be right where they differ by a lot);
``plugin_config={"kv_offload": {"copy_bytes_per_s": ..., "device_flops": ...}}`` sets them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Pinned host <-> H100 over PCIe 5 (what cudaMemcpyAsync reaches in practice) and a bf16
# prefill's effective throughput; on the CPU a memcpy and a few cores' matmuls.
_DEFAULTS = {
    "cuda": {"copy_bytes_per_s": 25e9, "device_flops": 300e12},
    "cpu": {"copy_bytes_per_s": 5e9, "device_flops": 1e11},
}


@dataclass(frozen=True)
class SwapCost:
    block_bytes: int
    flops_per_token: float
    copy_bytes_per_s: float
    device_flops: float

    @classmethod
    def for_device(cls, device_type: str, block_bytes: int, flops_per_token: float, overrides: dict) -> "SwapCost":
        rates = {**_DEFAULTS.get(device_type, _DEFAULTS["cpu"]), **overrides}
        return cls(block_bytes, flops_per_token, float(rates["copy_bytes_per_s"]), float(rates["device_flops"]))

    def swap_is_cheaper(self, num_copy_blocks: int, num_recompute_tokens: int) -> bool:
        copy_s = 2 * num_copy_blocks * self.block_bytes / self.copy_bytes_per_s
        recompute_s = num_recompute_tokens * self.flops_per_token / self.device_flops
        return copy_s < recompute_s
