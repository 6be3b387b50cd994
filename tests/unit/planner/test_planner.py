"""The capacity planner on cases with known answers: roofline arithmetic, the simulator's
service times and queueing, goodput counting, fitting, and the search's choice."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from load_tests.workloads import LengthDist
from planner import search as planner_search
from planner.__main__ import main as planner_main
from planner.hardware import (
    HARDWARE,
    LLAMA_31_8B,
    SMOLLM2_135M,
    DeviceProfile,
    Efficiency,
    Linear,
    ModelSpec,
    PassCost,
    roofline_profile,
)
from planner.profile import (
    device_from_measurement,
    fit_hop,
    fit_linear,
    stack_device,
)
from planner.sim import (
    Arrival,
    ColocatedSystem,
    EngineLimits,
    SplitSystem,
    Workload,
    load_trace,
    simulate,
)
from planner.validate import compare_run

# the split tests below time the prefill phase itself: no short prompt skips it while it is
# backed up (``local_prefill_when_busy`` has tests of its own)
NO_WAIT = EngineLimits(max_batch_size=16, token_budget=4096, prefill_max_rows=8,
                       batch_wait_s=0.0, local_prefill_when_busy=0)


def device(name="dev", *, prefill_per_token=0.001, prefill_base=0.01, step=0.02,
           hop_latency=0.0, hop_gbs=1e9, overhead=0.0, price=1.0, kv_budget=1 << 20,
           power=(100.0, 50.0, 10.0)) -> DeviceProfile:
    """A profile with simple exact costs: prefill = base + per_token x tokens, decode step =
    ``step`` whatever the batch, KV 1000 bytes per token."""
    return DeviceProfile(
        name=name,
        prefill=PassCost(0.0, Linear(prefill_base, prefill_per_token, 0.0)),
        decode=PassCost(0.0, Linear(step, 0.0, 0.0)),
        kv_bytes_per_token=1000, kv_budget_tokens=kv_budget, hop_latency_s=hop_latency,
        hop_gbs=hop_gbs, request_overhead_s=overhead, price_per_hour=price,
        power_prefill_w=power[0], power_decode_w=power[1], power_idle_w=power[2])


# ---- roofline ---------------------------------------------------------------------------


def test_model_spec_counts_llama_8b_parameters_and_kv_bytes():
    assert LLAMA_31_8B.num_params == pytest.approx(8.03e9, rel=0.005)
    # 2 (K, V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes
    assert LLAMA_31_8B.kv_bytes_per_token == 131072
    assert SMOLLM2_135M.num_params == pytest.approx(134.5e6, rel=0.01)


def test_model_spec_from_transformers_config_dict():
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "torch_dtype": "bfloat16", "_name_or_path": "llama"}
    spec = ModelSpec.from_config(cfg)
    assert spec.head_dim == 128 and spec.num_kv_heads == 8 and spec.dtype == "bfloat16"
    assert spec.num_params == LLAMA_31_8B.num_params


def test_roofline_decode_is_weight_bandwidth_bound_and_prefill_compute_bound():
    h100 = HARDWARE["H100"]
    eff = Efficiency(compute=0.5, memory=0.8, pass_overhead_s=0.0)
    prof = roofline_profile(h100, LLAMA_31_8B, eff=eff)
    weights = LLAMA_31_8B.weight_bytes
    # batch 1, context 1: reading the weights dominates
    expected = (weights + 2 * LLAMA_31_8B.kv_bytes_per_token) / (3.35e12 * 0.8)
    assert prof.decode_s(1, 1) == pytest.approx(expected, rel=1e-6)
    # 8192 tokens: 2 x params x tokens FLOPs at half of 989 TFLOP/s (attention small at n=512)
    t = prof.prefill_s(16, 512)
    dense = 2 * LLAMA_31_8B.layer_params * 8192 / (989e12 * 0.5)
    assert dense < t < dense * 1.1
    # twice the bandwidth: decode twice as fast; same FLOPs: prefill unchanged
    h200 = roofline_profile(HARDWARE["H200"], LLAMA_31_8B, eff=eff)
    assert h200.decode_s(1, 1) == pytest.approx(prof.decode_s(1, 1) * 3.35 / 4.8, rel=1e-6)
    assert h200.prefill_s(16, 512) == pytest.approx(t, rel=1e-9)


def test_roofline_kv_budget_and_fit():
    prof = roofline_profile(HARDWARE["H100"], LLAMA_31_8B)
    usable = 80e9 * 0.9 - LLAMA_31_8B.weight_bytes
    assert prof.kv_budget_tokens == int(usable // 131072)
    from planner.hardware import LLAMA_31_70B

    with pytest.raises(ValueError, match="does not fit"):
        roofline_profile(HARDWARE["L4"], LLAMA_31_70B)
    assert roofline_profile(HARDWARE["H100"], LLAMA_31_70B, tp=2).price_per_hour == \
        pytest.approx(2 * HARDWARE["H100"].price_per_hour)


def test_every_preset_names_its_source():
    assert {"H100", "H200", "A100", "MI300X", "L4"} <= set(HARDWARE)
    for spec in HARDWARE.values():
        assert "datasheet" in spec.source and spec.price_per_hour > 0


def test_slowed_profile_scales_every_pass():
    prof = roofline_profile(HARDWARE["A100"], LLAMA_31_8B)
    slow = prof.slowed(1.5)
    assert slow.prefill_s(4, 1000) == pytest.approx(1.5 * prof.prefill_s(4, 1000))
    assert slow.decode_s(8, 500) == pytest.approx(1.5 * prof.decode_s(8, 500))
    assert slow.hop_s(10**6) == prof.hop_s(10**6)


def test_device_profile_roundtrips_through_dict():
    prof = roofline_profile(HARDWARE["A100"], LLAMA_31_8B)
    again = DeviceProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again == prof


# ---- fitting ----------------------------------------------------------------------------


def test_fit_linear_recovers_coefficients_and_clamps_negative_slopes():
    x1 = [1, 2, 4, 8, 16, 3]
    x2 = [10, 5, 40, 20, 100, 7]
    y = [0.5 + 0.1 * a + 0.01 * b for a, b in zip(x1, x2, strict=True)]
    fit = fit_linear(x1, x2, y)
    assert (fit.c0, fit.c1, fit.c2) == pytest.approx((0.5, 0.1, 0.01))
    noisy = fit_linear([1, 2, 3, 4], [4, 3, 2, 1], [1.0, 2.0, 3.0, 4.0])
    assert noisy.c2 >= 0 and noisy.c1 == pytest.approx(1.0)
    falling = fit_linear([1, 2, 3, 4], [1, 2, 3, 4], [4.0, 3.0, 2.0, 1.0])
    assert (falling.c1, falling.c2) == (0.0, 0.0) and falling.c0 == pytest.approx(2.5)


def test_the_engine_profile_times_cold_prefills_never_a_cached_prompt(monkeypatch):
    """Each timed prefill is of prompts not seen before, with no prefix cache: a repeat served
    from the cache would time a near-empty pass (the planner models hits separately)."""
    from app.config import EngineConfig
    from app.engine_core import EngineCore
    from app.prefill import Prefiller
    from planner import profile
    from tests.conftest import make_tiny_model

    seen: list[tuple[int, ...]] = []
    make_packages = Prefiller.make_packages

    def recording(self, reqs):
        assert self.prefix_cache is None
        seen.extend(r.prompt_token_ids for r in reqs)
        return make_packages(self, reqs)

    monkeypatch.setattr(Prefiller, "make_packages", recording)
    core = EngineCore(EngineConfig(prefix_cache_mb=64),
                      model=make_tiny_model(max_position_embeddings=2048))
    result = profile._time_passes(core, 1, repeats=2, quick=True)
    assert len(result["prefill"]) > 1 and len(seen) > 2 * len(result["prefill"])
    assert len(seen) == len(set(seen))
    assert result["kind"] == "float32"  # what the passes ran over, in the profile


def test_cli_profile_takes_the_model_and_its_weights(monkeypatch, tmp_path, capsys):
    """`planner profile --weights int8 --model M` profiles the engine those settings build."""
    from planner import profile

    asked = {}

    def fake_measure(threads, **kw):
        asked[threads] = kw
        return {"num_threads": threads, "model": kw["model"], "kind": "float32+int8dp",
                "kv_bytes_per_token": 1000,
                "prefill": [{"rows": 1, "longest": n, "seconds": 0.001 * n} for n in (16, 64)],
                "decode": [{"batch": b, "span": 64, "seconds": 0.01 + 0.001 * b}
                           for b in (1, 8)]}

    monkeypatch.setattr(profile, "measure_engine", fake_measure)
    out = tmp_path / "p.json"
    assert planner_main(["profile", "--out", str(out), "--threads", "1", "--no-hop",
                         "--weights", "int8", "--model", "/m"]) == 0
    assert asked[1]["weights"] == "int8" and asked[1]["model"] == "/m"
    saved = json.loads(out.read_text())
    assert saved["weights"] == "int8"
    assert "(float32+int8dp)" in saved["devices"]["cpu-1t"]["source"]


def test_device_from_measurement_fits_passes_and_hop():
    engine = {
        "num_threads": 1, "model": "m", "kv_bytes_per_token": 1000,
        "prefill": [{"rows": r, "longest": n, "seconds": 0.01 + 0.002 * r * n}
                    for r, n in ((1, 16), (1, 256), (2, 128), (4, 512))],
        "decode": [{"batch": b, "span": s, "seconds": 0.05 + 0.004 * b + 1e-6 * b * s}
                   for b, s in ((1, 64), (4, 64), (8, 1024), (16, 256))],
    }
    hop = {"actor_call_rtt_s": 0.001,
           "points": [{"where": "same_node", "bytes": b, "seconds": 0.003 + b / 2e9}
                      for b in (1 << 10, 1 << 20, 1 << 24)]}
    assert fit_hop(hop["points"], "same_node") == pytest.approx((0.003, 2.0))
    prof = device_from_measurement(engine, hop)
    assert prof.prefill_s(2, 300) == pytest.approx(0.01 + 0.002 * 600)
    assert prof.decode_s(8, 100) == pytest.approx(0.05 + 0.004 * 8 + 1e-6 * 800)
    assert prof.hop_s(10**9) == pytest.approx(0.003 + 0.5)
    assert prof.request_overhead_s == pytest.approx(0.006)


# ---- the simulator ----------------------------------------------------------------------


def test_single_request_split_equals_the_service_times():
    dev = device(hop_latency=0.004, hop_gbs=1.0, overhead=0.003)
    lim = EngineLimits(batch_wait_s=0.005)
    r = simulate(SplitSystem(dev, dev, 1, 1, lim), [Arrival(0.0, 500, 11)]).records[0]
    prefill = 2 * 0.01 + 0.001 * 500  # two passes: chunks of 256 and 244 tokens
    hop = 0.004 + 500 * 1000 / 1e9
    assert r.ttft_s == pytest.approx(0.003 + 0.005 + prefill + hop)
    assert r.tpot_s == pytest.approx(0.02)  # 10 decode steps for tokens 2..11
    assert r.e2e_s == pytest.approx(r.ttft_s + 10 * 0.02)


def test_single_request_colocated_equals_the_service_times():
    dev = device()
    r = simulate(ColocatedSystem(dev, 1, NO_WAIT), [Arrival(0.0, 200, 5)]).records[0]
    assert r.ttft_s == pytest.approx(0.01 + 0.2)
    assert r.tpot_s == pytest.approx(0.02)


def test_one_output_token_finishes_at_the_first_token():
    dev = device()
    r = simulate(SplitSystem(dev, dev, 1, 1, NO_WAIT), [Arrival(0.0, 100, 1)]).records[0]
    assert r.e2e_s == pytest.approx(r.ttft_s) and r.tpot_s is None


def test_queueing_grows_as_load_nears_capacity():
    dev = device(prefill_base=0.0, prefill_per_token=0.001)  # 0.5 s per 500-token prompt
    lim = EngineLimits(token_budget=500, prefill_max_rows=1, batch_wait_s=0.0)
    ttft = {}
    for rate in (0.2, 1.0, 1.7):  # capacity 2 req/s
        w = Workload(rate, LengthDist.fixed(500), LengthDist.fixed(4), 400, seed=1)
        s = simulate(SplitSystem(dev, dev, 1, 1, lim), w.arrivals()).summary()
        ttft[rate] = s["ttft_ms"]["p90"]
    assert ttft[0.2] < ttft[1.0] < ttft[1.7]
    assert ttft[0.2] < 700  # light load: close to the 500 ms service time
    assert ttft[1.7] > 2 * ttft[0.2]
    # M/D/1 mean wait at rho 0.5: rho / (2 mu (1 - rho)) = 0.25 s on top of 0.5 s
    w = Workload(1.0, LengthDist.fixed(500), LengthDist.fixed(4), 4000, seed=2)
    s = simulate(SplitSystem(dev, dev, 1, 1, lim), w.arrivals()).summary()
    assert s["ttft_ms"]["mean"] == pytest.approx(750, rel=0.08)


def test_prefill_passes_share_rows_and_add_replicas_parallelize():
    dev = device(prefill_base=0.1, prefill_per_token=0.0)
    arrivals = [Arrival(0.0, 100, 2) for _ in range(4)]
    whole = EngineLimits(local_prefill_when_busy=0, batch_wait_s=0.0, prefill_chunk_tokens=4096)
    one = simulate(SplitSystem(dev, dev, 1, 1, whole), arrivals).records
    # all four arrive together: one padded pass of 4 rows, everyone's first token at 0.1 s
    assert [r.ttft_s for r in one] == pytest.approx([0.1] * 4)
    # a pass computes at most prefill_chunk_tokens (256): two rows of 100 per pass, and
    # each prompt's package leaves when its own pass ends
    chunked = simulate(SplitSystem(dev, dev, 1, 1, NO_WAIT), arrivals).records
    assert sorted(r.ttft_s for r in chunked) == pytest.approx([0.1, 0.1, 0.2, 0.2])
    # one row per pass: the passes run in turn
    lim = EngineLimits(local_prefill_when_busy=0, prefill_max_rows=1, batch_wait_s=0.0,
                       prefill_routing="least_loaded")
    serial = simulate(SplitSystem(dev, dev, 1, 1, lim), arrivals).records
    assert sorted(r.ttft_s for r in serial) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    two = simulate(SplitSystem(dev, dev, 2, 1, lim), arrivals).records
    assert sorted(r.ttft_s for r in two) == pytest.approx([0.1, 0.1, 0.2, 0.2])


def test_decode_batch_limit_queues_sequences():
    dev = device(prefill_base=0.0, prefill_per_token=0.0)
    lim = EngineLimits(max_batch_size=1, batch_wait_s=0.0)
    recs = simulate(SplitSystem(dev, dev, 1, 1, lim),
                    [Arrival(0.0, 10, 3), Arrival(0.0, 10, 3)]).records
    # the second waits for the first's two steps before its own two
    assert sorted(r.e2e_s for r in recs) == pytest.approx([0.04, 0.08])


def test_colocated_prefill_stalls_running_streams_split_does_not():
    dev = device(prefill_base=0.0, prefill_per_token=0.001)
    stream = Arrival(0.0, 10, 51)
    doc = Arrival(0.3, 1000, 1)  # a 1 s prefill arriving mid-stream
    split = simulate(SplitSystem(dev, dev, 1, 1, NO_WAIT), [stream, doc]).records
    colo = simulate(ColocatedSystem(dev, 1, NO_WAIT), [stream, doc]).records
    tpot_split = next(r.tpot_s for r in split if r.output_tokens == 51)
    tpot_colo = next(r.tpot_s for r in colo if r.output_tokens == 51)
    assert tpot_split == pytest.approx(0.02)
    assert tpot_colo == pytest.approx(0.02 + 1.0 / 50, rel=0.01)


def test_prefill_slowdown_charges_a_lone_prompt_not_a_chunk_riding_a_step():
    """``DeviceProfile.prefill_slowdown`` (``stack_device``'s fit on lone prompts' TTFTs):
    a prompt alone on the colocated engine runs its pass that much slower; one whose
    chunks ride a stream's decode steps is charged the engine's own time plus the stack's
    per-step cost, whatever the lone-prompt factor."""
    base = dataclasses.replace(device(prefill_base=0.0, prefill_per_token=0.001),
                               decode_stack=Linear(0.005, 0.0, 0.0))
    lone = [Arrival(0.0, 200, 1)]
    mid = [Arrival(0.0, 10, 60), Arrival(0.3, 200, 1)]

    def ttfts(dev, arrivals):
        recs = simulate(ColocatedSystem(dev, 1, NO_WAIT), arrivals).records
        return [r.ttft_s for r in sorted(recs, key=lambda r: r.sent_at)]

    slowed = base.slowed_prefill(2.0)
    assert slowed.prefill_slowdown == 2.0
    assert ttfts(slowed, lone)[0] == pytest.approx(2 * ttfts(base, lone)[0])
    # the same but for the stream's steps falling 10 ms later (its own 10-token prompt ran
    # alone, slowed): a slowed chunk would add its 0.2 s
    assert ttfts(slowed, mid)[1] == pytest.approx(ttfts(base, mid)[1], abs=0.0101)
    # the chunk's step: 200 prompt tokens and the stream's row, plus the stack's 5 ms
    assert ttfts(base, mid)[1] < 0.2 + 0.02 + 0.005 + 0.025 + 1e-6


def test_chunked_colocated_bounds_the_stall():
    dev = device(prefill_base=0.0, prefill_per_token=0.001)
    stream = Arrival(0.0, 10, 51)
    doc = Arrival(0.3, 1000, 1)
    chunked = simulate(ColocatedSystem(dev, 1, NO_WAIT, "chunked", 100), [stream, doc]).records
    itl_stream = next(r for r in chunked if r.output_tokens == 51)
    # ten mixed passes of 0.02 + 0.1 s instead of one 1 s stall: same total here, but the
    # document's first token comes after its last chunk
    assert itl_stream.tpot_s == pytest.approx(0.02 + 1.0 / 50, rel=0.05)
    assert next(r for r in chunked if r.output_tokens == 1).ttft_s > 1.0


def test_goodput_counts_only_requests_meeting_every_slo():
    dev = device(prefill_base=0.0, prefill_per_token=0.001)
    lim = EngineLimits(token_budget=400, prefill_max_rows=1, batch_wait_s=0.0)
    res = simulate(SplitSystem(dev, dev, 1, 1, lim), [Arrival(0.0, 400, 2),
                                                      Arrival(0.0, 400, 2)])
    s = res.summary({"ttft": 600})  # first 0.4 s, second 0.8 s
    assert s["good_requests"] == 1 and s["good_fraction"] == 0.5
    assert s["goodput"] == pytest.approx(1 / res.duration_s)
    assert res.duration_s == pytest.approx(0.8 + 0.02)


def test_cost_and_energy_accounting():
    dev = device(prefill_base=0.0, prefill_per_token=0.001, price=3600.0,
                 power=(100.0, 50.0, 10.0))
    res = simulate(ColocatedSystem(dev, 1, NO_WAIT), [Arrival(0.0, 1000, 11)])
    s = res.summary()
    # 1 s prefill + 10 x 0.02 s decode; $1 per second; 11 output tokens
    assert res.duration_s == pytest.approx(1.2)
    assert s["cost_per_m_output_tokens"] == pytest.approx(1.2 / 11 * 1e6)
    assert s["energy_per_request_j"] == pytest.approx(100 * 1.0 + 50 * 0.2)


def test_trace_from_loadgen_results(tmp_path):
    results = {"config": {"slos_ms": {"ttft": 500}}, "runs": [{
        "rate": 1.0, "summary": {"overall": {"duration_s": 3.0}},
        "requests": [
            {"class": "fixed", "sent_at": 1.0, "ok": True, "error": None, "prompt_tokens": 100,
             "output_tokens": 3, "ttft_s": 0.2, "e2e_s": 0.26, "itl_s": []},
            {"class": "fixed", "sent_at": 0.0, "ok": True, "error": None, "prompt_tokens": 50,
             "output_tokens": 2, "ttft_s": 0.1, "e2e_s": 0.12, "itl_s": []},
            {"class": "fixed", "sent_at": 2.0, "ok": False, "error": "x",
             "prompt_tokens": None, "output_tokens": 0, "ttft_s": None, "e2e_s": None,
             "itl_s": []}]}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    [trace] = load_trace(path)
    assert [(a.at, a.input_len, a.output_len) for a in trace] == [(0.0, 50, 2), (1.0, 100, 3)]
    dev = device(prefill_base=0.0)
    cmp = compare_run(SplitSystem(dev, dev, 1, 1, NO_WAIT), results["runs"][0], {"ttft": 500})
    # predicted TTFTs 50 ms and 100 ms (1 ms per prompt token): p90 interpolates to 95 ms
    assert cmp["rows"]["ttft p90"]["predicted"] == pytest.approx(95.0)
    assert cmp["rows"]["ttft p90"]["measured"] == pytest.approx(190.0)
    assert cmp["rows"]["ttft p90"]["error"] == pytest.approx(-0.5)
    assert cmp["rows"]["goodput"]["measured"] == pytest.approx(2 / 3.0)


# ---- the search -------------------------------------------------------------------------


def test_search_picks_the_obviously_better_hardware():
    slow = device("slow", prefill_per_token=0.002, step=0.04, price=1.0)
    fast = device("fast", prefill_per_token=0.0005, step=0.01, price=1.0)
    w = Workload(1.0, LengthDist.fixed(200), LengthDist.fixed(8), 60, seed=3)
    res = planner_search.search([slow, fast], w, {"ttft": 1000, "tpot": 30},
                                limits=NO_WAIT, max_per_phase=2, top_k=2,
                                colocated_policies=("interleave",), min_span_s=10.0)
    best = res["split"][0].system
    assert isinstance(best, SplitSystem)
    assert best.prefill.name == "fast" and best.decode.name == "fast"
    assert res["colocated"][0].system.device.name == "fast"
    assert res["colocated"][0].goodput_per_dollar > res["colocated"][1].goodput_per_dollar
    text = planner_search.table(res, 4.0)
    assert "split" in text and "colocated 1xfast" in text


def test_max_goodput_rate_finds_capacity():
    dev = device(prefill_base=0.0, prefill_per_token=0.001)  # 0.1 s per prompt
    lim = EngineLimits(token_budget=100, prefill_max_rows=1, batch_wait_s=0.0,
                       local_prefill_when_busy=0)
    w = Workload(1.0, LengthDist.fixed(100), LengthDist.fixed(2), 300, seed=4)
    rate, s = planner_search.max_goodput_rate(SplitSystem(dev, dev, 1, 1, lim), w,
                                              {"ttft": 500}, min_span_s=20.0)
    # capacity is 10 req/s; a 500 ms TTFT target is met by 90% somewhat below it
    assert 5.0 < rate < 10.0
    assert s is not None and s["good_fraction"] >= 0.9


def test_cli_simulate_runs(capsys):
    assert planner_main(["simulate", "--model", "llama-3.1-8b", "--prefill", "H100",
                         "--decode", "A100", "--num-requests", "20", "--rate", "2",
                         "--kv-layout", "paged", "--max-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "split 1xH100 : 1xA100" in out and "per M output tokens" in out


def test_cli_simulate_names_a_device_it_has_no_profile_for():
    """The CPU devices come from a measured profile: without one, a clear message, not a
    KeyError traceback."""
    with pytest.raises(SystemExit, match=r"no device profile cpu-1t .*--profile"):
        planner_main(["simulate", "--num-requests", "5"])


# ---- the decode replica's KV: the engine's paged pool --------------------------------------


def _ctx_device(kv_budget=1 << 20) -> DeviceProfile:
    """Free prefill and hop; a decode step costs 1e-4 s per KV position it attends."""
    return DeviceProfile("ctx", PassCost(0.0, Linear(0.0, 0.0, 0.0)),
                         PassCost(0.0, Linear(0.0, 0.0, 1e-4)), 0, kv_budget)


# alike: prompts of 900 and 1000 tokens (one prefill pass: padding under a quarter), rows
# of 901 and 1001 positions at their first step; outlier: three 64-token chats and a
# 1,024-token document with 960 tokens cached (four 64-token chunks, one pass), rows of
# 65, 65, 65 and 1,025 positions
_ALIKE = [Arrival(0.0, 900, 2), Arrival(0.0, 1000, 2)]
_OUTLIER = [*(Arrival(0.0, 64, 2) for _ in range(3)), Arrival(0.0, 1024, 2, cached_len=960)]


@pytest.mark.parametrize(("layout", "alike", "outlier"), [
    # the engine: padded to the longest while that copies at most twice the positions
    # held (2 x 1001 <= 2 x 1902), exact once it would not (4 x 1025 > 2 x 1220)
    ("paged", 2 * 1001, 65 * 3 + 1025),
    ("inplace", 901 + 1001, 65 * 3 + 1025),  # every row its own positions
    ("padded", 2 * 1001, 4 * 1025),  # the old buffer: every row the longest's
])
def test_decode_step_attends_what_the_layout_gathers(layout, alike, outlier):
    lim = EngineLimits(batch_wait_s=0.0, kv_layout=layout, prefill_chunk_tokens=4096)
    for arrivals, positions in ((_ALIKE, alike), (_OUTLIER, outlier)):
        recs = simulate(SplitSystem(_ctx_device(), _ctx_device(), 1, 1, lim), arrivals).records
        assert len({r.ttft_s for r in recs}) == 1  # one prefill pass, one decode step
        assert [r.e2e_s - r.ttft_s for r in recs] == pytest.approx(
            [positions * 1e-4] * len(arrivals))


@pytest.mark.parametrize("lengths", [
    [1], [7, 7, 7], [3, 17, 9], [3, 40, 2], [901, 1001], [65, 65, 65, 1025],
    [1, 1, 4],  # padded copies exactly twice the positions held: still padded
    [1, 1, 5],  # just over twice: exact
    [16, 17, 200, 33],
])
def test_gather_rule_is_the_engines(lengths):
    """The planner's padded-or-exact choice and positions equal the engine's own decode step
    (``PagedDecodeStep.build``) over rows of ``lengths`` positions."""
    import torch

    from app.attention import _EXACT_OVER_PADDED, PagedDecodeStep
    from app.kv_cache import DEFAULT_BLOCK_SIZE, LayerSpan, PagedKVCache, contiguous_tables
    from app.kv_package import KVLayout
    from planner.sim import (
        EXACT_OVER_PADDED,
        KV_BLOCK_TOKENS,
        attended_positions,
        gathers_exact,
    )

    assert (KV_BLOCK_TOKENS, EXACT_OVER_PADDED) == (DEFAULT_BLOCK_SIZE, _EXACT_OVER_PADDED)
    cpu = torch.device("cpu")
    tables = contiguous_tables(len(lengths), max(lengths), KV_BLOCK_TOKENS)
    cache = PagedKVCache(KVLayout(1, 1, 2, "float32"), [LayerSpan(0, 1, cpu)],
                         sum(map(len, tables)), KV_BLOCK_TOKENS, torch.float32)
    step = PagedDecodeStep.build(cache, tables, [n - 1 for n in lengths])
    assert gathers_exact(lengths) is step.exact
    assert attended_positions(lengths, "paged") == step.read_slots[cpu].numel()


@pytest.mark.parametrize(("layout", "ends"), [
    ("paged", [0.2, 0.2, 0.4]),  # 3 blocks each in a pool of 6: the third waits
    ("inplace", [0.2, 0.2, 0.4]),  # the same pool
    ("padded", [0.2, 0.4, 0.6]),  # the old buffer: 2 rows x 128 positions > 100 tokens
])
def test_decode_admission_stops_when_the_pool_runs_out_of_blocks(layout, ends):
    """Three sequences of 22 + 11 tokens under a 100-token KV budget: 99 tokens would fit,
    but each reserves 3 blocks of 16 and the pool has 100 // 16 = 6."""
    dev = device(prefill_base=0.0, prefill_per_token=0.0, step=0.02, kv_budget=100)
    lim = EngineLimits(batch_wait_s=0.0, kv_layout=layout)
    arrivals = [Arrival(0.0, 22, 11) for _ in range(3)]
    assert sum(a.input_len + a.output_len for a in arrivals) <= 100
    recs = simulate(SplitSystem(dev, dev, 1, 1, lim), arrivals).records
    assert sorted(r.e2e_s for r in recs) == pytest.approx(ends)


class _NoKV:
    """The engine's KV pool, reduced to what admission touches."""

    def write(self, table, kv) -> None:
        pass


class _Runner:
    max_model_len = 1 << 20
    kv_device = "cpu"

    def make_kv_cache(self, num_blocks, block_size):
        return _NoKV()


class _Package:
    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def kv_tensor(self, device):
        return None


@pytest.mark.parametrize(("budget", "requests"), [
    (100, [(23, 10)] * 3),  # 99 tokens, 9 blocks of 6: two join
    (96, [(38, 10)] * 3),  # 48 tokens = 3 blocks each: the first two fill the pool exactly
    (100, [(10, 6), (100, 50), (5, 5)]),  # the second's 10 blocks hold back the third
    (100, [(10, 6)] * 7),  # one block each: 6 join (the pool is 100 // 16 blocks, not 7)
    (15, [(3, 5)] * 2),  # a budget under one block: a pool of one block
    (1 << 14, [(500, 300)] * 20),  # 16 rows, then the batch is full
])
def test_decode_admission_is_the_engines(budget, requests):
    """The simulated decode replica admits the same sequences as the engine's ``Decoder``
    with the same KV budget (``max_kv_tokens``) and batch bound."""
    from collections import deque

    from app.decode import Decoder
    from app.sampling import SamplingParams
    from app.sequence import Sequence
    from planner.sim.engine import _Decoder, _Req, _Seq

    engine = Decoder(_Runner(), eos_token_ids=frozenset(), max_batch_size=16,
                     max_kv_tokens=budget)
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add(Sequence(f"r{i}", [5] * prompt, SamplingParams(max_tokens=max_tokens)),
                   _Package(prompt))
    engine._admit()
    sim = _Decoder(device(kv_budget=budget), EngineLimits(max_batch_size=16), None, None)
    sim.waiting = deque(_Seq(_Req(Arrival(0.0, p, m), 0.0, i))
                        for i, (p, m) in enumerate(requests))
    sim.admit()
    assert len(sim.running) == len(engine.running) < len(requests)
    assert sim.reserved_blocks == engine.reserved_blocks


def test_cli_defaults_model_this_engines_paged_pool():
    from planner.__main__ import _build_parser, _limits

    ap = _build_parser()
    assert EngineLimits().kv_layout == "paged"
    assert _limits(ap.parse_args(["simulate"])).kv_layout == "paged"  # this machine
    assert ap.parse_args(["validate", "--profile", "p.json"]).kv_layout == "paged"
    # roofline GPUs: efficiencies of vLLM, whose kernel reads the blocks in place
    assert _limits(ap.parse_args(["search"])).kv_layout == "inplace"
    assert _limits(ap.parse_args(["simulate", "--kv-layout", "padded"])).kv_layout == "padded"
    with pytest.raises(SystemExit):
        ap.parse_args(["simulate", "--kv-layout", "contiguous"])
    with pytest.raises(ValueError, match="KV layout"):
        EngineLimits(kv_layout="contiguous")


def test_cli_takes_a_transformers_config_file(tmp_path, capsys):
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "torch_dtype": "bfloat16"}
    (tmp_path / "llama").mkdir()
    path = tmp_path / "llama" / "config.json"
    path.write_text(json.dumps(cfg))
    args = ["simulate", "--prefill", "H100", "--decode", "H100", "--num-requests", "10",
            "--rate", "2", "--kv-layout", "paged", "--max-batch-size", "64", "--seed", "5"]
    assert planner_main([*args, "--model", str(path)]) == 0
    from_file = capsys.readouterr().out
    assert planner_main([*args, "--model", "llama-3.1-8b"]) == 0
    assert capsys.readouterr().out == from_file


def test_stack_fit_adds_per_step_streaming_cost_and_request_overhead():
    """A stack measurement whose TPOT is the engine step plus 5 ms + 3 ms per stream, and
    whose lone-request TTFT is prefill + hop + 40 ms (or 1.5x the prefill + 30 ms), fits back
    to exactly those costs; the simulator then charges them (a lone request's TPOT is step +
    8 ms)."""
    dev = DeviceProfile("cpu-1t", PassCost(0.0, Linear(0.01, 0.001, 0.0)),
                        PassCost(0.0, Linear(0.02, 0.004, 1e-6)), 1000, 1 << 20,
                        hop_latency_s=0.002, hop_gbs=1.0)
    stack = {
        "decode": [{"batch": b, "span": 88, "tpot_s": dev.decode_s(b, 88) + 0.005 + 0.003 * b}
                   for b in (1, 2, 4, 8)],
        "requests": [{"prompt_tokens": n, "ttft_s": dev.prefill_s(1, n)
                      + dev.hop_s(n * 1000) + 0.04} for n in (64, 256)],
    }
    fitted = stack_device(dev, stack)
    assert fitted.decode_stack.c0 == pytest.approx(0.005)
    assert fitted.decode_stack.c1 == pytest.approx(0.003)
    assert fitted.request_overhead_s == pytest.approx(0.04)
    assert fitted.decode_s(4, 100) == pytest.approx(dev.decode_s(4, 100) + 0.017)
    assert DeviceProfile.from_dict(json.loads(json.dumps(fitted.to_dict()))) == fitted
    assert fitted.prefill_s(1, 300) == pytest.approx(dev.prefill_s(1, 300))  # factor 1
    # prefill 1.5x slower in the server plus 30 ms: both recovered from two prompt lengths
    slow = {**stack, "requests": [{"prompt_tokens": n, "ttft_s": 1.5 * (dev.prefill_s(1, n)
                                   + dev.hop_s(n * 1000)) + 0.03} for n in (64, 256)]}
    fitted = stack_device(dev, slow)
    assert fitted.request_overhead_s == pytest.approx(0.03)
    assert fitted.prefill_s(2, 300) == pytest.approx(1.5 * dev.prefill_s(2, 300))
    assert fitted.decode_s(4, 100) == pytest.approx(dev.decode_s(4, 100) + 0.017)
    [rec] = simulate(SplitSystem(fitted, fitted, 1, 1, NO_WAIT),
                     [Arrival(0.0, 64, 5)]).records
    assert rec.tpot_s == pytest.approx(fitted.decode_s(1, 70), rel=0.05)
    assert rec.tpot_s > dev.decode_s(1, 70) + 0.007


def test_stack_cores_are_the_machines_busy_time_less_the_engines():
    """``measure_stack``'s decode runs record the machine's CPU time; what the engines' own
    passes (each request's prefill, its tokens' steps at the run's batch) do not account
    for is the stack's, over the run's wall time: the cores it keeps busy while tokens
    stream; the median over the runs."""
    from planner.profile import stack_cores

    dev = device(prefill_base=0.01, prefill_per_token=0.001, step=0.02)

    def point(b, tokens, requests, cores):
        engines = tokens / b * 0.02 + requests * (0.01 + 0.064)
        return {"batch": b, "span": 88, "tpot_s": 0.03, "wall_s": 5.0, "requests": requests,
                "input_len": 64, "output_tokens": tokens, "cpu_busy_s": engines + 5.0 * cores}

    stack = {"cores": 2, "decode": [point(1, 100, 3, 0.6), point(2, 200, 5, 0.8),
                                    point(4, 400, 9, 0.7), {"batch": 8, "span": 88,
                                                            "tpot_s": 0.05}]}
    assert stack_cores(dev, stack) == pytest.approx(0.7)
    assert stack_cores(dev, {"decode": [{"batch": 1, "span": 88, "tpot_s": 0.03}]}) is None


def test_weighted_share_is_linux_sharing_cores_by_weight():
    """``weighted_share``: the first consumer's share of the cores, in proportion to the
    weights, no thread above one core and no consumer above its cap, what one cannot use
    going to the others."""
    from planner.sim.engine import weighted_share

    assert weighted_share(2.0, [1.0]) == 1.0
    assert weighted_share(2.0, [1.0, 1.0]) == 1.0
    assert weighted_share(2.0, [1.0, 1.0, 1.0]) == pytest.approx(2 / 3)
    # a low-priority thread beside two others: 2 x 0.41 / 2.41 of the cores
    assert weighted_share(2.0, [0.41, 1.0, 1.0]) == pytest.approx(0.82 / 2.41)
    assert weighted_share(2.0, [1.0, 1.0, 0.41]) == pytest.approx(2 / 2.41)
    # a consumer capped below its proportional share leaves the rest to the others
    assert weighted_share(2.0, [1.0, 1.0, 1.0], [1.0, 1.0, 0.2]) == pytest.approx(0.9)
    assert weighted_share(2.0, [1.0, 1.0], [0.5, 1.0]) == 0.5
    assert weighted_share(1.0, [1.0, 3.0]) == pytest.approx(0.25)


def test_prefill_lanes_run_two_prompts_side_by_side_on_the_cores_they_share():
    """``EngineLimits.prefill_lanes``: two 256-token prompts (one chunk each) that arrive
    together run one after the other on one lane (TTFTs 0.256 and 0.512 s), side by side
    on two: on a two-core machine with no stack, each pass on a core of its own (both
    0.256 s); on a device of its own, the second lane's pass on half of it (0.512 s, the
    first unslowed: a pass's share is fixed when it starts). A prompt that arrives while
    one lane runs takes the free one at once, not after the running pass; a short one
    waits for lane 0."""
    dev = device(prefill_base=0.0, prefill_per_token=0.001, step=0.02)
    arrivals = [Arrival(0.0, 256, 1), Arrival(0.0, 256, 1), Arrival(0.1, 256, 1)]

    def ttfts(lanes, n=2, **kw):
        lim = EngineLimits(batch_wait_s=0.0, local_prefill_when_busy=0, prefill_lanes=lanes)
        recs = simulate(SplitSystem(dev, dev, 1, 1, lim, **kw), arrivals[:n]).records
        return sorted(r.ttft_s for r in recs)

    assert ttfts(1) == pytest.approx([0.256, 0.512], abs=2e-3)
    assert ttfts(2, shared_cores=2.0) == pytest.approx([0.256, 0.256], abs=2e-3)
    assert ttfts(2) == pytest.approx([0.256, 0.512], abs=2e-3)
    # the third arrives at 0.1 s while one lane is free again only at 0.256: with three
    # lanes on three cores it starts at once
    assert ttfts(3, n=3, shared_cores=3.0) == pytest.approx([0.256, 0.256, 0.256], abs=2e-3)
    assert ttfts(1, n=3)[-1] == pytest.approx(0.768 - 0.1, abs=2e-3)
    # an extra lane takes long prompts only: two 64-token chats go one after the other
    chats = [Arrival(0.0, 64, 1), Arrival(0.0, 64, 1)]
    lim = EngineLimits(batch_wait_s=0.0, local_prefill_when_busy=0, prefill_lanes=2,
                       prefill_batch_tokens=64)
    recs = simulate(SplitSystem(dev, dev, 1, 1, lim, shared_cores=2.0), chats).records
    assert sorted(r.ttft_s for r in recs) == pytest.approx([0.064, 0.128], abs=2e-3)
    with pytest.raises(ValueError, match="prefill_lanes"):
        EngineLimits(prefill_lanes=0)


def test_shared_cores_slow_a_prefill_pass_by_its_share_of_the_cores():
    """``SplitSystem.shared_cores``: a prompt that arrives while a stream decodes runs its
    pass beside the decode replica's engine and the stack (1.5 cores while tokens stream):
    Linux gives the three 2/3 of a core each, so the pass takes 1.5x its own-core time.
    The first prompt, alone on the machine, runs at full speed; without a stack two cores
    give both phases a core. A pass's share follows what runs: the stream ends mid-pass
    and the rest of the pass runs on a whole core."""
    dev = device(prefill_base=0.0, prefill_per_token=0.001, step=0.02)
    lim = EngineLimits(batch_wait_s=0.0, local_prefill_when_busy=0)
    arrivals = [Arrival(0.0, 100, 1000), Arrival(1.0, 500, 2)]

    def ttfts(arr=arrivals, **kw):
        recs = simulate(SplitSystem(dev, dev, 1, 1, lim, **kw), arr).records
        return [r.ttft_s for r in sorted(recs, key=lambda r: r.sent_at)]

    own = ttfts()
    assert own == pytest.approx([0.1, 0.5], abs=1e-3)
    shared = ttfts(shared_cores=2.0, stack_cores=1.5)
    assert shared[0] == pytest.approx(own[0], abs=1e-6)
    assert shared[1] == pytest.approx(0.5 * 1.5, abs=2e-3)
    assert ttfts(shared_cores=2.0) == pytest.approx(own, abs=1e-6)
    # one core for both phases: the pass gets half of it even with no stack
    assert ttfts(shared_cores=1.0)[1] == pytest.approx(1.0, abs=2e-3)
    # a stream of 10 tokens: its first at 0.1 s, then 9 steps of 20 ms, those that start
    # while the pass runs on 2/3 of a core (30 ms): steps start at 0.10, 0.12, 0.14, then
    # 0.16 ... 0.31, the last ending at 0.34 s. The second prompt arrives at 0.15 s: 0.19 s
    # on 2/3 of a core (0.127 s of its work), then the rest on a core of its own
    short = [Arrival(0.0, 100, 10), Arrival(0.15, 500, 2)]
    got = ttfts(short, shared_cores=2.0, stack_cores=1.5)
    assert got[1] == pytest.approx(0.19 + (0.5 - 0.19 * 2 / 3), abs=2e-3)
    with pytest.raises(ValueError, match="shared_cores"):
        SplitSystem(dev, dev, shared_cores=0.0)


def test_a_pass_alone_on_the_machine_takes_its_idle_cores():
    """``prefill_max_threads`` (``app.idle_cores``) with ``SplitSystem.prefill_wide``: a pass
    with no other pass and no stream beside it runs on the wide engine (here twice as
    fast); while a stream decodes it keeps to its share of one core, and it widens again
    once the stream ends."""
    dev = device(prefill_base=0.0, prefill_per_token=0.001, step=0.02)
    wide = device(prefill_base=0.0, prefill_per_token=0.0005, step=0.02)
    lim = EngineLimits(batch_wait_s=0.0, local_prefill_when_busy=0, prefill_max_threads=2)

    def ttfts(arrivals, **kw):
        system = SplitSystem(dev, dev, 1, 1, lim, shared_cores=2.0, **kw)
        recs = simulate(system, arrivals).records
        return [r.ttft_s for r in sorted(recs, key=lambda r: r.sent_at)]

    lone = [Arrival(0.0, 400, 2)]
    assert ttfts(lone) == pytest.approx([0.4], abs=1e-3)
    assert ttfts(lone, prefill_wide=wide) == pytest.approx([0.2], abs=1e-3)
    # a 10-token stream (first token at 0.005 s wide, then 9 steps of 20 ms: it decodes
    # until 0.185 s); the 400-token prompt arriving at 0.1 s runs on one core beside it
    # (0.085 s, 0.085 of its work), then wide for the rest (0.315 / 2)
    mid = [Arrival(0.0, 10, 10), Arrival(0.1, 400, 2)]
    got = ttfts(mid, prefill_wide=wide)
    assert got[0] == pytest.approx(0.005, abs=1e-3)
    assert got[1] == pytest.approx(0.085 + (0.4 - 0.085) / 2, abs=2e-3)
    with pytest.raises(ValueError, match="prefill_max_threads"):
        EngineLimits(prefill_max_threads=0)


def test_shared_cores_slow_a_decode_step_beside_prefill_passes():
    """On ``shared_cores`` a decode step runs on its share of them beside the passes under
    way: two cores, two lanes each with a long prompt and no stack: the step's engine gets
    2 / (1 + 1 + LANE_WEIGHT) of a core (an extra lane runs at the lowest priority), and a
    whole core once the passes are done."""
    from planner.sim.constants import LANE_WEIGHT

    dev = device(prefill_base=0.0, prefill_per_token=0.001, step=0.02)
    lim = EngineLimits(batch_wait_s=0.0, local_prefill_when_busy=0, prefill_lanes=2)
    # a stream of 11 tokens, then two 1,000-token prompts while it decodes
    arrivals = [Arrival(0.0, 10, 11), Arrival(0.05, 1000, 2), Arrival(0.05, 1000, 2)]
    recs = sorted(simulate(SplitSystem(dev, dev, 1, 1, lim, shared_cores=2.0),
                           arrivals).records, key=lambda r: r.sent_at)
    share = 2 / (2 + LANE_WEIGHT)
    # first token at 0.01 s; steps at 20 ms until the passes start at 0.05 s (steps end at
    # 0.03 and 0.05), then 8 steps at 20 ms / share
    assert recs[0].e2e_s == pytest.approx(0.05 + 8 * 0.02 / share, abs=2e-3)
    alone = sorted(simulate(SplitSystem(dev, dev, 1, 1, lim, shared_cores=2.0),
                            arrivals[:1]).records, key=lambda r: r.sent_at)
    assert alone[0].e2e_s == pytest.approx(0.01 + 10 * 0.02, abs=2e-3)


# ---- chunked prefill, prefix cache, several answers (issue 14) ----------------------------


def _ttft_of(records, prompt_tokens):
    return next(r.ttft_s for r in records if r.prompt_tokens == prompt_tokens)


@pytest.mark.parametrize("kind", ["split", "colocated"])
def test_chunked_prefill_lets_a_short_prompt_pass_a_long_one(kind):
    """A 64-token chat that arrives 0.1 s into a 2048-token document's prefill joins the
    next pass (shortest remaining first) and waits for one 256-token chunk, not for the
    whole document."""
    dev = device(prefill_base=0.0, prefill_per_token=0.001, step=0.001)
    arrivals = [Arrival(0.0, 2048, 2), Arrival(0.1, 64, 2)]

    def system(chunk):
        lim = EngineLimits(local_prefill_when_busy=0, batch_wait_s=0.0, prefill_chunk_tokens=chunk)
        if kind == "split":
            return SplitSystem(dev, dev, 1, 1, lim)
        return ColocatedSystem(dev, 1, lim)

    chunked = simulate(system(256), arrivals).records
    whole = simulate(system(4096), arrivals).records
    # chunked: the document's first chunk ends at 0.256 s, the chat's own pass at 0.320 s
    assert _ttft_of(chunked, 64) == pytest.approx(0.320 - 0.1, abs=0.002)
    # whole prompts: the chat waits for the 2.048 s document pass
    assert _ttft_of(whole, 64) == pytest.approx(2.048 + 0.064 - 0.1, abs=0.002)
    # the document pays for the chat's pass (and, colocated, for the chat's decode step)
    assert _ttft_of(chunked, 2048) == pytest.approx(2.048 + 0.064, abs=0.002)


def test_fairness_bound_keeps_a_long_prompt_from_starving():
    """Short prompts arriving faster than one replica prefills them would keep a long
    prompt waiting forever under shortest-first alone; once it has waited
    prefill_fairness_s it leads every other pass."""
    dev = device(prefill_base=0.0, prefill_per_token=0.001)
    shorts = [Arrival(0.05 * k, 64, 2) for k in range(200)]  # 10 s of 64-token chats
    arrivals = [Arrival(0.0, 1024, 2), *shorts]

    def long_ttft(fairness_s):
        lim = EngineLimits(batch_wait_s=0.0, prefill_fairness_s=fairness_s,
                           local_prefill_when_busy=0)
        return _ttft_of(simulate(SplitSystem(dev, dev, 1, 1, lim), arrivals).records, 1024)

    # 4 chunks of 256, each leading every other pass (the others: 4 chats of 64) from 1 s on
    assert long_ttft(1.0) < 1.0 + 8 * 0.256 + 0.1
    assert long_ttft(1e9) > 10.0  # starved until the chats stop coming
    # the chats still get every other pass: the fair run serves every one of them
    lim = EngineLimits(local_prefill_when_busy=0, batch_wait_s=0.0, prefill_fairness_s=1.0)
    assert len(simulate(SplitSystem(dev, dev, 1, 1, lim), arrivals).records) == 201


def test_cached_prefix_is_whole_blocks_and_leaves_a_token_to_compute():
    from planner.sim import cached_prefix

    assert cached_prefix(1024, 0.5) == 512
    assert cached_prefix(1000, 0.5) == 496  # 31 blocks of 16
    assert cached_prefix(1024, 1.0) == 1008  # the last block holds the last token
    assert cached_prefix(16, 1.0) == 0 and cached_prefix(1024, 0.0) == 0
    w = Workload(1.0, LengthDist.fixed(1024), LengthDist.fixed(4), 5, prefix_hit_rate=0.5)
    assert {a.cached_len for a in w.arrivals()} == {512}
    # the same draws as without a hit rate: only the cached prefix differs
    plain = Workload(1.0, LengthDist.parse("lognormal:500:0.5"), LengthDist.fixed(4), 20)
    hit = Workload(1.0, LengthDist.parse("lognormal:500:0.5"), LengthDist.fixed(4), 20,
                   prefix_hit_rate=0.5)
    assert [(a.at, a.input_len) for a in plain.arrivals()] == \
        [(a.at, a.input_len) for a in hit.arrivals()]


@pytest.mark.parametrize("kind", ["split", "colocated"])
def test_prefix_hit_rate_of_half_halves_prefill_compute(kind):
    """Half the prompt cached: half the prefill compute (and energy); the KV hop still
    carries the whole prompt and decode still holds and attends to all of it."""
    dev = DeviceProfile("d", PassCost(0.0, Linear(0.0, 0.001, 0.0)),
                        PassCost(0.0, Linear(0.01, 0.0, 1e-5)), 1000, 1 << 20,
                        hop_latency_s=0.0, hop_gbs=0.001, power_prefill_w=100.0)
    lim = EngineLimits(batch_wait_s=0.0)
    system = (SplitSystem(dev, dev, 1, 1, lim) if kind == "split"
              else ColocatedSystem(dev, 1, lim))
    cold = simulate(system, [Arrival(0.0, 1024, 3)])
    warm = simulate(system, [Arrival(0.0, 1024, 3).with_prefix_hit_rate(0.5)])
    hop = 1024 * 1000 / 1e6 if kind == "split" else 0.0  # the whole prompt, 1.024 s
    assert cold.records[0].ttft_s == pytest.approx(1.024 + hop)
    assert warm.records[0].ttft_s == pytest.approx(0.512 + hop)
    assert warm.energy_j == pytest.approx(cold.energy_j / 2)  # only prefill draws power
    # decode attends to the whole prompt either way: 0.01 + 1e-5 x context per step
    assert warm.records[0].tpot_s == pytest.approx(cold.records[0].tpot_s)
    assert warm.records[0].tpot_s == pytest.approx(0.01 + 1e-5 * 1025.5)


@pytest.mark.parametrize("kind", ["split", "colocated"])
def test_n_answers_cost_one_prefill_and_n_decode_sequences(kind):
    """n = 4: the prompt is prefilled once (same prefill time and energy as n = 1) and
    four sequences decode (a step of batch 4, four answers' tokens)."""
    dev = DeviceProfile("d", PassCost(0.0, Linear(0.0, 0.001, 0.0)),
                        PassCost(0.0, Linear(0.01, 0.005, 0.0)), 1000, 1 << 20,
                        hop_gbs=1e9, power_prefill_w=100.0)
    lim = EngineLimits(batch_wait_s=0.0)
    system = (SplitSystem(dev, dev, 1, 1, lim) if kind == "split"
              else ColocatedSystem(dev, 1, lim))
    one = simulate(system, [Arrival(0.0, 500, 5)])
    four = simulate(system, [Arrival(0.0, 500, 5, n=4)])
    [r1], [r4] = one.records, four.records
    assert r4.ttft_s == pytest.approx(r1.ttft_s) == pytest.approx(0.5)
    assert r4.output_tokens == 20 and r1.output_tokens == 5
    assert r1.tpot_s == pytest.approx(0.015)  # a step of one sequence
    assert r4.tpot_s == pytest.approx(0.03)  # a step of four
    # prefill energy: one 0.5 s prefill at 100 W either way (decode draws nothing here)
    assert four.energy_j == pytest.approx(one.energy_j) == pytest.approx(50.0)
    s = four.summary({"tpot": 20})
    assert s["good_requests"] == 0 and one.summary({"tpot": 20})["good_requests"] == 1


def test_a_request_of_several_answers_is_good_only_when_every_answer_is():
    """Room for one sequence per decode batch: the second answer waits for the first, so
    its TPOT is twice the step; the request's TPOT is the worst answer's."""
    dev = device(prefill_base=0.0, prefill_per_token=0.001, step=0.02)
    lim = EngineLimits(max_batch_size=1, batch_wait_s=0.0)
    res = simulate(SplitSystem(dev, dev, 1, 1, lim), [Arrival(0.0, 100, 5, n=2)])
    [rec] = res.records
    assert rec.ttft_s == pytest.approx(0.1)
    assert rec.tpot_s == pytest.approx(2 * 0.02)  # (8 steps) / 4 tokens
    assert rec.e2e_s == pytest.approx(0.1 + 8 * 0.02)
    assert res.summary({"tpot": 30})["good_requests"] == 0
    assert res.summary({"tpot": 50})["good_requests"] == 1
    # two colocated replicas: the second answer decodes on the idle one, its first token
    # after the KV hop there; the request's TTFT is that answer's
    far = device(prefill_base=0.0, prefill_per_token=0.001, step=0.02, hop_latency=0.05)
    [rec] = simulate(ColocatedSystem(far, 2, lim), [Arrival(0.0, 100, 5, n=2)]).records
    assert rec.ttft_s == pytest.approx(0.1 + 0.05)
    assert rec.tpot_s == pytest.approx(0.02)  # each answer has a batch to itself
    # one-token answers have no TPOT, so a TPOT bound does not exclude them
    single = simulate(SplitSystem(dev, dev, 1, 1, lim), [Arrival(0.0, 100, 1, n=3)])
    assert single.records[0].output_tokens == 3
    assert single.summary({"tpot": 1, "ttft": 200})["good_requests"] == 1


def test_cli_takes_prefix_hit_rate_n_and_prefill_chunk(capsys):
    base = ["simulate", "--model", "llama-3.1-8b", "--prefill", "H100", "--decode", "H100",
            "--num-requests", "40", "--rate", "2", "--kv-layout", "paged",
            "--max-batch-size", "64", "--input-len", "4096", "--output-len", "16"]

    def figures(*extra):
        assert planner_main([*base, *extra]) == 0
        out = capsys.readouterr().out
        ttft = float(out.split("ttft  p50")[1].split()[0])
        tokens = float(out.split("req/s, ")[1].split(" tok/s")[0])
        return ttft, tokens

    plain_ttft, plain_tokens = figures()
    hit_ttft, _ = figures("--prefix-hit-rate", "0.5")
    assert hit_ttft < 0.7 * plain_ttft
    _, n_tokens = figures("--n", "4")
    assert n_tokens == pytest.approx(4 * plain_tokens, rel=0.1)
    whole_ttft, _ = figures("--prefill-chunk", "8192")
    assert whole_ttft < plain_ttft  # one pass instead of two: one pass base fewer


# ---- this app's mixed batching; short prompts skipping a backed-up prefill phase ----------


def _engine_prefiller(lim: EngineLimits):
    """The engine's own planner (``app.prefill.Prefiller``) with ``lim``'s settings, on a
    stub runner (planning touches only its config)."""
    from types import SimpleNamespace

    from app.config import EngineConfig
    from app.prefill import Prefiller

    cfg = EngineConfig(max_batch_size=lim.max_batch_size, prefill_token_budget=lim.token_budget,
                       prefill_max_batch_size=lim.prefill_max_rows,
                       prefill_chunk_tokens=lim.prefill_chunk_tokens,
                       prefill_batch_tokens=lim.prefill_batch_tokens,
                       prefill_fairness_s=lim.prefill_fairness_s)
    return Prefiller(SimpleNamespace(config=cfg), "stub")


def _engine_job(tokens: int, done: int = 0, arrived: float = 0.0):
    from types import SimpleNamespace

    from app.prefill import PrefillJob

    return PrefillJob(SimpleNamespace(num_tokens=tokens), arrived=arrived, done=done)


def _engine_chunk_steps(lim, prompts, decode_rows, now=10.0, joins=False):
    """The engine's mixed steps (``Prefiller.plan_chunks``) until every prompt is computed:
    per step, (prompt index, tokens) of each chunk. ``prompts``: (tokens, done, arrived).
    ``joins``: each finished prompt's answer joins the decode rows of the next steps."""
    planner = _engine_prefiller(lim)
    jobs = [_engine_job(n, d, t) for n, d, t in prompts]
    steps = []
    while any(j.remaining for j in jobs):
        plan = planner.plan_chunks([j for j in jobs if j.remaining], decode_rows, now)
        steps.append([(jobs.index(j), n) for j, n in zip(plan.rows, plan.sizes, strict=True)])
        for j, n in zip(plan.rows, plan.sizes, strict=True):
            j.done += n
            if joins and not j.remaining:
                decode_rows = min(lim.max_batch_size, decode_rows + 1)
    return steps


@pytest.mark.parametrize(("lim", "prompts", "decode_rows"), [
    # several chats in one step, up to the pass budget (256) with the 4 decode rows
    (EngineLimits(), [(40, 0, 9.0), (60, 0, 9.0), (80, 0, 9.0), (100, 0, 9.0), (30, 0, 9.0),
                      (50, 0, 9.0)], 4),
    # a full decode batch: the chunks still get a quarter of the budget
    (EngineLimits(prefill_chunk_tokens=16), [(40, 0, 9.0), (10, 0, 9.5)], 16),
    (EngineLimits(), [(700, 0, 9.0), (90, 0, 9.0)], 300),
    # a long prompt in chunks of prefill_chunk_tokens after its cached prefix; a waited
    # document leads every other step (fairness) among later chats
    (EngineLimits(), [(1024, 960, 9.0), (2000, 0, 1.0), *((64, 0, 9.5) for _ in range(6))], 2),
    # at most prefill_max_rows prompts per step
    (EngineLimits(prefill_max_rows=3), [(5, 0, 9.0) for _ in range(7)], 1),
    # no more prompts once a step's chunks hold prefill_batch_tokens
    (EngineLimits(prefill_batch_tokens=64), [(40, 0, 9.0), (20, 0, 9.0), (64, 0, 9.0),
                                             (10, 0, 9.0), (300, 0, 9.0)], 2),
])
def test_mixed_step_chunks_are_the_engines(lim, prompts, decode_rows):
    """Step after step, the simulated replica puts the same prompts' chunks, of the same
    sizes, into its decode steps as the engine's ``Prefiller.plan_chunks``."""
    from planner.sim.engine import _PrefillQueue, _Req

    q = _PrefillQueue(device(), lim)
    reqs = [_Req(Arrival(t, n, 2, cached_len=d), t, k) for k, (n, d, t) in enumerate(prompts)]
    for r in sorted(reqs, key=lambda r: r.sent_at):  # each joins when it arrives
        q.add(r, r.sent_at)
    steps = []
    while len(q):
        plan = q.plan_chunks(10.0, decode_rows)
        steps.append([(reqs.index(r), n) for r, n in zip(plan.rows, plan.sizes, strict=True)])
        q.advance(plan.rows, plan.sizes)
    assert steps == _engine_chunk_steps(lim, prompts, decode_rows)


def _stream_then_burst(lim, burst, *, streams=4, at=1.001, dev=None, policy="mixed"):
    """``streams`` 16-token prompts at 0 that decode for long, then ``burst`` prompts
    arriving together at ``at`` on one colocated replica."""
    dev = dev or device(prefill_base=0.0, prefill_per_token=0.0, step=0.02)
    arrivals = ([Arrival(0.0, 16, 400) for _ in range(streams)]
                + [Arrival(at, n, 2) for n in burst])
    return simulate(ColocatedSystem(dev, 1, lim, policy), arrivals).records


def test_a_mixed_step_carries_several_short_prompts_up_to_the_budget_with_the_decode_rows():
    """Six chats arrive while four streams decode: the next decode steps carry them in the
    engine's plan (budget 256 with the decode rows, each prompt finished joining the rows),
    and each step costs its chunks' prefill compute on top of the decode step; each chat's
    first token comes with the step that computed its last chunk."""
    dev = device(prefill_base=0.01, prefill_per_token=0.001, step=0.02)
    lim = EngineLimits(batch_wait_s=0.0)
    burst = [40, 60, 80, 100, 30, 50]
    recs = _stream_then_burst(lim, burst, dev=dev)
    # nothing decoding: the streams' prompts are one pass of their own (4 rows x 16)
    first = 0.01 + 0.001 * 64
    assert [r.ttft_s for r in recs[:4]] == pytest.approx([first] * 4)
    steps = _engine_chunk_steps(lim, [(n, 0, 0.0) for n in burst], 4, joins=True)
    assert len(steps[0]) >= 4 and sum(n for _, n in steps[0]) + 4 == lim.pass_tokens
    # the burst waits for the plain step under way, then step k costs 0.02 + its chunks
    t = first + 0.02 * math.ceil((1.001 - first) / 0.02)
    expected = {}
    for step in steps:
        t += 0.02 + 0.01 + 0.001 * sum(n for _, n in step)
        for k, _ in step:
            expected[k] = t - 1.001  # the last chunk's step sets it
    assert [r.ttft_s for r in recs[4:]] == pytest.approx([expected[k] for k in range(6)])
    # with mixed_batch off the same chats are prefill passes between the steps
    apart = _stream_then_burst(lim, burst, dev=dev, policy="interleave")
    assert [r.ttft_s for r in apart[4:]] != pytest.approx([r.ttft_s for r in recs[4:]])


def test_a_full_decode_batch_still_gives_the_chunks_a_quarter_of_the_budget():
    """Sixteen streams fill the batch and a pass is 16 tokens: a step still computes 4
    prompt tokens, so a 40-token prompt takes the engine's 10 steps (one for 4 tokens)."""
    lim = EngineLimits(batch_wait_s=0.0, prefill_chunk_tokens=16, max_batch_size=16)
    [short] = _stream_then_burst(lim, [4], streams=16)[16:]
    [long_] = _stream_then_burst(lim, [40], streams=16)[16:]
    steps = len(_engine_chunk_steps(lim, [(40, 0, 0.0)], 16))
    assert steps == 10
    assert long_.ttft_s - short.ttft_s == pytest.approx((steps - 1) * 0.02)


def test_after_a_pass_of_its_own_the_queue_runs_the_next_before_the_decode_loop_wakes():
    """Twelve chats at an idle replica: a pass of its own (nothing decodes). When it ends,
    the queue's task plans its next pass at once (``PrefillQueue._run``), before the
    streams of the chats it finished reach the decode loop; the loop's first step is
    planned during that pass, from the chats not in it, and runs after it, with the streams
    the loop held then."""
    dev = DeviceProfile("d", PassCost(0.0, Linear(0.01, 0.001, 0.0)),  # prefill per token
                        PassCost(0.0, Linear(0.02, 0.005, 0.0)), 1000, 1 << 20)  # per row
    lim = EngineLimits(batch_wait_s=0.0)
    recs = simulate(ColocatedSystem(dev, 1, lim), [Arrival(0.0, 64, 3) for _ in range(12)])
    planner, jobs = _engine_prefiller(lim), [_engine_job(64) for _ in range(12)]
    t, ends = 0.0, {}
    for _ in range(2):
        rows = planner.plan_pass(jobs, 0.0)
        t += 0.01 + 0.001 * len(rows) * max(j.remaining for j in rows)
        for j in rows:
            j.done, ends[jobs.index(j)] = j.req.num_tokens, t
    # the first pass's streams; the second's reach the loop after it planned its first
    # step, and each step's finished chats join the next
    streams, joining = 4, 4
    while any(j.remaining for j in jobs):
        plan = planner.plan_chunks(jobs, streams, 0.0)
        t += 0.02 + 0.005 * streams + 0.01 + 0.001 * plan.tokens
        for j, n in zip(plan.rows, plan.sizes, strict=True):
            j.done += n
            if not j.remaining:
                ends[jobs.index(j)] = t
                joining += 1
        streams, joining = streams + joining, 0
    assert [list(ends.values()).count(t) for t in sorted(set(ends.values()))] == [4, 4, 3, 1]
    assert [r.ttft_s for r in recs.records] == pytest.approx([ends[k] for k in range(12)])


def test_the_colocated_default_is_this_apps_mixed_batching():
    import inspect

    from app.config import EngineConfig
    from planner.__main__ import _build_parser
    from planner.validate import local_system

    assert EngineConfig().mixed_batch
    dev = device()
    assert ColocatedSystem(dev).policy == "mixed" and SplitSystem(dev, dev).decode_policy == "mixed"
    ap = _build_parser()
    assert ap.parse_args(["simulate"]).policy == "mixed"
    assert ap.parse_args(["simulate", "--policy", "interleave"]).policy == "interleave"
    assert ap.parse_args(["simulate", "--policy", "chunked"]).policy == "chunked"
    assert ap.parse_args(["search"]).colocated_policies.split(",")[0] == "mixed"
    default = inspect.signature(planner_search.search).parameters["colocated_policies"].default
    assert default[0] == "mixed"
    assert local_system("colocated", {"cpu-2t": dev}).policy == "mixed"
    assert ColocatedSystem(dev, 1, policy="interleave").describe() == "colocated 1xdev, interleave"
    with pytest.raises(ValueError, match="policy"):
        SplitSystem(dev, dev, decode_policy="chunked")


def _split_path(lim: EngineLimits):
    """The app's routing (``SplitPath``) with ``lim``'s settings, on stand-in handles."""
    from deployments.split_path import SplitPath

    return SplitPath(object(), object(), local_prefill_threshold=lim.local_prefill_threshold,
                     request_timeout_s=60.0, max_retries=0, retry_backoff_s=0.0,
                     local_prefill_when_busy=lim.local_prefill_when_busy,
                     prefill_busy_tokens=lim.busy_prefill_tokens)


def _route(path, tokens: int):
    """``SplitPath.prefill_then_decode``'s choice for a prompt of ``tokens``, and its
    ``Backlog``."""
    from types import SimpleNamespace

    from deployments.split_path import Backlog

    preq = SimpleNamespace(num_tokens=tokens)
    local = path._prefills_locally(preq)
    return local, Backlog(path, tokens, local=local, short=not local and path._is_short(preq))


def test_split_defaults_are_the_apps():
    from deployments.args import AppArgs

    args, lim = AppArgs.model_validate({}), EngineLimits()
    assert lim.local_prefill_threshold == args.local_prefill_threshold
    assert lim.local_prefill_when_busy == args.local_prefill_when_busy > 0
    assert lim.busy_prefill_tokens == args.busy_prefill_tokens
    other = AppArgs.model_validate({"engine": {"prefill_chunk_tokens": 2048,
                                               "prefill_token_budget": 1024}})
    assert EngineLimits(prefill_chunk_tokens=2048, token_budget=1024).busy_prefill_tokens \
        == other.busy_prefill_tokens


def test_validate_models_each_app_as_its_serve_config_sets_it(tmp_path, capsys):
    """``limits_of_app``: the engine bounds and the split's routing of a Serve config (the
    shipped ones: local.yaml's passes of a few chats, the colocated app's up to the chunk),
    over the simulator-only fields given; the CLI replays each app with its own."""
    from pathlib import Path

    from planner.validate import limits_of_app

    root = Path(__file__).resolve().parents[3] / "serve_configs"
    split = limits_of_app(root / "local.yaml", EngineLimits(kv_layout="inplace"))
    colocated = limits_of_app(root / "local-colocated.yaml")
    assert split.prefill_batch_tokens == 128 and colocated.prefill_batch_tokens is None
    assert split.kv_layout == "inplace"  # kept from the base
    cfg = tmp_path / "app.yaml"
    cfg.write_text("applications:\n  - name: a\n    import_path: x:y\n    args:\n"
                   "      engine: {prefill_chunk_tokens: 512, max_batch_size: 4}\n"
                   "      local_prefill_when_busy: 0\n      prefill_batch_wait_s: 0.02\n")
    lim = limits_of_app(cfg)
    assert (lim.prefill_chunk_tokens, lim.max_batch_size, lim.local_prefill_when_busy,
            lim.batch_wait_s) == (512, 4, 0, 0.02)
    assert lim.token_budget == EngineLimits().token_budget  # unset: the engine's default
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications:\n  - args: {bogus: 1}\n")
    with pytest.raises(SystemExit):
        planner_main(["validate", "--profile", "p.json", "--split", "r.json",
                      "--split-config", str(bad)])
    assert "--split-config" in capsys.readouterr().err


_FAR = dict(prefill_base=0.0, prefill_per_token=0.001, step=0.02, hop_latency=5.0)


@pytest.mark.parametrize(("doc", "when_busy"), [(1000, 128), (1000, 100), (256, 128),
                                               (1000, 0)])
def test_a_burst_of_short_prompts_is_split_between_the_phases_as_split_path_splits_it(
        doc, when_busy):
    """A document queued at the prefill phase (256 tokens: exactly one pass, backed up),
    then a burst of chats (and one prompt too long to count as short under 100) routed
    before any stream starts: each goes where the app's own ``SplitPath`` sends it given
    the same backlogs; the local ones have no KV hop (5 s here). At 0 every prompt hops."""
    dev = device(**_FAR)
    lim = EngineLimits(batch_wait_s=0.0, local_prefill_when_busy=when_busy)
    burst = [64] * 9 + [120] + [64] * 2
    arrivals = [Arrival(0.0, doc, 2), *(Arrival(0.001 * (k + 1), n, 2)
                                         for k, n in enumerate(burst))]
    recs = simulate(SplitSystem(dev, dev, 1, 1, lim), arrivals).records
    path = _split_path(lim)
    expected = [_route(path, a.input_len)[0] for a in arrivals]
    assert [r.local_prefill for r in recs] == expected
    if when_busy:
        assert True in expected and expected.count(False) > 1  # both sides get some
    else:
        assert not any(expected)
    for r in recs:
        assert (r.ttft_s < 5.0) is r.local_prefill


def test_a_prompt_counts_in_the_backlog_until_its_stream_starts():
    """The document's tokens count until its stream starts on the decode replica, after
    the hop: a chat arriving during the hop still finds the prefill phase backed up and is
    prefilled locally; one after the stream started hops (``SplitPath``, step by step)."""
    dev = device(**{**_FAR, "hop_latency": 1.0})
    lim = EngineLimits(batch_wait_s=0.0)
    arrivals = [Arrival(0.0, 300, 2), Arrival(0.8, 64, 2), Arrival(1.5, 64, 2)]
    recs = simulate(SplitSystem(dev, dev, 1, 1, lim), arrivals).records
    path = _split_path(lim)
    doc_local, doc = _route(path, 300)  # prefill ends at 0.3 s, stream starts at 1.3 s
    chat_local, chat = _route(path, 64)
    chat.drop()  # its own pass on the decode replica ends at 0.864 s
    doc.drop()
    late_local, _ = _route(path, 64)
    assert [r.local_prefill for r in recs] == [doc_local, chat_local, late_local] \
        == [False, True, False]


def test_local_prefill_threshold_and_shared_prefill_route_as_split_path_does():
    """Under ``local_prefill_threshold`` a prompt is prefilled on the decode replica even
    when the prefill phase is idle; a request of several answers holds no backlog
    (``SplitPath.shared_prefill``), so the chat after it hops."""
    dev = device(**_FAR)
    lim = EngineLimits(batch_wait_s=0.0, local_prefill_threshold=50)
    recs = simulate(SplitSystem(dev, dev, 1, 1, lim), [Arrival(0.0, 40, 2)]).records
    assert recs[0].local_prefill and recs[0].ttft_s == pytest.approx(0.04)
    arrivals = [Arrival(0.0, 1000, 2, n=2), Arrival(0.01, 64, 2)]
    recs = simulate(SplitSystem(dev, dev, 1, 1, lim), arrivals).records
    assert [r.local_prefill for r in recs] == [False, False]
    one = simulate(SplitSystem(dev, dev, 1, 1, lim), [Arrival(0.0, 1000, 2), arrivals[1]])
    assert [r.local_prefill for r in one.records] == [False, True]


@pytest.mark.parametrize("policy", ["mixed", "interleave"])
def test_a_decode_replica_prefills_its_local_prompts_as_a_colocated_replica_does(policy):
    """Every prompt local (a threshold above every length): the split's decode replicas
    serve exactly as colocated replicas of the same policy (``DecodeServer`` and
    ``ColocatedServer`` share the queue and the decode loop)."""
    dev = device(prefill_base=0.005, prefill_per_token=0.0005, step=0.02)
    lim = EngineLimits(batch_wait_s=0.005, local_prefill_threshold=1 << 20)
    w = Workload(4.0, LengthDist.parse("lognormal:200:0.8:8:2000"),
                 LengthDist.parse("lognormal:40:0.6:2:200"), 120, seed=7)
    split = simulate(SplitSystem(dev, dev, 1, 2, lim, decode_policy=policy), w.arrivals())
    colo = simulate(ColocatedSystem(dev, 2, lim, policy), w.arrivals())
    assert all(r.local_prefill for r in split.records)
    assert [(r.ttft_s, r.e2e_s) for r in split.records] == \
        [(r.ttft_s, r.e2e_s) for r in colo.records]


def test_cli_takes_the_split_routing_and_policies():
    from planner.__main__ import _build_parser, _limits

    ap = _build_parser()
    lim = _limits(ap.parse_args(["simulate"]))
    assert (lim.local_prefill_threshold, lim.local_prefill_when_busy,
            lim.prefill_busy_tokens) == (0, 128, None)
    lim = _limits(ap.parse_args(["simulate", "--local-prefill-when-busy", "0",
                                 "--local-prefill-threshold", "32",
                                 "--prefill-busy-tokens", "512"]))
    assert (lim.local_prefill_threshold, lim.local_prefill_when_busy,
            lim.busy_prefill_tokens) == (32, 0, 512)
    with pytest.raises(SystemExit):
        planner_main(["simulate", "--system", "split", "--policy", "chunked"])
