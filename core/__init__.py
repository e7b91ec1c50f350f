"""pagelm: a small-core, plugin-everything LLM inference engine.

The public API mirrors vLLM's offline API: ``LLM``, ``SamplingParams``, ``RequestOutput``.
"""

from pagelm.hookspecs import hookimpl
from pagelm.plugin_api import PLUGIN_API_VERSION
from pagelm.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("pagelm.llm", "LLM"),
    "EngineConfig": ("pagelm.config", "EngineConfig"),
    "RequestOutput": ("pagelm.outputs", "RequestOutput"),
    "CompletionOutput": ("pagelm.outputs", "CompletionOutput"),
    "Logprob": ("pagelm.outputs", "Logprob"),
    "AttentionBackend": ("pagelm.attention", "AttentionBackend"),
    "GraphSupport": ("pagelm.attention", "GraphSupport"),
    "SchedulingPolicy": ("pagelm.sched.policy", "SchedulingPolicy"),
    "RequestQueue": ("pagelm.sched.request_queue", "RequestQueue"),
    "StructuredOutputBackend": ("pagelm.structured_output", "StructuredOutputBackend"),
    "StructuredOutputManager": ("pagelm.structured_output", "StructuredOutputManager"),
    "Proposer": ("pagelm.spec_decode", "Proposer"),
    "SpeculativeConfig": ("pagelm.spec_decode", "SpeculativeConfig"),
    "get_plugin_manager": ("pagelm.plugin_manager", "get_plugin_manager"),
}


def __getattr__(name: str):
    # Heavy modules (transformers, the engine) load on first use, not on `import pagelm`,
    # so plugins importing `pagelm.hookimpl` stay cheap.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'pagelm' has no attribute {name!r}")


__all__ = [
    "PLUGIN_API_VERSION", "GuidedDecodingParams", "SamplingParams", "StructuredOutputsParams", "hookimpl", "__version__",
    *_LAZY,
]
