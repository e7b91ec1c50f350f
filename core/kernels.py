"""The fused-kernel registry: which function runs each of the core's fused kernels
(``pagelm_register_kernels``; the built-in Triton ones are ``pagelm.backends.kernels``).

An entry is a ``"module:function"`` reference imported on first call, so that registering
does not import Triton and a test can patch a kernel module first. A kernel nobody
registers is ``None`` here, and its caller runs the torch reference.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import pagelm.plugin_manager as plugin_manager

# The kernels the core looks up, with the call it makes (see each caller's reference path).
KERNELS = {
    "rms_norm": "rms_norm(x, weight, eps, residual) -> (normed, x + residual)  (pagelm.models.ops)",
    "rotary_embedding": "rotary_embedding(positions, q, k, cos_sin_cache, head_dim, rotary_dim, qk_norm=None)",
    "silu_and_mul": "silu_and_mul(x) -> silu(gate) * up",
    "gemv": "gemv(x, weight, bias, silu_input=False, norm=None, prefetch=None, all_reduce=None): one-row "
    "linear, optional prologues; prefetch (2.20, optional): the next projection's weight, a hint; "
    "all_reduce (2.21, optional): sum the output over two tensor-parallel ranks through these buffers",
    "apply_token_bitmask": "apply_token_bitmask(logits, bitmask, rows) in place  (pagelm.sample.bitmask)",
    "exponential_race": "exponential_race(logits, noise, temperature, bitmask) -> ids  (the sampler)",
    "derive_step_inputs": "derive_step_inputs(staging, block_table, input_ids, ...)  (decode graphs)",
    "draft_step_inputs": "draft_step_inputs(step ids, slots, seq_lens, last_index, next_token, real, ...) (2.25: "
    "a draft head's graph, before pass 1)",
    "draft_pass_inputs": "draft_pass_inputs(last_positions, max_drafts, block_table, ...) (2.25: a draft head's "
    "graph, before each pass after the first)",
    "gather_drafts": "gather_drafts(staging, source, out_of_vocab, *, sources_offset, num_tokens, vocab_size) (2.25: "
    "a verification graph's drafts kept on the device)",
}

# (plugin manager, its generation, {name: (module, function)}): looked up again when the set
# of plugins changes.
_cache: tuple[object, int, dict[str, tuple[str, str]]] | None = None


def fused_kernel(name: str) -> Callable | None:
    """The function registered as kernel ``name``, or None. Cheap enough per call: two
    attribute reads and a dict lookup once the table is built."""
    cache, manager = _cache, plugin_manager._manager
    if cache is None or cache[0] is not manager or cache[1] != manager.generation:
        cache = _load()
    ref = cache[2].get(name)
    if ref is None:
        return None
    module = sys.modules.get(ref[0]) or importlib.import_module(ref[0])
    return getattr(module, ref[1])


def _load() -> tuple[object, int, dict[str, tuple[str, str]]]:
    global _cache
    manager = plugin_manager.get_plugin_manager()
    registry = manager.collect("kernel")
    refs = {}
    for name in registry.names():
        ref = registry.get(name)
        module, _, function = ref.partition(":") if isinstance(ref, str) else ("", "", "")
        if not module or not function:
            raise ValueError(f"kernel {name!r} must be registered as 'module:function', got {ref!r}")
        refs[name] = (module, function)
    _cache = (manager, manager.generation, refs)
    return _cache
