"""The ``pagelm bench`` command, registered as a plugin: the benchmarks import only when the
command runs."""

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_cli_commands(registry) -> None:
    from pagelm.plugins.bench.cli import add_parser

    registry.add("bench", add_parser)
