"""What the phase servers share: the decode stream, and the replica's identity, health check
and fault injection (the prefill queue: ``app.prefill_queue``)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from app.chat import PromptBuilder
from app.config import EngineConfig
from app.engine_core import EngineCore
from app.errors import ReplicaUnhealthyError
from app.kv_package import KVPackage
from app.messages import StreamStart
from app.model_loader import load_tokenizer
from app.prefill_queue import _stall
from deployments.args import AppArgs
from deployments.metrics import DecodeMetrics, KernelMetrics
from deployments.token_feed import FeedOut, serve_feed

logger = logging.getLogger(__name__)


def model_eos_token_ids(core: EngineCore) -> frozenset[int]:
    """The tokens that end a sequence: the decoder stops on them, and a prefill masks them
    from a first token under ``min_tokens``, so both phases must agree."""
    return PromptBuilder(load_tokenizer(core.config)).eos_token_ids(
        getattr(core.model, "generation_config", None))


def deployed_autoscaling_config() -> Any:
    """This replica's deployment's ``autoscaling_config`` as Serve deployed it (after a
    Serve config's overrides); None when it does not autoscale or outside a replica."""
    try:
        config = serve.get_replica_context()._deployment_config
    except Exception:  # outside a Serve replica (the class used directly)
        return None
    return config.autoscaling_config


def current_replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (the class used directly)
        return ""


async def inject_fault(args: AppArgs, core: EngineCore, kind: str, seconds: float,
                       target: str | None = None) -> str:
    """Shared by the phase servers: refuse unless fault injection is enabled in the args.
    With ``target``, only the replica of that id acts; every call returns the id of the
    replica that received it."""
    if not args.enable_fault_injection:
        raise PermissionError("fault injection is disabled (enable_fault_injection: false)")
    if target is not None and target != current_replica_id():
        return current_replica_id()
    if kind == "crash":
        os._exit(1)
    if kind == "stall":
        _stall(core, seconds)
        return current_replica_id()
    raise ValueError(f"unknown fault {kind!r}; expected 'stall' or 'crash'")


class DecodeReplica:
    """A replica that runs a continuous-batching decode loop and streams its sequences."""

    def __init__(self, args: dict[str, Any], phase: str) -> None:
        self.args = AppArgs.model_validate(args)
        self.args.check_scaling_policy(phase, deployed_autoscaling_config())
        cfg: EngineConfig = self.args.engine_config(phase)
        self.core = EngineCore(cfg)
        self.eos_token_ids = model_eos_token_ids(self.core)
        self.loop = self.core.make_decode_loop(self.eos_token_ids)
        self.core.grammars.warm(self.eos_token_ids)  # structured outputs, before serving
        self.node_id = ray.get_runtime_context().get_node_id()
        self.replica_id = current_replica_id()
        self.metrics = DecodeMetrics(self.args.model_name)
        KernelMetrics(self.args.model_name).record(self.core.runner.kernel_paths())
        self.started = 0
        self.kv_bytes_received = 0
        self.hop_s_total = 0.0
        self._stats_task: asyncio.Task | None = None
        self.unhealthy: str | None = None  # set when the health check finds the loop wedged
        self.feeds: dict[str, FeedOut] = {}  # ingress id -> its token feed from this replica

    async def generate(self, wrapped_ref: list[ray.ObjectRef],
                       choice: int | None = None, feed: str | None = None,
                       ) -> AsyncIterator[Any]:
        """Stream one request: a :class:`StreamStart`, then :class:`TokenEvent` items (or,
        when ingress ``feed`` has a token feed open here, the tokens go through that).

        ``wrapped_ref`` holds the KV package's ObjectRef inside a list so Ray passes it here
        unresolved; this replica resolves it, pulling the bytes from the node that made it.
        ``choice`` picks one answer of a package made for several (``n > 1``): one object
        in the store, read by one stream per answer. Every replica that decodes has it: the
        answers of a prompt prefilled on a decode replica or in the colocated app share
        their package this way too.
        """
        t0 = time.time()
        package: KVPackage = await wrapped_ref[0]
        wrapped_ref.clear()  # drop our reference: the object can be freed once copied in
        if choice is not None:
            package = package.for_choice(choice)
        fetched = time.time()
        hop = fetched - package.created_at
        self.kv_bytes_received += package.kv_nbytes
        self.hop_s_total += hop
        self.metrics.kv_hop.observe(hop)
        self.metrics.kv_hop_bytes.inc(package.kv_nbytes)
        start = StreamStart(self.node_id, package.kv_nbytes, hop, fetched - t0,
                            package.prefill_s, replica_id=self.replica_id,
                            prefill_done_at=package.created_at,
                            cached_tokens=package.cached_tokens)
        async for item in self._stream(start, package, feed):
            yield item

    async def _stream(self, start: StreamStart, package: KVPackage,
                      feed: str | None) -> AsyncIterator[Any]:
        """``start`` (``fed`` set when ingress ``feed`` has a token feed open here), then
        ``package`` joins the running batch and its tokens are yielded, or pushed into that
        feed. The feed counts the stream from before ``start`` is sent, so it cannot end
        idle between the two. A stream this replica gave up (unhealthy) raises a retryable
        error instead of ending quietly."""
        out = self.feeds.get(feed) if feed is not None else None
        if out is not None:
            out.attached += 1
        try:
            yield dataclasses.replace(start, fed=out is not None)
            self._ensure_stats_task()
            self.started += 1
            events = self.loop.generate(package)
            del package  # the decode loop holds the only reference until it copies the KV in
            async for event in events:
                if event.error is not None and self.unhealthy:
                    raise ReplicaUnhealthyError(f"decode replica unhealthy: {event.error}")
                if out is None:
                    yield event
                else:
                    out.push(event)
        finally:
            if out is not None:
                out.attached -= 1

    async def feed(self, ingress_id: str, on_replica: str) -> AsyncIterator[Any]:
        """The token feed of an ingress's streams on this replica
        (``deployments.token_feed``): this replica's id, then a list of tokens per step."""
        async for item in serve_feed(self.feeds, ingress_id, self.replica_id, on_replica):
            yield item

    def _ensure_stats_task(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.get_running_loop().create_task(self._report_stats())

    async def _report_stats(self) -> None:
        reported_steps = self.loop.decoder.steps
        while True:
            reported_steps = self.record_metrics(reported_steps)
            await asyncio.sleep(1.0)

    def record_metrics(self, reported_steps: int) -> int:
        """Observe the steps run since ``reported_steps`` (the loop keeps the last few step
        times) and set the gauges; returns the steps reported so far."""
        new_steps = self.loop.decoder.steps - reported_steps
        recent = list(self.loop.step_times)
        for seconds in recent[max(0, len(recent) - new_steps):]:
            self.metrics.step.observe(seconds)
        st = self.loop.decoder.stats()
        self.metrics.running.set(self.loop.num_active)
        self.metrics.waiting.set(self.loop.num_waiting + self.prefills_waiting())
        self.metrics.kv_tokens.set(st.kv_tokens_used)
        self.metrics.kv_usage.set(st.kv_tokens_used / st.kv_tokens_budget
                                  if st.kv_tokens_budget else 0.0)
        return reported_steps + new_steps

    def prefills_waiting(self) -> int:
        """Prompts this replica still has to prefill before they join the batch."""
        return 0

    def decode_stats(self) -> dict[str, Any]:
        st = self.loop.decoder.stats()
        steps = list(self.loop.step_times)
        return {
            "node_id": self.node_id,
            "replica_id": self.replica_id,
            "fingerprint": self.core.fingerprint,
            "engine_nice": self.core.nice,
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

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes Serve replace the
        replica. A decode loop wedged in one step (or dead with work left) fails it."""
        stalled = self.loop.stalled_s()
        if stalled > self.args.decode_stall_timeout_s:
            message = (f"decode loop stalled for {stalled:.0f}s (limit "
                       f"{self.args.decode_stall_timeout_s:g}s)")
            # hand the streams back now (the ingress resumes them elsewhere) rather than
            # holding them while Serve stops this replica
            self.unhealthy = message
            self.loop.fail_streams(message)
            raise RuntimeError(message)

    async def inject_fault(self, kind: str, seconds: float = 0.0, target: str | None = None,
                           on_replica: str | None = None) -> str:
        """Fault tests only (``enable_fault_injection``): ``stall`` wedges the decode loop
        for ``seconds`` by holding the model (returns this replica's id); ``crash`` kills
        this replica's process. ``on_replica`` targets a replica as ``target`` does and
        routes the call there (``deployments.token_feed.FeedRouter``)."""
        return await inject_fault(self.args, self.core, kind, seconds, target or on_replica)
