"""Named registries that registration hooks fill (tox's ``register`` object pattern)."""

from __future__ import annotations

import inspect
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """An unknown backend/policy/model name; the message lists the registered ones."""


class PluginError(RuntimeError):
    """A plugin broke its contract (a class with abstract methods left, a registration hook
    that raised, a proposer's bad drafts...); the message names the plugin and what is wrong."""


def raise_problems(setting: str, problems: list[str]) -> None:
    """A plugin's ``validate`` answer as one ``ValueError`` naming the setting (none: return)."""
    if problems:
        raise ValueError(f"{setting}: " + "; ".join(problems))


class Registry(Generic[T]):
    def __init__(self, kind: str, base: type | None = None) -> None:
        self.kind = kind
        # The plugin ABC every entry must subclass (None: anything goes).
        self.base = base
        self._entries: dict[str, T] = {}
        self._sources: dict[str, str] = {}
        # Who is adding entries now ("plugin 'x' (module, from dist)"), set by the plugin
        # manager around each plugin's registration hook, for errors that name the culprit.
        self.adding: str | None = None

    def add(self, name: str, entry: T, *, source: str | None = None) -> None:
        if self.base is not None and not (isinstance(entry, type) and issubclass(entry, self.base)):
            raise PluginError(
                f"{self.adding or 'a plugin'} registers {self.kind} {name!r}, which must be a subclass of "
                f"{self.base.__module__}.{self.base.__qualname__}, got {entry!r}"
            )
        if self.base is not None and inspect.isabstract(entry):
            missing = ", ".join(sorted(entry.__abstractmethods__))
            raise PluginError(
                f"{self.adding or 'a plugin'} registers {self.kind} {name!r} "
                f"({entry.__module__}.{entry.__qualname__}), which does not implement {missing} "
                f"(abstract in {self.base.__qualname__})"
            )
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(
                f"{self.kind} {name!r} registered twice "
                f"({self._sources.get(name)} and {source or getattr(entry, '__module__', '?')})"
            )
        self._entries[name] = entry
        self._sources[name] = source or getattr(entry, "__module__", "?")

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._entries)) or '(none)'}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
