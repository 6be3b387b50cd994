"""DecodeServer: pulls KV packages from the object store and streams tokens from its batch."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from app.chat import PromptBuilder
from app.errors import ReplicaUnhealthyError
from app.kv_package import KVPackage
from app.local_engine import EngineCore
from app.model_loader import load_tokenizer
from app.sequence import PrefillRequest
from deployments import autoscaling
from deployments.args import AppArgs
from deployments.metrics import DecodeMetrics


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
        def hold() -> None:
            with core.runner.lock:
                time.sleep(seconds)

        asyncio.get_running_loop().run_in_executor(None, hold)
        return current_replica_id()
    raise ValueError(f"unknown fault {kind!r}; expected 'stall' or 'crash'")


@dataclass(frozen=True, slots=True)
class StreamStart:
    """First item of every decode stream: where and how the KV package arrived."""

    node_id: str
    kv_bytes: int
    kv_hop_s: float  # prefill returned -> this replica holds the package
    fetch_s: float  # time spent resolving the ObjectRef here
    prefill_s: float  # compute time of the prefill batch that made the package
    local_prefill: bool = False  # prefilled by this decode replica (no KV hop)
    replica_id: str = ""  # the decode replica serving the stream


@serve.deployment(name="DecodeServer")
class DecodeServer:
    def __init__(self, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        cfg = self.args.engine_config("decode")
        self.core = EngineCore(cfg)
        eos = PromptBuilder(load_tokenizer(cfg)).eos_token_ids(
            getattr(self.core.model, "generation_config", None)
        )
        self.loop = self.core.make_decode_loop(eos)
        # short prompts are prefilled here (conditional disaggregation): same code, same model
        self.prefiller = self.core.make_prefiller()
        self.node_id = ray.get_runtime_context().get_node_id()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside a Serve replica (the class used directly)
            self.replica_id = ""
        self.metrics = DecodeMetrics()
        self.tpot_window_s = self.args.decode.scaling.latency_window_s
        self.started = 0
        self.local_prefills = 0  # streams that were prefilled here
        self.local_prefilling = 0  # of those, still in their prefill
        self.kv_bytes_received = 0
        self.hop_s_total = 0.0
        self._stats_task: asyncio.Task | None = None
        self.unhealthy: str | None = None  # set when the health check finds the loop wedged

    async def generate(self, wrapped_ref: list[ray.ObjectRef]) -> AsyncIterator[Any]:
        """Stream one request: a :class:`StreamStart`, then :class:`TokenEvent` items.

        ``wrapped_ref`` holds the KV package's ObjectRef inside a list so Ray passes it here
        unresolved; this replica resolves it, pulling the bytes from the prefill node.
        """
        self._ensure_stats_task()
        t0 = time.time()
        package: KVPackage = await wrapped_ref[0]
        wrapped_ref.clear()  # drop our reference: the object can be freed once copied in
        fetched = time.time()
        hop = fetched - package.created_at
        self.started += 1
        self.kv_bytes_received += package.kv_nbytes
        self.hop_s_total += hop
        self.metrics.kv_hop_ms.observe(hop * 1000)
        yield StreamStart(self.node_id, package.kv_nbytes, hop, fetched - t0, package.prefill_s,
                          replica_id=self.replica_id)
        events = self.loop.generate(package)
        del package
        async for event in self._checked(events):
            yield event

    async def generate_local(self, req: PrefillRequest) -> AsyncIterator[Any]:
        """Prefill a short prompt on this replica, then decode it in this replica's batch.

        The same stream as :meth:`generate` (a :class:`StreamStart`, then tokens) without the
        KV hop. The prefill holds the model between two decode steps, so only prompts short
        enough to cost the running batch less than a hop would come here
        (``local_prefill_threshold``).
        """
        self._ensure_stats_task()
        self.prefiller.validate(req)
        self.local_prefilling += 1
        try:
            [package] = await asyncio.to_thread(self.prefiller.prefill, [req])
        finally:
            self.local_prefilling -= 1
        self.started += 1
        self.local_prefills += 1
        yield StreamStart(self.node_id, package.kv_nbytes, 0.0, 0.0, package.prefill_s,
                          local_prefill=True, replica_id=self.replica_id)
        events = self.loop.generate(package)
        del package
        async for event in self._checked(events):
            yield event

    async def _checked(self, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for event in events:
            if getattr(event, "error", None) is not None and self.unhealthy:
                raise ReplicaUnhealthyError(f"decode replica unhealthy: {event.error}")
            yield event

    def _ensure_stats_task(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.get_running_loop().create_task(self._report_stats())

    async def _report_stats(self) -> None:
        while True:
            st = self.loop.decoder.stats()
            self.metrics.active.set(self.loop.num_active)
            self.metrics.waiting.set(self.loop.num_waiting)
            self.metrics.kv_tokens.set(st.kv_tokens_used)
            await asyncio.sleep(1.0)

    def _tpot_ms(self) -> float:
        """Mean of the last decode steps (a step includes any wait for a local prefill), or
        0 when no sequence is streaming or no step ran within the latency window."""
        recent = list(self.loop.step_times)[-32:]
        if (self.loop.num_active == 0 or not recent
                or time.monotonic() - self.loop.last_step_at > self.tpot_window_s):
            return 0.0
        return sum(recent) / len(recent) * 1000.0

    def record_autoscaling_stats(self) -> dict[str, float]:
        """This replica's load for ``deployments.autoscaling.DecodePolicy``."""
        return {
            autoscaling.DECODE_SEQUENCES: float(self.loop.num_active + self.local_prefilling),
            autoscaling.DECODE_KV_TOKENS: float(self.loop.decoder.stats().kv_tokens_used),
            autoscaling.DECODE_TPOT_MS: self._tpot_ms(),
        }

    def stats(self) -> dict[str, Any]:
        st = self.loop.decoder.stats()
        steps = list(self.loop.step_times)
        return {
            "node_id": self.node_id,
            "fingerprint": self.core.fingerprint,
            "active": self.loop.num_active,
            "running": st.running,
            "waiting": self.loop.num_waiting,
            "kv_tokens_used": st.kv_tokens_used,
            "kv_tokens_budget": st.kv_tokens_budget,
            "started": self.started,
            "kv_bytes_received": self.kv_bytes_received,
            "hop_s_total": self.hop_s_total,
            "steps": self.loop.decoder.steps,
            "mean_step_s": sum(steps) / len(steps) if steps else None,
            "replica_id": self.replica_id,
            "local_prefills": self.local_prefills,
            "autoscaling": self.record_autoscaling_stats(),
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

    async def inject_fault(self, kind: str, seconds: float = 0.0,
                           target: str | None = None) -> str:
        """Fault tests only (``enable_fault_injection``): ``stall`` wedges the decode loop
        for ``seconds`` by holding the model (returns this replica's id); ``crash`` kills
        this replica's process."""
        return await inject_fault(self.args, self.core, kind, seconds, target)
