"""The side-by-side table of peer_bench results: ratios to vLLM and to the decode floor."""

from __future__ import annotations

import json

import pytest

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


def test_rounds_ratios_to_a_named_baseline(tmp_path, capsys):
    """peer_rounds --baseline: the ratios are to that server's figure in the same round (the
    budget-matched vLLM of make bench-peers), the median with the rounds' min-max."""
    from load_tests import peer_rounds

    rounds = []
    for i, (matched, split) in enumerate(((50.0, 40.0), (100.0, 60.0), (80.0, 80.0))):
        folder = tmp_path / f"round-{i}"
        folder.mkdir()
        for name, tok_s in (("vllm", 200.0), ("vllm-matched", matched), ("split", split)):
            (folder / f"{name}_W-short.json").write_text(json.dumps(_result(tok_s, 10.0)))
        rounds.append(str(folder))
    servers = ["--servers", "vllm", "vllm-matched", "split"]
    assert peer_rounds.main([*rounds, *servers, "--baseline", "vllm-matched"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("| W-short | out tok/s"))
    assert "split / vllm-matched" not in row
    # split over matched per round: 0.80, 0.60, 1.00
    assert row.rstrip(" |").endswith("0.80x (0.60-1.00, 3 rounds)")


def test_rounds_compare_servers_at_different_dtypes_round_by_round(tmp_path, capsys):
    """``NAME@DTYPE`` reads a server from that dtype's rounds only (make bench-peers' layout),
    pairing rounds by name across dtypes: the app at bf16 over vLLM at float32. A server
    named without its dtype, found in two rounds of one name, is refused."""
    from load_tests import peer_rounds

    rounds = []
    for dtype, vllm, split in (("bfloat16", (50.0, 60.0, 40.0), (150.0, 150.0, 150.0)),
                               ("float32", (100.0, 120.0, 150.0), (90.0, 90.0, 90.0))):
        for i in range(3):
            folder = tmp_path / dtype / f"round-{i + 1}"
            folder.mkdir(parents=True)
            for name, tok_s in (("vllm", vllm[i]), ("split", split[i])):
                (folder / f"{name}_W-short.json").write_text(json.dumps(_result(tok_s, 10.0)))
            rounds.append(str(folder))
    servers = ["split@bfloat16", "vllm@bfloat16", "vllm@float32"]
    assert peer_rounds.main([*rounds, "--servers", *servers, "--baseline", "vllm@float32"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("| W-short | out tok/s"))
    cells = [c.strip() for c in row.strip("| ").split("|")]
    # medians: split at bf16 150, vLLM at bf16 50, at float32 120; split / vllm@float32 per
    # round 1.50, 1.25, 1.00; vllm@bfloat16 / vllm@float32 0.50, 0.50, 0.27
    assert cells[2:5] == ["150.0", "50.0", "120.0"]
    assert cells[5] == "1.25x (1.00-1.50, 3 rounds)"
    assert cells[6] == "0.50x (0.27-0.50, 3 rounds)"
    with pytest.raises(SystemExit):
        peer_rounds.main([*rounds, "--servers", "split", "vllm", "--baseline", "vllm"])
    assert "name the dtype: split@<folder>" in capsys.readouterr().err
