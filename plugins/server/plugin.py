"""The ``pagelm serve`` command, registered as a plugin: FastAPI and the server import only
when the command runs (``pip install 'pagelm[server]'``)."""

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_cli_commands(registry) -> None:
    from pagelm.plugins.server.cli import add_parser

    registry.add("serve", add_parser)
