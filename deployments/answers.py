"""The ingress's answers (``Ingress``'s share, a mixin): one answer's text deltas with
their accounting (in-flight count, admission, outcome, latency and token metrics, the trace
kept for ``GET /debug/requests``), the ``n`` answers of one request, and the whole or
streamed answer that the routes and the handle API return.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from transformers import PreTrainedTokenizerBase

from app.messages import FinishReason, PrefillRequest
from app.output import LogprobText, StreamDelta, text_deltas
from app.tools import ToolMode
from deployments.admission import QueueWait
from deployments.metrics import IngressMetrics
from deployments.openai_api import error_response, merge_streams, sse_response
from deployments.protocol import Endpoint, GenerationRequest
from deployments.request_trace import RequestTrace, TraceHistory
from deployments.responses import completion_body, stream_chunks
from deployments.retries import choice_request, unwrap_error
from deployments.split_path import SharedPackage, SplitPath

logger = logging.getLogger(__name__)


class Answers:
    """Runs prepared requests through the phases (``path``) and shapes what comes back.
    Stands on the ingress's ``path``, ``tokenizer``, ``model_name``, ``admission``,
    ``metrics``, ``in_flight`` and ``history``, and on ``prepare``, ``ignored`` and
    ``tool_mode`` (``deployments.request_prep.RequestPrep``)."""

    path: SplitPath
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    admission: QueueWait | None
    metrics: IngressMetrics
    in_flight: int
    history: TraceHistory
    prepare: Callable[[Endpoint, GenerationRequest, str], PrefillRequest]
    ignored: Callable[[Any, str], dict[str, str]]
    tool_mode: Callable[[Endpoint, GenerationRequest], ToolMode | None]

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
