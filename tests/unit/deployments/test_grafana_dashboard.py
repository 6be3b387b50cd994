"""The Grafana dashboard (serve_configs/grafana/) queries only series that exist: this app's
metrics as Ray exports them (``ray_`` + the declared name, histograms as ``_bucket``,
``_sum``, ``_count``), or Ray Serve's own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ray.serve

from deployments.metrics import declared_names

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "serve_configs" / "grafana" / "splitserve-dashboard.json"


def _exprs(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        query = node.get("query")
        if isinstance(query, dict) and isinstance(query.get("query"), str):
            found.append(query["query"])
        return found + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def _serve_source() -> str:
    root = Path(ray.serve.__file__).parent
    return "".join(p.read_text() for p in (root / "_private").glob("*.py"))


def test_every_queried_series_is_declared():
    dash = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dash)
    assert len(exprs) >= 20
    series = {s for e in exprs for s in re.findall(r"\bray_[a-zA-Z0-9_]+", e)}
    declared = declared_names()
    serve_source = _serve_source()
    used = set()
    for s in sorted(series):
        name = s.removeprefix("ray_")
        if name.startswith("serve_"):
            assert f'"{name}"' in serve_source, f"{s}: not a Ray Serve metric"
            continue
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in declared or base in declared, f"{s}: not in deployments/metrics.py"
        used.add(name if name in declared else base)
    # the split's own signals are all on it
    assert {"splitserve_kv_hop_seconds", "splitserve_prefill_waiting_tokens",
            "vllm_time_to_first_token_seconds", "vllm_request_time_per_output_token_seconds",
            "splitserve_requests_total", "vllm_num_requests_waiting"} <= used


def test_percentiles_read_histogram_buckets():
    for expr in _exprs(json.loads(DASHBOARD.read_text())):
        if "histogram_quantile" in expr:
            assert re.search(r"rate\(ray_\w+_bucket\{", expr) and "by (le" in expr, expr
