"""ColocatedServer: the baseline. One deployment runs both phases on the same cores.

Same engine and limits as the split app (prefill chunked under the same token budget, the
same continuous-batching decode loop, the same KV package handed from one to the other); the
only difference is where prefill runs.

With ``mixed_batch`` (the default) it schedules as vLLM does: while sequences are decoding, a
waiting prompt's next chunk rides in the decode step itself (``PrefillQueue.mix_into``,
``ModelRunner.forward_mixed``): one forward pass reads the weights once for the decode rows
and the chunk, under the prefill pass budget, so a running stream waits one (longer) pass per
token, never a separate prefill pass. With nothing decoding, prompts get prefill passes of
their own. With ``mixed_batch: false``, a prompt's chunks are prefill passes between two
decode steps: every running stream stalls for each chunk; that stall is what the split app
removes. With ``prefill_lanes`` > 1 (each lane on one thread), long prompts also get
passes on extra lanes, beside the decode steps, as on a prefill replica
(``PrefillQueue._run_lanes``; with ``mixed_batch`` the engine thread's lane 0 runs passes
only while nothing decodes; BENCHMARKS.md section 7).

It answers the Ingress like a decode replica that prefills locally: ``generate_local`` takes a
:class:`PrefillRequest` and streams a :class:`StreamStart`, then :class:`TokenEvent` items.
An ``n > 1`` request is prefilled once (``make_kv_package``, a first token per answer) and
each answer's stream reads that package (``generate([ref], k)``), as in the split app.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from app.kv_package import KVPackage
from app.messages import PrefillRequest, StreamStart, TokenEvent
from app.prefill_queue import PrefillQueue
from deployments.metrics import PrefillMetrics
from deployments.replica import DecodeReplica


@serve.deployment(name="ColocatedServer")
class ColocatedServer(DecodeReplica):
    def __init__(self, args: dict[str, Any]) -> None:
        super().__init__(args, "colocated")
        # the decode side reports the waiting prompts with its own waiting sequences
        self.batcher = PrefillQueue(self.core, self.args.prefill_batch_wait_s,
                                    PrefillMetrics(self.args.model_name, count_waiting=False),
                                     eos_token_ids=self.eos_token_ids,
                                     lanes=self.core.config.prefill_lanes)
        if self.core.config.mixed_batch:
            self.batcher.mix_into(self.loop)

    def prefills_waiting(self) -> int:
        return self.batcher.waiting_requests

    async def make_kv_package(self, req: PrefillRequest) -> KVPackage:
        """Prefill ``req`` here (batched with prompts that arrive together); called through
        the handle for the one prefill of an ``n > 1`` request."""
        return await self.batcher.enqueue(req)

    async def generate_local(self, req: PrefillRequest, feed: str | None = None,
                             ) -> AsyncIterator[StreamStart | TokenEvent]:
        """Prefill ``req`` here, then stream its tokens from this replica's running batch: a
        :class:`StreamStart`, then tokens."""
        package = await self.make_kv_package(req)
        start = StreamStart(self.node_id, package.kv_nbytes, time.time() - package.created_at, 0.0,
                            package.prefill_s, local_prefill=True, replica_id=self.replica_id,
                            prefill_done_at=package.created_at,
                            cached_tokens=package.cached_tokens)
        async for item in self._stream(start, package, feed):
            yield item

    def stats(self, on_replica: str | None = None) -> dict[str, Any]:
        """This replica's state; ``on_replica`` routes the call to that replica
        (``deployments.token_feed.FeedRouter``)."""
        b = self.batcher
        return {
            **self.decode_stats(),
            "num_threads": self.core.config.num_threads,
            "waiting_tokens": b.waiting_tokens,
            "waiting_requests": b.waiting_requests,
            "prefills": b.requests_total,
            "prefill_tokens_total": b.tokens_total,
            "prefill_compute_s_total": b.compute_s_total,
            "prefill_passes": b.passes,
            "prefill_preemptions": b.preemptions,
            "mixed_batch": b.decode is not None,
            "mixed_passes": b.mixed_passes,
            **b.cache_stats(),
        }
