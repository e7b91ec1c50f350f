"""The engine core process's CPU and memory on ``/metrics``.

``prometheus_client``'s process collector describes the process that answers ``/metrics``:
the API server. The model, its KV cache and every forward pass live in the engine core's
own process, whose memory and CPU time a dashboard could not see. vLLM gets its engine's
through Prometheus' multiprocess mode; pagelm reads the core's ``/proc/<pid>`` when
``/metrics`` is scraped (nothing per step), under pagelm's prefix, as

    pagelm:engine_core_process_resident_memory_bytes, ..._virtual_memory_bytes,
    ..._cpu_seconds_total, ..._start_time_seconds, ..._open_fds, ..._max_fds

The pid is read at each scrape: a core restarted after a crash is a new process. With the
core in the API process (``--no-engine-process``) there is nothing more to describe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

PREFIX = "pagelm:engine_core"


class EngineCoreProcessCollector(Collector):
    """``pid()``: the engine core's process id now, or None."""

    def __init__(self, pid: Callable[[], int | None]) -> None:
        self._pid = pid

    def collect(self) -> Iterable[Metric]:
        pid = self._pid()
        if pid is None:
            return []
        # A reader per scrape (it reads the boot time once): cheap, and always this pid's.
        # A process that is gone has no /proc entry: it yields nothing.
        return ProcessCollector(namespace=PREFIX, pid=lambda: pid, registry=None).collect()
