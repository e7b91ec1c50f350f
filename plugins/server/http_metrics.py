"""HTTP request metrics for the server, under the names, labels and buckets that
prometheus-fastapi-instrumentator's default gives them (what vLLM's server exposes), so that
request-rate and error-rate panels written for vLLM work unchanged::

    http_requests_total{method, status, handler}            status grouped: "2xx", "4xx", ...
    http_request_duration_seconds{method, handler}          buckets 0.1, 0.5, 1
    http_request_duration_highr_seconds                     21 buckets, no labels
    http_request_size_bytes{handler}, http_response_size_bytes{handler}   Content-Length

``handler`` is the route's template (``/v1/models/{model_id:path}``), ``none`` for a path no
route serves. A request's duration runs until its last byte is sent, so a streamed completion
counts whole. Probes and scrapes (``/health``, ``/metrics``, ``/version``) are left out, as in
vLLM. Written here rather than taken from the instrumentator: two counters, three
observations per request, and one ASGI wrapper.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from starlette.routing import Match

HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30, 60)
LOWR_BUCKETS = (0.1, 0.5, 1)
EXCLUDED_PATHS = frozenset({"/health", "/metrics", "/version"})


class HTTPMetrics:
    """The metrics, registered once in the engine's registry (so ``/metrics`` serves them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "http_requests_total", "Total number of requests by method, status and handler.",
            ["method", "status", "handler"], registry=registry,
        )
        self.request_size = Summary(
            "http_request_size_bytes",
            "Content length of incoming requests by handler. Only value of header is respected. Otherwise ignored. "
            "No percentile calculated. ", ["handler"], registry=registry,
        )
        self.response_size = Summary(
            "http_response_size_bytes",
            "Content length of outgoing responses by handler. Only value of header is respected. Otherwise ignored. "
            "No percentile calculated. ", ["handler"], registry=registry,
        )
        self.duration_highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. ",
            buckets=HIGHR_BUCKETS, registry=registry,
        )
        self.duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important. ",
            ["method", "handler"], buckets=LOWR_BUCKETS, registry=registry,
        )

    def observe(self, method: str, status: int, handler: str, duration: float, in_bytes: int, out_bytes: int) -> None:
        self.requests.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.request_size.labels(handler).observe(in_bytes)
        self.response_size.labels(handler).observe(out_bytes)
        self.duration_highr.observe(duration)
        self.duration.labels(method, handler).observe(duration)


class HTTPMetricsMiddleware:
    """Plain ASGI, outermost: it counts every request, the refused ones (401, 413) too."""

    def __init__(self, app, metrics: HTTPMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in EXCLUDED_PATHS:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status, out_bytes = 500, 0  # what the client gets if the app raises

        async def observed_send(message) -> None:
            nonlocal status, out_bytes
            if message["type"] == "http.response.start":
                status = message["status"]
                out_bytes = _content_length(message.get("headers", ()))
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            self.metrics.observe(
                scope["method"], status, _handler(scope), time.perf_counter() - start,
                _content_length(scope["headers"]), out_bytes,
            )


def _content_length(headers) -> int:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


def _handler(scope) -> str:
    """The template of the route that served the request: the router notes it in the scope;
    a request refused before routing (401) is matched here."""
    route = scope.get("route")
    if route is None:
        for candidate in scope["app"].router.routes:
            if candidate.matches(scope)[0] is Match.FULL:
                route = candidate
                break
    return getattr(route, "path", None) or "none"
