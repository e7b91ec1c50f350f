"""Every pagelm hook. Plugins implement them with ``@pagelm.hookimpl``.

Registration hooks receive a registry and add named entries; lifecycle hooks fire once per
engine or once per request. None fires per token or per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pagelm.config import EngineConfig
    from pagelm.registry import Registry
    from pagelm.request import Request

hookspec = pluggy.HookspecMarker("pagelm")
hookimpl = pluggy.HookimplMarker("pagelm")


# ---------------------------------------------------------------------------------------------
# registration: called each time an engine resolves names, so late registrations are seen
# ---------------------------------------------------------------------------------------------


@hookspec
def pagelm_register_attention_backends(registry: "Registry") -> None:
    """Add ``AttentionBackend`` subclasses: ``registry.add(name, backend_cls)``. The name is
    what ``attention_backend=`` selects."""


@hookspec
def pagelm_register_scheduling_policies(registry: "Registry") -> None:
    """Add ``SchedulingPolicy`` subclasses: ``registry.add(name, policy_cls)``. The name is
    what ``scheduling_policy=`` selects."""


@hookspec
def pagelm_register_structured_output_backends(registry: "Registry") -> None:
    """Add ``StructuredOutputBackend`` subclasses (guided decoding libraries; a grammar
    library subclasses ``pagelm.plugins.structured_output.GrammarBackend``):
    ``registry.add(name, backend_cls)``. The name is what ``structured_output_backend=``
    selects."""


@hookspec
def pagelm_register_proposers(registry: "Registry") -> None:
    """Add speculative-decoding ``Proposer`` subclasses (usually of
    ``pagelm.plugins.spec_decode.DraftProposer``): ``registry.add(name, proposer_cls)``.
    The name is what ``speculative_config={"method": name}`` selects."""


@hookspec
def pagelm_register_models(registry: "Registry") -> None:
    """Add model classes keyed by the Hugging Face ``architectures`` name in config.json:
    ``registry.add("LlamaForCausalLM", cls)``."""


@hookspec
def pagelm_register_model_loaders(registry: "Registry") -> None:
    """Add ``ModelLoader`` subclasses (``pagelm.model_loader``) keyed by the ``load_format``
    names they serve: ``registry.add("safetensors", loader_cls)``."""


@hookspec
def pagelm_register_executors(registry: "Registry") -> None:
    """Add ``Executor`` subclasses (``pagelm.executor``): how the ranks beside the engine
    core's are started and reached; ``registry.add(name, executor_cls)``, the name is what
    ``distributed_executor_backend=`` selects (built in: ``uni``, ``mp``)."""


@hookspec
def pagelm_register_routers(registry: "Registry") -> None:
    """Add data-parallel ``Router`` subclasses (``pagelm.router``): which engine replica
    serves each new request; ``registry.add(name, router_cls)``, the name is what
    ``data_parallel_router=`` selects (built in: ``round_robin``, ``least_loaded``,
    ``prefix_affinity``)."""


@hookspec
def pagelm_register_data_parallel(registry: "Registry") -> None:
    """Add the class that runs ``data_parallel_size`` > 1 engine cores behind the one-core
    interface (``registry.add(name, cls)``; made as ``cls(config, eos_token_ids,
    core_factory)``). Exactly one may be registered (built in: ``replicas``)."""


@hookspec
def pagelm_register_tool_parsers(registry: "Registry") -> None:
    """Add ``ToolParser`` subclasses (``pagelm.tool_parser``): how the OpenAI server finds
    tool calls in a model's text; ``registry.add(name, parser_cls)``, the name is what
    ``pagelm serve --tool-call-parser`` selects (built in: ``hermes``, ``llama3_json``)."""


@hookspec
def pagelm_register_stat_loggers(registry: "Registry") -> None:
    """Add ``StatLogger`` subclasses (``pagelm.stat_logger``): what ``AsyncLLM`` hands each
    engine step's statistics to; ``registry.add(name, logger_cls)``. Every registered one is
    used (built in: ``prometheus``, ``logging``; ``PAGELM_DISABLE_PLUGINS`` leaves one out)."""


@hookspec
def pagelm_register_kv_offload(registry: "Registry") -> None:
    """Add ``KVOffload`` subclasses (``pagelm.kv_offload``): a second KV tier behind the GPU
    pool, for swap preemption and prefix spill; ``registry.add(name, offload_cls)``, the name
    is what ``kv_offload=`` selects when ``swap_space`` > 0 (built in: ``cpu``)."""


@hookspec
def pagelm_register_kernels(registry: "Registry") -> None:
    """Name the fused kernels behind the core's ops, sampler and decode graphs:
    ``registry.add("rms_norm", "pkg.module:function")``. The reference is imported on first
    use, not at registration (so registering does not import Triton). The names and the
    signatures the core calls are listed in ``pagelm.kernels.KERNELS``; a name nobody
    registers runs its torch reference."""


@hookspec
def pagelm_register_cli_commands(registry: "Registry") -> None:
    """Add ``pagelm`` subcommands: ``registry.add(name, add_parser)``, where
    ``add_parser(subparsers)`` adds the subcommand to an argparse subparsers object and sets
    its ``func(args) -> int``. Every built-in subcommand (``serve``, ``bench``, ``plugins``...)
    is added this way."""


# ---------------------------------------------------------------------------------------------
# lifecycle: once per engine or per request, never per token
# ---------------------------------------------------------------------------------------------


@hookspec
def pagelm_configure(config: "EngineConfig") -> None:
    """Called once when an engine is created, before the model is loaded; a plugin may read
    or adjust the config (e.g. its own ``plugin_config`` entries)."""


@hookspec
def pagelm_engine_started(engine: Any) -> None:
    """Called once the engine core has its model, KV cache and scheduler."""


@hookspec
def pagelm_request_finished(request: "Request", reason: str) -> None:
    """Called once per request when it leaves the engine (``reason``: stop, length, abort)."""


@hookspec
def pagelm_engine_shutdown(engine: Any) -> None:
    """Called once when the engine shuts down."""
