"""The test topology (test infrastructure, shared by the integration tests and the benchmarks
that need Ray): a head for the ingress, a node that offers only the prefill tag and a node
that offers only the decode tag, each with its own raylet and object store, all on this
machine; Serve's HTTP proxy on 127.0.0.1 on a free port; each node's Prometheus endpoint
(Ray's metrics export port) on a free port, and the head's dashboard (what ``serve status``
asks) where Ray starts it."""

from __future__ import annotations

import fcntl
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

OBJECT_STORE_BYTES = 120 * 1024 * 1024
# The integration tests take the same lock: one Ray cluster on this machine at a time.
LOCK_PATH = "/tmp/splitserve-ray-cluster.lock"


@dataclass(frozen=True)
class Topology:
    url: str  # http://127.0.0.1:PORT
    head_id: str
    prefill_id: str
    decode_id: str
    metrics_urls: tuple[str, ...] = ()  # http://NODE_IP:PORT/metrics: head, prefill, decode
    dashboard_url: str | None = None  # http://HOST:PORT, None when Ray started none


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 300.0) -> None:
    """Until ``GET {url}/health`` answers ready."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=10)
            if r.status_code == 200 and r.json().get("ready"):
                return
            last = r.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s}s: {last}")


@contextmanager
def split_topology(prefill_slots: float = 2, decode_slots: float = 2) -> Iterator[Topology]:
    """Start the three-node cluster and Serve; shut everything down on exit."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    with open(LOCK_PATH, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ports = [free_port() for _ in range(3)]
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"ingress_node": 1},
            "object_store_memory": OBJECT_STORE_BYTES, "metrics_export_port": ports[0]})
        prefill = cluster.add_node(num_cpus=1, resources={"prefill_accel": prefill_slots},
                                   object_store_memory=OBJECT_STORE_BYTES,
                                   metrics_export_port=ports[1])
        decode = cluster.add_node(num_cpus=1, resources={"decode_accel": decode_slots},
                                  object_store_memory=OBJECT_STORE_BYTES,
                                  metrics_export_port=ports[2])
        cluster.wait_for_nodes()
        webui = cluster.webui_url
        ray.init(address=cluster.address, include_dashboard=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        try:
            yield Topology(f"http://127.0.0.1:{port}", cluster.head_node.node_id,
                           prefill.node_id, decode.node_id,
                           tuple(f"http://{node.node_ip_address}:{p}/metrics"
                                 for node, p in zip((cluster.head_node, prefill, decode), ports,
                                                    strict=True)),
                           f"http://{webui}" if webui else None)
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()
            fcntl.flock(lock, fcntl.LOCK_UN)


def _deep_merged(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = _deep_merged(out[key], value)
        out[key] = value
    return out


def _cpus(n: float) -> dict:
    return {"deployment_config": {"ray_actor_options": {"num_cpus": n}}}


def phase_args(**overrides) -> dict:
    """App args for this topology: one torch thread and half a CPU per replica (two replicas
    of a phase fit its one-CPU node), the ingress pinned to the head. ``overrides`` are
    merged in at any depth (``decode={"deployment_config": {"num_replicas": 2}}``)."""
    args: dict = {
        "prefill": {"resource_tag": "prefill_accel", "num_threads": 1, **_cpus(0.5)},
        "decode": {"resource_tag": "decode_accel", "num_threads": 1, **_cpus(0.5)},
        "ingress": {"resource_tag": "ingress_node", **_cpus(0.1)},
        "prefill_batch_wait_s": 0.002,
    }
    return _deep_merged(args, overrides)


@contextmanager
def cpu_hog(processes: int = 1, max_s: float = 900.0) -> Iterator[list]:
    """Busy cores beside the cluster, as on a production machine running other work:
    ``processes`` pure-Python spinning processes, each ending by itself after ``max_s`` and
    killed on exit."""
    import subprocess
    import sys

    spin = f"import time\nend = time.time() + {max_s}\nwhile time.time() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(processes)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(30)
