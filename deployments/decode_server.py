"""DecodeServer: pulls KV packages from the object store and streams tokens from its batch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from app.kv_package import KVPackage
from app.chat import PromptBuilder
from app.local_engine import EngineCore
from app.model_loader import load_tokenizer
from deployments.args import AppArgs
from deployments.metrics import DecodeMetrics


@dataclass(frozen=True, slots=True)
class StreamStart:
    """First item of every decode stream: where and how the KV package arrived."""

    node_id: str
    kv_bytes: int
    kv_hop_s: float  # prefill returned -> this replica holds the package
    fetch_s: float  # time spent resolving the ObjectRef here
    prefill_s: float  # compute time of the prefill batch that made the package


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
        self.node_id = ray.get_runtime_context().get_node_id()
        self.metrics = DecodeMetrics()
        self.started = 0
        self.kv_bytes_received = 0
        self.hop_s_total = 0.0
        self._stats_task: asyncio.Task | None = None

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
        yield StreamStart(self.node_id, package.kv_nbytes, hop, fetched - t0, package.prefill_s)
        events = self.loop.generate(package)
        del package
        async for event in events:
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
        }

    def ping(self) -> str:
        return self.node_id
