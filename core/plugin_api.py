"""The plugin API version: what a plugin declares it was written against, and the rule for
accepting it.

A plugin module (or plugin object) declares ``PAGELM_PLUGIN_API = "MAJOR.MINOR"`` as a
literal string: the version of the contract (hookspecs, the plugin ABCs, the registries) it
was written and tested against. Do not import :data:`PLUGIN_API_VERSION` to declare it: that
would always match. The plugin manager accepts a plugin when

* its MAJOR equals this pagelm's MAJOR (a new major removes or changes hooks or ABC
  methods), and
* its MINOR is at most this pagelm's MINOR (a new minor only adds hooks, optional ABC methods
  with defaults, or registry entries, which an older plugin does not use but a newer one may).

A plugin that declares nothing is loaded with a warning (it predates the declaration).
"""

from __future__ import annotations

import re
from typing import Any

# What each version added, and the migration notes: docs/plugins.md ("Plugin API version").
PLUGIN_API_VERSION = "2.25"
PLUGIN_API_ATTRIBUTE = "PAGELM_PLUGIN_API"

_VERSION_RE = re.compile(r"^(\d+)(?:\.(\d+))?$")


def parse_api_version(value: Any) -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; ``"1"`` or ``1`` -> ``(1, 0)``. ``ValueError`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, 0
    match = _VERSION_RE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{PLUGIN_API_ATTRIBUTE} must look like 'MAJOR.MINOR' (e.g. '1.0'), got {value!r}")
    return int(match.group(1)), int(match.group(2) or 0)


def declared_api_version(plugin: Any) -> str | None:
    value = getattr(plugin, PLUGIN_API_ATTRIBUTE, None)
    return None if value is None else str(value)


def api_incompatibility(declared: Any, provided: str = PLUGIN_API_VERSION) -> str | None:
    """Why a plugin declaring ``declared`` cannot run on plugin API ``provided`` (None: it can)."""
    try:
        major, minor = parse_api_version(declared)
    except ValueError as exc:
        return str(exc)
    have_major, have_minor = parse_api_version(provided)
    if major != have_major:
        return (
            f"it declares plugin API {declared}, but this pagelm provides plugin API {provided} "
            f"(major versions differ); use a release of the plugin made for plugin API {have_major}.x"
        )
    if minor > have_minor:
        return (
            f"it declares plugin API {declared}, newer than this pagelm's plugin API {provided}; "
            f"upgrade pagelm or use an older release of the plugin"
        )
    return None
