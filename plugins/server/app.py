"""The HTTP application: OpenAI-compatible routes (completions, chat completions, responses)
plus health, load, metrics, tokenizer and version endpoints, around one ``AsyncLLM``."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

import pagelm
from pagelm.engine.async_llm import AsyncLLM
from pagelm.plugins.server import (
    DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_SEQUENCES_PER_REQUEST, DEFAULT_MAX_STOP_STRINGS,
)
from pagelm.plugins.server.core_process_metrics import EngineCoreProcessCollector
from pagelm.plugins.server.errors import APIError, install_error_handlers
from pagelm.plugins.server.http_metrics import HTTPMetrics, HTTPMetricsMiddleware
from pagelm.plugins.server.load import ServerLoad, ServerLoadMiddleware
from pagelm.plugins.server.media import ImageFetcher
from pagelm.plugins.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagelm.plugins.server.responses import ResponsesServing
from pagelm.plugins.server.responses_protocol import ResponsesRequest
from pagelm.plugins.server.serving import OpenAIServing
from pagelm.plugins.server.tools import ToolCalling
from pagelm.plugins.server.tokenize import tokenize as tokenize_request
from pagelm.plugins.server.tokenizer_info import tokenizer_info


def build_app(
    engine: AsyncLLM, *, model_name: str | None = None, api_key: str | None = None, allow_unknown_fields: bool = False,
    max_n: int = DEFAULT_MAX_N, trust_request_chat_template: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS,
    tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
    enable_tokenizer_info_endpoint: bool = False, max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    exclude_tools_when_tool_choice_none: bool = False,
    image_fetcher: ImageFetcher | None = None,
) -> FastAPI:
    """The app serving ``engine``. It starts the engine's output loop at start-up and shuts the
    engine down when the server stops. ``allow_unknown_fields``: ignore request fields
    neither pagelm nor the OpenAI API defines, instead of a 400 naming them; ``max_n``: the
    most samples (``n``) one request may ask for; ``trust_request_chat_template``: render a
    ``chat_template`` a request brings (else a 400); ``max_request_body_bytes``: larger
    bodies are a 413 before they are read; ``max_stop_strings``: the most stop strings one
    request may give; ``max_sequences_per_request``: the most sequences (prompts x n) one
    request may run; ``tool_call_parser`` (a registered tool-call parser) and
    ``enable_auto_tool_choice``: ``tool_choice="auto"`` (see tools.py);
    ``exclude_tools_when_tool_choice_none``: render no tools for ``tool_choice="none"``;
    ``enable_tokenizer_info_endpoint``: serve ``/tokenizer_info`` (vLLM's flag; it shows the
    chat template and the model's path); ``image_fetcher``: how chat ``image_url`` parts are
    read (size and time limits, whether http(s) URLs are fetched)."""
    model_name = model_name or engine.model_name
    serving = OpenAIServing(
        engine, model_name, allow_unknown_fields=allow_unknown_fields, max_n=max_n,
        trust_request_chat_template=trust_request_chat_template, max_stop_strings=max_stop_strings,
        tool_calling=ToolCalling(
            engine.tokenizer, tool_call_parser, enable_auto_tool_choice, exclude_tools_when_tool_choice_none
        ),
        max_sequences=max_sequences_per_request, images=image_fetcher,
    )
    responses_serving = ResponsesServing(serving)
    load = ServerLoad()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="pagelm", version=pagelm.__version__, lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(ServerLoadMiddleware, load=load)  # inside the others: counts what gets through
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:  # added late: it runs early, so that no unauthenticated body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # The engine's metrics are the prometheus stat logger's (a plugin: without it, /metrics
    # has the HTTP metrics only). Outermost: it times and counts every request, refused too.
    registry = getattr(engine.stat_loggers.get("prometheus"), "registry", None) or CollectorRegistry()
    app.add_middleware(HTTPMetricsMiddleware, metrics=HTTPMetrics(registry))
    registry.register(EngineCoreProcessCollector(lambda: engine.core.pid))  # the core's own process

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return await _unless_disconnected(raw, serving.completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return await _unless_disconnected(raw, serving.chat(body))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Any:
        return await _unless_disconnected(raw, responses_serving.create(body))

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, root=engine.config.model, max_model_len=engine.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)  # 404 model_not_found, in the OpenAI format
        return ModelCard(id=model_name, root=engine.config.model, max_model_len=engine.max_model_len)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead_error is not None:
            return APIError(f"the engine is dead: {engine.dead_error}", 503).response()
        if engine.draining:  # load balancers stop sending here
            return APIError("the server is shutting down", 503).response()
        return Response(status_code=200)

    # vLLM's /ping (SageMaker's health check): /health by another name, GET or POST.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/load")
    async def server_load() -> dict:
        return {"server_load": load.in_flight}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    if enable_tokenizer_info_endpoint:
        info = tokenizer_info(engine.tokenizer)

        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> JSONResponse:
            return JSONResponse(info)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagelm.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        serving.check_fields(body)
        return await asyncio.to_thread(tokenize_request, serving, body)  # off the event loop

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        serving.check_fields(body)
        bad = [t for t in body.tokens if not 0 <= t < engine.engine.vocab_size]
        if bad:
            raise APIError(f"tokens {bad[:8]} are outside the vocabulary", param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(engine.tokenizer.decode, body.tokens))

    return app


async def _unless_disconnected(raw: Request, work: Awaitable) -> Any:
    """Run ``work`` unless the client goes away first; then cancel it, which aborts its
    requests. (Streaming responses get the same from Starlette, which cancels the stream.)"""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Response(status_code=499)  # nobody is listening any more


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route but ``/health`` and ``/ping`` (load
    balancers probe them without credentials): ``/tokenize`` and ``/metrics`` answered anyone,
    and an unauthenticated 5 MB ``/tokenize`` stalled the server. Plain ASGI: streams untouched."""

    OPEN_PATHS = frozenset({"/health", "/ping"})

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = APIError("invalid API key", 401, code="invalid_api_key").body()
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """A request body over ``max_bytes`` is a 413 in the OpenAI error format: refused on its
    ``Content-Length`` before it is read, or when a chunked body grows past the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen, refused = 0, False

        async def limited_receive():
            # Past the limit: answer 413 here and tell the app the client left (an exception
            # would reach FastAPI's body parser, which turns it into a 400).
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refused = True
                    await self._refuse(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message) -> None:
            if not refused:  # nothing after the 413
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, scope, receive, send) -> None:
        message = f"the request body is larger than the server's --max-request-body-bytes={self.max_bytes}"
        body = APIError(message, 413, code="request_too_large").body()
        await JSONResponse(body, status_code=413)(scope, receive, send)
