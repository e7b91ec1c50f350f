"""Shortest job first, with aging.

A request's expected remaining work is the tokens it still has to compute plus the output
tokens it is still expected to generate::

    work(r) = (num_tokens - num_computed_tokens) + max(expected_output(r) - num_output_tokens, 1)

``expected_output`` is ``max_tokens`` unless an output-length predictor is configured. Aging
lowers the rank of a waiting request by ``aging_tokens_per_s`` for every second it has
waited, so its effective rank is ``work(r) - a * (now - arrival_time)``. ``now`` is the same
for everybody, so the order is that of the static key ``work(r) + a * arrival_time`` and the
queue is a plain heap. **The bound**: a request with work ``W`` that arrived at ``t`` is
never overtaken by a request that arrives after ``t + W / a``; it can only wait for the
finitely many requests that arrived before then, so no request waits forever.

Settings (``plugin_config={"sjf": {...}}``):

* ``aging_tokens_per_s`` (default 100): ``a`` above, > 0. Large values tend to FCFS.
* ``predictor``: a callable ``f(request) -> expected number of output tokens`` or a
  ``"module:function"`` string naming one (e.g. a learned output-length model).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from pagelm import hookimpl
from pagelm.request import Request
from pagelm.sched.policy import SchedulingPolicy

PAGELM_PLUGIN_API = "2.25"

DEFAULT_AGING_TOKENS_PER_S = 100.0
# Expected output of a request without max_tokens and without a predictor.
DEFAULT_OUTPUT_TOKENS = 256

OutputPredictor = Callable[[Request], float]


def _settings(config) -> dict[str, Any]:
    return dict((config.plugin_config or {}).get("sjf") or {})


def _load_predictor(spec: OutputPredictor | str | None) -> OutputPredictor | None:
    if spec is None or callable(spec):
        return spec
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


class SJFPolicy(SchedulingPolicy):
    name = "sjf"

    def __init__(self, config) -> None:
        super().__init__(config)
        settings = _settings(config)
        self.aging = float(settings.get("aging_tokens_per_s", DEFAULT_AGING_TOKENS_PER_S))
        self.predictor = _load_predictor(settings.get("predictor"))

    @classmethod
    def validate(cls, config) -> list[str]:
        settings = _settings(config)
        problems = []
        unknown = sorted(set(settings) - {"aging_tokens_per_s", "predictor"})
        if unknown:
            problems.append(f"unknown sjf settings {unknown}; known: aging_tokens_per_s, predictor")
        aging = settings.get("aging_tokens_per_s", DEFAULT_AGING_TOKENS_PER_S)
        if not isinstance(aging, (int, float)) or aging <= 0:
            problems.append(f"sjf aging_tokens_per_s must be a number > 0 (no aging could starve), got {aging!r}")
        try:
            _load_predictor(settings.get("predictor"))
        except (ImportError, AttributeError, ValueError) as exc:
            problems.append(f"sjf predictor {settings.get('predictor')!r} cannot be loaded: {exc}")
        return problems

    # ---- ranking -------------------------------------------------------------------------
    def expected_output_tokens(self, request: Request) -> float:
        if self.predictor is not None:
            return float(self.predictor(request))
        return float(request.max_tokens if request.max_tokens is not None else DEFAULT_OUTPUT_TOKENS)

    def remaining_work(self, request: Request) -> float:
        to_compute = request.num_tokens - request.num_computed_tokens
        to_generate = max(self.expected_output_tokens(request) - request.num_output_tokens, 1.0)
        return to_compute + to_generate

    def rank(self, request: Request) -> float:
        """Smaller first: remaining work, less ``aging_tokens_per_s`` per second waited
        (up to a constant shared by every request)."""
        return self.remaining_work(request) + self.aging * request.arrival_time


@hookimpl
def pagelm_register_scheduling_policies(registry) -> None:
    registry.add(SJFPolicy.name, SJFPolicy)
