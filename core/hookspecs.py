"""Every pagelm hook (docs/plugins.md describes each). Plugins implement them with
``@pagelm.hookimpl``. None fires per token or per step, and none is ``firstresult``."""

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


@hookspec(historic=True)
def pagelm_add_plugin_kinds(plugin_manager: Any) -> None:
    """Called as each plugin is registered (pytest's ``pytest_addhooks``): a plugin that owns a
    plugin kind of its own adds it with ``plugin_manager.add_kind(kind, hookspecs, hook_name,
    base)`` (the data-parallel routers, the tool-call parsers); other plugins then register
    entries of that kind through ``hook_name`` like any other."""


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
    """Add guided-decoding ``StructuredOutputBackend`` subclasses: ``registry.add(name,
    backend_cls)``. The name is what ``structured_output_backend=`` selects."""


@hookspec
def pagelm_register_proposers(registry: "Registry") -> None:
    """Add speculative-decoding ``Proposer`` subclasses: ``registry.add(name, proposer_cls)``.
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
    """Add ``Executor`` subclasses (how the ranks beside the engine core's are started):
    ``registry.add(name, executor_cls)``. The name is what ``distributed_executor_backend=``
    selects."""


@hookspec
def pagelm_register_data_parallel(registry: "Registry") -> None:
    """Add the class that runs ``data_parallel_size`` > 1 engine cores behind the one-core
    interface: ``registry.add(name, cls)``. Exactly one may be registered."""


@hookspec
def pagelm_register_stat_loggers(registry: "Registry") -> None:
    """Add ``StatLogger`` subclasses: ``registry.add(name, logger_cls)``. ``AsyncLLM`` hands
    each engine step's statistics to every registered one."""


@hookspec
def pagelm_register_kv_offload(registry: "Registry") -> None:
    """Add ``KVOffload`` subclasses (a second KV tier behind the GPU pool):
    ``registry.add(name, offload_cls)``. The name is what ``kv_offload=`` selects when
    ``swap_space`` > 0."""


@hookspec
def pagelm_register_kernels(registry: "Registry") -> None:
    """Name the fused kernels behind the core's ops, sampler and decode graphs:
    ``registry.add("rms_norm", "pkg.module:function")``, imported on first use. The names and
    signatures are ``pagelm.kernels.KERNELS``; a name nobody registers runs its reference."""


@hookspec
def pagelm_register_cli_commands(registry: "Registry") -> None:
    """Add ``pagelm`` subcommands: ``registry.add(name, add_parser)``, where
    ``add_parser(subparsers)`` adds the subcommand and sets its ``func(args) -> int``."""


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
