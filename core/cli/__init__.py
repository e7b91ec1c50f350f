"""The ``pagelm`` command. Each subcommand lives in its own module exposing
``add_parser(subparsers)``, which registers the subcommand and sets ``func``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules under pagelm.cli, in the order `pagelm --help` lists them.
COMMANDS = ["serve", "generate", "bench", "plugins", "simulate", "train_eagle"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagelm", description="pagelm: LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"pagelm.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
