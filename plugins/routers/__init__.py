"""The built-in data-parallel routers (``data_parallel_router``): ``round_robin``,
``least_loaded`` and ``prefix_affinity``."""

from pagelm import hookimpl
from pagelm.plugins.routers.balance import LeastLoadedRouter, RoundRobinRouter
from pagelm.plugins.routers.prefix_affinity import PrefixAffinityRouter

PAGELM_PLUGIN_API = "2.13"


@hookimpl
def pagelm_register_routers(registry) -> None:
    for cls in (RoundRobinRouter, LeastLoadedRouter, PrefixAffinityRouter):
        registry.add(cls.name, cls)
