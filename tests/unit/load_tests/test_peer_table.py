"""The side-by-side table of peer_bench results: ratios to vLLM and to the decode floor."""

from __future__ import annotations

import json

from load_tests import peer_table


def _result(tok_s: float, tpot: float, duration: float = 10.0) -> dict:
    return {"output_throughput": tok_s, "median_tpot_ms": tpot, "p99_itl_ms": 2 * tpot,
            "median_ttft_ms": 50.0, "total_input_tokens": 640, "duration": duration,
            "completed": 8, "num_prompts": 8}


def test_table_and_floor_ratios(tmp_path, capsys):
    for name, result in {"vllm_W-short": _result(60.0, 100.0),
                         "split_W-short": _result(30.0, 200.0),
                         "vllm_W-single": _result(9.0, 90.0),
                         "split_W-single": _result(8.0, 120.0)}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    (tmp_path / "decode_bench.json").write_text(json.dumps({"float32+packed": {
        "weight_mb": 538.0, "floor_ms": 40.0, "step1_ms": 100.0, "step8_ms": 150.0,
        "step8_over_step1": 1.5}}))
    assert peer_table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| ")}
    # TPOT 120 ms over a 40 ms floor and a 100 ms engine step; 30 tok/s over 8 per 40 ms
    assert "| 3.00x | 1.20x | 0.15 |" in rows["split (`make run`)"]
    assert "| 2.25x | 0.90x | 0.30 |" in rows["vLLM-CPU"]
    assert "0.50x" in [c.strip() for c in out.split("W-short | out tok/s")[1]
                      .splitlines()[0].split("|")]  # split / vLLM tok/s


def test_no_floor_without_decode_bench(tmp_path, capsys):
    (tmp_path / "vllm_W-short.json").write_text(json.dumps(_result(60.0, 100.0)))
    assert peer_table.main([str(tmp_path)]) == 0
    assert "Decode floor" not in capsys.readouterr().out
