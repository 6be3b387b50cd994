"""PrefillServer: batches waiting prompts under a token budget and returns KV packages.

The returned package lands in this node's object store; the ingress holds its ObjectRef
unresolved and the decode replica pulls it.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve

from app.engine_core import EngineCore
from app.kv_package import KVPackage
from app.messages import PrefillRequest
from app.prefill_queue import PrefillQueue
from deployments import autoscaling
from deployments.args import AppArgs
from deployments.metrics import KernelMetrics, PrefillMetrics
from deployments.replica import (
    current_replica_id,
    deployed_autoscaling_config,
    inject_fault,
    model_eos_token_ids,
)


@serve.deployment(name="PrefillServer")
class PrefillServer:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        self.args.check_scaling_policy("prefill", deployed_autoscaling_config())
        self.core = EngineCore(self.args.engine_config("prefill"))
        self.throughput = autoscaling.ThroughputWindow()
        self.latency = autoscaling.LatencyWindow(self.args.prefill.latency_window_s)
        self.batcher = PrefillQueue(self.core, self.args.prefill_batch_wait_s,
                                     PrefillMetrics(self.args.model_name),
                                     on_batch=self.throughput.add,
                                     eos_token_ids=model_eos_token_ids(self.core),
                                     lanes=self.core.config.prefill_lanes)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.core.grammars.warm(model_eos_token_ids(self.core))  # structured outputs
        KernelMetrics(self.args.model_name).record(self.core.runner.kernel_paths())

    async def make_kv_package(self, req: PrefillRequest) -> KVPackage:
        """Prefill one prompt (batched with others that arrive together)."""
        key = object()
        self.latency.start(key)
        try:
            return await self.batcher.enqueue(req)
        finally:
            self.latency.finish(key)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load for ``deployments.autoscaling.PrefillPolicy``."""
        return {
            autoscaling.PREFILL_WAITING_TOKENS: float(self.batcher.waiting_tokens),
            autoscaling.PREFILL_WAITING_REQUESTS: float(self.batcher.waiting_requests),
            autoscaling.PREFILL_TOKENS_PER_S: self.throughput.tokens_per_s,
            autoscaling.PREFILL_MEAN_PROMPT_TOKENS: self.throughput.mean_prompt_tokens,
            autoscaling.PREFILL_LATENCY_MS: self.latency.value_ms(),
        }

    def stats(self) -> dict[str, Any]:
        b = self.batcher
        return {
            "replica_id": current_replica_id(),
            "node_id": self.node_id,
            "fingerprint": self.core.fingerprint,
            "engine_nice": self.core.nice,
            "waiting_tokens": b.waiting_tokens,
            "waiting_requests": b.waiting_requests,
            "completed": b.completed,
            "tokens_total": b.tokens_total,
            "compute_s_total": b.compute_s_total,
            "passes": b.passes,
            "preemptions": b.preemptions,
            **b.cache_stats(),
            **b.thread_stats(),
            "autoscaling": self.record_autoscaling_stats(),
        }

    def ping(self) -> str:
        return self.node_id

    async def inject_fault(self, kind: str, seconds: float = 0.0,
                           target: str | None = None) -> str:
        """Fault tests only (``enable_fault_injection``): ``stall`` holds the model for
        ``seconds``; ``crash`` kills this replica's process."""
        return await inject_fault(self.args, self.core, kind, seconds, target)
