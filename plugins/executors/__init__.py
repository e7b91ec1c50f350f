"""The built-in executors: ``uni`` (one rank) and ``mp`` (the other ranks as local processes)."""

from pagelm import hookimpl
from pagelm.plugins.executors.mp import MultiprocessingExecutor, UniExecutor

PAGELM_PLUGIN_API = "2.6"


@hookimpl
def pagelm_register_executors(registry) -> None:
    registry.add("uni", UniExecutor)
    registry.add("mp", MultiprocessingExecutor)
