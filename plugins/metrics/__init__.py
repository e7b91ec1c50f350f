"""The built-in stat loggers, registered as a plugin like any third party's: ``prometheus``
(``/metrics``, vLLM's metric names; only where ``prometheus_client`` is installed) and
``logging`` (the periodic stats line)."""

import importlib.util

from pagelm import hookimpl

PAGELM_PLUGIN_API = "2.25"


@hookimpl
def pagelm_register_stat_loggers(registry) -> None:
    from pagelm.plugins.metrics.logging import LoggingStatLogger

    registry.add(LoggingStatLogger.name, LoggingStatLogger)
    if importlib.util.find_spec("prometheus_client") is not None:  # the server extra
        from pagelm.plugins.metrics.prometheus import PrometheusStatLogger

        registry.add(PrometheusStatLogger.name, PrometheusStatLogger)
