"""``pagelm plugins``: every plugin found in the ``pagelm.plugins`` entry-point group, what
it registers, where it comes from, and whether it loaded."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list discovered plugins", description=__doc__)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def collect() -> list[dict]:
    from pagelm.plugin_api import PLUGIN_API_VERSION
    from pagelm.plugin_manager import PluginManager

    pm = PluginManager()
    pm.load_entry_points(strict=False)
    rows = []
    for name, info in sorted(pm.loaded.items()):
        registered = pm.registrations(name)
        rows.append(
            {
                "name": name,
                "kind": ", ".join(registered) or "lifecycle hooks",
                "registers": {kind: names for kind, names in registered.items()},
                "package": info.distribution,
                "version": info.version,
                "module": info.module,
                "plugin_api": info.api_version or f"undeclared (assumed {PLUGIN_API_VERSION})",
                "status": "loaded",
            }
        )
    for name, (info, why) in sorted(pm.not_loaded.items()):
        rows.append(
            {
                "name": name,
                "kind": "?",
                "registers": {},
                "package": info.distribution,
                "version": info.version,
                "module": info.module,
                "plugin_api": "?",
                "status": why,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    from pagelm.plugin_api import PLUGIN_API_VERSION

    rows = collect()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ["name", "kind", "registers", "package", "version", "api", "status"]
    table = [
        [
            r["name"],
            r["kind"],
            "; ".join(", ".join(v) for v in r["registers"].values()) or "-",
            r["package"],
            r["version"],
            r["plugin_api"],
            r["status"],
        ]
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, *table]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"\npagelm plugin API {PLUGIN_API_VERSION}")
    return 0
