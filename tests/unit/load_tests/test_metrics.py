"""The load generator's metric arithmetic on synthetic timings with known answers."""

from __future__ import annotations

import pytest

from load_tests.metrics import (
    RequestRecord,
    attach_server_timings,
    breakdown,
    distribution,
    meets_slos,
    parse_slos,
    percentile,
    summarize,
    summarize_by_class,
    tpot,
)


def rec(cls="a", ttft=0.1, e2e=1.0, out=10, itl=(), ok=True, error=None, sent=0.0,
        prompt=8) -> RequestRecord:
    return RequestRecord(cls, sent, prompt_tokens=prompt, output_tokens=out, ttft_s=ttft,
                         e2e_s=e2e, itl_s=list(itl), ok=ok, error=error)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 0, 1.0),
        ([1, 2, 3, 4], 100, 4.0),
        ([4, 1, 3, 2], 25, 1.75),  # unsorted input; rank 0.75 between 1 and 2
        (list(range(1, 101)), 99, 99.01),  # rank 98.01 -> 99 + 0.01
        (list(range(1, 101)), 90, 90.1),
        ([7.0], 99, 7.0),
        ([10, 20], 90, 19.0),
    ],
)
def test_percentile_interpolates_linearly(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tpot_excludes_the_first_token():
    # 1 s in all, first token at 0.1 s, 10 tokens: the 9 after the first took 0.9 s
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot(2.5, 0.5, 5) == pytest.approx(0.5)
    assert tpot(1.0, 0.1, 1) is None  # one token has no time per *output* token
    assert tpot(None, 0.1, 10) is None


def test_distribution_reports_milliseconds():
    d = distribution([0.010, 0.020, 0.030, 0.040])
    assert d["count"] == 4
    assert d["mean"] == pytest.approx(25.0)
    assert d["p50"] == pytest.approx(25.0)
    assert d["p90"] == pytest.approx(37.0)
    assert d["p99"] == pytest.approx(39.7)
    assert distribution([]) == {"count": 0, "mean": None, "p50": None, "p90": None,
                                "p99": None}


def test_parse_slos_accepts_list_or_one_string():
    assert parse_slos(["ttft:2000", "tpot:100"]) == {"ttft": 2000.0, "tpot": 100.0}
    assert parse_slos(["ttft:2000 tpot:100 e2e:9000"]) == {
        "ttft": 2000.0, "tpot": 100.0, "e2e": 9000.0}
    for bad in (["ttft"], ["latency:5"], ["tpot:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_a_request_meets_slos_only_if_it_meets_all():
    slos = {"ttft": 500.0, "tpot": 100.0}
    # ttft 0.1 s, tpot (1.0 - 0.1) / 9 = 0.1 s = 100 ms: on the bound counts as met
    assert meets_slos(rec(ttft=0.1, e2e=1.0, out=10), slos)
    assert not meets_slos(rec(ttft=0.6, e2e=1.5, out=10), slos)  # ttft over
    assert not meets_slos(rec(ttft=0.1, e2e=2.0, out=10), slos)  # tpot 211 ms over
    assert not meets_slos(rec(ok=False, error="x"), slos)  # failures never count
    assert meets_slos(rec(ttft=0.1, e2e=0.1, out=1), slos)  # no TPOT to violate
    assert meets_slos(rec(ttft=9.0, e2e=20.0), {})  # no SLOs: every success is good
    assert not meets_slos(rec(ttft=0.1, e2e=5.0), {"e2e": 4000.0})


def test_summarize_throughput_goodput_and_failures():
    records = [
        rec(ttft=0.1, e2e=1.0, out=10, itl=[0.1] * 9),  # tpot 100 ms: good
        rec(ttft=0.2, e2e=2.2, out=11, itl=[0.2] * 10),  # tpot 200 ms: misses tpot
        rec(ttft=3.0, e2e=3.9, out=10, itl=[0.1] * 9),  # ttft misses
        rec(ok=False, error="HTTP 429: busy", out=0, ttft=None, e2e=None),
        rec(ok=False, error="HTTP 429: busy", out=0, ttft=None, e2e=None),
        rec(ok=False, error="ReadTimeout", out=0, ttft=None, e2e=None),
    ]
    s = summarize(records, duration_s=10.0, slos={"ttft": 1000, "tpot": 150})
    assert (s["requests"], s["completed"], s["failed"]) == (6, 3, 3)
    assert s["output_tokens"] == 31
    assert s["request_throughput"] == pytest.approx(0.3)
    assert s["output_throughput"] == pytest.approx(3.1)
    assert s["good_requests"] == 1
    assert s["goodput"] == pytest.approx(0.1)
    assert s["good_fraction"] == pytest.approx(1 / 6)
    assert s["errors"] == {"HTTP 429: busy": 2, "ReadTimeout": 1}
    assert s["ttft_ms"]["mean"] == pytest.approx((100 + 200 + 3000) / 3)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["tpot_ms"]["count"] == 3
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((100 + 200 + 100) / 3)
    # ITL pools every gap of every request: 18 of 100 ms and 10 of 200 ms
    assert s["itl_ms"]["count"] == 28
    assert s["itl_ms"]["mean"] == pytest.approx((18 * 100 + 10 * 200) / 28)
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["p90"] == pytest.approx(200.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(2200.0)
    assert s["prompt_tokens"] == 24  # failed requests do not count


def test_summarize_by_class_splits_classes_over_the_same_duration():
    records = [rec("decode", ttft=0.05, e2e=2.6, out=52), rec("docs", ttft=2.0, e2e=2.5, out=6),
               rec("decode", ttft=0.05, e2e=1.05, out=21), rec("docs", ok=False, error="e")]
    s = summarize_by_class(records, duration_s=4.0, slos={"tpot": 60})
    assert list(s["classes"]) == ["decode", "docs"]
    dec, docs = s["classes"]["decode"], s["classes"]["docs"]
    assert dec["tpot_ms"]["p50"] == pytest.approx(50.0)  # both 50 ms
    assert docs["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert dec["good_requests"] == 2 and docs["good_requests"] == 0
    assert docs["failed"] == 1
    # class rates are over the run's duration, so they add up to the overall rate
    assert dec["request_throughput"] + docs["request_throughput"] == pytest.approx(
        s["overall"]["request_throughput"])
    assert s["overall"]["goodput"] == pytest.approx(0.5)


def test_summarize_needs_a_positive_duration():
    with pytest.raises(ValueError):
        summarize([rec()], 0.0)


def _rec(rid: str | None, cls: str = "a", e2e: float = 1.0) -> RequestRecord:
    return RequestRecord(cls, 0.0, ok=True, ttft_s=0.2, e2e_s=e2e, output_tokens=5,
                         request_id=rid)


def test_server_timings_join_by_id_and_break_down():
    recs = [_rec("x"), _rec("y", e2e=3.0), _rec(None), _rec("z", cls="b")]
    traces = [
        {"id": "x", "breakdown": {"prefill_queue_s": 0.1, "prefill_compute_s": 0.2,
                                  "kv_hop_s": 0.01, "first_token_s": 0.02,
                                  "decode_queue_s": 0.0, "decode_s": 0.5}},
        {"id": "y", "breakdown": {"prefill_queue_s": 0.3, "prefill_compute_s": 0.4,
                                  "kv_hop_s": 0.03, "first_token_s": 0.04,
                                  "decode_queue_s": None, "decode_s": 1.5}},
        {"id": "other", "breakdown": None},
    ]
    assert attach_server_timings(recs, traces) == 2
    assert recs[0].server["id"] == "x" and recs[2].server is None and recs[3].server is None
    b = breakdown([r for r in recs if r.request_class == "a"])
    assert b["requests"] == 2
    assert b["phases_ms"]["prefill_queue_s"]["mean"] == pytest.approx(200.0)
    assert b["phases_ms"]["decode_s"]["p50"] == pytest.approx(1000.0)
    assert b["phases_ms"]["decode_queue_s"]["count"] == 1  # None is left out, not zero
    assert b["client_e2e_ms_mean"] == pytest.approx(2000.0)
    assert b["share_of_e2e"]["decode_s"] == pytest.approx(0.5)
    assert breakdown([recs[3]])["requests"] == 0


def test_slo_capacity_interpolates_the_rate_where_attainment_crosses_the_target():
    from load_tests.goodput import attainment, slo_capacity

    assert slo_capacity([(0.2, 1.0), (0.4, 0.95), (0.6, 0.75), (0.8, 0.1)], 0.9) == \
        pytest.approx(0.4 + 0.2 * (0.95 - 0.9) / (0.95 - 0.75))
    assert slo_capacity([(0.4, 0.95), (0.2, 1.0)], 0.9) == 0.4  # every rate met it
    assert slo_capacity([(0.2, 0.8), (0.4, 0.95)], 0.9) == 0.0  # the lowest rate misses
    # past the first miss, a lucky higher rate does not count
    assert slo_capacity([(0.2, 1.0), (0.4, 0.5), (0.6, 0.95)], 0.9) == \
        pytest.approx(0.2 + 0.2 * 0.1 / 0.5)
    reqs = [{"class": "a", "sent_at": 0.0, "ok": True, "ttft_s": 0.5, "e2e_s": 2.0,
             "output_tokens": 11},
            {"class": "a", "sent_at": 0.0, "ok": True, "ttft_s": 3.0, "e2e_s": 4.0,
             "output_tokens": 11},
            {"class": "a", "sent_at": 0.0, "ok": False, "error": "x"}]
    assert attainment(reqs, {"ttft": 1000, "tpot": 200}) == pytest.approx(1 / 3)
    assert attainment(reqs, {"ttft": 5000}) == pytest.approx(2 / 3)
