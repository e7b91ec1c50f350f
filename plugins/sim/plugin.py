"""The ``pagelm simulate`` command, registered as a plugin: the simulator imports only when the
command runs."""

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_cli_commands(registry) -> None:
    from pagelm.plugins.sim.cli import add_parser

    registry.add("simulate", add_parser)
