"""``pagelm serve [MODEL]``: the OpenAI-compatible HTTP server.

MODEL is a local Hugging Face model directory or a hub id (org/name, downloaded through
huggingface_hub, or taken from its cache when offline). Without MODEL, pagelm's built-in demo
model is used (trained on first use). The engine core runs in its own process; this one
serves HTTP, tokenizes and detokenizes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from pagelm.plugins.engine_args import add_engine_args, engine_kwargs
from pagelm.plugins.server.media import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_MAX_IMAGE_BYTES, ImageFetcher
from pagelm.plugins.server import (
    DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    DEFAULT_MAX_STOP_STRINGS,
)

logger = logging.getLogger("pagelm")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", help="model directory or hub id (default: the built-in demo model)")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; 0.0.0.0 for all)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    server.add_argument(
        "--api-key", default=os.environ.get("PAGELM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and /ping "
        "(default: $PAGELM_API_KEY, else none)",
    )
    server.add_argument("--served-model-name", help="model name clients use (default: MODEL as given)")
    server.add_argument("--revision", help="hub revision (branch, tag or commit) for a hub id MODEL")
    server.add_argument(
        "--log-stats-interval", type=float, default=10.0,
        help="seconds between throughput/KV usage log lines; 0 turns them off (default: 10)",
    )
    server.add_argument(
        "--allow-unknown-fields", action="store_true",
        help="ignore request fields neither pagelm nor the OpenAI API defines (default: a 400 naming them)",
    )
    server.add_argument(
        "--max-n", type=_positive_int, default=DEFAULT_MAX_N,
        help=f"most samples (n) one request may ask for (default: {DEFAULT_MAX_N}); "
        "the most logprobs is the engine's --max-logprobs",
    )
    server.add_argument(
        "--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help=f"larger request bodies are a 413 (default: {DEFAULT_MAX_REQUEST_BODY_BYTES})",
    )
    server.add_argument(
        "--max-header-bytes", type=_positive_int, default=DEFAULT_MAX_HEADER_BYTES,
        help=f"larger request heads (request line + headers), or more than 256 headers, are a 431 "
        f"(default: {DEFAULT_MAX_HEADER_BYTES})",
    )
    server.add_argument(
        "--max-sequences-per-request", type=_positive_int, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="most sequences one request may run: its prompts times n "
        f"(default: {DEFAULT_MAX_SEQUENCES_PER_REQUEST})",
    )
    server.add_argument(
        "--max-stop-strings", type=_positive_int, default=DEFAULT_MAX_STOP_STRINGS,
        help=f"most stop strings one request may give (default: {DEFAULT_MAX_STOP_STRINGS})",
    )
    server.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="render a chat_template sent in a request (default: a 400; a template is code run on the server)",
    )
    server.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='let the model decide to call tools (tool_choice "auto", the default with tools); needs --tool-call-parser',
    )
    server.add_argument(
        "--tool-call-parser", metavar="NAME",
        help="how the model writes tool calls: a registered tool-call parser (built in: hermes for Hermes/Qwen, "
        "llama3_json for Llama 3.x; `pagelm plugins` lists all)",
    )
    server.add_argument(
        "--exclude-tools-when-tool-choice-none", action="store_true",
        help='with tool_choice "none", leave the tools out of the rendered prompt (as vLLM; default: the '
        "chat template gets them, as with any other tool_choice)",
    )
    server.add_argument(
        "--enable-tokenizer-info-endpoint", action="store_true",
        help="serve GET /tokenizer_info, the tokenizer's configuration (as vLLM; default: off, as it shows "
        "the chat template and the model's path)",
    )
    server.add_argument(
        "--max-engine-restarts", type=int, default=3,
        help="start a new engine core this many times when it dies (its requests fail; default: 3)",
    )
    server.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish; then each ends with an error "
        "(a final error event and [DONE] for streams). New requests get a 503 meanwhile (default: 30)",
    )
    server.add_argument("--log-level", default="info", help="log level (default: info)")
    server.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=True, help="log every HTTP request (default: on)"
    )
    server.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=True,
        help="run the engine core in its own process; --no-engine-process runs it in a thread "
        "of the server process, which then shares the GIL with HTTP (default: on)",
    )
    server.add_argument(
        "--max-image-bytes", type=_positive_int, default=DEFAULT_MAX_IMAGE_BYTES,
        help=f"largest image file a chat image_url part may carry or point to (default: {DEFAULT_MAX_IMAGE_BYTES})",
    )
    server.add_argument(
        "--image-fetch-timeout", type=float, default=DEFAULT_FETCH_TIMEOUT_S,
        help=f"seconds one http(s) image_url fetch may take (default: {DEFAULT_FETCH_TIMEOUT_S})",
    )
    server.add_argument(
        "--fetch-image-urls", action=argparse.BooleanOptionalAction, default=True,
        help="fetch http(s) image_url parts; --no-fetch-image-urls takes data: URLs only (default: on)",
    )
    server.add_argument(
        "--allowed-media-domains", type=lambda text: tuple(d for d in text.split(",") if d),
        help="comma-separated hosts http(s) image_url parts may name (default: any)",
    )
    add_engine_args(p)
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _check_tool_args(args: argparse.Namespace) -> None:
    from pagelm.plugin_manager import get_plugin_manager
    from pagelm.registry import UnknownNameError

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("pagelm serve: --enable-auto-tool-choice needs --tool-call-parser NAME")
    if args.tool_call_parser:
        try:
            get_plugin_manager().collect("tool call parser").get(args.tool_call_parser)
        except UnknownNameError as exc:
            raise SystemExit(f"pagelm serve: --tool-call-parser: {exc}") from None


def resolve_serve_model(given: str | None, revision: str | None = None) -> tuple[str, str]:
    """(local model directory, default served name) for MODEL, the demo model when None."""
    if given is None:
        try:
            from pagelm.plugins.demo.model import ensure_demo_model
        except ImportError as exc:
            raise SystemExit(f"no MODEL given and the built-in demo model is unavailable: {exc}")
        path = ensure_demo_model()
        return str(path), "pagelm-demo"
    from pagelm.models.hub import ModelResolutionError, resolve_model

    try:
        return resolve_model(given, revision=revision), given
    except ModelResolutionError as exc:
        raise SystemExit(f"pagelm serve: {exc}")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagelm.config import EngineConfig
    from pagelm.engine.async_llm import AsyncLLM
    from pagelm.plugins.server.app import build_app
    from pagelm.plugins.server.http_limits import uvicorn_http_options

    level = getattr(logging, args.log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s %(message)s")
    logging.getLogger("pagelm").setLevel(level)
    _check_tool_args(args)  # before the engine starts
    kwargs = engine_kwargs(args)
    path, default_name = resolve_serve_model(args.model or kwargs.pop("model", None), args.revision)
    kwargs.pop("model", None)
    config = EngineConfig.from_kwargs(path, **kwargs)
    engine = AsyncLLM(
        config,
        engine_process=args.engine_process,
        model_name=args.served_model_name or default_name,
        log_stats_interval=args.log_stats_interval or None,
        max_engine_restarts=args.max_engine_restarts,
    )
    app = build_app(
        engine, api_key=args.api_key, allow_unknown_fields=args.allow_unknown_fields, max_n=args.max_n,
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_body_bytes=args.max_request_body_bytes, max_stop_strings=args.max_stop_strings,
        tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        max_sequences_per_request=args.max_sequences_per_request,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        image_fetcher=ImageFetcher(
            args.max_image_bytes, args.image_fetch_timeout, args.fetch_image_urls, args.allowed_media_domains
        ),
    )
    server = _draining_server_class()(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=args.access_log,
        timeout_graceful_shutdown=args.shutdown_timeout + 2, **uvicorn_http_options(args.max_header_bytes),
    ), engine, args.shutdown_timeout)
    print(
        f"pagelm: serving {engine.model_name!r} on http://{args.host}:{args.port}; try:\n"
        f"  curl http://{args.host}:{args.port}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{engine.model_name}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 64}}'",
        flush=True,
    )
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn, with a drain on SIGTERM/SIGINT: new requests get a 503 at once, running
        ones have ``drain_s`` to finish, then each ends with an error that the server turns
        into a final error event and ``[DONE]`` (uvicorn alone cut streams after 5 s with
        nothing, and answered plain-text 500s)."""

        def __init__(self, config, engine, drain_s: float) -> None:
            super().__init__(config)
            self.engine, self.drain_s = engine, drain_s

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                from pagelm.engine.core_client import EngineShuttingDown

                self.engine.begin_drain()
                loop = asyncio.get_event_loop()
                error = EngineShuttingDown(f"the server shut down (after {self.drain_s:g} s of draining)")
                loop.call_later(self.drain_s, self.engine.end_streams, error)
            super().handle_exit(sig, frame)

    return DrainingServer
