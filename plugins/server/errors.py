"""Errors in the OpenAI format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagelm.engine.core_client import EngineDeadError, EngineShuttingDown
from pagelm.engine.core_output import EngineStepError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error", 503: "service_unavailable"}


_ENGINE_PARAMS = {"prompt", "prompt_token_ids", "stop_token_ids", "request_id"}


class APIError(Exception):
    def __init__(
        self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or _TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def param_of(message: str, names: set[str]) -> str | None:
    """The parameter a validation message is about: ``SamplingParams`` and the engine start
    their messages with its name ("top_p must be in (0, 1], got 2.0")."""
    first = message.split(" ", 1)[0].strip(":,")
    return first if first in names else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = next((p for p in reversed(loc) if not p.isdigit()), None) if loc else None
        where = ".".join(loc)
        message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", exc))
        return APIError(message, 400, param=param).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return APIError(str(exc.detail), exc.status_code).response()

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        # Input the engine rejected (its messages start with the parameter's name).
        return APIError(str(exc), 400, param=param_of(str(exc), _ENGINE_PARAMS)).response()

    @app.exception_handler(EngineStepError)
    async def _engine_step(request: Request, exc: EngineStepError) -> JSONResponse:
        # A step raised and took the requests in it down; the engine serves on.
        return APIError(str(exc), 500).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        if isinstance(exc, EngineShuttingDown):
            return APIError(str(exc), 503).response()
        return APIError(f"the engine is dead: {exc}", 500).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return APIError(f"internal error: {exc}", 500).response()
