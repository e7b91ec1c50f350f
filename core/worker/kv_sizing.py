"""How many KV blocks the engine's pool has: each rank works out what its own memory holds
for its own layers (a pipeline stage holds some of the layers, the last one the LM head and
the sampler's logits too), and every rank takes the minimum over all of them, since every
rank allocates the same block ids::

    stage 0: (budget - its peak) // its block bytes = 900  --+
    stage 1: (budget - its peak) // its block bytes = 700  --+-- min over the ranks = 700 everywhere
"""

from __future__ import annotations

import logging

import torch

from pagelm.distributed import min_over_ranks
from pagelm.kv_cache import cdiv

logger = logging.getLogger("pagelm")

# Decode graphs allocate their activations from a private pool, outside the profiled peak.
CUDA_GRAPH_RESERVE = 512 << 20
# More memory than a CUDA context takes held outside torch's allocator: other processes, most
# likely, and they count against ``gpu_memory_utilization`` (worth a warning).
FOREIGN_MEMORY_WARNING = 2 << 30


def num_kv_blocks(config, runner, layers, max_model_len: int) -> int:
    """The pool's size, the same on every rank (a collective: every rank calls it at once)."""
    return min_over_ranks(this_rank_kv_blocks(config, runner, layers, max_model_len), runner.device)


def kv_block_bytes(layers, block_size: int, dtype: torch.dtype) -> int:
    """One block of every layer in ``layers`` (this rank's: its stage's layers, its heads)."""
    return sum(2 * l.spec.num_kv_heads * l.spec.head_dim for l in layers) * dtype.itemsize * block_size


def this_rank_kv_blocks(config, runner, layers, max_model_len: int) -> int:
    """What this rank's memory holds for its layers. On CUDA: its share of the card, minus
    what a worst-case step needs (weights, activations, the sampler's logits: measured by a
    profiling forward pass, which every rank runs together), minus memory that is not torch's
    (CUDA context, other processes), minus room for the decode graphs, minus a
    vision-language model's full encoder cache (its encoder's activations are in the peak:
    the profiling pass runs it too). On the CPU:
    ``cpu_kv_cache_space``, at most what ``max_num_seqs`` full sequences need."""
    per_block = kv_block_bytes(layers, config.block_size, runner.dtype)
    device = runner.device
    if device.type == "cuda":
        peak = runner.profile_run()
        free, total = torch.cuda.mem_get_info(device)
        graphs = CUDA_GRAPH_RESERVE if not config.enforce_eager else 0
        return kv_blocks_in_budget(
            total, free, torch.cuda.memory_reserved(device), peak, config.gpu_memory_utilization, graphs, per_block,
            runner.encoder_cache_bytes(),
        )
    needed = config.max_num_seqs * cdiv(max_model_len, config.block_size)
    return max(1, min(config.cpu_kv_cache_space // per_block, needed))


def kv_blocks_in_budget(
    total: int, free: int, reserved: int, peak: int, utilization: float, graphs: int, per_block: int,
    encoder_cache: int = 0,
) -> int:
    """Blocks of ``per_block`` bytes that fit a card of ``total`` bytes (``free`` of them free,
    ``reserved`` held by torch's allocator) after a step peaking at ``peak``, ``graphs``
    for CUDA graphs and ``encoder_cache`` for a full encoder cache (allocated later, like
    the graphs), using at most ``utilization`` of the card."""
    not_torch = total - free - reserved
    if not_torch > FOREIGN_MEMORY_WARNING:
        logger.warning(
            "KV sizing: %.2f GiB of this GPU is held outside this process's torch allocator "
            "(CUDA context, other processes); it counts against gpu_memory_utilization=%.2f",
            not_torch / 2**30, utilization,
        )
    later = graphs + encoder_cache
    budget = min(total * utilization - peak - not_torch - later, free - later)
    logger.info(
        "KV sizing: %.2f GiB total, peak step %.2f GiB, non-torch %.2f GiB%s -> KV %.2f GiB",
        total / 2**30, peak / 2**30, not_torch / 2**30,
        f", encoder cache {encoder_cache / 2**30:.2f} GiB" if encoder_cache else "", max(budget, 0) / 2**30,
    )
    return max(int(budget // per_block), 0)
