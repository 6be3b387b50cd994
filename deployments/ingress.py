"""Ingress: the OpenAI-compatible HTTP API and the Python handle API.

CPU only, no weights: it tokenizes, validates, asks prefill for a KV package (keeping the
ObjectRef, never its bytes), hands that ref to decode, and detokenizes the token stream.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` type.
import asyncio
import collections
import dataclasses
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.chat import PromptBuilder
from app.decode import TokenEvent
from app.errors import (
    AuthenticationError,
    EngineError,
    InvalidRequestError,
    ModelNotFoundError,
    NotFoundError,
    PayloadTooLargeError,
    QueueFullError,
    ReplicaUnhealthyError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from app.model_loader import load_tokenizer, local_model_dir, resolve_model
from app.output import GenerationFailed, StreamDelta, text_deltas
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    usage_dict,
)
from app.sequence import PrefillRequest, validate_prompt
from deployments.args import AppArgs
from deployments.metrics import IngressMetrics
from deployments.replica import StreamStart

logger = logging.getLogger(__name__)

api = FastAPI(title="splitserve", description="OpenAI-compatible API over split prefill/decode")
api.state.api_key = None

_OPEN_PATHS = frozenset({"/health"})

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}},
    }},
}
_COMPLETION_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                   "created": {"type": "integer"}, "model": {"type": "string"},
                   "choices": {"type": "array", "minItems": 1},
                   "usage": {"type": "object", "required": ["prompt_tokens",
                                                           "completion_tokens",
                                                           "total_tokens"]}},
}


def _openapi_schema() -> dict[str, Any]:
    """FastAPI's schema plus the request bodies, which the routes parse themselves (to answer
    bad input with OpenAI-shaped 400s rather than FastAPI's 422s), and every response."""
    from fastapi.openapi.utils import get_openapi

    if api.openapi_schema:
        return api.openapi_schema
    schema = get_openapi(title=api.title, version="1.0.0", description=api.description,
                         routes=api.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = _ERROR_SCHEMA
    components["Completion"] = _COMPLETION_SCHEMA
    error = {"description": "OpenAI-shaped error",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, model in (("/v1/chat/completions", ChatCompletionRequest),
                        ("/v1/completions", CompletionRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        op["responses"] = {
            "200": {"description": "The completion, or an SSE stream when stream is true",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Completion"}},
                        "text/event-stream": {"schema": {"type": "string"}}}},
            **{code: error for code in ("400", "401", "404", "413", "429", "500", "503", "504")},
        }
    # GET /debug/requests reads its query itself, for the same reason
    op = schema["paths"]["/debug/requests"]["get"]
    op["parameters"] = [{"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 0, "default": 100}}]
    op["responses"] = {
        "200": {"description": "The last finished requests' server-side timings",
                "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"],
                    "properties": {"object": {"type": "string"},
                                   "data": {"type": "array"}}}}}},
        **{code: error for code in ("400", "401", "404")},
    }
    schema["openapi"] = "3.1.0"
    api.openapi_schema = schema
    return schema


api.openapi = _openapi_schema  # type: ignore[method-assign]


@api.middleware("http")
async def require_api_key(request: Request, call_next):
    """With an API key configured, every route but /health needs it as a bearer token."""
    key = getattr(request.app.state, "api_key", None)
    path = request.url.path
    root = request.scope.get("root_path", "")  # the app's route prefix under Serve
    if root and path.startswith(root):
        path = path[len(root):]
    if key and path not in _OPEN_PATHS:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return error_response(AuthenticationError())
    return await call_next(request)


# A replica, its worker or its node went away, or the KV object was lost with them: the
# request can be re-run elsewhere (ARCHITECTURE.md, failure policy).
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    ray.exceptions.ObjectLostError,  # OwnerDiedError, ObjectReconstructionFailedError...
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    serve.exceptions.DeploymentUnavailableError,
    ReplicaUnhealthyError,  # a decode replica found itself wedged and gave up its streams
)


def unwrap_error(exc: BaseException) -> BaseException:
    """The engine error inside a Ray task error, if there is one."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        return cause
    if isinstance(exc, serve.exceptions.BackPressureError):
        return ServiceUnavailableError(f"a phase is at capacity: {exc}", retry_after_s=1.0,
                                       code="backpressure")
    return exc


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, RETRYABLE_ERRORS) or isinstance(unwrap_error(exc), RETRYABLE_ERRORS)


def error_response(exc: BaseException) -> JSONResponse:
    exc = unwrap_error(exc)
    if isinstance(exc, EngineError):
        headers = {}
        retry = getattr(exc, "retry_after_s", None)
        if retry is not None:
            headers["Retry-After"] = str(max(1, round(retry)))
        return JSONResponse(error_body(exc.message, exc.error_type, exc.param, exc.code),
                            status_code=exc.status_code, headers=headers)
    logger.exception("internal error", exc_info=exc)
    return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


def _validation_error(exc: ValidationError) -> InvalidRequestError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if p not in ("function-after",))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        msg = f"unsupported field {loc!r}"
    return InvalidRequestError(f"{loc}: {msg}" if loc else msg, param=loc or None)


@dataclass(slots=True)
class RequestTrace:
    """Server-side timings of one request (seconds), for the handle API, ``GET
    /debug/requests`` and load tests.

    ``breakdown`` splits the request's life into phases: ``prefill_queue_s`` (ingress hand-off,
    routing and waiting for a prefill batch), ``prefill_compute_s`` (the batch's forward pass),
    ``kv_hop_s`` (prefill returned -> the decode replica holds the package),
    ``first_token_s`` (the rest of the time to the first token: stream start, detokenizing,
    the hops back to the ingress), ``decode_queue_s`` (waiting to join the decode batch,
    which the client sees as a longer gap after the first token) and ``decode_s`` (first to
    last token). Cross-process differences use wall clocks (``time.time()``), so on a
    multi-node cluster they are as good as its clock sync.
    """

    received: float = field(default_factory=time.perf_counter)
    received_at: float = field(default_factory=time.time)
    stream_start: StreamStart | None = None
    first_token: float | None = None
    last_token: float | None = None
    decode_queue_s: float | None = None
    output_tokens: int = 0
    attempts: int = 0  # streams started: 1, plus one per retry
    kv_locations: list[str] | None = None
    kv_object_size: int | None = None

    def breakdown(self) -> dict[str, float | None] | None:
        s = self.stream_start
        if s is None or self.first_token is None or not s.prefill_done_at:
            return None
        queue = max(0.0, s.prefill_done_at - s.prefill_s - self.received_at)
        ttft = self.first_token - self.received
        decode = None if self.last_token is None else self.last_token - self.first_token
        return {
            "prefill_queue_s": queue,
            "prefill_compute_s": s.prefill_s,
            "kv_hop_s": s.kv_hop_s,
            "first_token_s": max(0.0, ttft - queue - s.prefill_s - s.kv_hop_s),
            "decode_queue_s": self.decode_queue_s,
            "decode_s": decode,
        }

    def as_dict(self) -> dict[str, Any]:
        s = self.stream_start
        out: dict[str, Any] = {
            "ttft_s": None if self.first_token is None else self.first_token - self.received,
            "e2e_s": None if self.last_token is None else self.last_token - self.received,
            "output_tokens": self.output_tokens,
            "attempts": self.attempts,
            "breakdown": self.breakdown(),
        }
        if s is not None:
            out.update(decode_node=s.node_id, kv_bytes=s.kv_bytes, kv_hop_s=s.kv_hop_s,
                       kv_fetch_s=s.fetch_s, prefill_compute_s=s.prefill_s,
                       prefill_path="local" if s.local_prefill else "remote",
                       decode_replica=s.replica_id)
        if self.kv_locations is not None:
            out.update(kv_locations=self.kv_locations, kv_object_size=self.kv_object_size)
        return out


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    def __init__(self, prefill: DeploymentHandle | None, decode: DeploymentHandle,
                 args: dict[str, Any]) -> None:
        """``decode`` streams tokens; in the colocated app (``mode: colocated``) it is the
        ColocatedServer, which prefills every prompt itself, and ``prefill`` is None."""
        from transformers import AutoConfig

        self.args = AppArgs.model_validate(args)
        cfg = self.args.engine_config("prefill")
        self.prefill = prefill
        self.decode = decode
        self.colocated = self.args.mode == "colocated"
        self.tokenizer = load_tokenizer(cfg)
        self.prompts = PromptBuilder(self.tokenizer)
        model_cfg = AutoConfig.from_pretrained(
            local_model_dir(resolve_model(cfg.model), cfg.resolved_cache_dir))
        model_len = int(getattr(model_cfg, "max_position_embeddings", 2048))
        self.max_model_len = min(model_len, cfg.max_model_len or model_len)
        self.vocab_size = int(model_cfg.vocab_size)
        self.model_name = self.args.model_name
        self.node_id = ray.get_runtime_context().get_node_id()
        self.metrics = IngressMetrics()
        self.in_flight = 0
        self.retries = 0
        self.api_key = self.args.ingress.api_key or os.environ.get("SPLITSERVE_API_KEY") or None
        api.state.api_key = self.api_key
        api.state.max_body_bytes = self.args.ingress.max_body_bytes
        history = self.args.ingress.trace_history
        # the server-side timings of the last requests (GET /debug/requests)
        self.recent: collections.deque[dict[str, Any]] | None = (
            collections.deque(maxlen=history) if history else None)

    # ---- request preparation -------------------------------------------------------------

    def _prepare(self, kind: str, body: Any) -> tuple[Any, PrefillRequest]:
        if self.in_flight >= self.args.ingress.max_in_flight:
            raise QueueFullError(
                f"the server is at capacity ({self.in_flight} requests in flight); retry later",
                retry_after_s=1.0)
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = schema.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        if req.model is not None and req.model != self.model_name:
            raise ModelNotFoundError(
                f"model {req.model!r} is not served here; this server serves {self.model_name!r}")
        if kind == "chat":
            ids = self.prompts.encode_chat(req.message_dicts())
            param = "messages"
            default_max = self.args.default_max_tokens
        else:
            ids = self.prompts.encode_prompt(req.prompt)
            param = "prompt"
            default_max = 16
        if req.max_tokens is None:
            # never let the default push a valid prompt over the context
            default_max = max(1, min(default_max, self.max_model_len - len(ids)))
        sampling = req.sampling_params(default_max).with_seed()
        validate_prompt(ids, sampling, max_model_len=self.max_model_len,
                        vocab_size=self.vocab_size, param=param)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return req, PrefillRequest(new_id(prefix), tuple(ids), sampling)

    # ---- the split path ------------------------------------------------------------------

    async def _token_events(self, preq: PrefillRequest,
                            trace: RequestTrace | None) -> AsyncIterator[TokenEvent]:
        ref: ray.ObjectRef | None = None
        prefill_call = None
        if self.colocated or preq.num_tokens < self.args.local_prefill_threshold:
            # colocated app, or a short prompt: the decode replica prefills it itself, no hop
            stream = self.decode.options(stream=True).generate_local.remote(preq)
        else:
            prefill_call = self.prefill.prefill.remote(preq)
            try:
                ref = await prefill_call._to_object_ref()
            except BaseException:
                prefill_call.cancel()  # client gone or timed out: drop the queued prompt
                raise
            # the list keeps Ray from resolving the ref here: decode resolves it on its node
            stream = self.decode.options(stream=True).generate.remote([ref])
        try:
            async for item in stream:
                if isinstance(item, StreamStart):
                    if trace is not None:
                        trace.stream_start = item
                        trace.attempts += 1
                        if trace.kv_locations is None and ref is not None:
                            loc = ray.experimental.get_object_locations([ref])[ref]
                            trace.kv_locations = list(loc.get("node_ids", []))
                            trace.kv_object_size = loc.get("object_size")
                    ref = None  # decode holds the package: let the object go
                    prefill_call = None
                    continue
                yield item
        finally:
            stream.cancel()
            if prefill_call is not None:
                prefill_call.cancel()  # a prompt still queued for prefill is dropped

    async def _resilient_events(self, preq: PrefillRequest,
                                trace: RequestTrace | None) -> AsyncIterator[TokenEvent]:
        """The token stream of ``preq``, surviving replica and node failures and bounded in
        time.

        When a prefill or decode replica (or its node, or the KV object) is lost, the request
        is prefilled again with the prompt plus the tokens already delivered and resumes on
        another decode replica: sampling continues at the same output index, so the client
        sees no missing and no duplicated token (greedy: the undisturbed text). After
        ``max_retries`` re-runs, or past ``request_timeout_s``, it ends with an error.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.args.request_timeout_s
        delivered: list[int] = []
        attempt = 0
        current = preq
        while True:
            events = self._token_events(current, trace).__aiter__()
            try:
                while True:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise TimeoutError
                    try:
                        event = await asyncio.wait_for(events.__anext__(), remaining)
                    except StopAsyncIteration:
                        return
                    if event.token_id is not None:
                        delivered.append(event.token_id)
                    if (trace is not None and event.decode_queue_s is not None
                            and trace.decode_queue_s is None):
                        trace.decode_queue_s = event.decode_queue_s
                    yield event
                    if event.finish_reason is not None:
                        return
            except TimeoutError:
                raise RequestTimeoutError(
                    f"request {preq.request_id} took longer than the server's request timeout "
                    f"({self.args.request_timeout_s:g} s); its work was stopped") from None
            except Exception as exc:
                if not is_retryable(exc):
                    raise
                if attempt >= self.args.max_retries:
                    raise GenerationFailed(
                        f"request {preq.request_id} failed after {attempt} retries: "
                        f"{type(unwrap_error(exc)).__name__}") from exc
                attempt += 1
                self.retries += 1
                logger.warning("request %s: %s; retry %d/%d with %d tokens delivered",
                               preq.request_id, type(unwrap_error(exc)).__name__, attempt,
                               self.args.max_retries, len(delivered))
                current = PrefillRequest(
                    f"{preq.request_id}-retry{attempt}",
                    preq.prompt_token_ids + tuple(delivered),
                    dataclasses.replace(preq.sampling,
                                        max_tokens=preq.sampling.max_tokens - len(delivered)),
                    output_offset=len(delivered),
                )
                await asyncio.sleep(self.args.retry_backoff_s * 2 ** (attempt - 1))
            finally:
                await events.aclose()

    async def _deltas(self, preq: PrefillRequest,
                      trace: RequestTrace | None = None) -> AsyncIterator[StreamDelta]:
        trace = trace or RequestTrace()
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        n_tokens = 0
        try:
            async for delta in text_deltas(self._resilient_events(preq, trace),
                                           self.tokenizer, preq.sampling):
                t = time.perf_counter()
                if trace.first_token is None:
                    trace.first_token = t
                    self.metrics.ttft_ms.observe((t - trace.received) * 1000)
                trace.last_token = t
                n_tokens += len(delta.token_ids)
                yield delta
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            trace.output_tokens = n_tokens
            if self.recent is not None:
                self.recent.append({"id": preq.request_id, "prompt_tokens": preq.num_tokens,
                                    **trace.as_dict()})
            if n_tokens > 1 and trace.first_token is not None and trace.last_token is not None:
                self.metrics.tpot_ms.observe(
                    (trace.last_token - trace.first_token) / (n_tokens - 1) * 1000)

    async def _complete(self, kind: str, body: Any,
                        trace: RequestTrace | None = None) -> dict[str, Any]:
        _req, preq = self._prepare(kind, body)
        text, token_ids, finish = "", [], None
        async for delta in self._deltas(preq, trace):
            text += delta.text
            token_ids.extend(delta.token_ids)
            finish = delta.finish_reason or finish
        usage = usage_dict(preq.num_tokens, len(token_ids))
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {"id": preq.request_id, "object": obj, "created": now(),
                "model": self.model_name, "choices": [choice], "usage": usage}

    async def _chunks(self, kind: str, req: Any, preq: PrefillRequest,
                      deltas: AsyncIterator[StreamDelta]) -> AsyncIterator[dict[str, Any]]:
        created = now()
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        n_out = 0

        def chunk(text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"content": text}
                if first:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            return {"id": preq.request_id, "object": obj, "created": created,
                    "model": self.model_name, "choices": [choice]}

        first = True
        async for delta in deltas:
            n_out += len(delta.token_ids)
            if delta.text or delta.finish_reason or first:
                yield chunk(delta.text, delta.finish_reason, first)
                first = False
        opts = req.stream_options
        if opts is not None and opts.include_usage:
            yield {"id": preq.request_id, "object": obj, "created": created,
                   "model": self.model_name, "choices": [],
                   "usage": usage_dict(preq.num_tokens, n_out)}

    async def _stream_response(self, kind: str, body: dict[str, Any]):
        req, preq = self._prepare(kind, body)
        chunks = self._chunks(kind, req, preq, self._deltas(preq))
        # Wait for the first chunk before answering, so a failure to start (queue full, a
        # dead phase) gets its own status code instead of a 200 with an error event.
        first = await chunks.__anext__()

        async def sse() -> AsyncIterator[str]:
            try:
                yield f"data: {json.dumps(first)}\n\n"
                async for c in chunks:
                    yield f"data: {json.dumps(c)}\n\n"
            except Exception as exc:  # the stream already started: end it with an error event
                err = unwrap_error(exc)
                if isinstance(err, EngineError):
                    body_ = error_body(err.message, err.error_type, err.param, err.code)
                else:
                    logger.exception("stream failed")
                    body_ = error_body("internal server error", "server_error")
                yield f"data: {json.dumps(body_)}\n\n"
            finally:
                await chunks.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _read_json(self, request: Request) -> Any:
        limit = self.args.ingress.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(f"the request body is over {limit} bytes")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise PayloadTooLargeError(f"the request body is over {limit} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InvalidRequestError("the request body is not valid JSON") from None

    async def _handle(self, kind: str, request: Request):
        try:
            body = await self._read_json(request)
            if isinstance(body, dict) and body.get("stream") is True:
                return await self._stream_response(kind, body)
            return JSONResponse(await self._complete(kind, body))
        except Exception as exc:
            return error_response(exc)

    # ---- HTTP routes ---------------------------------------------------------------------

    @api.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._handle("chat", request)

    @api.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._handle("completion", request)

    @api.get("/v1/models")
    async def http_models(self):
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "splitserve",
            "max_model_len": self.max_model_len}]}

    @api.get("/debug/requests")
    async def http_recent_requests(self, request: Request):
        """Server-side timings of the most recent finished requests, newest last (see
        ``RequestTrace``); ``limit`` (default 100) a non-negative integer, else 400; 404 when
        ``ingress.trace_history`` is 0."""
        raw = request.query_params.get("limit", "100")
        if not raw.isdigit():
            return error_response(InvalidRequestError(
                f"limit must be a non-negative integer, got {raw!r}", param="limit"))
        if self.recent is None:
            return error_response(NotFoundError(
                "request history is off (ingress.trace_history: 0)", code="not_found"))
        return {"object": "list", "data": self.recent_requests(int(raw))}

    @api.get("/health")
    async def http_health(self):
        status = await self.readiness()
        return JSONResponse(status, status_code=200 if status["ready"] else 503)

    # ---- Python handle API ---------------------------------------------------------------

    async def readiness(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Ready when both phases (or the colocated server) answer a ping through their
        handles."""
        async def ping(handle: DeploymentHandle) -> bool:
            try:
                await asyncio.wait_for(handle.ping.remote(), timeout_s)
                return True
            except Exception:
                return False

        if self.colocated:
            ok = await ping(self.decode)
            return {"ready": ok, "colocated": ok}
        prefill_ok, decode_ok = await asyncio.gather(ping(self.prefill), ping(self.decode))
        return {"ready": prefill_ok and decode_ok, "prefill": prefill_ok, "decode": decode_ok}

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat completion from the same fields as the HTTP body (non-streaming)."""
        return await self._complete("chat", body)

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._complete("completion", body)

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streaming chat: yields the same chunk objects as the SSE stream."""
        req, preq = self._prepare("chat", body)
        async for c in self._chunks("chat", req, preq, self._deltas(preq)):
            yield c

    async def completions_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        req, preq = self._prepare("completion", body)
        async for c in self._chunks("completion", req, preq, self._deltas(preq)):
            yield c

    def recent_requests(self, limit: int = 100) -> list[dict[str, Any]]:
        """The server-side timings of the last ``limit`` finished requests, newest last."""
        if self.recent is None or limit <= 0:
            return []
        return list(self.recent)[-limit:]

    async def trace(self, body: dict[str, Any], kind: str = "chat") -> dict[str, Any]:
        """Run one request and report where its work and its KV object went (diagnostics)."""
        trace = RequestTrace()
        response = await self._complete(kind, body, trace)
        return {"response": response, "ingress_node": self.node_id, **trace.as_dict()}
