"""BENCHMARKS.md's generated tables equal what the committed result files give, and the block
rewriting itself (load_tests/bench_tables.py)."""

from __future__ import annotations

import json

import pytest

from load_tests import bench_tables

BENCHMARKS = bench_tables.ROOT / "BENCHMARKS.md"


def test_committed_tables_match_committed_results():
    text = BENCHMARKS.read_text()
    blocks = bench_tables.blocks(text)
    generators = {spec.split()[0] for spec, _ in blocks}
    # the bf16 side-by-side tables and the structured-output ones at least
    assert {"peer_rounds", "structured_peer", "structured_bench"} <= generators
    assert sum(spec.startswith("peer_rounds") for spec, _ in blocks) >= 2
    for spec, body in blocks:
        assert body == bench_tables.generate(spec, BENCHMARKS.parent) + "\n", spec
    assert bench_tables.main(["--check", "--file", str(BENCHMARKS)]) == 0


def _result(tok_s: float, tpot: float, ttft: float) -> dict:
    return {"output_throughput": tok_s, "median_tpot_ms": tpot, "p99_itl_ms": 2 * tpot,
            "median_ttft_ms": ttft, "p90_ttft_ms": ttft, "total_input_tokens": 640,
            "duration": 10.0, "completed": 8, "num_prompts": 8}


def _rounds(tmp_path):
    # two rounds; split / vllm out tok/s 0.5 and 1.0 at W-short, TPOT 2.0 and 1.0
    for i, (vllm, split) in enumerate([((60.0, 100.0), (30.0, 200.0)),
                                       ((40.0, 100.0), (40.0, 100.0))], start=1):
        folder = tmp_path / "results" / f"r{i}"
        folder.mkdir(parents=True)
        for server, (tok_s, tpot) in (("vllm", vllm), ("split", split)):
            (folder / f"{server}_W-short.json").write_text(json.dumps(_result(tok_s, tpot, 50.0)))


def test_rewrite_check_and_errors(tmp_path, capsys):
    _rounds(tmp_path)
    doc = tmp_path / "doc.md"
    spec = 'peer_rounds results/r* --servers vllm split --figure "W-short:ITL p99 ms"'
    stale = f"before\n<!-- generated: {spec} -->\n| old |\n<!-- /generated -->\nafter\n"
    doc.write_text(stale)

    assert bench_tables.main(["--check", "--file", str(doc)]) == 1
    assert doc.read_text() == stale  # --check changes nothing
    assert bench_tables.main(["--file", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(f"before\n<!-- generated: {spec} -->\n| workload |")
    assert text.endswith("<!-- /generated -->\nafter\n")
    assert "| W-short | out tok/s | 50.0 | 35.0 | 0.75x (0.50-1.00, 2 rounds) |" in text
    assert "| W-short | ITL p99 ms |" in text
    assert bench_tables.main(["--check", "--file", str(doc)]) == 0
    assert bench_tables.main(["--file", str(doc)]) == 0
    assert doc.read_text() == text  # idempotent

    # a changed result makes the block stale again
    (tmp_path / "results" / "r2" / "split_W-short.json").write_text(
        json.dumps(_result(80.0, 100.0, 50.0)))
    assert bench_tables.main(["--check", "--file", str(doc)]) == 1
    capsys.readouterr()

    for bad in ("<!-- generated: nosuch x -->\n<!-- /generated -->\n",
                "<!-- generated: peer_rounds results/missing -->\n<!-- /generated -->\n",
                "<!-- generated: peer_rounds results/none* -->\n<!-- /generated -->\n",
                "<!-- generated: peer_rounds results/r1 -->\n| never closed |\n"):
        doc.write_text(bad)
        assert bench_tables.main(["--check", "--file", str(doc)]) == 2
        assert bench_tables.main(["--file", str(doc)]) == 2
        assert doc.read_text() == bad
    with pytest.raises(bench_tables.BlockError):
        bench_tables.generate('peer_rounds results/r1 --figure "W-short:nope"', tmp_path)


def test_structured_peer_ratio_is_the_median_of_rounds(tmp_path):
    for r, (vllm, split) in enumerate([(200.0, 160.0), (180.0, 180.0)], start=1):
        for server, tok_s in (("vllm", vllm), ("split", split)):
            (tmp_path / f"{r}-{server}.json").write_text(json.dumps(
                {"requests": 24, "output_tok_s": tok_s, "valid": 10,
                 "finish_reasons": {"stop": 10, "length": 14}}))
    table = bench_tables.generate("structured_peer .", tmp_path)
    assert "| output tok/s | 200.0 / 180.0 | 160.0 / 180.0 | 0.90x (0.80-1.00, 2 rounds) |" in table
    assert "| finish_reason length | 14 / 14 | 14 / 14 | |" in table
