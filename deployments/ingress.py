"""Ingress: the Serve deployment that answers the OpenAI HTTP API and the Python handle API.

CPU only, no weights. It tokenizes and validates a request (``prepare``), runs it through the
phases (``deployments.split_path``), detokenizes the token stream and shapes the answer
(``deployments.openai_api``). It keeps the KV package's ObjectRef, never its bytes.
"""

# No `from __future__ import annotations` here: FastAPI must see the real types.
import asyncio
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

import ray
from fastapi import Query
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.chat import PromptBuilder
from app.errors import InvalidRequestError, ModelNotFoundError, NotFoundError, QueueFullError
from app.messages import FinishReason, PrefillRequest
from app.model_loader import load_tokenizer, read_model_shape
from app.output import StreamDelta, text_deltas
from app.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
    Endpoint,
    ModelCard,
    ModelList,
    new_id,
)
from app.sequence import validate_prompt
from deployments.args import AppArgs
from deployments.metrics import IngressMetrics
from deployments.openai_api import (
    ERROR_RESPONSES,
    SSE_RESPONSE,
    api,
    completion_body,
    error_response,
    merge_streams,
    sse_response,
    stream_chunks,
    validation_error,
)
from deployments.request_trace import RequestTrace, TraceHistory
from deployments.split_path import SplitPath, choice_request, unwrap_error

GenerationRequest = ChatCompletionRequest | CompletionRequest


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    def __init__(self, prefill: DeploymentHandle | None, decode: DeploymentHandle,
                 args: dict[str, Any]) -> None:
        """``decode`` streams tokens; in the colocated app it is the ColocatedServer, which
        prefills every prompt itself, and ``prefill`` is None."""
        self.args = AppArgs.model_validate(args)
        self.path = SplitPath(
            prefill, decode, local_prefill_threshold=self.args.local_prefill_threshold,
            request_timeout_s=self.args.request_timeout_s, max_retries=self.args.max_retries,
            retry_backoff_s=self.args.retry_backoff_s)
        self.tokenizer = load_tokenizer(self.args.engine)
        self.prompts = PromptBuilder(self.tokenizer)
        self.shape = read_model_shape(self.args.engine)
        self.model_name = self.args.model_name
        self.node_id = ray.get_runtime_context().get_node_id()
        self.metrics = IngressMetrics(self.model_name)
        self.in_flight = 0
        self.history = TraceHistory(self.args.ingress.trace_history)
        api.state.api_key = (self.args.ingress.api_key or os.environ.get("SPLITSERVE_API_KEY")
                             or None)
        api.state.max_body_bytes = self.args.ingress.max_body_bytes

    # ---- request preparation -------------------------------------------------------------

    def parse(self, endpoint: Endpoint, body: Any) -> GenerationRequest:
        """A handle caller's body dict, validated like an HTTP body."""
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        try:
            return endpoint.request_model.model_validate(body)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    def prepare(self, endpoint: Endpoint, req: GenerationRequest) -> PrefillRequest:
        """Admit, tokenize and check a request against the model: every 4xx is raised here,
        before any replica is involved, and counted by its type."""
        try:
            return self._prepare(endpoint, req)
        except Exception as exc:
            self.metrics.requests.inc(tags={"route": endpoint.value,
                                            "outcome": type(exc).__name__})
            raise

    def _prepare(self, endpoint: Endpoint, req: GenerationRequest) -> PrefillRequest:
        if self.in_flight >= self.args.ingress.max_in_flight:
            raise QueueFullError(
                f"the server is at capacity ({self.in_flight} requests in flight); retry later",
                retry_after_s=1.0)
        if req.model is not None and req.model != self.model_name:
            raise ModelNotFoundError(
                f"model {req.model!r} is not served here; this server serves {self.model_name!r}")
        if isinstance(req, ChatCompletionRequest):
            ids = self.prompts.encode_chat(req.message_dicts())
            default_max = self.args.default_max_tokens
        else:
            ids = self.prompts.encode_prompt(req.prompt)
            default_max = 16
        max_len = self.shape.max_model_len
        if req.max_tokens is None:
            # never let the default push a valid prompt over the context
            default_max = max(1, min(default_max, max_len - len(ids)))
        sampling = req.sampling_params(default_max).with_seed()
        validate_prompt(ids, sampling, max_model_len=max_len, vocab_size=self.shape.vocab_size,
                        param=endpoint.prompt_param)
        return PrefillRequest(new_id(endpoint.id_prefix), tuple(ids), sampling, n=req.n or 1)

    # ---- generation ----------------------------------------------------------------------

    async def deltas(self, endpoint: Endpoint, preq: PrefillRequest,
                     trace: RequestTrace | None = None,
                     shared: tuple[ray.ObjectRef, int] | None = None,
                     ) -> AsyncIterator[StreamDelta]:
        """The text of one answer as it is generated, with its accounting: in-flight count,
        outcome, latency and token metrics and the trace kept for ``GET /debug/requests``.
        ``shared``: the answer's first attempt reads a package made for several."""
        trace = trace or RequestTrace()
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        outcome = "cancelled"  # the client left before the end (the generator was closed)
        finish = None
        try:
            async for delta in text_deltas(self.path.resumable_stream(preq, trace, shared),
                                           self.tokenizer, preq.sampling):
                previous = trace.last_token
                trace.token(len(delta.token_ids))
                self.record_tokens(trace, previous, len(delta.token_ids))
                finish = delta.finish_reason or finish
                yield delta
            outcome = "ok"
        except Exception as exc:
            outcome = type(unwrap_error(exc)).__name__
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
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

    async def answers(self, endpoint: Endpoint, preq: PrefillRequest,
                      trace: RequestTrace | None = None) -> list[AsyncIterator[StreamDelta]]:
        """One delta stream per answer. ``n > 1``: the prompt is prefilled once (a first token
        per answer) and every answer's decode stream reads that one KV object."""
        if preq.n == 1:
            return [self.deltas(endpoint, preq, trace)]
        ref = await self.path.shared_prefill(preq)
        return [self.deltas(endpoint, choice_request(preq, k),
                            shared=None if ref is None else (ref, k))
                for k in range(preq.n)]

    async def complete(self, endpoint: Endpoint, req: GenerationRequest,
                       trace: RequestTrace | None = None) -> dict[str, Any]:
        """The whole answer of a non-streamed request (``trace``: of its first answer)."""
        preq = self.prepare(endpoint, req)
        streams = await self.answers(endpoint, preq, trace)

        async def collect(stream: AsyncIterator[StreamDelta]) -> tuple[str, int, Any]:
            text, n_out, finish = "", 0, None
            async for delta in stream:
                text += delta.text
                n_out += len(delta.token_ids)
                finish = delta.finish_reason or finish
            return text, n_out, finish

        tasks = [asyncio.ensure_future(collect(s)) for s in streams]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:  # one answer failed (or the client left): stop the others
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return completion_body(endpoint, preq.request_id, self.model_name,
                               [(text, finish) for text, _, finish in results],
                               preq.num_tokens, sum(n for _, n, _ in results))

    async def indexed_deltas(self, endpoint: Endpoint,
                             preq: PrefillRequest) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(answer index, delta) of every answer, as they come."""
        streams = await self.answers(endpoint, preq)
        if len(streams) == 1:
            async for delta in streams[0]:
                yield 0, delta
            return
        async for item in merge_streams(streams):
            yield item

    def chunks(self, endpoint: Endpoint,
               req: GenerationRequest) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streamed answer."""
        preq = self.prepare(endpoint, req)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return stream_chunks(endpoint, preq.request_id, self.model_name, preq.num_tokens,
                             self.indexed_deltas(endpoint, preq), include_usage)

    async def answer(self, endpoint: Endpoint, req: GenerationRequest):
        try:
            if req.stream:
                return await sse_response(self.chunks(endpoint, req))
            return JSONResponse(await self.complete(endpoint, req))
        except Exception as exc:
            return error_response(exc)

    # ---- HTTP routes ---------------------------------------------------------------------

    @api.post("/v1/chat/completions", response_model=CompletionResponse,
              responses={**SSE_RESPONSE, **ERROR_RESPONSES})
    async def http_chat(self, body: ChatCompletionRequest):
        return await self.answer(Endpoint.CHAT, body)

    @api.post("/v1/completions", response_model=CompletionResponse,
              responses={**SSE_RESPONSE, **ERROR_RESPONSES})
    async def http_completions(self, body: CompletionRequest):
        return await self.answer(Endpoint.COMPLETION, body)

    @api.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def http_models(self):
        card = ModelCard(id=self.model_name, max_model_len=self.shape.max_model_len)
        return ModelList(data=[card])

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

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat completion from the same fields as the HTTP body (non-streaming)."""
        return await self.complete(Endpoint.CHAT, self.parse(Endpoint.CHAT, body))

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.complete(Endpoint.COMPLETION, self.parse(Endpoint.COMPLETION, body))

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streaming chat: yields the same chunk objects as the SSE stream."""
        async for c in self.chunks(Endpoint.CHAT, self.parse(Endpoint.CHAT, body)):
            yield c

    async def completions_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for c in self.chunks(Endpoint.COMPLETION, self.parse(Endpoint.COMPLETION, body)):
            yield c

    def recent_requests(self, limit: int = 100) -> list[dict[str, Any]]:
        """The server-side timings of the last ``limit`` finished requests, newest last."""
        return self.history.last(limit)

    async def trace(self, body: dict[str, Any], kind: str = "chat") -> dict[str, Any]:
        """Run one request and report where its work and its KV object went (diagnostics)."""
        endpoint = Endpoint(kind)
        trace = RequestTrace()
        response = await self.complete(endpoint, self.parse(endpoint, body), trace)
        return {"response": response, "ingress_node": self.node_id, **trace.as_dict()}
