"""Loads plugins from the ``pagelm.plugins`` entry-point group, once per process, and
answers "which class is called X" for every plugin kind. The loading rules
(``PAGELM_DISABLE_PLUGINS``, ``PAGELM_PLUGINS``, ``PAGELM_DISABLE_PLUGIN_AUTOLOAD``, the
plugin API check) are in docs/plugins.md, "Packaging and enabling".
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
import warnings
from dataclasses import dataclass, replace
from typing import Any

import pluggy

from pagelm import hookspecs
from pagelm.plugin_api import PLUGIN_API_ATTRIBUTE, PLUGIN_API_VERSION, api_incompatibility, declared_api_version
from pagelm.registry import PluginError, Registry, UnknownNameError

logger = logging.getLogger("pagelm")

ENTRY_POINT_GROUP = "pagelm.plugins"
BUILTIN_DISTRIBUTION = "pagelm"
IN_PROCESS = "(in-process)"


class PluginLoadError(PluginError):
    """A plugin entry point could not be imported or registered."""


@dataclass(frozen=True)
class PluginInfo:
    name: str
    module: str
    distribution: str
    version: str
    # PAGELM_PLUGIN_API as declared (None: not declared).
    api_version: str | None = None

    @property
    def builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION


class PluginManager:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("pagelm")
        self.pm.add_hookspecs(hookspecs)
        self.loaded: dict[str, PluginInfo] = {}
        # Entry points found but not loaded: name -> (info, why). Filled by
        # ``load_entry_points(strict=False)`` with errors, and always with skipped plugins.
        self.not_loaded: dict[str, tuple[PluginInfo, str]] = {}
        self._entry_points_loaded = False
        self._lock = threading.Lock()
        # Bumped whenever the set of plugins changes, so caches of what they register (the
        # fused-kernel table) know to look again.
        self.generation = 0
        # Exceptions lifecycle hooks raised (caught by ``notify``), since start.
        self.num_hook_errors = 0
        # Plugin kinds that plugins own (``add_kind``): kind -> (registration hook, ABC).
        self.plugin_kinds: dict[str, tuple[str, type | None]] = {}
        self.pm.hook.pagelm_add_plugin_kinds.call_historic(kwargs={"plugin_manager": self})

    # ---- loading -------------------------------------------------------------------------
    def load_entry_points(self, strict: bool = True) -> None:
        """Import and register every entry point in ``pagelm.plugins``. With ``strict=False``
        (``pagelm plugins``) a failing plugin is recorded in ``not_loaded`` instead of raising."""
        with self._lock:
            if self._entry_points_loaded:
                return
            allow = _name_list("PAGELM_PLUGINS")
            disabled = _name_list("PAGELM_DISABLE_PLUGINS") or set()
            autoload = os.environ.get("PAGELM_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true", "True")
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist is not None else "?"
                version = ep.dist.version if ep.dist is not None else "?"
                info = PluginInfo(ep.name, ep.value, dist, version)
                if ep.name in disabled:  # built-in ones too
                    self.not_loaded[ep.name] = (info, "disabled (PAGELM_DISABLE_PLUGINS)")
                    continue
                if dist != BUILTIN_DISTRIBUTION:
                    if not autoload:
                        self.not_loaded[ep.name] = (info, "disabled (PAGELM_DISABLE_PLUGIN_AUTOLOAD)")
                        continue
                    if allow is not None and ep.name not in allow:
                        self.not_loaded[ep.name] = (info, "disabled (not in PAGELM_PLUGINS)")
                        continue
                if ep.name in self.loaded:
                    continue
                try:
                    self._register(self._import(ep, info), info)
                except PluginLoadError as exc:
                    if strict:
                        raise
                    self.not_loaded[ep.name] = (info, f"error: {exc}")
            self._entry_points_loaded = True
            self.check_pending()

    @staticmethod
    def _import(ep: importlib.metadata.EntryPoint, info: PluginInfo) -> Any:
        try:
            return ep.load()
        except Exception as exc:
            raise PluginLoadError(
                f"pagelm plugin {info.name!r} ({info.module}, from {info.distribution}) failed to import: "
                f"{type(exc).__name__}: {exc}{_exclude_hint(info)}"
            ) from exc

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register an in-process plugin object or module (tests, notebooks). The entry points
        load first, so that hooks of the plugin kinds they add are known."""
        self.load_entry_points()
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        self._register(plugin, PluginInfo(name, getattr(plugin, "__name__", repr(plugin)), IN_PROCESS, "-"))
        self.check_pending()

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.loaded.pop(name, None)
        self.generation += 1

    def _register(self, plugin: Any, info: PluginInfo) -> None:
        if self.pm.is_registered(plugin) or self.pm.get_plugin(info.name) is not None:
            return
        info = replace(info, api_version=self._check_api_version(plugin, info))
        try:
            self.pm.register(plugin, name=info.name)
        except Exception as exc:
            raise PluginLoadError(f"pagelm plugin {info.name!r} could not be registered: {exc}") from exc
        self.loaded[info.name] = info
        self.generation += 1

    @staticmethod
    def _check_api_version(plugin: Any, info: PluginInfo) -> str | None:
        declared = declared_api_version(plugin)
        if declared is None:
            if info.distribution not in (BUILTIN_DISTRIBUTION, IN_PROCESS):
                warnings.warn(
                    f"pagelm plugin {info.name!r} (from {info.distribution}) does not declare "
                    f"{PLUGIN_API_ATTRIBUTE}; assuming plugin API {PLUGIN_API_VERSION}",
                    stacklevel=4,
                )
            return None
        problem = api_incompatibility(declared)
        if problem is not None:
            raise PluginLoadError(
                f"pagelm plugin {info.name!r} ({info.module}, from {info.distribution} {info.version}) "
                f"is incompatible: {problem}{_exclude_hint(info)}"
            )
        return declared

    def add_kind(self, kind: str, hookspecs: Any, hook_name: str, base: type | None = None) -> None:
        """Add plugin kind ``kind`` (from ``pagelm_add_plugin_kinds``): ``hookspecs`` (a module
        or class) holds its registration hookspec ``hook_name``; entries must subclass ``base``.
        ``collect(kind)`` answers what is registered."""
        if kind not in self.plugin_kinds:
            self.pm.add_hookspecs(hookspecs)
        self.plugin_kinds[kind] = (hook_name, base)

    def check_pending(self) -> None:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"a pagelm plugin implements an unknown hook: {exc}") from exc

    # ---- registries ----------------------------------------------------------------------
    def collect(self, kind: str, exclude: list[Any] | None = None) -> Registry:
        """What is registered as plugin ``kind`` ("attention backend", "router", ...; ``kinds()``
        lists them). Calls each plugin's registration hook on its own, so that an entry that
        breaks the contract, or a hook that raises, is an error naming that plugin."""
        self.load_entry_points()
        kinds = self.kinds()
        if kind not in kinds:
            raise UnknownNameError(f"unknown plugin kind {kind!r} (is the plugin that adds it disabled?); "
                                   f"known: {', '.join(sorted(kinds))}")
        hook_name, base = kinds[kind]
        registry: Registry = Registry(kind, base=base)
        caller = getattr(self.pm.hook, hook_name)
        if exclude:
            caller = self.pm.subset_hook_caller(hook_name, remove_plugins=exclude)
        for impl in reversed(caller.get_hookimpls()):
            registry.adding = self.describe(impl.plugin_name)
            try:
                impl.function(registry=registry)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(f"{registry.adding} failed in {hook_name}: {type(exc).__name__}: {exc}") from exc
        registry.adding = None
        return registry

    def describe(self, plugin_name: str) -> str:
        """``plugin 'name' (module, from distribution)``, for messages."""
        info = self.loaded.get(plugin_name)
        if info is None:
            return f"pagelm plugin {plugin_name!r}"
        return f"pagelm plugin {plugin_name!r} ({info.module}, from {info.distribution})"

    def registrations(self, plugin_name: str) -> dict[str, list[str]]:
        """What one loaded plugin registers: ``{kind: [names]}`` (``pagelm plugins``)."""
        plugin = self.pm.get_plugin(plugin_name)
        others = [p for name, p in self.pm.list_name_plugin() if p is not plugin]
        out = {}
        for kind in self.kinds():
            names = self.collect(kind, exclude=others).names()
            if names:
                out[kind] = names
        return out

    @property
    def hook(self) -> Any:
        self.load_entry_points()
        return self.pm.hook

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call lifecycle hook ``hook_name`` on every plugin that implements it, each on its
        own: an exception is logged with the plugin's name and counted (``num_hook_errors``),
        and never reaches the engine, so one plugin's bug cannot stop it serving everyone."""
        caller = getattr(self.hook, hook_name)
        for impl in reversed(caller.get_hookimpls()):  # pluggy's order: last registered first
            try:
                impl.function(**{name: kwargs[name] for name in impl.argnames})
            except Exception:
                self.num_hook_errors += 1
                logger.exception("pagelm plugin %r raised in %s; the engine carries on", impl.plugin_name, hook_name)

    def kinds(self) -> dict[str, tuple[str, type | None]]:
        """Plugin kind -> (registration hook, the ABC its entries must subclass): the core's
        and those plugins added."""
        self.load_entry_points()
        return {**_core_kinds(), **self.plugin_kinds}


def _core_kinds() -> dict[str, tuple[str, type | None]]:
    """The core's plugin kinds -> (registration hook, the ABC its entries must subclass)."""
    # The contract modules themselves, not their packages (which import the engine parts).
    from pagelm.attention.backend import AttentionBackend
    from pagelm.executor import Executor
    from pagelm.kv_offload import KVOffload
    from pagelm.model_loader import ModelLoader
    from pagelm.sched.policy import SchedulingPolicy
    from pagelm.spec_decode.proposer import Proposer
    from pagelm.stat_logger import StatLogger
    from pagelm.structured_output import StructuredOutputBackend

    return {
        "attention backend": ("pagelm_register_attention_backends", AttentionBackend),
        "scheduling policy": ("pagelm_register_scheduling_policies", SchedulingPolicy),
        "structured output backend": ("pagelm_register_structured_output_backends", StructuredOutputBackend),
        "speculative proposer": ("pagelm_register_proposers", Proposer),
        "model architecture": ("pagelm_register_models", None),
        "model loader": ("pagelm_register_model_loaders", ModelLoader),
        "executor": ("pagelm_register_executors", Executor),
        "data parallel": ("pagelm_register_data_parallel", None),
        "stat logger": ("pagelm_register_stat_loggers", StatLogger),
        "kv offload": ("pagelm_register_kv_offload", KVOffload),
        "cli command": ("pagelm_register_cli_commands", None),
        "kernel": ("pagelm_register_kernels", None),
    }


def _name_list(variable: str) -> set[str] | None:
    """The comma-separated plugin names in environment ``variable`` (None: unset)."""
    raw = os.environ.get(variable)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _exclude_hint(info: PluginInfo) -> str:
    """How to start without plugin ``info``: by name always; a third-party one also by loading
    only named plugins or none (those switches leave built-ins loaded, so they would not help)."""
    hint = f"; to start without it set PAGELM_DISABLE_PLUGINS={info.name}"
    if info.builtin:
        return hint
    return hint + " (or list the plugins to load in PAGELM_PLUGINS, or PAGELM_DISABLE_PLUGIN_AUTOLOAD=1 for built-ins only)"


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (plugins load once per process)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager
