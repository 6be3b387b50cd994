"""A real multi-node Ray cluster on this machine: a head (ingress only), a node that offers
only the prefill tag and a node that offers only the decode tag, each with its own raylet and
object store."""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

APP = "splitserve"
OBJECT_STORE = 120 * 1024 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_app_args(**overrides) -> dict[str, Any]:
    args: dict[str, Any] = {
        "prefill": {"resource_tag": "prefill_accel", "num_cpus": 0.5, "num_threads": 1},
        "decode": {"resource_tag": "decode_accel", "num_cpus": 0.5, "num_threads": 1},
        "ingress": {"resource_tag": "ingress_node", "num_cpus": 0.1},
        "prefill_batch_wait_s": 0.002,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key] = {**args[key], **value}
        else:
            args[key] = value
    return args


def wait_ready(url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=10)
            if r.status_code == 200 and r.json().get("ready"):
                return
            last = r.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise TimeoutError(f"app not ready after {timeout_s}s: {last}")


@pytest.fixture(scope="session")
def ray_machine_lock():
    """One Ray cluster on this machine at a time (parallel test sessions would fight over
    ports and the two cores); free in CI, where one session runs."""
    import fcntl

    with open("/tmp/splitserve-ray-cluster.lock", "w") as fh:
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
                        "object_store_memory": OBJECT_STORE},
    )
    prefill = cluster.add_node(num_cpus=1, resources={"prefill_accel": 2},
                               object_store_memory=OBJECT_STORE)
    decode = cluster.add_node(num_cpus=1, resources={"decode_accel": 2},
                              object_store_memory=OBJECT_STORE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False)
    port = _free_port()
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

    serve.run(build_app(test_app_args()), name=APP, route_prefix="/", blocking=False)
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
            serve.run(build_app(test_app_args()), name=APP, route_prefix="/", blocking=False)
            wait_ready(cluster.url, timeout_s=240)
