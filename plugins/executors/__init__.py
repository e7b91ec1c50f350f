"""The built-in executors: ``uni`` (one rank), ``mp`` (the other ranks as local processes),
``ray`` (the other ranks as Ray actors, across nodes; needs ``pagelm[ray]``) and
``external_launcher`` (every rank started by ``torchrun``, each with its own engine)."""

from pagelm import hookimpl
from pagelm.plugins.executors.external_launcher import ExternalLauncherExecutor
from pagelm.plugins.executors.mp import MultiprocessingExecutor, UniExecutor
from pagelm.plugins.executors.ray_executor import RayExecutor

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_executors(registry) -> None:
    registry.add("uni", UniExecutor)
    registry.add("mp", MultiprocessingExecutor)
    registry.add("ray", RayExecutor)
    registry.add("external_launcher", ExternalLauncherExecutor)
