"""The ``pagelm`` command: a dispatcher. Every subcommand (``plugins``, ``generate``,
``serve``, ``bench``, ``simulate``) is a plugin's, added through the
``pagelm_register_cli_commands`` hook."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from pagelm.plugin_manager import get_plugin_manager

    parser = argparse.ArgumentParser(prog="pagelm", description="pagelm: LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = get_plugin_manager().cli_commands()
    for name in commands.names():
        commands.get(name)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
