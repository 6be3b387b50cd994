"""Answers in OpenAI's shape: several choices (n), streamed chunks per choice, the merge of
several answer streams, logprobs (chat and completions shapes), and the sampling fields'
validation; the HTTP app (no Ray): field policy, request ids, and the routes tooling
expects (/v1/models/{id}, /tokenize, /detokenize, /version)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from app.errors import InvalidRequestError
from app.messages import FinishReason, TokenEvent
from app.output import LogprobText, StreamDelta, text_deltas
from app.sampling import SamplingParams, TokenLogprobs
from deployments.bodies import CompletionResponse, StreamChunk
from deployments.openai_api import merge_streams, validation_error
from deployments.protocol import ChatCompletionRequest, CompletionRequest, Endpoint
from deployments.responses import completion_body, stream_chunks


async def _items(values, delay=0.0, fail_at=None, closed=None):
    try:
        for i, v in enumerate(values):
            if i == fail_at:
                raise RuntimeError("boom")
            await asyncio.sleep(delay)
            yield v
    finally:
        if closed is not None:
            closed.append(values)


def test_merge_interleaves_every_stream_and_ends_with_the_last():
    async def run():
        return [x async for x in merge_streams([_items("abc", 0.01), _items("xy", 0.015)])]
    out = asyncio.run(run())
    assert sorted(out) == [(0, "a"), (0, "b"), (0, "c"), (1, "x"), (1, "y")]
    assert [v for k, v in out if k == 0] == ["a", "b", "c"]  # each stream keeps its order
    assert out[:2] == [(0, "a"), (1, "x")]  # interleaved, not one after the other


def test_merge_stops_every_stream_at_the_first_error():
    closed: list = []

    async def run():
        async for _ in merge_streams([_items("abcdef", 0.01, closed=closed),
                                      _items("xy", 0.001, fail_at=1, closed=closed)]):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run())
    assert sorted(closed) == ["abcdef", "xy"]  # the slow stream was closed, not left running


def test_several_choices_in_a_body_and_in_chunks():
    body = completion_body(Endpoint.CHAT, "id1", "m", [("one", FinishReason.STOP),
                                                       ("two", FinishReason.LENGTH)], 5, 7)
    CompletionResponse.model_validate(body)
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [
        (0, "one"), (1, "two")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}

    async def deltas():
        yield 1, StreamDelta("he", [1], None)
        yield 0, StreamDelta("", [2], None)
        yield 1, StreamDelta("y", [3], FinishReason.LENGTH)
        yield 0, StreamDelta("ok", [4], FinishReason.STOP)

    async def run():
        return [c async for c in stream_chunks(Endpoint.CHAT, "id1", "m", 5, deltas(), True)]
    chunks = asyncio.run(run())
    firsts = [c["choices"][0] for c in chunks[:2]]
    # each choice's first chunk carries the role, even an empty one
    assert [(f["index"], f["delta"]) for f in firsts] == [
        (1, {"role": "assistant", "content": "he"}), (0, {"role": "assistant", "content": ""})]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []


class _Tok:
    """A tokenizer whose token i reads "<i>"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, tuple(top))


def test_logprobs_in_whole_bodies_have_openai_shapes():
    entries = [LogprobText.of(_lp(7, -0.5, (7, -0.5), (9, -1.5)), _Tok()),
               LogprobText.of(_lp(3, -2.0, (4, -0.25), (3, -2.0)), _Tok())]
    chat = completion_body(Endpoint.CHAT, "c", "m", [("<7><3>", FinishReason.LENGTH)], 4, 2,
                           [entries])
    CompletionResponse.model_validate(chat)
    [first, second] = chat["choices"][0]["logprobs"]["content"]
    assert first == {"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>"),
                     "top_logprobs": [{"token": "<7>", "logprob": -0.5, "bytes": list(b"<7>")},
                                      {"token": "<9>", "logprob": -1.5, "bytes": list(b"<9>")}]}
    assert [t["token"] for t in second["top_logprobs"]] == ["<4>", "<3>"]

    text = completion_body(Endpoint.COMPLETION, "t", "m", [("<7><3>", FinishReason.LENGTH)],
                           4, 2, [entries])
    CompletionResponse.model_validate(text)
    assert text["choices"][0]["logprobs"] == {
        "tokens": ["<7>", "<3>"], "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"<7>": -0.5, "<9>": -1.5}, {"<4>": -0.25, "<3>": -2.0}],
        "text_offset": [0, 3]}
    # logprobs=0: only the chosen token in top_logprobs
    zero = completion_body(Endpoint.COMPLETION, "t", "m", [("<5>", None)], 1, 1,
                           [[LogprobText.of(_lp(5, -0.1), _Tok())]])
    assert zero["choices"][0]["logprobs"]["top_logprobs"] == [{"<5>": -0.1}]
    # not asked for: null, as before
    plain = completion_body(Endpoint.CHAT, "c", "m", [("x", FinishReason.STOP)], 1, 1)
    assert plain["choices"][0]["logprobs"] is None


def test_logprobs_in_streamed_chunks_one_entry_per_token():
    async def events():
        yield TokenEvent("r", 7, 0, logprobs=_lp(7, -0.5, (7, -0.5)))
        yield TokenEvent("r", 3, 1, logprobs=_lp(3, -1.0, (3, -1.0)))
        yield TokenEvent("r", 4, 2, FinishReason.LENGTH, logprobs=_lp(4, -2.0, (4, -2.0)))

    async def run(endpoint):
        deltas = text_deltas(events(), _Tok(), SamplingParams(logprobs=1))

        async def indexed():
            async for d in deltas:
                yield 0, d
        return [c async for c in stream_chunks(endpoint, "r", "m", 3, indexed(), False)]

    chunks = asyncio.run(run(Endpoint.COMPLETION))
    lps = [c["choices"][0]["logprobs"] for c in chunks]
    assert [lp["tokens"] for lp in lps] == [["<7>"], ["<3>"], ["<4>"]]
    assert [lp["text_offset"] for lp in lps] == [[0], [3], [6]]  # offsets run on per choice
    assert "".join(c["choices"][0]["text"] for c in chunks) == "<7><3><4>"
    for c in chunks:
        StreamChunk.model_validate(c)
    chat = asyncio.run(run(Endpoint.CHAT))
    assert [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chat] == [
        "<7>", "<3>", "<4>"]
    for c in chat:
        StreamChunk.model_validate(c)


def test_a_token_with_no_text_yet_still_sends_its_logprobs():
    async def deltas():
        yield 0, StreamDelta("a", [1], None, [LogprobText("a", -0.1)])
        yield 0, StreamDelta("", [2], None, [LogprobText("\ufffd", -0.2)])  # half a character
        yield 0, StreamDelta("é", [3], FinishReason.STOP, [LogprobText("\ufffd", -0.3)])

    async def run():
        return [c async for c in stream_chunks(Endpoint.CHAT, "r", "m", 1, deltas(), False)]
    chunks = asyncio.run(run())
    assert [c["choices"][0]["logprobs"]["content"][0]["logprob"] for c in chunks] == [
        -0.1, -0.2, -0.3]


def _bad(model, body: dict) -> InvalidRequestError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error(info.value.errors())


@pytest.mark.parametrize(("body", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 1.2}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to isdigit(), not to int()
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
])
def test_sampling_fields_out_of_range_get_400_naming_them(body, param):
    err = _bad(CompletionRequest, {"prompt": "hi", **body})
    assert err.param == param and err.status_code == 400


def test_sampling_fields_reach_the_sampling_params():
    req = CompletionRequest.model_validate(
        {"prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -0.25, "min_p": 0.1,
         "min_tokens": 3, "logit_bias": {"42": -100, "7": 2.5}, "logprobs": 0})
    sp = req.sampling_params(16)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.min_tokens) == (
        0.5, -0.25, 0.1, 3)
    assert sp.logit_bias == ((7, 2.5), (42, -100.0)) and sp.logprobs == 0
    assert CompletionRequest.model_validate({"prompt": "hi"}).sampling_params(16).plain
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate({"prompt": "hi", "min_tokens": 17}).sampling_params(16)
    assert info.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError) as info:
        req.sampling_params(16).__class__(logit_bias=((49152, 1.0),)).check_vocab(49152)
    assert info.value.param == "logit_bias"

    msgs = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest.model_validate({"messages": msgs, "logprobs": True,
                                                 "top_logprobs": 20})
    assert chat.sampling_params(16).logprobs == 20
    assert ChatCompletionRequest.model_validate(
        {"messages": msgs, "logprobs": True}).sampling_params(16).logprobs == 0
    assert ChatCompletionRequest.model_validate(
        {"messages": msgs, "top_logprobs": 0}).sampling_params(16).logprobs is None
    assert "top_logprobs" in _bad(ChatCompletionRequest,
                                  {"messages": msgs, "top_logprobs": 2}).message
    assert _bad(ChatCompletionRequest, {"messages": msgs, "logprobs": True,
                                        "top_logprobs": 21}).param == "top_logprobs"
# ---- the HTTP app, without Ray: the Ingress on a fake colocated server ----------------------


@pytest.fixture(scope="module")
def ingress():
    """An Ingress (its real constructor) over a fake colocated server that streams
    ``TOKENS``, without Ray: the node id and the metrics are stubbed, and FastAPI's class-based
    routes find the instance through a stubbed replica context."""
    import ray
    from ray import serve

    from deployments import ingress as ingress_module
    from tests.unit.deployments.test_split_path import FakeCall, FakeHandle, token_stream

    mp = pytest.MonkeyPatch()
    mp.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node"))
    mp.setattr(ingress_module, "IngressMetrics", lambda: _NoMetrics())
    mp.delenv("SPLITSERVE_API_KEY", raising=False)
    decode = FakeHandle(generate_local=lambda preq: FakeCall(stream=token_stream(preq)))
    # the class as written, under the one that @serve.ingress makes (an async constructor)
    instance = ingress_module.Ingress.func_or_class.__mro__[1](None, decode, {})
    mp.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=instance))
    yield instance
    mp.undo()


class _NoMetrics:
    def __getattr__(self, name):
        return SimpleNamespace(observe=lambda *a, **k: None, inc=lambda *a, **k: None,
                               set=lambda *a, **k: None)


@pytest.fixture
def client(ingress):
    from fastapi.testclient import TestClient

    from deployments.openai_api import api

    api.state.api_key = None
    return TestClient(api)


HI = [{"role": "user", "content": "hi"}]


def test_unknown_and_neutral_fields_are_accepted_and_unknown_ones_reported(client, caplog):
    body = {"messages": [*HI, {"role": "assistant", "content": None, "refusal": None}],
            "max_tokens": 3, "frobnicate": 1, "stream_options": {"include_usage": True, "x": 1},
            "tools": [], "tool_choice": "auto", "response_format": {"type": "text"},
            "store": False, "metadata": {"a": "b"}, "user": "u", "parallel_tool_calls": True,
            "top_logprobs": None, "service_tier": "auto"}
    with caplog.at_level(logging.WARNING, logger="deployments.ingress"):
        r = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "abc-1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "frobnicate,messages.refusal,stream_options.x"
    warnings = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert warnings == ["request abc-1: ignored unknown fields: frobnicate, "
                        "messages.refusal, stream_options.x"]
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and "x-ignored-fields" not in r.headers


def test_unknown_field_names_are_reported_escaped_and_bounded(client, caplog):
    """Names are the client's: any characters, any number (found by the schema fuzzer: a
    non-Latin-1 name made the header unencodable and the answer a 500)."""
    odd = {"\U0001a358x": 1, "a,b": 2, "line\nbreak": 3, "LPT1": 4}
    for path in ("/v1/completions", "/tokenize"):
        with caplog.at_level(logging.WARNING, logger="deployments.ingress"):
            r = client.post(path, json={"prompt": "hi", **odd})
        assert r.status_code == 200, r.text
        header = r.headers["x-ignored-fields"]
        assert header.isascii() and set(header.split(",")) == {
            "%F0%9A%8D%98x", "a%2Cb", "line%0Abreak", "LPT1"}
    assert not any("\n" in rec.getMessage() for rec in caplog.records)
    many = {f"f{i:03d}": i for i in range(100)}
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **many})
    names = r.headers["x-ignored-fields"].split(",")
    assert len(names) == 33 and names[-1] == "...68 more"


REFUSED = [
    # tools without tool_choice: "auto", which needs a tool-call parser (none configured)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"store": True}, "store"),
    ({"best_of": 2}, "best_of"),
    ({"logprobs": "many"}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
     "messages.0.tool_calls"),
    ({"temperature": -1}, "temperature"),
    ({"metadata": "not a dict"}, "metadata"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_values_that_would_change_the_output_get_a_400_naming_the_field(client, fields,
                                                                        param):
    r = client.post("/v1/chat/completions", json={"messages": HI, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(f"{param}: ")


@pytest.mark.parametrize(("fields", "param"), [({"echo": True}, "echo"),
                                               ({"suffix": "x"}, "suffix"),
                                               ({"best_of": 3}, "best_of")])
def test_completion_fields_that_cannot_be_honoured(client, fields, param):
    r = client.post("/v1/completions", json={"prompt": "hi", **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_request_id_is_echoed_or_generated_on_every_answer(client, ingress):
    r = client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2},
                    headers={"X-Request-Id": "client-7"})
    assert r.headers["x-request-id"] == "client-7"
    # the internal id (the response's id) carries the client's, plus a unique suffix
    assert r.json()["id"].startswith("chatcmpl-client-7-")
    with client.stream("POST", "/v1/completions", headers={"X-Request-Id": "client-8"},
                       json={"prompt": "hi", "max_tokens": 2, "stream": True}) as s:
        assert s.headers["x-request-id"] == "client-8"
        assert '"id": "cmpl-client-8-' in s.read().decode()
    r = client.post("/v1/chat/completions", json={"messages": []},
                    headers={"X-Request-Id": "client-9"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "client-9"
    for bad in ("x" * 129, "two words", "\u00e9t\u00e9"):
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                        headers={"X-Request-Id": bad.encode()})
        generated = r.headers["x-request-id"]
        assert generated != bad and len(generated) == 32 and generated.isalnum()
    r = client.get("/v1/models")
    assert len(r.headers["x-request-id"]) == 32


def test_two_requests_with_one_client_id_get_distinct_internal_ids(client):
    ids = {client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       headers={"X-Request-Id": "same"}).json()["id"] for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("cmpl-same-") for i in ids)


def test_behind_serve_the_proxy_returns_the_id_and_the_app_adds_it_only_when_it_differs():
    from ray.serve.context import _RequestContext, _serve_request_context

    from deployments.openai_api import RequestIds

    async def call(given: bytes | None, serve_id: str) -> tuple[str, list]:
        seen = {}

        async def app(scope, receive, send):
            seen["id"] = scope["state"]["request_id"]
            await send({"type": "http.response.start", "status": 200, "headers": []})

        sent = []

        async def send(message):
            sent.append(message)

        _serve_request_context.set(_RequestContext(request_id=serve_id))
        headers = [] if given is None else [(b"x-request-id", given)]
        await RequestIds(app)({"type": "http", "headers": headers}, None, send)
        return seen["id"], sent[0]["headers"]

    # Serve's proxy echoes its id (the client's, or one it made up): not added twice
    assert asyncio.run(call(b"mine", "mine")) == ("mine", [])
    assert asyncio.run(call(None, "serve-made")) == ("serve-made", [])
    # a client id this app refuses: Serve echoes it as sent, the app adds its own
    rid, headers = asyncio.run(call(b"x" * 200, "x" * 200))
    assert len(rid) == 32 and headers == [(b"x-request-id", rid.encode())]


def test_model_card_tokenize_detokenize_and_version(client, ingress):
    name = ingress.model_name
    card = client.get(f"/v1/models/{name}").json()
    assert card["id"] == name and card["object"] == "model" and card["max_model_len"] > 0
    r = client.get("/v1/models/gpt-9")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"

    tok = client.post("/tokenize", json={"model": name, "prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == card["max_model_len"]
    assert tok["tokens"] == ingress.prompts.encode_prompt("Hello world")
    assert client.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {
        "prompt": ingress.tokenizer.decode(tok["tokens"])}
    chat = client.post("/tokenize", json={"messages": HI}).json()
    assert chat["tokens"] == ingress.prompts.encode_chat(HI)
    bare = client.post("/tokenize", json={"messages": HI, "add_generation_prompt": False})
    assert bare.json()["count"] < chat["count"]

    for body, param in (({"tokens": [1, -1]}, "tokens"), ({"tokens": [10**9]}, "tokens"),
                        ({"tokens": ["a"]}, "tokens.0")):
        r = client.post("/detokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = client.post("/tokenize", json={"model": name})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/tokenize", json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404

    from importlib.metadata import version
    assert client.get("/version").json() == {"version": version("splitserve")}


def test_new_routes_need_the_api_key_and_health_does_not(client):
    from deployments.openai_api import api

    api.state.api_key = "sekrit"
    try:
        for method, path, body in (("GET", "/version", None), ("GET", "/v1/models/x", None),
                                   ("POST", "/tokenize", {"prompt": "x"}),
                                   ("POST", "/detokenize", {"tokens": [1]})):
            r = client.request(method, path, json=body)
            assert r.status_code == 401 and r.headers["x-request-id"], path
            r = client.request(method, path, json=body,
                               headers={"Authorization": "Bearer sekrit"})
            assert r.status_code != 401, path
        assert client.get("/openapi.json").status_code == 401
    finally:
        api.state.api_key = None


def test_usage_reports_the_prompt_tokens_the_prefix_cache_supplied():
    """OpenAI's shape, always present: ``usage.prompt_tokens_details.cached_tokens``, in a
    whole body and in a stream's usage chunk (read at the end, once the prefill ran)."""
    body = completion_body(Endpoint.COMPLETION, "t", "m", [("x", FinishReason.STOP)], 40, 1,
                           cached_tokens=32)
    CompletionResponse.model_validate(body)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    capped = completion_body(Endpoint.COMPLETION, "t", "m", [("x", None)], 4, 1,
                             cached_tokens=9)
    assert capped["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    cached = {"n": 0}

    async def deltas():
        cached["n"] = 16  # the first answer's stream started: the trace has it now
        yield 0, StreamDelta("ok", [4], FinishReason.STOP)

    async def run():
        return [c async for c in stream_chunks(Endpoint.CHAT, "r", "m", 20, deltas(), True,
                                               cached_tokens=lambda: cached["n"])]
    last = asyncio.run(run())[-1]
    StreamChunk.model_validate(last)
    assert last["usage"] == {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21,
                             "prompt_tokens_details": {"cached_tokens": 16}}


def test_http_usage_counts_the_first_streams_cached_tokens_once(client, ingress, monkeypatch):
    """Through the ingress: the cached count of the answer's StreamStart reaches ``usage``,
    whole and streamed; with n = 2 the prompt (and its cached part) counts once."""
    from deployments.retries import choice_request
    from tests.unit.deployments.test_split_path import FakeCall, FakeHandle, token_stream

    def cached_stream(preq):
        async def gen():
            stream = token_stream(preq)
            start = await stream.__anext__()
            yield dataclasses.replace(start, cached_tokens=1)
            async for item in stream:
                yield item
        return FakeCall(stream=gen())

    # a colocated server: n > 1 is one make_kv_package, then generate([ref], k) per answer
    decode = FakeHandle(
        generate_local=cached_stream, make_kv_package=lambda preq: FakeCall(value=preq),
        generate=lambda wrapped, k: cached_stream(choice_request(wrapped[0], k)))
    monkeypatch.setattr(ingress.path, "decode", decode)
    monkeypatch.setattr(ingress.path, "locate", lambda ref: ([], None))  # no Ray here
    r = client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 3})
    assert r.status_code == 200, r.text
    one = r.json()["usage"]
    assert one["prompt_tokens_details"] == {"cached_tokens": 1}
    r = client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 3, "n": 2})
    two = r.json()["usage"]
    assert two["prompt_tokens_details"] == {"cached_tokens": 1}
    assert two["prompt_tokens"] == one["prompt_tokens"]
    assert two["completion_tokens"] == 2 * one["completion_tokens"]
    assert [name for name, _ in decode.calls[-3:]] == ["make_kv_package", "generate",
                                                        "generate"]
    r = client.post("/v1/completions", json={"prompt": "hi there", "max_tokens": 3,
                                             "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
