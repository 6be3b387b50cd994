"""Workload building: length distributions, class specs, exact-length prompts, arrivals."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from load_tests.loadgen import build_streams
from load_tests.workloads import (
    LengthDist,
    PromptFactory,
    PromptFile,
    RequestClass,
    RequestSpec,
    arrival_gaps,
    pick_class,
)


def test_length_specs():
    rng = random.Random(0)
    assert LengthDist.parse("64").sample(rng) == 64
    assert LengthDist.parse(64).kind == "fixed"
    u = LengthDist.parse("uniform:10:20")
    assert {u.sample(rng) for _ in range(500)} == set(range(10, 21))
    ln = LengthDist.parse("lognormal:100:0.5:20:300")
    draws = [ln.sample(rng) for _ in range(4000)]
    assert min(draws) >= 20 and max(draws) <= 300
    assert 90 <= statistics.median(draws) <= 110  # the median is the given one
    for bad in ("uniform:5", "lognormal:0:1", "zipf:1:2", "uniform:9:3", "0"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_class_spec_parsing():
    c = RequestClass.parse("name=docs,input=1024,output=16,rate=0.5,n=10")
    assert (c.name, c.input_len.sample(random.Random()), c.output_len.low) == ("docs", 1024, 16)
    assert c.rate == 0.5 and c.num_requests == 10 and c.own_stream and c.ignore_eos
    d = RequestClass.parse("name=decode,input=64,output=256,concurrency=4,background=1,"
                           "ignore_eos=0")
    assert d.concurrency == 4 and d.background and not d.ignore_eos
    assert RequestClass.parse("chat").input_len.kind == "lognormal"
    for bad in ("name=x,input=5", "name=x,output=5,rate=1,concurrency=2",
                "name=x,output=5,n=3", "name=x,output=5,colour=red", "input=5,output=5",
                "name=x,output=5,background=1"):
        with pytest.raises(ValueError):
            RequestClass.parse(bad)


def test_streams_shared_and_own():
    a = RequestClass.parse("name=a,input=8,output=8,weight=3")
    b = RequestClass.parse("name=b,input=8,output=8")
    own = RequestClass.parse("name=docs,input=512,output=4,rate=0.2,n=5")
    streams = build_streams([a, b, own], rate=2.0, concurrency=None, burstiness=1.0,
                            num_requests=40)
    assert [(s.name, [c.name for c in s.classes], s.num_requests, s.rate) for s in streams] == [
        ("shared", ["a", "b"], 40, 2.0), ("docs", ["docs"], 5, 0.2)]
    with pytest.raises(ValueError, match="--rate"):
        build_streams([a], rate=None, concurrency=None, burstiness=1.0, num_requests=4)
    rng = random.Random(1)
    picks = [pick_class([a, b], rng).name for _ in range(4000)]
    assert 0.72 < picks.count("a") / len(picks) < 0.78  # weight 3 : 1


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_the_requested_mean_and_burstiness(burstiness):
    gaps = arrival_gaps(2.0, burstiness, random.Random(3))
    xs = [next(gaps) for _ in range(20000)]
    assert statistics.fmean(xs) == pytest.approx(0.5, rel=0.05)
    # gamma(shape k): coefficient of variation 1/sqrt(k); Poisson has CV 1
    cv = statistics.pstdev(xs) / statistics.fmean(xs)
    assert cv == pytest.approx(burstiness ** -0.5, rel=0.08)


def test_request_bodies():
    spec = RequestSpec("decode", max_tokens=32, ignore_eos=True, prompt=[5, 6, 7],
                       input_tokens=3)
    body = spec.body("completions", "m", 0.0)
    assert body == {"max_tokens": 32, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "model": "m",
                    "ignore_eos": True, "prompt": [5, 6, 7]}
    with pytest.raises(ValueError):
        spec.body("chat", "m", 0.0)  # token ids cannot be a chat message
    text = RequestSpec("c", max_tokens=4, ignore_eos=False, prompt="hi")
    assert text.body("chat", None, 0.7)["messages"] == [{"role": "user", "content": "hi"}]
    assert "ignore_eos" not in text.body("chat", None, 0.7)  # only sent when asked for


def test_prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in [
        {"prompt": "hello", "max_tokens": 7},
        {"messages": [{"role": "user", "content": "hey"}], "class": "chatty"},
    ]) + "\n")
    pf = PromptFile.load(path)
    cls = RequestClass("jsonl", None, LengthDist.fixed(5))
    seen = {}
    rng = random.Random(0)
    for _ in range(50):
        s = pf.make(cls, rng)
        seen[s.request_class] = s
    assert seen["jsonl"].max_tokens == 7 and seen["jsonl"].prompt == "hello"
    assert seen["chatty"].max_tokens == 5 and seen["chatty"].messages[0]["content"] == "hey"
    path.write_text('{"prompt": "a", "messages": []}\n')
    with pytest.raises(ValueError, match="exactly one"):
        PromptFile.load(path)


@pytest.mark.smollm
def test_synthetic_prompts_have_exact_token_counts(smollm_tokenizer):
    from app.chat import PromptBuilder

    factory = PromptFactory(smollm_tokenizer)
    builder = PromptBuilder(smollm_tokenizer)  # what the server's ingress does
    rng = random.Random(0)
    for n in (40, 64, 257, 1024):
        msgs = factory.chat_messages(n, rng)
        assert len(builder.encode_chat(msgs)) == n
        ids = factory.token_ids(n, rng)
        assert len(builder.encode_prompt(ids)) == n
        assert len(smollm_tokenizer.encode(factory.text(n, rng), add_special_tokens=False)) == n
    a = factory.chat_messages(300, random.Random(1))
    b = factory.chat_messages(300, random.Random(2))
    assert a != b  # different requests, different prompts: nothing shared to cache
    cls = RequestClass.parse("name=docs,input=128,output=16")
    spec = factory.make(cls, "chat", random.Random(5))
    assert len(builder.encode_chat(spec.messages)) == 128 == spec.input_tokens
    with pytest.raises(ValueError, match="template"):
        factory.chat_messages(factory.chat_overhead, rng)
