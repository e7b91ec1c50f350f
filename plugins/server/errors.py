"""Errors in the OpenAI format: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import re

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
        return _ASCIIJSONResponse(self.body(), status_code=self.status)


class _ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote request text
    that is no valid Unicode (a lone surrogate), which UTF-8 cannot encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def param_of(message: str, names: set[str]) -> str | None:
    """The parameter a validation message is about: ``SamplingParams`` and the engine start
    their messages with its name ("top_p must be in (0, 1], got 2.0")."""
    first = message.split(" ", 1)[0].strip(":,")
    return first if first in names else None


def validation_error(errors: list[dict]) -> APIError:
    """A 400 for pydantic's errors about a request body: ``param`` is the top-level field the
    client sent (not a union member's tag such as ``str`` or ``list[int]``, nor a dict key
    inside the field), the message the path to the bad value and what it must be."""
    first = errors[0] if errors else {}
    loc = list(first.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if first.get("type") == "json_invalid":  # loc is ("body", character offset)
        error = (first.get("ctx") or {}).get("error", "JSON decode error")
        return APIError(f"the request body is not valid JSON: {error} (at character {loc[0] if loc else 0})")
    if not loc:  # the body itself: missing, or not an object
        if first.get("type") == "missing":
            return APIError("the request body is empty: send a JSON object")
        return APIError(f"the request body must be a JSON object: {first.get('msg', 'invalid value')}")
    path = [str(part) for part in loc if not _is_union_tag(part)]
    where = ".".join(path)
    tags = _union_choices(errors, loc)
    if tags:
        message = f"{where}: must be {' | '.join(tags)}"
    else:
        message = f"{where}: {first.get('msg', 'invalid value')}"
    return APIError(message, param=path[0] if path else None)


# Pydantic puts the member of a union it tried in ``loc`` ("str", "list[int]",
# "dict[str,any]", a model's class name): not a field. Fields are snake_case identifiers.
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "none", "list", "dict"})


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _TYPE_NAMES or not _FIELD.fullmatch(part))


def _union_choices(errors: list[dict], loc: list) -> list[str]:
    """The union members a value failed, when ``loc`` passes through a union ("prompt", "str"):
    each member's tag, in order (one error per member)."""
    at = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    if at is None:
        return []
    prefix = tuple(loc[:at])
    tags: list[str] = []
    for error in errors:
        other = [part for part in error.get("loc", ()) if part != "body"]
        if tuple(other[:at]) == prefix and len(other) > at and _is_union_tag(other[at]) and other[at] not in tags:
            tags.append(str(other[at]))
    return tags


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI turns a body that is not UTF-8, or JSON nested past Python's recursion
        # limit, into a bare "There was an error parsing the body": say which it was.
        cause = exc.__cause__
        if isinstance(cause, UnicodeDecodeError):
            return APIError(f"the request body is not valid UTF-8: {cause.reason} at byte {cause.start}").response()
        if isinstance(cause, RecursionError):
            return APIError("the request body's JSON is nested too deeply").response()
        if isinstance(cause, ValueError):  # e.g. an integer of more than 4300 digits
            return APIError(f"the request body is not valid JSON: {cause}").response()
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
