"""The colocated baseline on the three-node cluster, next to the split app: same Ingress under
its own route prefix, one deployment doing both phases, greedy output equal to LocalEngine's,
prefills interleaved with running decode streams; and a short load-generator run against the
live apps."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from ray import serve

from app.sampling import SamplingParams
from load_tests import loadgen
from tests.integration import conftest as cluster

pytestmark = pytest.mark.integration

COLO = "colocated"
PREFIX = "/colocated"
PROMPTS = [
    "What is the capital of Italy?",
    "Write a haiku about winter.",
    "Name two colours of the rainbow.",
]
LONG = {"prompt": "Once upon a time", "max_tokens": 48}  # the stream a prefill interrupts
SHORT = {"prompt": "The sky is", "max_tokens": 8}


@pytest.fixture(scope="module")
def colocated_url(split_cluster):
    """The colocated app beside the split one: its own name and route prefix, on the decode
    node (a slice of its tag), deleted at the end of the module."""
    from deployments.builder import build_app

    args = cluster.app_args(colocated={
        "resource_tag": "decode_accel", "resource_amount": 0.5, "num_threads": 1,
        "deployment_config": {"ray_actor_options": {"num_cpus": 0.25}}})
    serve.run(build_app(args), name=COLO, route_prefix=PREFIX, blocking=False)
    url = split_cluster.url + PREFIX
    try:
        cluster.wait_ready(url)
        yield url
    finally:
        serve.delete(COLO)


@pytest.fixture(scope="module")
def reference(smollm_model, smollm_tokenizer):
    """Greedy outputs from the in-process LocalEngine: chat PROMPTS, then LONG and SHORT."""
    chats = [(SamplingParams(max_tokens=24, temperature=0.0),
              {"messages": [{"role": "user", "content": p}]}) for p in PROMPTS]
    raw = [(SamplingParams(max_tokens=body["max_tokens"], temperature=0.0, ignore_eos=True),
            {"prompt": body["prompt"]}) for body in (LONG, SHORT)]
    return cluster.local_greedy(smollm_model, smollm_tokenizer, chats + raw)


def test_colocated_greedy_matches_local_engine(colocated_url, reference):
    aclient = openai.AsyncOpenAI(base_url=f"{colocated_url}/v1", api_key="unused",
                                 max_retries=0)

    async def one(prompt: str, stream: bool) -> tuple[str, str | None, int | None]:
        kwargs = dict(model="smollm2-135m-instruct", max_tokens=24, temperature=0,
                      messages=[{"role": "user", "content": prompt}])
        if not stream:
            r = await aclient.chat.completions.create(**kwargs)
            return (r.choices[0].message.content, r.choices[0].finish_reason,
                    r.usage.completion_tokens)
        text, finish, usage = "", None, None
        s = await aclient.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True})
        async for chunk in s:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, usage

    async def run_all():  # all six at once: batched prefills, one running decode batch
        return await asyncio.gather(*(one(p, s) for s in (False, True) for p in PROMPTS))

    expected = [(r.text, r.finish_reason, len(r.token_ids))
                for r in reference[:len(PROMPTS)]] * 2
    assert asyncio.run(run_all()) == expected


def test_one_deployment_prefills_and_decodes(colocated_url, split_cluster):
    from ray.util.state import list_actors

    health = httpx.get(f"{colocated_url}/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"ready": True, "colocated": True}
    alive = [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
             if a.class_name.startswith(f"ServeReplica:{COLO}:")]
    assert sorted(a.class_name.split(":")[-1] for a in alive) == ["ColocatedServer", "Ingress"]
    server = next(a for a in alive if a.class_name.endswith("ColocatedServer"))
    assert server.node_id == split_cluster.decode_id

    handle = serve.get_app_handle(COLO)
    stats = serve.get_deployment_handle("ColocatedServer", COLO).stats
    before = stats.remote().result(timeout_s=60)
    trace = handle.trace.remote({"prompt": "Tell me about the sea. " * 20, "max_tokens": 4,
                                 "temperature": 0}, kind="completion").result(timeout_s=120)
    after = stats.remote().result(timeout_s=60)
    assert trace["prefill_path"] == "local" and trace["decode_node"] == split_cluster.decode_id
    assert "kv_locations" not in trace  # nothing went through the object store
    prompt_tokens = trace["response"]["usage"]["prompt_tokens"]
    assert after["prefills"] == before["prefills"] + 1
    assert after["prefill_tokens_total"] == before["prefill_tokens_total"] + prompt_tokens
    assert after["started"] == before["started"] + 1


def test_n_answers_share_one_prefill(colocated_url, reference):
    """n = 3 in the colocated app: one prefill (a first token per answer), three decode
    streams that read its package; greedy answers are the reference, counted once in usage
    for the prompt."""
    stats = serve.get_deployment_handle("ColocatedServer", COLO).stats
    body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 24,
            "temperature": 0, "n": 3}
    before = stats.remote().result(timeout_s=60)
    r = httpx.post(f"{colocated_url}/v1/chat/completions", json=body, timeout=180)
    after = stats.remote().result(timeout_s=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert after["prefills"] == before["prefills"] + 1
    assert after["started"] == before["started"] + 3
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert {c["message"]["content"] for c in out["choices"]} == {reference[1].text}
    single = httpx.post(f"{colocated_url}/v1/chat/completions", json={**body, "n": 1},
                        timeout=180).json()["usage"]
    assert out["usage"]["prompt_tokens"] == single["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 3 * single["completion_tokens"]
    assert single["prompt_tokens_details"]["cached_tokens"] > 0  # prefilled just before


def test_prefill_of_a_new_prompt_interleaves_with_a_running_stream(colocated_url, reference):
    """A prompt arriving while another stream decodes is prefilled between its steps and gets
    its first token long before that stream ends; both outputs stay exact."""
    long_ref, short_ref = reference[-2], reference[-1]

    async def stream(body, marks: dict, started: asyncio.Event | None = None):
        times: list[float] = []
        text = ""
        async with httpx.AsyncClient(timeout=120) as client:
            req = {**body, "temperature": 0, "ignore_eos": True, "stream": True}
            async with client.stream("POST", f"{colocated_url}/v1/completions",
                                     json=req) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    piece = json.loads(line[6:])["choices"][0]["text"]
                    if piece:
                        times.append(time.perf_counter())
                        text += piece
                        if started is not None and len(times) == 4:
                            started.set()
        marks["first"], marks["last"] = times[0], times[-1]
        return text

    async def run():
        long_marks: dict = {}
        short_marks: dict = {}
        started = asyncio.Event()
        long_task = asyncio.create_task(stream(LONG, long_marks, started))
        await asyncio.wait_for(started.wait(), 120)
        short_text = await stream(SHORT, short_marks)
        return await long_task, short_text, long_marks, short_marks

    long_text, short_text, long_marks, short_marks = asyncio.run(run())
    assert long_text == long_ref.text and short_text == short_ref.text
    # the short request was admitted while the long one ran, not queued behind it
    assert short_marks["last"] < long_marks["last"]


def test_loadgen_smoke_against_live_apps(colocated_url, split_app, tmp_path):
    """A few requests of two classes against the colocated app (completions, exact token-id
    prompts) and a few chat requests against the split app: every request succeeds with the
    lengths asked for, and the results, per-class figures and plots are written."""
    out = tmp_path / "colo"
    code = loadgen.main([
        "--base-url", colocated_url, "--endpoint", "completions", "--label", "colocated",
        "--class", "name=decode,input=40,output=12,concurrency=2,n=4",
        "--class", "name=docs,input=300,output=3,rate=2,n=2",
        "--slo", "ttft:60000", "tpot:30000", "--duration", "60", "--drain-timeout", "60",
        "--out", str(out), "--no-progress", "--warmup", "1"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    [run] = res["runs"]
    overall, classes = run["summary"]["overall"], run["summary"]["classes"]
    assert (overall["completed"], overall["failed"]) == (6, 0)
    assert classes["decode"]["completed"] == 4 and classes["docs"]["completed"] == 2
    for r in run["requests"]:
        want_in, want_out = (40, 12) if r["class"] == "decode" else (300, 3)
        assert (r["prompt_tokens"], r["output_tokens"]) == (want_in, want_out)  # server usage
        assert 0 < r["ttft_s"] <= r["e2e_s"]
    assert len([g for r in run["requests"] if r["class"] == "decode" for g in r["itl_s"]]) > 0
    assert overall["good_requests"] == 6  # loose SLOs: every request counts
    assert overall["goodput"] == pytest.approx(6 / overall["duration_s"])
    assert overall["output_tokens"] == 4 * 12 + 2 * 3
    assert (out / "latency_cdf.png").stat().st_size > 10_000

    out = tmp_path / "split"
    code = loadgen.main([
        "--base-url", split_app.url, "--endpoint", "chat", "--label", "split",
        "--input-len", "64", "--output-len", "6", "--rates", "4,8", "--num-requests", "3",
        "--duration", "60", "--out", str(out), "--no-progress", "--server-timings"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    assert [run["rate"] for run in res["runs"]] == [4.0, 8.0]
    for run in res["runs"]:
        assert run["summary"]["overall"]["completed"] == 3
        # chat prompts built to 64 tokens after the template, as the server counts them
        assert {(r["prompt_tokens"], r["output_tokens"]) for r in run["requests"]} == {(64, 6)}
        # the server's own timings of each request, joined by response id
        assert run["summary"]["server_timings_matched"] == 3
        for r in run["requests"]:
            b = r["server"]["breakdown"]
            assert r["server"]["id"] == r["request_id"]
            assert b["prefill_compute_s"] > 0 and b["kv_hop_s"] > 0 and b["decode_s"] > 0
            assert b["decode_queue_s"] is not None and b["decode_queue_s"] >= 0
            assert sum(b[k] for k in ("prefill_queue_s", "prefill_compute_s", "kv_hop_s",
                                      "first_token_s")) <= r["ttft_s"] + 0.05
        phases = run["summary"]["breakdown"]["fixed"]["phases_ms"]
        assert phases["prefill_compute_s"]["count"] == 3
    assert (out / "goodput_vs_rate.png").exists() and (out / "latency_cdf_rate8.png").exists()


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_structured_outputs_split_equals_colocated_equals_local(colocated_url, split_app,
                                                                smollm_model, smollm_tokenizer):
    """A JSON schema through the OpenAI SDK's response_format (chat, streamed and not) and
    vLLM's guided_choice (completions): the split app (first token masked on the prefill
    replica, the rest on the decode replica) answers token for token as the colocated app
    and the in-process engine do, and the answers match their constraints."""
    from app.structured import Constraint

    ask = [{"role": "user", "content": "A person as JSON, please."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    [ref_json, ref_choice] = cluster.local_greedy(smollm_model, smollm_tokenizer, [
        (SamplingParams(max_tokens=60, temperature=0.0,
                        constraint=Constraint.json_schema(PERSON, "response_format")),
         {"messages": ask}),
        (SamplingParams(max_tokens=8, temperature=0.0,
                        constraint=Constraint.choice(["Paris", "Rome", "Oslo"], "guided_choice")),
         {"prompt": "The capital of France is"})])
    person = json.loads(ref_json.text)
    assert set(person) == {"name", "age"} and ref_choice.text in ("Paris", "Rome", "Oslo")
    for base in (split_app.url, colocated_url):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=ask,
                                           max_tokens=60, temperature=0, response_format=fmt)
        assert r.choices[0].message.content == ref_json.text
        assert r.choices[0].finish_reason == "stop"
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2-135m-instruct", messages=ask, max_tokens=60, temperature=0,
            response_format=fmt, stream=True) if c.choices)
        assert text == ref_json.text
        body = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is",
                "max_tokens": 8, "temperature": 0, "guided_choice": ["Paris", "Rome", "Oslo"]}
        got = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
        assert got["choices"][0]["text"] == ref_choice.text


ORDER = {"type": "object", "additionalProperties": False,
         "required": ["customer", "items", "priority"],
         "properties": {
             "customer": {"type": "object", "additionalProperties": False,
                          "required": ["name", "vip"],
                          "properties": {"name": {"type": "string", "maxLength": 12},
                                         "vip": {"type": "boolean"}}},
             "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                 "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                 "properties": {"sku": {"enum": ["A1", "B2", "C3"]},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
             "priority": {"enum": ["low", "high"]}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "unit": {"enum": ["C", "F"]}}}}}


def test_twenty_sampled_constrained_answers_validate_on_both_apps(colocated_url, split_app):
    """A nested schema (objects, an array, enums, required fields), a choice and a regex,
    20 seeded answers each at temperature 1, sent together, through both apps: every answer
    validates (jsonschema) or matches."""
    import re

    import jsonschema

    ask = [{"role": "user", "content": "An order as JSON."}]

    async def run(base):
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        common = dict(model="smollm2-135m-instruct", messages=ask, temperature=1.0)
        jobs = [client.chat.completions.create(
            **common, seed=s, max_tokens=160, response_format={
                "type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}})
            for s in range(20)]
        jobs += [client.chat.completions.create(
            **common, seed=s, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
            for s in range(20)]
        jobs += [client.chat.completions.create(
            **common, seed=s, max_tokens=12, extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
            for s in range(20)]
        return await asyncio.gather(*jobs)

    for base in (split_app.url, colocated_url):
        answers = asyncio.run(run(base))
        for r in answers[:20]:
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(json.loads(r.choices[0].message.content), ORDER)
        assert {r.choices[0].message.content for r in answers[20:40]} <= {"yes", "no"}
        for r in answers[40:]:
            assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", r.choices[0].message.content)


def test_tool_calls_and_the_follow_up_turn_and_the_sdk_s_parse(split_app):
    """tool_choice required and named give tool_calls whose arguments validate; the turn
    that carries the call and its result is answered; the SDK's parse() returns an object."""
    import jsonschema
    import pydantic

    client = openai.OpenAI(base_url=f"{split_app.url}/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    params = WEATHER_TOOL["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=ask,
                                           tools=[WEATHER_TOOL], tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=60,
                                           temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), params)
    follow = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=16, temperature=0, tools=[WEATHER_TOOL],
        tool_choice="none", messages=[*ask, r.choices[0].message.model_dump(exclude_none=True),
                                      {"role": "tool", "tool_call_id": call.id,
                                       "content": "4C and snowing"}])
    assert follow.choices[0].message.content

    class City(pydantic.BaseModel):
        name: str
        population: int

    parsed = client.beta.chat.completions.parse(
        model="smollm2-135m-instruct", max_tokens=80, temperature=0, response_format=City,
        messages=[{"role": "user", "content": "A city, as JSON."}])
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and isinstance(city.population, int)
