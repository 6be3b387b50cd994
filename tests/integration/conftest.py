"""A real multi-node Ray cluster on this machine: a head (ingress only), a node that offers
only the prefill tag and a node that offers only the decode tag, each with its own raylet and
object store."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from ray import serve
from ray.util.state import list_actors

from tests.cluster import Topology, phase_args, split_topology, wait_ready

APP = "splitserve"
# the test topology and its helpers are the benchmarks' too (tests/cluster.py)
app_args = phase_args


@pytest.fixture(scope="session")
def split_cluster():
    """The three-node cluster with Serve on it (``tests.cluster.split_topology``), for the
    whole session; it holds the machine's Ray lock, so parallel sessions wait their turn."""
    with split_topology() as topology:
        yield topology


@pytest.fixture(scope="session")
def split_app(split_cluster):
    """The split app with default engine settings, deployed once for the session."""
    from ray import serve

    from deployments.builder import build_app

    serve.run(build_app(app_args()), name=APP, route_prefix="/", blocking=False)
    wait_ready(split_cluster.url)
    return split_cluster


@contextlib.contextmanager
def exclusive_app(cluster: Topology, app, name: str, route_prefix: str):
    """Deploy ``app`` alone on the cluster (other apps hold replica slots it may need); the
    session's split app comes back afterwards if it was running."""
    from ray import serve

    from deployments.builder import build_app

    running = list(serve.status().applications)
    for other in running:
        serve.delete(other)
    serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
    url = cluster.url + (route_prefix.rstrip("/") if route_prefix != "/" else "")
    try:
        wait_ready(url, timeout_s=240)
        yield url
    finally:
        serve.delete(name)
        if APP in running:
            serve.run(build_app(app_args()), name=APP, route_prefix="/", blocking=False)
            wait_ready(cluster.url, timeout_s=240)


def local_greedy(model, tokenizer, requests: list[tuple[Any, dict[str, Any]]]) -> list:
    """The reference the app must match: each (SamplingParams, prompt= or messages=) request
    run alone through the in-process LocalEngine; returns their GenerationOutputs."""
    import asyncio

    from app.config import EngineConfig
    from app.engine_core import LocalEngine

    engine = LocalEngine(EngineConfig(), model=model, tokenizer=tokenizer)

    async def run() -> list:
        outs = [await engine.generate(engine.make_request(sp, **kw)) for sp, kw in requests]
        await engine.close()
        return outs

    return asyncio.run(run())


def live_replicas(app: str, deployment: str) -> list:
    """The live actors of a deployment's replicas (Ray's state API)."""
    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name.endswith(f"{app}:{deployment}")]


def decode_replica_stats(app: str) -> dict[str, dict]:
    """stats() of each live decode replica of ``app``, asked by its id (its router sends a
    call that names a replica there), keyed by the replica id the answer gives."""
    handle = serve.get_deployment_handle("DecodeServer", app)
    seen: dict[str, dict] = {}
    for actor in live_replicas(app, "DecodeServer"):
        st = handle.stats.remote(on_replica=actor.name.split("#")[-1]).result(timeout_s=30)
        seen[st["replica_id"]] = st
    return seen
