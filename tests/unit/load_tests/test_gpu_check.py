"""The GPU check's core on the tiny model, on the CPU chosen explicitly: greedy equality, step
timings per batch size, the KV package's size and transfers, the table and the JSON."""

from __future__ import annotations

import json
import random

import torch

from app.config import EngineConfig
from load_tests.gpu_check import CheckReport, GreedyResult, format_report, run_check

EOS = frozenset({2})  # the tiny model's


def test_run_check_on_cpu(tiny_model):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (7, 15)]
    config = EngineConfig(device="cpu", max_kv_tokens=4096)
    report = run_check(tiny_model, config, greedy_prompts=prompts, max_new_tokens=6,
                       eos_token_ids=EOS, batch_sizes=[1, 3], prompt_len=12, decode_steps=2,
                       repeats=1)
    assert torch.is_grad_enabled()  # inference mode stayed inside the check
    assert report.ok and report.device == "cpu" and report.dtype == "float32"
    assert [g.prompt_tokens for g in report.greedy] == [7, 15]
    for g in report.greedy:
        assert g.equal_alone and g.alone == g.expected and 0 < len(g.expected) <= 6

    assert [(s.phase, s.batch, s.tokens_per_step) for s in report.steps] == [
        ("prefill", 1, 12), ("decode", 1, 1), ("prefill", 3, 36), ("decode", 3, 3)]
    assert all(s.ms > 0 and s.tokens_per_s > 0 for s in report.steps)

    layers, kv_heads, head_dim = 2, 2, 16
    kv_bytes = 2 * layers * kv_heads * head_dim * 4 * 12
    assert report.kv_tokens == 12
    assert kv_bytes <= report.kv_bytes <= kv_bytes + 12 * 4  # + the prompt's token ids
    assert 0 < report.kv_inband_bytes < 4096
    names = [t.name for t in report.transfers]
    assert len(names) == 4 and sum(t.used for t in report.transfers) == 2
    assert all(t.nbytes == kv_bytes and t.ms > 0 for t in report.transfers)

    table = format_report(report, "tiny")
    assert "2/2 prompts decoded alone" in table
    assert table.count("\nprefill ") == 2 and table.count("\ndecode ") == 2
    for name in names:
        assert name in table
    as_json = json.loads(json.dumps(report.as_dict()))
    assert as_json["ok"] is True and len(as_json["steps"]) == 4
    assert as_json["transfers"][0]["gb_per_s"] > 0


def test_a_greedy_mismatch_fails_the_check_and_says_where():
    report = CheckReport("cuda:0", "GPU", "bfloat16", "bfloat16",
                         greedy=[GreedyResult(5, [1, 2, 3, 4], [1, 2, 9, 4], [1, 2, 9, 4])])
    assert not report.ok
    table = format_report(report, "m")
    assert "0/1 prompts decoded alone" in table
    assert "differs at output 2: [9, 4] vs generate [3, 4]" in table
    assert not CheckReport("cpu", "cpu", "float32", "float32").ok  # nothing checked: not ok


def test_a_divergence_is_measured_in_a_full_forward_and_a_tie_passes(tiny_model):
    from app.engine_core import EngineCore
    from load_tests.gpu_check import Divergence, divergence

    core = EngineCore(EngineConfig(device="cpu", max_kv_tokens=4096), model=tiny_model)
    prompt, expected = [5, 17, 99, 3], [40, 41, 42]
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([prompt + expected[:1]])).logits[0, -1]
        d = divergence(core, prompt, [40, 7, 8], expected)
    assert (d.at, d.engine_token, d.generate_token) == (1, 7, 41)
    assert abs(d.logit_gap - abs(logits[7] - logits[41]).item()) < 1e-5
    big = max(abs(logits[7].item()), abs(logits[41].item()))
    assert abs(d.tolerance - 2 * torch.finfo(torch.float32).eps * big) < 1e-9
    assert divergence(core, prompt, expected, expected) is None
    assert divergence(core, prompt, expected[:2], expected) is None  # stopped early: no token

    tie = Divergence(2, 9, 3, logit_gap=0.1, tolerance=0.2)
    far = Divergence(2, 9, 3, logit_gap=0.5, tolerance=0.2)
    for div, ok in ((tie, True), (far, False)):
        report = CheckReport("cuda:0", "GPU", "bfloat16", "bfloat16", greedy=[
            GreedyResult(5, [1, 2, 3, 4], [1, 2, 9, 4], [1, 2, 9, 4], div)])
        assert report.ok is ok and report.as_dict()["greedy"][0]["agrees_alone"] is ok
        table = format_report(report, "m")
        verdict = "0.1000 (within" if ok else "0.5000 (beyond"
        assert f"full-forward logit gap {verdict} the tolerance 0.2000)" in table
