"""The OpenAI HTTP surface: the FastAPI app, its middleware (API key, body size), the mapping
of every error to OpenAI's shape, and the SSE framing (the answers' bodies:
``deployments.responses``).

The routes themselves are methods of the Serve deployment (``deployments.ingress``); FastAPI
validates their bodies against the typed models of ``deployments.protocol`` and documents
every request and response in ``/openapi.json``. Bad input is answered with OpenAI-shaped 400s
(not FastAPI's 422s).
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` type.
import asyncio
import hmac
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.errors import (
    AuthenticationError,
    EngineError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)
from deployments.bodies import ErrorResponse, error_body
from deployments.retries import unwrap_error

T = TypeVar("T")

logger = logging.getLogger(__name__)

class OpenAIApp(FastAPI):
    """FastAPI, less the 422 it documents for every body: this API answers bad input with
    OpenAI-shaped 400s (``validation_error``)."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema:
            return self.openapi_schema
        schema = super().openapi()  # cached on self: the edits below stay
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema


api = OpenAIApp(title="splitserve", version="1.0.0",
                description="OpenAI-compatible API over split prefill/decode")
api.state.api_key = None
api.state.max_body_bytes = 1 << 20

_OPEN_PATHS = frozenset({"/health"})

REQUEST_ID_HEADER = "X-Request-Id"
IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
MAX_REQUEST_ID = 128
_VISIBLE = re.compile(r"[!-~]+")  # visible ASCII: no spaces or control characters

# The error answers every route may give, for the OpenAPI schema.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": "OpenAI-shaped error"}
    for code in (400, 401, 404, 413, 429, 500, 503, 504)
}
# Before OpenAPI 3.2 an event stream's `schema` describes one event: its `data` is a JSON
# chunk (deployments.bodies.StreamChunk), an error body, or "[DONE]".
SSE_RESPONSE: dict[int | str, dict[str, Any]] = {200: {
    "description": "The completion, or an SSE stream of chunks when stream is true",
    "content": {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                       "id": {"type": "string"}, "retry": {"type": "integer"}}}}}}}


# ---- errors -------------------------------------------------------------------------------


def error_response(exc: BaseException, request_id: str = "") -> JSONResponse:
    """Any exception as an OpenAI-shaped JSON error; engine errors keep their status code
    (and ``Retry-After``), anything else is a 500 logged with ``request_id``."""
    exc = unwrap_error(exc)
    if isinstance(exc, EngineError):
        headers = {}
        retry = getattr(exc, "retry_after_s", None)
        if retry is not None:
            headers["Retry-After"] = str(max(1, round(retry)))
        return JSONResponse(error_body(exc.message, exc.error_type, exc.param, exc.code),
                            status_code=exc.status_code, headers=headers)
    logger.error("request %s: internal error", request_id, exc_info=exc)
    return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


_NAMED = re.compile(r"(\w+): (.+)", re.DOTALL)


def validation_error(errors: list[Any]) -> InvalidRequestError:
    """The first of pydantic's (or FastAPI's) validation errors as a 400 naming its field.

    A check of several fields (a model validator) names the field it is about by starting
    its message with ``"field: "``; that field becomes the error's ``param``."""
    first = dict(errors[0]) if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "function-after"]
    if loc and loc[0] in ("body", "query", "path"):
        loc = loc[1:]
    kind = first.get("type")
    if kind == "json_invalid":
        return InvalidRequestError("the request body is not valid JSON")
    if not loc and kind in ("missing", "model_attributes_type", "dict_type", "model_type"):
        return InvalidRequestError("the request body must be a JSON object")
    msg = first.get("msg", "invalid value")
    if kind == "value_error":
        msg = str(first.get("ctx", {}).get("error", msg))
        named = _NAMED.fullmatch(msg)
        if named:
            if not loc or loc[-1] != named[1]:
                loc.append(named[1])
            msg = named[2]
    field = ".".join(loc)
    return InvalidRequestError(f"{field}: {msg}" if field else msg, param=field or None)


@api.exception_handler(RequestValidationError)
async def _on_validation_error(_request: Request, exc: RequestValidationError):
    return error_response(validation_error(list(exc.errors())))


@api.exception_handler(StarletteHTTPException)
async def _on_http_error(_request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        return error_response(NotFoundError(f"no route {_request.url.path}", code="not_found"))
    if exc.status_code == 413:
        return error_response(PayloadTooLargeError(str(exc.detail)))
    if exc.status_code == 400:  # FastAPI could not read the body at all
        return error_response(InvalidRequestError("the request body is not valid JSON"))
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"),
                        status_code=exc.status_code)


# ---- middleware ---------------------------------------------------------------------------


def _route_path(request: Request) -> str:
    path = request.url.path
    root = request.scope.get("root_path", "")  # the app's route prefix under Serve
    return path[len(root):] if root and path.startswith(root) else path


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over {limit} bytes")


class _HttpMiddleware:
    """ASGI middleware that acts on HTTP requests (``http``) and passes anything else on."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise NotImplementedError

    @staticmethod
    def header(scope: dict[str, Any], name: bytes) -> bytes | None:
        return dict(scope.get("headers") or []).get(name)


class BodyLimit(_HttpMiddleware):
    """ASGI middleware: a body over the app's ``state.max_body_bytes`` gets 413, checked on the
    declared length first and on the bytes as they arrive (a chunked upload)."""

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # the app Serve runs (set by the Ingress at start), which need not be this module's
        limit = int(getattr(scope["app"].state, "max_body_bytes", 1 << 20))
        declared = self.header(scope, b"content-length") or b""
        if declared.isdigit() and int(declared) > limit:
            too_large = PayloadTooLargeError(f"the request body is over {limit} bytes")
            await error_response(too_large)(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(limit)  # FastAPI re-raises HTTPExceptions as they are
            return message

        await self.app(scope, limited_receive, send)


def serve_request_id() -> str:
    """Serve's id for the current request ("" outside Serve): for HTTP, the client's
    X-Request-Id as sent, or one Serve's proxy made up; the proxy returns it in its own
    X-Request-ID response header. Read from Serve's request context (private, no public API)."""
    ctx = serve.context._serve_request_context.get()
    return ctx.request_id if ctx is not None else ""


def client_request_id(given: str | None) -> str:
    """The id a request is known by to its client and in logs: ``given`` (the client's
    X-Request-Id) when it is 1 to 128 visible ASCII characters, else Serve's id for the
    request if that is, else a new one. Only ever echoed and logged: the id that keys the
    request inside the system adds a unique suffix (``deployments.bodies.new_id``)."""
    for candidate in (given, serve_request_id()):
        if candidate and len(candidate) <= MAX_REQUEST_ID and _VISIBLE.fullmatch(candidate):
            return candidate
    return uuid.uuid4().hex


class RequestIds(_HttpMiddleware):
    """ASGI middleware: each HTTP request's ``client_request_id`` goes in
    ``scope["state"]["request_id"]`` for the routes, and in the response's ``X-Request-Id``.
    Behind Serve's proxy, which returns Serve's id in that header itself, the header is added
    only where the two differ (a client id that was refused), so no response carries one id
    twice."""

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        given = self.header(scope, b"x-request-id")
        rid = client_request_id(given.decode("latin-1") if given is not None else None)
        scope.setdefault("state", {})["request_id"] = rid
        echoed = rid == serve_request_id()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and not echoed:
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


# Starlette runs the middleware added last first: the request gets its id, then the API key
# is checked, then the body's size.
api.add_middleware(BodyLimit)


class ApiKey(_HttpMiddleware):
    """With an API key configured, every route but /health needs it as a bearer token. Plain
    ASGI, as the others: a streamed answer's chunks pass straight through (Starlette's
    ``@app.middleware("http")`` carries each chunk through a memory stream of its own)."""

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        key = getattr(scope["app"].state, "api_key", None)
        if key and _route_path(Request(scope)) not in _OPEN_PATHS:
            given = self.header(scope, b"authorization") or b""
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                await error_response(AuthenticationError())(scope, receive, send)
                return
        await self.app(scope, receive, send)


api.add_middleware(ApiKey)
api.add_middleware(RequestIds)


# ---- responses ----------------------------------------------------------------------------


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) of several async iterators, as each produces; the first error ends all
    of them (and propagates), as does closing the merged stream."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((k, item, None, False))
        except Exception as exc:
            await queue.put((k, None, exc, True))
        else:
            await queue.put((k, None, None, True))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            k, item, exc, done = await queue.get()
            if exc is not None:
                raise exc
            if done:
                live -= 1
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def sse_response(chunks: AsyncIterator[dict[str, Any]],
                       request_id: str = "") -> StreamingResponse:
    """Frame ``chunks`` as Server-Sent Events ending in ``data: [DONE]``.

    The first chunk is awaited before answering, so a failure to start (queue full, a dead
    phase) gets its own status code rather than a 200 with an error event; a failure after
    that ends the stream with an error event."""
    first = await chunks.__anext__()

    async def events() -> AsyncIterator[str]:
        try:
            yield _sse(first)
            async for chunk in chunks:
                yield _sse(chunk)
        except Exception as exc:
            err = unwrap_error(exc)
            if isinstance(err, EngineError):
                yield _sse(error_body(err.message, err.error_type, err.param, err.code))
            else:
                logger.exception("request %s: stream failed", request_id)
                yield _sse(error_body("internal server error", "server_error"))
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
