"""The ``pagelm generate`` command, registered as a plugin (``pagelm_register_cli_commands``)."""

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_cli_commands(registry) -> None:
    from pagelm.plugins.generate.cli import add_parser

    registry.add("generate", add_parser)
