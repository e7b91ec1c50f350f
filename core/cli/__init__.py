"""The ``pagelm`` command: a dispatcher. Every subcommand (``plugins``, ``generate``,
``serve``, ``bench``, ``simulate``) is a plugin's, added through the
``pagelm_register_cli_commands`` hook."""

from __future__ import annotations

import argparse
import sys


def build_parser(plugins=None) -> argparse.ArgumentParser:
    """The parser of every registered subcommand (``plugins``: a plugin manager; default the
    process's, which loads every plugin strictly and raises on a broken one)."""
    from pagelm.plugin_manager import get_plugin_manager

    parser = argparse.ArgumentParser(prog="pagelm", description="pagelm: LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = (plugins or get_plugin_manager()).collect("cli command")
    for name in commands.names():
        commands.get(name)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagelm.plugin_manager import PluginLoadError, PluginManager

    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser()
    except PluginLoadError as exc:
        # A broken plugin stops every command but ``pagelm plugins``, which is how one finds it.
        if argv[:1] != ["plugins"]:
            raise SystemExit(f"pagelm: {exc}") from exc
        tolerant = PluginManager()
        tolerant.load_entry_points(strict=False)
        parser = build_parser(tolerant)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)

if __name__ == "__main__":
    sys.exit(main())
