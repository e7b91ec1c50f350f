"""Loads plugins from the ``pagelm.plugins`` entry-point group and answers "which class is
called X" for every plugin kind.

* Built-in plugins are entry points of the ``pagelm`` distribution itself and always load.
* Third-party ones load unless ``PAGELM_DISABLE_PLUGIN_AUTOLOAD=1``; ``PAGELM_PLUGINS=a,b``
  loads only the named ones.
* Loading is idempotent and happens once per process; ``check_pending()`` afterwards makes a
  misspelt ``pagelm_*`` hook fail loudly.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
from dataclasses import dataclass
from typing import Any

import pluggy

from pagelm import hookspecs
from pagelm.registry import Registry

ENTRY_POINT_GROUP = "pagelm.plugins"
BUILTIN_DISTRIBUTION = "pagelm"


class PluginLoadError(RuntimeError):
    """A plugin entry point could not be imported or registered."""


@dataclass(frozen=True)
class PluginInfo:
    name: str
    module: str
    distribution: str
    version: str

    @property
    def builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION


class PluginManager:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("pagelm")
        self.pm.add_hookspecs(hookspecs)
        self.loaded: dict[str, PluginInfo] = {}
        self._entry_points_loaded = False
        self._lock = threading.Lock()

    # ---- loading -------------------------------------------------------------------------
    def load_entry_points(self) -> None:
        with self._lock:
            if self._entry_points_loaded:
                return
            allow = _allow_list()
            autoload = os.environ.get("PAGELM_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true", "True")
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist is not None else "?"
                version = ep.dist.version if ep.dist is not None else "?"
                if dist != BUILTIN_DISTRIBUTION:
                    if not autoload or (allow is not None and ep.name not in allow):
                        continue
                if ep.name in self.loaded:
                    continue
                try:
                    plugin = ep.load()
                except Exception as exc:
                    raise PluginLoadError(
                        f"pagelm plugin {ep.name!r} ({ep.value}, from {dist}) failed to import: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                self._register(plugin, PluginInfo(ep.name, ep.value, dist, version))
            self._entry_points_loaded = True
            self.check_pending()

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register an in-process plugin object or module (tests, notebooks)."""
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        self._register(plugin, PluginInfo(name, getattr(plugin, "__name__", repr(plugin)), "(in-process)", "-"))
        self.check_pending()

    def unregister(self, name: str) -> None:
        self.pm.unregister(name=name)
        self.loaded.pop(name, None)

    def _register(self, plugin: Any, info: PluginInfo) -> None:
        if self.pm.is_registered(plugin) or self.pm.get_plugin(info.name) is not None:
            return
        try:
            self.pm.register(plugin, name=info.name)
        except Exception as exc:
            raise PluginLoadError(f"pagelm plugin {info.name!r} could not be registered: {exc}") from exc
        self.loaded[info.name] = info

    def check_pending(self) -> None:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginLoadError(f"a pagelm plugin implements an unknown hook: {exc}") from exc

    # ---- registries ----------------------------------------------------------------------
    def _collect(self, kind: str, hook_name: str) -> Registry:
        self.load_entry_points()
        registry: Registry = Registry(kind)
        getattr(self.pm.hook, hook_name)(registry=registry)
        return registry

    def attention_backends(self) -> Registry:
        return self._collect("attention backend", "pagelm_register_attention_backends")

    def scheduling_policies(self) -> Registry:
        return self._collect("scheduling policy", "pagelm_register_scheduling_policies")

    def models(self) -> Registry:
        return self._collect("model architecture", "pagelm_register_models")

    @property
    def hook(self) -> Any:
        self.load_entry_points()
        return self.pm.hook


def _allow_list() -> set[str] | None:
    raw = os.environ.get("PAGELM_PLUGINS")
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide plugin manager (plugins load once per process)."""
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager
