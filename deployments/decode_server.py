"""DecodeServer: pulls KV packages from the object store and streams tokens from its batch."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from app.kv_package import KVPackage
from app.messages import PrefillRequest, StreamStart
from app.prefill_queue import PrefillQueue
from deployments import autoscaling
from deployments.metrics import PrefillMetrics
from deployments.replica import DecodeReplica


@serve.deployment(name="DecodeServer")
class DecodeServer(DecodeReplica):
    def __init__(self, args: dict[str, Any]) -> None:
        super().__init__(args, "decode")
        # short prompts are prefilled here (conditional disaggregation: the ingress's
        # local_prefill_threshold, and local_prefill_when_busy while the prefill phase is
        # backed up): same code, same model. With engine.mixed_batch (the default) a prompt
        # rides in the decode steps, as in the colocated app, so the running streams wait
        # one longer step, never a prefill pass of their own.
        self.batcher = PrefillQueue(self.core, self.args.prefill_batch_wait_s,
                                    PrefillMetrics(self.args.model_name, count_waiting=False),
                                    eos_token_ids=self.eos_token_ids)
        if self.core.config.mixed_batch:
            self.batcher.mix_into(self.loop)
        self.tpot_window_s = self.args.decode.latency_window_s
        self.local_prefills = 0  # prompts that were prefilled here

    @property
    def local_prefilling(self) -> int:
        """Prompts waiting for, or in, their prefill on this replica."""
        return self.batcher.waiting_requests

    async def make_kv_package(self, req: PrefillRequest) -> KVPackage:
        """Prefill a short prompt on this replica. Called through the handle for an
        ``n > 1`` request: one prefill, a first token per answer, and each answer's stream
        reads the package with ``generate([ref], k)``, as in the split path."""
        package = await self.batcher.enqueue(req)
        self.local_prefills += 1
        return package

    async def generate_local(self, req: PrefillRequest, feed: str | None = None,
                             on_replica: str | None = None) -> AsyncIterator[Any]:
        """Prefill a short prompt on this replica, then decode it in this replica's batch:
        the same stream as :meth:`generate` (a :class:`StreamStart`, then tokens) without
        the KV hop. ``on_replica`` routes the call to that replica (FeedRouter; the
        :class:`StreamStart` names the one that took it)."""
        package = await self.make_kv_package(req)
        start = StreamStart(self.node_id, package.kv_nbytes, 0.0, 0.0, package.prefill_s,
                            local_prefill=True, replica_id=self.replica_id,
                            prefill_done_at=package.created_at,
                            cached_tokens=package.cached_tokens)
        async for item in self._stream(start, package, feed):
            yield item

    def prefills_waiting(self) -> int:
        return self.local_prefilling

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

    def stats(self, on_replica: str | None = None) -> dict[str, Any]:
        """This replica's state; ``on_replica`` routes the call to that replica
        (``deployments.token_feed.FeedRouter``)."""
        return {
            **self.decode_stats(),
            "kv_bytes_received": self.kv_bytes_received,
            "hop_s_total": self.hop_s_total,
            "local_prefills": self.local_prefills,
            "local_prefill_tokens_total": self.batcher.tokens_total,
            "mixed_passes": self.batcher.mixed_passes,
            "autoscaling": self.record_autoscaling_stats(),
        }
