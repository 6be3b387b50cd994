"""Ingress: the Serve deployment that answers the OpenAI HTTP API and the Python handle API.

CPU only, no weights. It tokenizes and validates a request (``prepare``,
``deployments.request_prep``), runs it through the phases (``deployments.split_path``),
detokenizes the token stream and shapes the answer (``deployments.answers``,
``deployments.responses``). It keeps the KV package's ObjectRef, never its bytes. This module
holds the deployment itself: its state, its HTTP routes and its handle API.
"""

# No `from __future__ import annotations` here: FastAPI must see the real types.
import importlib.metadata
import logging
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

import ray
from fastapi import Query, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.chat import PromptBuilder
from app.config import dtype_name
from app.errors import InvalidRequestError, ModelNotFoundError, NotFoundError
from app.kv_package import KVLayout
from app.model_loader import load_tokenizer, read_model_shape
from deployments.admission import QueueWait
from deployments.answers import Answers
from deployments.args import AppArgs
from deployments.bodies import (
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from deployments.kv_budget import KVBudget, budget_from_cluster
from deployments.metrics import IngressMetrics
from deployments.openai_api import (
    ERROR_RESPONSES,
    SSE_RESPONSE,
    api,
    client_request_id,
    error_response,
)
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Endpoint,
    GenerationRequest,
    TokenizeRequest,
)
from deployments.request_prep import RequestPrep
from deployments.request_trace import RequestTrace, TraceHistory
from deployments.split_path import SplitPath
from deployments.token_feed import FeedHub

logger = logging.getLogger(__name__)


def by_reference(handle: DeploymentHandle | None) -> DeploymentHandle | None:
    """``handle`` calling through Ray's object store whatever the cluster's default: a KV
    package travels as an ObjectRef (``SplitPath``), which a by-value call (Serve's gRPC
    transport, the default under ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``) cannot give."""
    return None if handle is None else handle.options(_by_reference=True)


def _package_version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown"


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress(RequestPrep, Answers):
    """The ingress replica: request preparation (``RequestPrep``) and answers (``Answers``)
    are its mixins; the routes and the handle API are here."""

    def __init__(self, prefill: DeploymentHandle | None, decode: DeploymentHandle,
                 args: dict[str, Any]) -> None:
        """``decode`` streams tokens; in the colocated app it is the ColocatedServer, which
        prefills every prompt itself, and ``prefill`` is None."""
        self.args = AppArgs.model_validate(args)
        prefill, decode = by_reference(prefill), by_reference(decode)
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
            feeds=FeedHub(decode) if self.args.ingress.token_feed else None,
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
        if self.path.feeds is not None:
            out.update(self.path.feeds.stats())
        if self.admission is not None:
            out.update(waiting_first_token=self.admission.waiting,
                       refused_for_wait=self.admission.refused,
                       estimated_wait_s=self.admission.estimate_s())
        return out

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
