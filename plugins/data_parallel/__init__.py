"""Data parallelism (``data_parallel_size`` > 1): engine replicas behind one API, a router
plugin picking each request's replica (``replicas.py``)."""

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_data_parallel(registry) -> None:
    from pagelm.plugins.data_parallel.replicas import DataParallelCore

    registry.add("replicas", DataParallelCore)
