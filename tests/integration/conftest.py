"""A real multi-node Ray cluster on this machine: a head (ingress only), a node that offers
only the prefill tag and a node that offers only the decode tag, each with its own raylet and
object store."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest

from tests.cluster import (
    LOCK_PATH,
    OBJECT_STORE_BYTES,
    free_port,
    phase_args,
    wait_ready,
)

APP = "splitserve"
# the test topology and its helpers are the benchmarks' too (tests/cluster.py)
app_args = phase_args


@dataclass
class SplitCluster:
    cluster: Any
    head_id: str
    prefill_id: str
    decode_id: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def ray_machine_lock():
    """One Ray cluster on this machine at a time (parallel test sessions would fight over
    ports and the two cores); free in CI, where one session runs."""
    import fcntl

    with open(LOCK_PATH, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def split_cluster(ray_machine_lock):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"ingress_node": 1},
                        "object_store_memory": OBJECT_STORE_BYTES},
    )
    prefill = cluster.add_node(num_cpus=1, resources={"prefill_accel": 2},
                               object_store_memory=OBJECT_STORE_BYTES)
    decode = cluster.add_node(num_cpus=1, resources={"decode_accel": 2},
                              object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    try:
        yield SplitCluster(cluster, cluster.head_node.node_id, prefill.node_id, decode.node_id,
                           port)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def split_app(split_cluster):
    """The split app with default engine settings, deployed once for the session."""
    from ray import serve

    from deployments.builder import build_app

    serve.run(build_app(app_args()), name=APP, route_prefix="/", blocking=False)
    wait_ready(split_cluster.url)
    return split_cluster


@contextlib.contextmanager
def exclusive_app(cluster: SplitCluster, app, name: str, route_prefix: str):
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
