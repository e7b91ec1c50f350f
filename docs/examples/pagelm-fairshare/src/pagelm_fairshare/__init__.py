"""pagelm plugin: per-tenant fair-share scheduling (``scheduling_policy="fairshare"``)."""

from pagelm import hookimpl

from pagelm_fairshare.policy import FairSharePolicy

# The pagelm plugin API this plugin was written against (a literal, see pagelm.plugin_api).
PAGELM_PLUGIN_API = "2.0"

__all__ = ["FairSharePolicy"]


@hookimpl
def pagelm_register_scheduling_policies(registry) -> None:
    registry.add(FairSharePolicy.name, FairSharePolicy)
