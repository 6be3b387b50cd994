"""Cache-aware routing for the prefill phase: prompts that start alike go to the same replica.

Each prefill replica keeps its own prefix cache (``app.prefix_cache``), so a shared system
prompt or a chat's earlier turns are computed once only if their requests reach the same
replica. :class:`PrefixAffinityRouter` (a Ray Serve request router, run in the caller: the
ingress) ranks the replicas for a prompt by rendezvous hashing of its first
``prefix_tokens`` tokens: every caller ranks them alike with no shared state, and when a
replica joins or leaves only the prompts that ranked it first move.

Load comes first: when the first-ranked replica holds more than ``imbalance`` requests
more than the least loaded one (Serve's cached queue lengths), the prompt goes to the least
loaded instead. A replica that refuses (a
full queue) sends the prompt to the next in rank, as Serve does for any router.

Requests that carry no ``PrefillRequest`` (stats, fault injection) go to a replica at
random.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from app.messages import PrefillRequest


def prefix_key(prompt: tuple[int, ...], prefix_tokens: int) -> bytes:
    """What two prompts must share to be sent to the same replica."""
    head = prompt[:prefix_tokens]
    return hashlib.blake2b(repr(head).encode(), digest_size=16).digest()


def rank(key: bytes, replica_ids: list[str]) -> list[str]:
    """Rendezvous (highest random weight) order of ``replica_ids`` for ``key``."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(key + rid.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def _prefill_request(pending: PendingRequest | None) -> PrefillRequest | None:
    if pending is None:
        return None
    for arg in (*(pending.args or ()), *(pending.kwargs or {}).values()):
        if isinstance(arg, PrefillRequest):
            return arg
    return None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, prefix_tokens: int = 64, imbalance: int = 4,
                         **kwargs: Any) -> None:
        if prefix_tokens < 1 or imbalance < 0:
            raise ValueError("prefix_tokens must be >= 1 and imbalance >= 0")
        self.prefix_tokens = prefix_tokens
        self.imbalance = imbalance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        req = _prefill_request(pending_request)
        if req is None or len(candidate_replicas) < 2:
            # no prompt (stats, fault injection): a replica at random, the next if it is full
            return [[r] for r in shuffled]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[rid] for rid in rank(prefix_key(req.prompt_token_ids,
                                                         self.prefix_tokens), list(by_id))]
        cache = self.replica_queue_len_cache
        lens = [cache.get(r.replica_id) for r in ranked]
        known = [n for n in lens if n is not None]
        if lens[0] is not None and known and lens[0] - min(known) > self.imbalance:
            # the preferred replica is busy: the least loaded wins (ties at random; Serve
            # takes the first of equals)
            return [shuffled]
        return [[r] for r in ranked]
