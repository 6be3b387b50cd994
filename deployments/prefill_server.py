"""PrefillServer: batches waiting prompts under a token budget and returns KV packages.

The returned package lands in this node's object store; the ingress holds its ObjectRef
unresolved and the decode replica pulls it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray import serve

from app.kv_package import KVPackage
from app.local_engine import EngineCore
from app.sequence import PrefillRequest
from deployments import autoscaling
from deployments.args import AppArgs
from deployments.decode_server import current_replica_id, inject_fault
from deployments.metrics import PrefillMetrics


def _batch_tokens(items: list[tuple[PrefillRequest, int]]) -> int:
    return sum(weight for _, weight in items)


@serve.deployment(name="PrefillServer")
class PrefillServer:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        cfg = self.args.engine_config("prefill")
        self.core = EngineCore(cfg)
        self.prefiller = self.core.make_prefiller()
        self.token_budget = cfg.prefill_token_budget
        self._prefill_batch.set_max_batch_size(cfg.prefill_token_budget)
        self._prefill_batch.set_batch_wait_timeout_s(self.args.prefill_batch_wait_s)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.metrics = PrefillMetrics()
        self.waiting_tokens = 0
        self.waiting_requests = 0
        self.completed = 0
        self.compute_s_total = 0.0
        self.tokens_total = 0
        self.throughput = autoscaling.ThroughputWindow()
        self.latency = autoscaling.LatencyWindow(self.args.prefill.scaling.latency_window_s)

    async def prefill(self, req: PrefillRequest) -> KVPackage:
        """Prefill one prompt (batched with others that arrive together)."""
        self.prefiller.validate(req)
        self._track(req.num_tokens, +1)
        key = object()
        self.latency.start(key)
        try:
            # a prompt longer than the budget weighs the whole budget and so runs alone
            return await self._prefill_batch((req, min(req.num_tokens, self.token_budget)))
        finally:
            self.latency.finish(key)
            self._track(req.num_tokens, -1)
            self.completed += 1

    def _track(self, tokens: int, sign: int) -> None:
        self.waiting_tokens += sign * tokens
        self.waiting_requests += sign
        self.metrics.waiting_tokens.set(self.waiting_tokens)
        self.metrics.waiting_requests.set(self.waiting_requests)

    @serve.batch(max_batch_size=4096, batch_wait_timeout_s=0.005, batch_size_fn=_batch_tokens)
    async def _prefill_batch(
        self, items: list[tuple[PrefillRequest, int]]
    ) -> list[KVPackage]:
        requests = [req for req, _ in items]
        start = time.perf_counter()
        packages = await asyncio.to_thread(self.prefiller.prefill, requests)
        elapsed = time.perf_counter() - start
        tokens = sum(r.num_tokens for r in requests)
        self.compute_s_total += elapsed
        self.tokens_total += tokens
        self.throughput.add(len(requests), tokens, elapsed)
        self.metrics.batch_size.observe(len(requests))
        self.metrics.batch_tokens.observe(tokens)
        self.metrics.compute_ms.observe(elapsed * 1000)
        for pkg in packages:
            self.metrics.kv_bytes.observe(pkg.kv_nbytes)
        return packages

    def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load for ``deployments.autoscaling.PrefillPolicy``."""
        return {
            autoscaling.PREFILL_WAITING_TOKENS: float(self.waiting_tokens),
            autoscaling.PREFILL_WAITING_REQUESTS: float(self.waiting_requests),
            autoscaling.PREFILL_TOKENS_PER_S: self.throughput.tokens_per_s,
            autoscaling.PREFILL_MEAN_PROMPT_TOKENS: self.throughput.mean_prompt_tokens,
            autoscaling.PREFILL_LATENCY_MS: self.latency.value_ms(),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "replica_id": current_replica_id(),
            "node_id": self.node_id,
            "fingerprint": self.core.fingerprint,
            "waiting_tokens": self.waiting_tokens,
            "waiting_requests": self.waiting_requests,
            "completed": self.completed,
            "tokens_total": self.tokens_total,
            "compute_s_total": self.compute_s_total,
            "autoscaling": self.record_autoscaling_stats(),
        }

    def ping(self) -> str:
        return self.node_id

    async def inject_fault(self, kind: str, seconds: float = 0.0,
                           target: str | None = None) -> str:
        """Fault tests only (``enable_fault_injection``): ``stall`` holds the model for
        ``seconds``; ``crash`` kills this replica's process."""
        return await inject_fault(self.args, self.core, kind, seconds, target)
