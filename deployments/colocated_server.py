"""ColocatedServer: the baseline. One deployment runs both phases on the same cores.

Same engine and limits as the split app (prefill batched under the same token budget, the same
continuous-batching decode loop, the same KV package handed from one to the other); the only
difference is where prefill runs. A newly arrived prompt is prefilled between two decode steps:
the model runner's lock lets one forward pass run at a time, so the prefill waits for the step
in progress, and the next step waits for the prefill. Every running stream stalls for as long
as the prompt takes; that stall is what the split app removes.

It answers the Ingress like a decode replica that prefills locally: ``generate_local`` takes a
:class:`PrefillRequest` and streams a :class:`StreamStart`, then :class:`TokenEvent` items.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from app.chat import PromptBuilder
from app.decode import TokenEvent
from app.kv_package import KVPackage
from app.local_engine import EngineCore
from app.model_loader import load_tokenizer
from app.sequence import PrefillRequest
from deployments.args import AppArgs
from deployments.decode_server import StreamStart
from deployments.metrics import DecodeMetrics, PrefillMetrics


def _batch_tokens(items: list[tuple[PrefillRequest, int]]) -> int:
    return sum(weight for _, weight in items)


@serve.deployment(name="ColocatedServer")
class ColocatedServer:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        cfg = self.args.engine_config("colocated")
        self.core = EngineCore(cfg)
        self.prefiller = self.core.make_prefiller()
        eos = PromptBuilder(load_tokenizer(cfg)).eos_token_ids(
            getattr(self.core.model, "generation_config", None)
        )
        self.loop = self.core.make_decode_loop(eos)
        self.token_budget = cfg.prefill_token_budget
        self._prefill_batch.set_max_batch_size(cfg.prefill_token_budget)
        self._prefill_batch.set_batch_wait_timeout_s(self.args.prefill_batch_wait_s)
        self.node_id = ray.get_runtime_context().get_node_id()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (the class used directly)
            self.replica_id = ""
        self.prefill_metrics = PrefillMetrics()
        self.decode_metrics = DecodeMetrics()
        self.waiting_tokens = 0
        self.waiting_requests = 0
        self.prefills = 0
        self.prefill_tokens_total = 0
        self.prefill_compute_s_total = 0.0
        self.started = 0
        self._stats_task: asyncio.Task | None = None

    async def generate_local(self, req: PrefillRequest) -> AsyncIterator[StreamStart | TokenEvent]:
        """Prefill ``req`` here (batched with prompts that arrive together), then stream its
        tokens from this replica's running batch: a :class:`StreamStart`, then tokens."""
        self._ensure_stats_task()
        self.prefiller.validate(req)
        self._track(req.num_tokens, +1)
        try:
            # a prompt longer than the budget weighs the whole budget and so runs alone
            package = await self._prefill_batch((req, min(req.num_tokens, self.token_budget)))
        finally:
            self._track(req.num_tokens, -1)
        self.started += 1
        yield StreamStart(self.node_id, package.kv_nbytes, time.time() - package.created_at, 0.0,
                          package.prefill_s, local_prefill=True, replica_id=self.replica_id)
        events = self.loop.generate(package)
        del package  # the decode loop holds the only reference until it copies the KV in
        async for event in events:
            yield event

    def _track(self, tokens: int, sign: int) -> None:
        self.waiting_tokens += sign * tokens
        self.waiting_requests += sign
        self.prefill_metrics.waiting_tokens.set(self.waiting_tokens)
        self.prefill_metrics.waiting_requests.set(self.waiting_requests)

    @serve.batch(max_batch_size=4096, batch_wait_timeout_s=0.005, batch_size_fn=_batch_tokens)
    async def _prefill_batch(
        self, items: list[tuple[PrefillRequest, int]]
    ) -> list[KVPackage]:
        requests = [req for req, _ in items]
        start = time.perf_counter()
        # runs in a worker thread; its forward passes take the runner's lock between steps
        packages = await asyncio.to_thread(self.prefiller.prefill, requests)
        elapsed = time.perf_counter() - start
        tokens = sum(r.num_tokens for r in requests)
        self.prefills += len(requests)
        self.prefill_tokens_total += tokens
        self.prefill_compute_s_total += elapsed
        self.prefill_metrics.batch_size.observe(len(requests))
        self.prefill_metrics.batch_tokens.observe(tokens)
        self.prefill_metrics.compute_ms.observe(elapsed * 1000)
        return packages

    def _ensure_stats_task(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.get_running_loop().create_task(self._report_stats())

    async def _report_stats(self) -> None:
        while True:
            st = self.loop.decoder.stats()
            self.decode_metrics.active.set(self.loop.num_active)
            self.decode_metrics.waiting.set(self.loop.num_waiting)
            self.decode_metrics.kv_tokens.set(st.kv_tokens_used)
            await asyncio.sleep(1.0)

    def stats(self) -> dict[str, Any]:
        st = self.loop.decoder.stats()
        steps = list(self.loop.step_times)
        return {
            "node_id": self.node_id,
            "replica_id": self.replica_id,
            "fingerprint": self.core.fingerprint,
            "num_threads": self.core.config.num_threads,
            "waiting_tokens": self.waiting_tokens,
            "waiting_requests": self.waiting_requests,
            "prefills": self.prefills,
            "prefill_tokens_total": self.prefill_tokens_total,
            "prefill_compute_s_total": self.prefill_compute_s_total,
            "started": self.started,
            "active": self.loop.num_active,
            "running": st.running,
            "waiting": self.loop.num_waiting,
            "kv_tokens_used": st.kv_tokens_used,
            "kv_tokens_budget": st.kv_tokens_budget,
            "steps": self.loop.decoder.steps,
            "mean_step_s": sum(steps) / len(steps) if steps else None,
        }

    def ping(self) -> str:
        return self.node_id
