"""The soak's accounting: outcomes by code (a 200 whose stream broke is not a success),
refusals' speed and Retry-After, hung requests, recovery time and memory growth."""

from __future__ import annotations

from load_tests.soak import Outcome, Sample, memory_summary, phase_summary, recovery_s


def test_outcomes_are_counted_by_code_and_a_broken_stream_is_not_a_success():
    results = [
        Outcome("p", 0.0, 200, True, ttft_s=0.1, e2e_s=1.0, answered_s=0.05, tokens=64),
        Outcome("p", 0.1, 200, False, stream_error="short stream: 3 tokens"),
        Outcome("p", 0.2, 429, answered_s=0.01, retry_after="1"),
        Outcome("p", 0.3, 503, answered_s=0.03),
        Outcome("p", 0.4, 500),
        Outcome("p", -1.0, stream_error="hung: not finished within the drain"),
    ]
    s = phase_summary(results)
    assert s["sent"] == 6
    assert s["by_outcome"] == {"200": 1, "200 + short stream: 3 tokens": 1, "429": 1,
                               "503": 1, "500": 1, "no response": 1}
    assert s["refused_with_retry_after"] == 1 and s["refused_answered_p99_ms"] == 30
    assert s["server_errors_5xx_not_503"] == 1 and s["hung"] == 1
    assert s["ok_ttft_p50_ms"] == 100 and s["ok_e2e_p99_ms"] == 1000


def test_recovery_is_when_five_admitted_requests_in_a_row_are_back_near_the_baseline():
    slow = [Outcome("after", 100.0 + i, 200, True, ttft_s=3.0) for i in range(5)]
    fast = [Outcome("after", 110.0 + i, 200, True, ttft_s=0.5) for i in range(5)]
    assert recovery_s(slow + fast, baseline_p50=0.45, after_start=100.0) == 10.0
    assert recovery_s(slow, baseline_p50=0.45, after_start=100.0) is None


def test_memory_growth_is_measured_from_the_end_of_warm_up():
    samples = [Sample(0.0, {"DecodeServer": 500.0, "PrefillServer": 900.0}, 0.0, 0.0),
               Sample(10.0, {"DecodeServer": 1000.0, "PrefillServer": 1100.0}, 40.0, 100.0),
               Sample(20.0, {"DecodeServer": 1200.0, "PrefillServer": 1400.0}, 0.0, 380.0),
               Sample(30.0, {"DecodeServer": 1050.0, "PrefillServer": 1520.0}, 0.0, 500.0)]
    m = memory_summary(samples, warm_until=10.0)
    assert m["rss"]["DecodeServer"] == {"after_warmup_mb": 1000, "peak_mb": 1200,
                                        "end_mb": 1050, "growth_pct": 5.0}
    # prefill grew 38%, all but 2% of it the prefix cache filling towards its budget
    assert m["rss"]["PrefillServer"]["growth_pct"] == 38.2
    assert m["rss"]["PrefillServer"]["growth_less_prefix_cache_pct"] == 2.0
    assert m["prefix_cache_mb"] == {"after_warmup": 100, "end": 500}
    assert m["kv_objects_peak_mb"] == 40.0 and m["kv_objects_end_mb"] == 0.0
