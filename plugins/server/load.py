"""``GET /load``: the generation requests the server is working on, as vLLM reports them
(``{"server_load": N}``), for load balancers that send work to the least busy replica."""

from __future__ import annotations

from dataclasses import dataclass

# The routes that run the model. A request counts from its first byte until its response
# (a whole stream included) has gone out or the client has left.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


@dataclass
class ServerLoad:
    in_flight: int = 0


class ServerLoadMiddleware:
    """Keeps ``load.in_flight``: one increment and one decrement per request, nothing per
    token or streamed chunk. Plain ASGI, so a stream counts until its last byte."""

    def __init__(self, app, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1
