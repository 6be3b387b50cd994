"""Ingress: the Serve deployment that answers the OpenAI HTTP API and the Python handle API.

CPU only, no weights. It tokenizes and validates a request (``prepare``), runs it through the
phases (``deployments.split_path``), detokenizes the token stream and shapes the answer
(``deployments.openai_api``). It keeps the KV package's ObjectRef, never its bytes.
"""

# No `from __future__ import annotations` here: FastAPI must see the real types.
import asyncio
import importlib.metadata
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any
from urllib.parse import quote

import ray
from fastapi import Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.chat import PromptBuilder
from app.config import dtype_name
from app.errors import InvalidRequestError, ModelNotFoundError, NotFoundError, QueueFullError
from app.kv_package import KVLayout
from app.messages import FinishReason, PrefillRequest
from app.model_loader import load_tokenizer, read_model_shape
from app.output import LogprobText, StreamDelta, text_deltas
from app.sequence import validate_prompt
from app.tools import ToolMode
from deployments.admission import QueueWait
from deployments.args import AppArgs
from deployments.bodies import (
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    new_id,
)
from deployments.kv_budget import KVBudget, budget_from_cluster
from deployments.metrics import IngressMetrics
from deployments.openai_api import (
    ERROR_RESPONSES,
    IGNORED_FIELDS_HEADER,
    SSE_RESPONSE,
    api,
    client_request_id,
    error_response,
    merge_streams,
    sse_response,
    validation_error,
)
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Endpoint,
    TokenizeRequest,
)
from deployments.request_trace import RequestTrace, TraceHistory
from deployments.responses import completion_body, stream_chunks
from deployments.split_path import SharedPackage, SplitPath, choice_request, unwrap_error

GenerationRequest = ChatCompletionRequest | CompletionRequest

logger = logging.getLogger(__name__)

MAX_IGNORED_REPORTED = 32  # unknown field names listed in X-Ignored-Fields


def _package_version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    def __init__(self, prefill: DeploymentHandle | None, decode: DeploymentHandle,
                 args: dict[str, Any]) -> None:
        """``decode`` streams tokens; in the colocated app it is the ColocatedServer, which
        prefills every prompt itself, and ``prefill`` is None."""
        self.args = AppArgs.model_validate(args)
        self.tokenizer = load_tokenizer(self.args.engine)
        self.prompts = PromptBuilder(self.tokenizer)
        self.shape = read_model_shape(self.args.engine)
        self.kv_budget = self.make_kv_budget() if prefill is not None else None
        wait = self.args.ingress.max_queue_wait_s
        self.admission = QueueWait(wait) if wait is not None else None
        self.path = SplitPath(
            prefill, decode, local_prefill_threshold=self.args.local_prefill_threshold,
            request_timeout_s=self.args.request_timeout_s, max_retries=self.args.max_retries,
            retry_backoff_s=self.args.retry_backoff_s, kv_budget=self.kv_budget,
            local_prefill_when_busy=self.args.local_prefill_when_busy,
            prefill_busy_tokens=self.args.busy_prefill_tokens,
            prefill_preempts=self.args.engine.prefill_preempt_layers > 0,
            kv_bytes_per_token=KVLayout(
                self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim,
                dtype_name(self.args.engine.torch_kv_dtype)).bytes_per_token())
        self.model_name = self.args.model_name
        self.node_id = ray.get_runtime_context().get_node_id()
        self.metrics = IngressMetrics(self.model_name)
        self.in_flight = 0
        self.history = TraceHistory(self.args.ingress.trace_history)
        api.state.api_key = (self.args.ingress.api_key or os.environ.get("SPLITSERVE_API_KEY")
                             or None)
        api.state.max_body_bytes = self.args.ingress.max_body_bytes

    def make_kv_budget(self) -> KVBudget:
        """The bound on KV bytes in the object store, from a prompt's prefill until its
        stream ends: the configured bytes, or a share of the smallest node object store."""
        ing = self.args.ingress
        capacity = ing.kv_in_flight_bytes or budget_from_cluster(
            ray.nodes(), ing.kv_in_flight_fraction, ing.max_replicas)
        logger.info("KV budget: at most %.1f MB of KV packages in the object store",
                    capacity / 1e6)
        return KVBudget(capacity)

    def stats(self) -> dict[str, Any]:
        """What this ingress replica holds now: answers in flight and the KV budget."""
        out: dict[str, Any] = {"in_flight": self.in_flight,
                               "prefill_backlog_tokens": self.path.prefill_backlog_tokens,
                               "local_backlog_tokens": self.path.local_backlog_tokens,
                               "local_prefills_when_busy": self.path.local_when_busy}
        if self.kv_budget is not None:
            out.update(self.kv_budget.stats())
        if self.admission is not None:
            out.update(waiting_first_token=self.admission.waiting,
                       refused_for_wait=self.admission.refused,
                       estimated_wait_s=self.admission.estimate_s())
        return out

    # ---- request preparation -------------------------------------------------------------

    def parse(self, endpoint: Endpoint, body: Any) -> GenerationRequest:
        """A handle caller's body dict, validated like an HTTP body."""
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        try:
            return endpoint.request_model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; this server serves {self.model_name!r}")

    def ignored(self, body: Any, client_id: str) -> dict[str, str]:
        """Log the unknown fields of a body (once per request) and return the response header
        that reports them."""
        names = [quote(n, safe="._-~") for n in body.ignored_fields()]
        if not names:
            return {}
        # the names are the client's: percent-encoded, as a header must be ASCII and a log
        # line must stay one line; a header lists a bounded number of them
        logger.warning("request %s: ignored unknown fields: %s", client_id, ", ".join(names))
        shown = names[:MAX_IGNORED_REPORTED]
        if len(names) > len(shown):
            shown.append(f"...{len(names) - len(shown)} more")
        return {IGNORED_FIELDS_HEADER: ",".join(shown)}

    def prepare(self, endpoint: Endpoint, req: GenerationRequest,
                client_id: str) -> PrefillRequest:
        """Admit, tokenize and check a request against the model: every 4xx is raised here,
        before any replica is involved, and counted by its type. ``client_id``: the
        request's id to its client (``client_request_id``), which its internal id carries."""
        try:
            return self._prepare(endpoint, req, client_id)
        except Exception as exc:
            self.metrics.requests.inc(tags={"route": endpoint.value,
                                            "outcome": type(exc).__name__})
            raise

    def _prepare(self, endpoint: Endpoint, req: GenerationRequest,
                 client_id: str) -> PrefillRequest:
        if self.in_flight >= self.args.ingress.max_in_flight:
            raise QueueFullError(
                f"the server is at capacity ({self.in_flight} requests in flight); retry later",
                retry_after_s=1.0)
        if self.admission is not None:
            self.admission.admit()
        self.check_model(req.model)
        if isinstance(req, ChatCompletionRequest):
            ids = self.prompts.encode_chat(req.message_dicts(), tools=req.template_tools())
            default_max = self.args.default_max_tokens
        else:
            ids = self.prompts.encode_prompt(req.prompt)
            default_max = 16
        max_len = self.shape.max_model_len
        if req.max_tokens is None:
            # never let the default push a valid prompt over the context
            default_max = max(1, min(default_max, max_len - len(ids)))
        sampling = req.sampling_params(default_max, self.tool_parser(req)).with_seed()
        validate_prompt(ids, sampling, max_model_len=max_len, vocab_size=self.shape.vocab_size,
                        param=endpoint.prompt_param)
        return PrefillRequest(new_id(endpoint.id_prefix, client_id), tuple(ids), sampling,
                              n=req.n or 1)

    def tool_parser(self, req: GenerationRequest) -> str | None:
        return self.args.ingress.tool_call_parser if isinstance(req, ChatCompletionRequest) \
            else None

    def tool_mode(self, endpoint: Endpoint, req: GenerationRequest) -> ToolMode | None:
        """A chat answer's tool calls (``app.tools``), or None for text."""
        if endpoint is not Endpoint.CHAT or not isinstance(req, ChatCompletionRequest):
            return None
        return req.tool_mode(self.tool_parser(req))

    # ---- generation ----------------------------------------------------------------------

    async def deltas(self, endpoint: Endpoint, preq: PrefillRequest,
                     trace: RequestTrace | None = None,
                     shared: tuple[SharedPackage, int] | None = None,
                     ) -> AsyncIterator[StreamDelta]:
        """The text of one answer as it is generated, with its accounting: in-flight count,
        outcome, latency and token metrics and the trace kept for ``GET /debug/requests``.
        ``shared``: the answer's first attempt reads a package made for several."""
        trace = trace or RequestTrace()
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        if self.admission is not None:
            self.admission.entered()
        outcome = "cancelled"  # the client left before the end (the generator was closed)
        finish = None
        try:
            async for delta in text_deltas(self.path.resumable_stream(preq, trace, shared),
                                           self.tokenizer, preq.sampling):
                previous = trace.last_token
                if previous is None and self.admission is not None:
                    self.admission.first_token()
                trace.token(len(delta.token_ids))
                self.record_tokens(trace, previous, len(delta.token_ids))
                finish = delta.finish_reason or finish
                yield delta
            outcome = "ok"
        except Exception as exc:
            outcome = type(unwrap_error(exc)).__name__
            logger.warning("request %s failed: %s", preq.request_id, outcome)
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
            if trace.last_token is None and self.admission is not None:
                self.admission.left_without_token()
            self.history.add(preq.request_id, preq.num_tokens, trace)
            self.record_answer(endpoint, preq, trace, outcome, finish)

    def record_tokens(self, trace: RequestTrace, previous: float | None, n: int) -> None:
        """Tokens that just reached the ingress: TTFT for the first, the inter-token gap
        (shared by the tokens of one delta) for the others."""
        m = self.metrics
        if n > 0:  # Ray's counters refuse 0
            m.generation_tokens.inc(n)
        if previous is None:
            m.ttft.observe(trace.ttft_s)
            n -= 1
        if n > 0 and trace.last_token is not None:
            gap = (trace.last_token - (previous or trace.first_token)) / n
            for _ in range(n):
                m.itl.observe(gap)

    def record_answer(self, endpoint: Endpoint, preq: PrefillRequest, trace: RequestTrace,
                      outcome: str, finish: FinishReason | None) -> None:
        """One answer ended: its outcome, and for one that ended normally (or whose client
        left) vLLM's per-request series."""
        m = self.metrics
        m.requests.inc(tags={"route": endpoint.value, "outcome": outcome})
        if outcome not in ("ok", "cancelled"):
            return
        reason = "abort" if outcome == "cancelled" or finish is None else finish.value
        m.success.inc(tags={"finished_reason": reason})
        m.prompt_tokens.inc(preq.num_tokens)
        m.request_prompt_tokens.observe(preq.num_tokens)
        m.request_generation_tokens.observe(trace.output_tokens)
        if trace.last_token is not None:
            m.e2e.observe(trace.last_token - trace.received)
        if trace.tpot_s is not None:
            m.tpot.observe(trace.tpot_s)

    async def answers(self, endpoint: Endpoint, preq: PrefillRequest, trace: RequestTrace
                      ) -> tuple[list[AsyncIterator[StreamDelta]], Callable[[], None]]:
        """One delta stream per answer, the first recorded in ``trace`` (whose
        ``cached_tokens`` the usage reports: the prompt counts once), and what to call once
        they have ended. ``n > 1``: the prompt is prefilled once (a first token per answer)
        and every answer's decode stream reads that one KV object, whose room in the KV
        budget the call gives back (the object lives until the last stream ends)."""
        if preq.n == 1:
            return [self.deltas(endpoint, preq, trace)], lambda: None
        shared = await self.path.shared_prefill(preq, trace)
        streams = [self.deltas(endpoint, choice_request(preq, k), trace if k == 0 else None,
                               shared=None if shared is None else (shared, k))
                   for k in range(preq.n)]
        return streams, (lambda: None) if shared is None else shared.reservation.release

    async def complete(self, endpoint: Endpoint, req: GenerationRequest, client_id: str,
                       trace: RequestTrace | None = None) -> dict[str, Any]:
        """The whole answer of a non-streamed request (``trace``: of its first answer)."""
        preq = self.prepare(endpoint, req, client_id)
        trace = trace or RequestTrace()
        streams, done = await self.answers(endpoint, preq, trace)

        async def collect(stream: AsyncIterator[StreamDelta]
                          ) -> tuple[str, int, Any, list[LogprobText]]:
            text, n_out, finish, logprobs = "", 0, None, []
            async for delta in stream:
                text += delta.text
                n_out += len(delta.token_ids)
                finish = delta.finish_reason or finish
                logprobs += delta.logprobs or []
            return text, n_out, finish, logprobs

        tasks = [asyncio.ensure_future(collect(s)) for s in streams]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # one answer failed (or the client left): stop the others
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            done()
        return completion_body(endpoint, preq.request_id, self.model_name,
                               [(text, finish) for text, _, finish, _ in results],
                               preq.num_tokens, sum(n for _, n, _, _ in results),
                               [lps for *_, lps in results]
                               if preq.sampling.logprobs is not None else None,
                               cached_tokens=trace.cached_tokens or 0,
                               tool_mode=self.tool_mode(endpoint, req))

    async def indexed_deltas(self, endpoint: Endpoint, preq: PrefillRequest,
                             trace: RequestTrace) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(answer index, delta) of every answer, as they come (``trace``: the first's)."""
        streams, done = await self.answers(endpoint, preq, trace)
        try:
            if len(streams) == 1:
                async for delta in streams[0]:
                    yield 0, delta
                return
            async for item in merge_streams(streams):
                yield item
        finally:
            done()

    def chunks(self, endpoint: Endpoint, req: GenerationRequest,
               client_id: str) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed answer."""
        preq = self.prepare(endpoint, req, client_id)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        trace = RequestTrace()
        return stream_chunks(endpoint, preq.request_id, self.model_name, preq.num_tokens,
                             self.indexed_deltas(endpoint, preq, trace), include_usage,
                             cached_tokens=lambda: trace.cached_tokens or 0,
                             tool_mode=self.tool_mode(endpoint, req))

    async def answer(self, endpoint: Endpoint, req: GenerationRequest,
                     http: Request) -> Response:
        """The HTTP answer to a generation request (X-Request-Id is added by
        ``openai_api.RequestIds``)."""
        client_id = http.state.request_id
        headers = self.ignored(req, client_id)
        try:
            if req.stream:
                response: Response = await sse_response(self.chunks(endpoint, req, client_id),
                                                        client_id)
            else:
                response = JSONResponse(await self.complete(endpoint, req, client_id))
        except Exception as exc:
            response = error_response(exc, client_id)
        response.headers.update(headers)
        return response

    # ---- HTTP routes ---------------------------------------------------------------------

    @api.post("/v1/chat/completions", response_model=CompletionResponse,
              responses={**SSE_RESPONSE, **ERROR_RESPONSES})
    async def http_chat(self, body: ChatCompletionRequest, request: Request):
        return await self.answer(Endpoint.CHAT, body, request)

    @api.post("/v1/completions", response_model=CompletionResponse,
              responses={**SSE_RESPONSE, **ERROR_RESPONSES})
    async def http_completions(self, body: CompletionRequest, request: Request):
        return await self.answer(Endpoint.COMPLETION, body, request)

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, max_model_len=self.shape.max_model_len)

    @api.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def http_models(self):
        return ModelList(data=[self.model_card()])

    @api.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def http_model(self, model_id: str):
        """One model's card; 404 unless it is the served model."""
        try:
            self.check_model(model_id)
        except ModelNotFoundError as exc:
            return error_response(exc)
        return self.model_card()

    @api.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def http_tokenize(self, body: TokenizeRequest, request: Request):
        """vLLM's /tokenize: the token ids the generation routes would compute."""
        headers = self.ignored(body, request.state.request_id)
        try:
            self.check_model(body.model)
            if body.messages is not None:
                ids = self.prompts.encode_chat([m.model_dump(exclude_none=True)
                                                for m in body.messages],
                                               body.add_generation_prompt)
            else:
                ids = self.prompts.encode_prompt(str(body.prompt))
        except Exception as exc:
            return error_response(exc, request.state.request_id)
        out = TokenizeResponse(count=len(ids), max_model_len=self.shape.max_model_len,
                               tokens=ids)
        return JSONResponse(out.model_dump(), headers=headers)

    @api.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def http_detokenize(self, body: DetokenizeRequest, request: Request):
        """vLLM's /detokenize: token ids back to text; 400 for an id outside the
        vocabulary."""
        headers = self.ignored(body, request.state.request_id)
        try:
            self.check_model(body.model)
            bad = next((t for t in body.tokens if not 0 <= t < self.prompts.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"token id {bad} is outside the vocabulary [0, {self.prompts.vocab_size})",
                    param="tokens")
        except Exception as exc:
            return error_response(exc, request.state.request_id)
        text = self.tokenizer.decode(body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump(), headers=headers)

    @api.get("/version", response_model=VersionResponse, responses=ERROR_RESPONSES)
    async def http_version(self):
        return VersionResponse(version=_package_version())

    @api.get("/debug/requests", responses=ERROR_RESPONSES)
    async def http_recent_requests(self, limit: Annotated[int, Query(ge=0)] = 100):
        """Server-side timings of the most recent finished requests, newest last (see
        ``RequestTrace``); 404 when ``ingress.trace_history`` is 0."""
        if not self.history.enabled:
            return error_response(NotFoundError(
                "request history is off (ingress.trace_history: 0)", code="not_found"))
        return {"object": "list", "data": self.history.last(limit)}

    @api.get("/health")
    async def http_health(self):
        status = await self.readiness()
        return JSONResponse(status, status_code=200 if status["ready"] else 503)

    # ---- Python handle API ---------------------------------------------------------------

    async def readiness(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Ready when both phases (or the colocated server) answer a ping through their
        handles."""
        return await self.path.readiness(timeout_s)

    def handle_request(self, endpoint: Endpoint,
                       body: Any) -> tuple[GenerationRequest, str]:
        """A handle call's request and its id (Serve's id for the call); its unknown fields
        are logged as over HTTP."""
        req, client_id = self.parse(endpoint, body), client_request_id(None)
        self.ignored(req, client_id)
        return req, client_id

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat completion from the same fields as the HTTP body (non-streaming)."""
        return await self.complete(Endpoint.CHAT, *self.handle_request(Endpoint.CHAT, body))

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.complete(Endpoint.COMPLETION,
                                   *self.handle_request(Endpoint.COMPLETION, body))

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streaming chat: yields the same chunk objects as the SSE stream."""
        async for c in self.chunks(Endpoint.CHAT, *self.handle_request(Endpoint.CHAT, body)):
            yield c

    async def completions_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for c in self.chunks(Endpoint.COMPLETION,
                                   *self.handle_request(Endpoint.COMPLETION, body)):
            yield c

    def recent_requests(self, limit: int = 100) -> list[dict[str, Any]]:
        """The server-side timings of the last ``limit`` finished requests, newest last."""
        return self.history.last(limit)

    async def trace(self, body: dict[str, Any], kind: str = "chat") -> dict[str, Any]:
        """Run one request and report where its work and its KV object went (diagnostics)."""
        endpoint = Endpoint(kind)
        trace = RequestTrace()
        response = await self.complete(endpoint, *self.handle_request(endpoint, body), trace)
        return {"response": response, "ingress_node": self.node_id, **trace.as_dict()}
