"""What an operator sees of a live split app: each documented metric series on the nodes'
Prometheus endpoints (Ray's metrics export port) after a few requests, with plausible values
and the served model's name; and ``serve status`` (the CLI, through the head's dashboard)
reporting both phases healthy; and an app the cluster cannot place failing at build time."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from deployments.metrics import declared_names
from tests.integration.conftest import APP

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
# a prompt longer than a few KV blocks, sent twice: the second one hits the prefix cache
LONG = "Summarize the following notes. " + " ".join(f"Note {i}: the sky was blue."
                                                      for i in range(20))
# Counters Ray exports only once they were incremented: none of these requests evicts
NOT_YET = {"splitserve_prefix_cache_evictions_total"}
_LINE = re.compile(r"^(\w+)(?:\{(.*)\})? ([-+0-9.eEinfNa]+)$")


def _scrape(urls: tuple[str, ...]) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for url in urls:
        try:
            text = httpx.get(url, timeout=10).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            m = _LINE.match(line)
            if m:
                labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
                samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def _total(samples, name: str, **labels: str) -> float | None:
    values = [v for n, lab, v in samples
              if n == name and all(lab.get(k) == x for k, x in labels.items())]
    return sum(values) if values else None


def _missing(samples) -> list[str]:
    present = {n for n, lab, _ in samples if lab.get("model_name") == MODEL}
    missing = []
    for name in sorted(declared_names() - NOT_YET):
        exported = "ray_" + name
        if exported not in present and exported + "_count" not in present:
            missing.append(exported)
    return missing


def test_metrics_endpoint_exports_every_documented_series(split_app):
    assert len(split_app.metrics_urls) == 3
    n = 4
    with httpx.Client(base_url=split_app.url, timeout=120) as client:
        for i in range(n):
            content = LONG if i < 2 else f"Count to {i}."
            r = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 8, "stream": i % 2 == 0,
                "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 200, r.text
        r = client.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi"})
        assert r.status_code == 404

    def healthy(samples, deployment: str) -> float:
        return _total(samples, "ray_serve_deployment_replica_healthy", application=APP,
                      deployment=deployment) or 0

    # Ray exports every few seconds (Serve's controller its gauges on its own schedule); a
    # slow machine may take a while
    deadline = time.monotonic() + 90
    while True:
        samples = _scrape(split_app.metrics_urls)
        missing = _missing(samples)
        done = (not missing and (_total(samples, "ray_vllm_request_success_total",
                                        model_name=MODEL) or 0) >= n
                and (_total(samples, "ray_splitserve_requests_total",
                            outcome="ModelNotFoundError") or 0) >= 1
                and all(healthy(samples, d) >= 1 for d in ("PrefillServer", "DecodeServer")))
        if done or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert missing == [], f"not exported after 90 s: {missing}"

    def mean(name: str) -> float:
        return (_total(samples, f"{name}_sum", model_name=MODEL)
                / _total(samples, f"{name}_count", model_name=MODEL))

    assert _total(samples, "ray_vllm_time_to_first_token_seconds_count") >= n
    assert 0 < mean("ray_vllm_time_to_first_token_seconds") < 60  # seconds, not ms
    assert 0 < mean("ray_vllm_e2e_request_latency_seconds") < 120
    assert 0 < mean("ray_vllm_request_time_per_output_token_seconds") < 10
    assert 0 <= mean("ray_splitserve_kv_hop_seconds") < 30
    assert 0 < mean("ray_splitserve_decode_step_seconds") < 10
    assert 0 < mean("ray_splitserve_prefill_compute_seconds") < 60
    assert mean("ray_splitserve_kv_package_bytes") > 1024
    assert _total(samples, "ray_splitserve_kv_hop_bytes_total") > 1024 * n
    assert _total(samples, "ray_vllm_generation_tokens_total") >= n
    assert _total(samples, "ray_vllm_prompt_tokens_total") >= 2 * 100
    assert _total(samples, "ray_vllm_request_success_total", finished_reason="length") >= 1
    assert _total(samples, "ray_vllm_prefix_cache_hits_total") > 0
    assert _total(samples, "ray_splitserve_requests_total", outcome="ModelNotFoundError") >= 1
    assert _total(samples, "ray_splitserve_requests_total", outcome="ok") >= n
    usage = [v for name, _, v in samples if name == "ray_vllm_kv_cache_usage_perc"]
    assert usage and all(0 <= v <= 1 for v in usage)
    # replicas per phase: Ray Serve's own gauge, queried by the dashboard
    for deployment in ("PrefillServer", "DecodeServer"):
        assert healthy(samples, deployment) >= 1, f"{deployment}: no healthy-replica gauge"


def test_serve_status_reports_both_phases_healthy(split_app):
    """``serve status`` asks the head's dashboard (its REST API) for the app's state."""
    if split_app.dashboard_url is None:
        pytest.skip("the test cluster started no dashboard (ray[default] not installed?)")
    serve_cli = Path(sys.executable).parent / "serve"
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run([str(serve_cli), "status", "--address", split_app.dashboard_url],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        app = (yaml.safe_load(out.stdout)["applications"] or {}).get(APP, {})
        deployments = app.get("deployments", {})
        healthy = {name: d.get("status") for name, d in deployments.items()}
        if (healthy.get("PrefillServer") == healthy.get("DecodeServer") == "HEALTHY"
                or time.monotonic() > deadline):
            break
        time.sleep(2)
    assert app.get("status") == "RUNNING", out.stdout
    assert healthy.get("PrefillServer") == "HEALTHY", out.stdout
    assert healthy.get("DecodeServer") == "HEALTHY", out.stdout


def test_an_app_the_cluster_cannot_place_fails_at_build(split_app):
    """What `serve run` / `serve deploy` build on this cluster: a phase tag that no node
    offers fails at once with the fix named, instead of replicas pending forever."""
    import ray

    from deployments.builder import PlacementError, build_app

    assert ray.is_initialized()  # connected to the test cluster, as `serve run` is
    with pytest.raises(PlacementError, match="missing_accel") as err:
        build_app({"prefill": {"resource_tag": "missing_accel"}})
    assert "ray start" in str(err.value) and "allow_pending_resources" in str(err.value)
    assert build_app({}) is not None  # the tags this cluster offers pass
    assert build_app({"prefill": {"resource_tag": "missing_accel"},
                      "allow_pending_resources": True}) is not None
