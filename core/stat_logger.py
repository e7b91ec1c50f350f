"""The stat-logger contract (vLLM's ``StatLoggerBase``): the plugins that export or log the
statistics ``AsyncLLM`` collects, once per engine step, never per token (Prometheus and the
periodic log line are the built-in ones; docs/plugins.md, ``pagelm_register_stat_loggers``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pagelm.config import EngineConfig

# The stats types live in the engine, a higher layer: pagelm.engine.core_loop.SchedulerStats
# and pagelm.engine.iteration_stats.IterationStats.


class StatLogger(ABC):
    """Subclass, set ``name``, implement ``record``. One object per ``AsyncLLM``, used by its
    event loop only (no locking needed)."""

    name: ClassVar[str]

    def __init__(self, config: "EngineConfig", model_name: str, max_model_len: int, stats: "SchedulerStats") -> None:
        """``model_name``: the served name; ``max_model_len``: resolved from the model;
        ``stats``: the fresh engine core's (``num_kv_blocks`` is its KV cache size)."""
        self.config, self.model_name, self.max_model_len = config, model_name, max_model_len

    @abstractmethod
    def record(self, stats: "SchedulerStats", iteration: "IterationStats | None" = None) -> None:
        """One engine step: the core's state and totals after it, and what its outputs did
        (None: no step, only the state)."""

    def request_finished(self, reason: str, count: int = 1) -> None:
        """``count`` requests ended with ``reason`` outside the output processor (aborted by
        their client); those it finishes come in ``IterationStats.finished_requests``."""

    def engine_restarted(self, stats: "SchedulerStats") -> None:
        """A fresh engine core replaced a dead one; its totals start from zero again."""

    def log(self) -> None:
        """Called every ``log_stats_interval`` seconds (not at all when it is None)."""
