"""The built-in data-parallel routers (``data_parallel_router``): ``round_robin``,
``least_loaded`` and ``prefix_affinity``. Routers are a plugin kind this plugin adds: the
contract is ``router.py``."""

from pagelm import hookimpl
from pagelm.plugins.routers.balance import LeastLoadedRouter, RoundRobinRouter
from pagelm.plugins.routers.prefix_affinity import PrefixAffinityRouter

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_add_plugin_kinds(plugin_manager) -> None:
    from pagelm.plugins.routers import router

    plugin_manager.add_kind("router", router, "pagelm_register_routers", router.Router)


@hookimpl
def pagelm_register_routers(registry) -> None:
    for cls in (RoundRobinRouter, LeastLoadedRouter, PrefixAffinityRouter):
        registry.add(cls.name, cls)
