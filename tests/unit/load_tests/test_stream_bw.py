"""The read-bandwidth floor (load_tests/stream_bw.py) and bench_peers.sh's checks before it
starts anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from load_tests.stream_bw import WEIGHT_BYTES, format_report, read_gbs, report, summarize

ROOT = Path(__file__).resolve().parents[3]


def test_the_floor_is_the_weight_bytes_over_the_measured_bandwidth():
    assert all(v > 0 for v in read_gbs(1, gib=0.01, repeats=2))
    rep = report([1, 2], gib=0.01, repeats=2, params=1_000_000)
    assert set(rep["threads"]) == {"1", "2"}
    for r in rep["threads"].values():
        assert r["min"] <= r["read_gb_per_s"] <= r["max"]
        for dtype, size in WEIGHT_BYTES.items():
            expected_ms = 1_000_000 * size / (r["read_gb_per_s"] * 1e9) * 1000
            assert abs(r["floor_ms"][dtype] - expected_ms) < 1e-9
        assert r["floor_ms"]["float32"] == 2 * r["floor_ms"]["bfloat16"]
    text = format_report(rep)
    assert "1M parameters" in text and text.count("\n") == 3


def test_rounds_summarize_as_median_and_range(tmp_path):
    import json

    paths = []
    for i, gbs in enumerate((10.0, 20.0, 40.0)):
        rep = {"threads": {"1": {"read_gb_per_s": gbs,
                                 "floor_ms": {"bfloat16": 270e6 / (gbs * 1e9) * 1000}}}}
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(rep))
    table = summarize([str(p) for p in paths], "bfloat16")
    assert "| 1 | 20.0 (10.0-40.0) | 13.50 | 74 |" in table  # 270 MB at 20 GB/s


def _bench_peers(env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PEER", "PEER_SCRIPTS")}
    return subprocess.run([str(ROOT / "load_tests" / "bench_peers.sh")], env={**clean, **env},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_bench_peers_says_how_to_set_the_peer_up_and_starts_nothing(tmp_path):
    res = _bench_peers({})
    assert res.returncode == 2 and "setup.sh" in res.stderr and "PEER=" in res.stderr
    res = _bench_peers({"PEER": str(tmp_path)})
    assert res.returncode == 2 and "vllm-venv/bin/vllm is missing" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_bench_peers_refuses_a_model_that_is_not_a_model_folder(tmp_path):
    peer = tmp_path / "peer"
    (peer / "vllm-venv" / "bin").mkdir(parents=True)
    (peer / "vllm-venv" / "bin" / "vllm").write_text("#!/bin/sh\n")
    (peer / "vllm-venv" / "bin" / "vllm").chmod(0o755)
    (peer / "smollm2-hf").mkdir()
    (peer / "smollm2-hf" / "config.json").write_text("{}")
    (peer / "peer").mkdir()
    for script in ("bench.sh", "start_vllm.sh", "mixed.sh"):
        (peer / "peer" / script).write_text("#!/bin/sh\n")
    out = tmp_path / "out"
    res = _bench_peers({"PEER": str(peer), "MODEL": str(tmp_path / "empty"),
                        "OUT": str(out)})
    assert res.returncode == 2
    assert "is not a model folder (no config.json)" in res.stderr
    assert not out.exists()  # refused before the results folder or any server
    assert sorted(p.name for p in peer.iterdir()) == ["peer", "smollm2-hf", "vllm-venv"]
