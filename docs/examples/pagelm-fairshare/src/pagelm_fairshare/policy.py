"""Fair share between tenants: the tenant with the least (weighted) service goes next.

The tenant of a request is its ``cache_salt`` (requests without one share the tenant
``"default"``). Settings: ``plugin_config={"fairshare": {"weights": {tenant: weight}}}``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from pagelm.request import Request
from pagelm.sched.policy import SchedulingPolicy
from pagelm.sched.request_queue import RequestQueue

DEFAULT_TENANT = "default"


def tenant_of(request: Request) -> str:
    return request.cache_salt or DEFAULT_TENANT


def _settings(config) -> dict:
    return dict((config.plugin_config or {}).get("fairshare") or {})


class FairSharePolicy(SchedulingPolicy):
    """Ranks a request by its tenant's weighted service so far; its queue (``FairShareQueue``)
    keeps that accounting, so the order changes as requests are admitted."""

    name = "fairshare"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.queue = FairShareQueue(dict(_settings(config).get("weights") or {}))

    @classmethod
    def validate(cls, config) -> list[str]:
        settings = _settings(config)
        problems = []
        unknown = sorted(set(settings) - {"weights"})
        if unknown:
            problems.append(f"unknown fairshare settings {unknown}; known: weights")
        weights = settings.get("weights") or {}
        if not isinstance(weights, dict):
            problems.append(f"fairshare weights must be a mapping tenant -> weight, got {weights!r}")
        else:
            bad = {t: w for t, w in weights.items() if not isinstance(w, (int, float)) or w <= 0}
            if bad:
                problems.append(f"fairshare weights must be numbers > 0, got {bad}")
        return problems

    def rank(self, request: Request) -> float:
        """The tenant's service: the most-served tenant's request gives way first."""
        return self.queue.service.get(tenant_of(request), 0.0)

    def make_queue(self) -> RequestQueue:
        return self.queue


class FairShareQueue(RequestQueue):
    """One FIFO per tenant; the tenant with the least weighted service goes next."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self._queues: dict[str, deque[Request]] = {}
        # Weighted tokens admitted per tenant.
        self.service: dict[str, float] = {}
        self._len = 0

    def _cost(self, request: Request) -> float:
        tokens = request.num_prompt_tokens + (request.max_tokens or 0)
        return tokens / self.weights.get(tenant_of(request), 1.0)

    def _next_tenant(self, service: dict[str, float], queues: dict[str, deque[Request]]) -> str:
        # Least service first; ties go to the tenant whose head request arrived first.
        active = [t for t, q in queues.items() if q]
        return min(active, key=lambda t: (service[t], queues[t][0].arrival_time))

    def add(self, request: Request) -> None:
        tenant = tenant_of(request)
        queue = self._queues.setdefault(tenant, deque())
        if not queue:
            # Waking up: no credit for the time spent idle.
            floor = min((self.service[t] for t, q in self._queues.items() if q), default=0.0)
            self.service[tenant] = max(self.service.get(tenant, 0.0), floor)
        queue.append(request)
        self._len += 1

    def prepend(self, request: Request) -> None:
        tenant = tenant_of(request)
        self._queues.setdefault(tenant, deque()).appendleft(request)
        # Refund: it is charged again when it is admitted again.
        self.service[tenant] = self.service.get(tenant, 0.0) - self._cost(request)
        self._len += 1

    def peek(self) -> Request:
        return self._queues[self._next_tenant(self.service, self._queues)][0]

    def pop(self) -> Request:
        tenant = self._next_tenant(self.service, self._queues)
        request = self._queues[tenant].popleft()
        self.service[tenant] += self._cost(request)
        self._len -= 1
        return request

    def remove(self, request: Request) -> None:
        self._queues[tenant_of(request)].remove(request)
        self._len -= 1

    def __iter__(self) -> Iterator[Request]:
        # Replay pop() on copies.
        service = dict(self.service)
        queues = {t: deque(q) for t, q in self._queues.items()}
        for _ in range(self._len):
            tenant = self._next_tenant(service, queues)
            request = queues[tenant].popleft()
            service[tenant] += self._cost(request)
            yield request

    def __len__(self) -> int:
        return self._len
