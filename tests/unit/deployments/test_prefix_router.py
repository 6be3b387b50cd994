"""Prefill routing by prompt prefix: stable ranks, affinity, and load first."""

from __future__ import annotations

from dataclasses import dataclass

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from app.messages import PrefillRequest
from app.sampling import SamplingParams
from deployments.prefix_router import PrefixAffinityRouter, prefix_key, rank

DEPLOYMENT = DeploymentID(name="PrefillServer", app_name="splitserve")


@dataclass
class FakeReplica:  # what the router reads of Serve's RunningReplica
    replica_id: ReplicaID
    max_ongoing_requests: int = 64


def _replicas(n: int) -> list[FakeReplica]:
    return [FakeReplica(ReplicaID(f"r{i}", DEPLOYMENT)) for i in range(n)]


def _pending(prompt: tuple[int, ...]) -> PendingRequest:
    req = PrefillRequest("x", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    return PendingRequest(args=[req], kwargs={}, metadata=None)


def _router(**kwargs) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN,
                                  use_replica_queue_len_cache=True)
    router.initialize_state(**kwargs)
    return router


def test_rank_moves_only_the_keys_of_a_replica_that_left():
    ids = [f"r{i}" for i in range(5)]
    keys = [prefix_key(tuple(range(k, k + 64)), 64) for k in range(300)]
    before = {k: rank(k, ids)[0] for k in keys}
    after = {k: rank(k, ids[:-1])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "r4" for k in moved)
    assert 0 < len(moved) < len(keys) // 2
    assert len(set(before.values())) == 5  # every replica gets some prefixes


async def test_prompts_sharing_their_start_go_to_the_same_replica():
    router = _router(prefix_tokens=16)
    replicas = _replicas(4)
    system = tuple(range(100, 116))
    firsts = set()
    for user in range(10):
        groups = await router.choose_replicas(replicas, _pending(system + (user,) * 5))
        assert [len(g) for g in groups] == [1, 1, 1, 1]  # ranked, one by one
        firsts.add(groups[0][0].replica_id.unique_id)
    assert len(firsts) == 1
    others = {(await router.choose_replicas(replicas, _pending((7, s) * 8)))[0][0]
              .replica_id.unique_id for s in range(40)}
    assert len(others) > 1  # different starts spread


async def test_a_busy_preferred_replica_hands_over_to_the_least_loaded():
    router = _router(prefix_tokens=16, imbalance=4)
    replicas = _replicas(3)
    pending = _pending(tuple(range(50, 80)))
    [first], *_ = await router.choose_replicas(replicas, pending)
    for r in replicas:
        router.replica_queue_len_cache.update(r.replica_id, 9 if r is first else 2)
    [anyone] = await router.choose_replicas(replicas, pending)
    assert sorted(r.replica_id.unique_id for r in anyone) == ["r0", "r1", "r2"]
    router.replica_queue_len_cache.update(first.replica_id, 6)  # within the bound: affinity
    assert (await router.choose_replicas(replicas, pending))[0] == [first]
    # no prompt in the request (a stats call): one replica at random (then the others)
    firsts = set()
    for _ in range(30):
        groups = await router.choose_replicas(
            replicas, PendingRequest(args=[], kwargs={}, metadata=None))
        assert sorted(g[0].replica_id.unique_id for g in groups) == ["r0", "r1", "r2"]
        firsts.add(groups[0][0].replica_id.unique_id)
    assert len(firsts) > 1
