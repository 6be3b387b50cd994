"""Pressure on a real cluster: the object store when decode takes KV packages more slowly than
prefill makes them (the test nodes' stores are 120 MB, a 930-token package ~43 MB).

The session's split app (default settings): a package stays in the prefill node's store until
its stream ends, so long prompts arriving together would pile up there; the ingress's KV
budget (deployments.kv_budget, by default half the smallest store) must hold prompts back
before prefill instead.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from ray import serve
from ray.util.state import list_objects

from tests.cluster import OBJECT_STORE_BYTES
from tests.integration.conftest import APP

pytestmark = pytest.mark.integration

BIG = 1 << 20  # a KV package of a few hundred tokens is tens of MB; Serve's objects are small


def kv_objects() -> dict[str, int]:
    """KV-sized objects in the cluster's stores, by id (Ray lists an object once per
    reference to it)."""
    objects = list_objects(limit=10000, raise_on_missing_output=False)
    return {o.object_id: o.object_size for o in objects if (o.object_size or 0) >= BIG}


def kv_objects_bytes() -> int:
    return sum(kv_objects().values())


def stream(url: str, prompt: str, max_tokens: int) -> tuple[int, list]:
    """Stream a completion; returns its completion_tokens (from the usage chunk) and any
    error events."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    n, errors = 0, []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                elif chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
    return n, errors


def test_prefill_slows_to_decode_pace_instead_of_filling_the_object_store(split_app):
    """Four ~930-token prompts at once: without backpressure their four packages (~170 MB)
    would be made and streamed together, more than the 120 MB store holds. KV bytes in the
    stores stay within the ingress's budget (plus one package: a finished stream's object is
    freed asynchronously), every request completes, some waited for room (in their
    traces), and no KV object is left afterwards."""
    prompts = [f"Document {i}: " + " ".join(f"line {j} of document {i} is here."
                                             for j in range(85)) for i in range(4)]
    url = split_app.url
    ingress = serve.get_deployment_handle("Ingress", APP)
    before = ingress.stats.remote().result(timeout_s=60)
    budget = before["kv_budget_bytes"]
    assert budget == OBJECT_STORE_BYTES // 2  # the default: half the smallest store
    samples: list[int] = []
    largest = [0]
    results: dict[int, tuple[int, list]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            objects = kv_objects()
            samples.append(sum(objects.values()))
            largest[0] = max([largest[0], *objects.values()])
            time.sleep(0.3)

    def client(i: int) -> None:
        results[i] = stream(url, prompts[i], 16)

    sampler = threading.Thread(target=sample)
    sampler.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    try:
        for t in clients:
            t.start()
        for t in clients:
            t.join(600)
    finally:
        done.set()
        sampler.join(60)
    assert sorted(results) == list(range(len(prompts)))
    assert all(not errors and n == 16 for n, errors in results.values()), results
    stats = ingress.stats.remote().result(timeout_s=60)
    print(f"pressure: budget={budget} peak_reserved={stats['kv_in_flight_peak_bytes']} "
          f"waited={stats['kv_budget_waited']} max_sampled={max(samples)} "
          f"package={largest[0]} "
          f"samples={len(samples)}")
    assert stats["kv_in_flight_peak_bytes"] <= budget
    assert stats["kv_budget_waited"] > before["kv_budget_waited"]
    assert stats["kv_in_flight_bytes"] == 0
    assert max(samples) <= budget + largest[0], samples
    traces = httpx.get(f"{url}/debug/requests", timeout=60).json()["data"]
    assert any(t["kv_budget_wait_s"] > 0 for t in traces)
    deadline = time.monotonic() + 90
    while kv_objects_bytes() and time.monotonic() < deadline:
        time.sleep(1)
    assert kv_objects_bytes() == 0
