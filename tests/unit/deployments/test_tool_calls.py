"""Tool calls (app.tools, deployments.openai_api): tool_choice required / named constrain the
answer to the call's JSON, which the server returns as message.tool_calls (streamed as one
delta.tool_calls at the end) with finish_reason tool_calls; a call cut short stays text;
"auto" with tools and a name not among the tools are 400s; the conversation's tool calls and
results go through the chat template."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.config import EngineConfig
from app.engine_core import LocalEngine
from app.errors import InvalidRequestError
from app.messages import FinishReason
from app.output import StreamDelta
from app.tools import ToolMode
from deployments.protocol import ChatCompletionRequest, Endpoint
from deployments.responses import completion_body, stream_chunks

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER, TIME],
                                                 **fields})


@pytest.fixture(scope="module")
def engine():
    eng = LocalEngine(EngineConfig(max_batch_size=4))
    yield eng
    asyncio.run(eng.close())


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_forced_call_comes_back_as_tool_calls(engine, choice, temperature):
    req = _request(tool_choice=choice, max_tokens=80, temperature=temperature, seed=4)
    sp = req.sampling_params(80)
    ids = engine.prompts.encode_chat(req.message_dicts(), tools=req.template_tools())
    out = asyncio.run(engine.generate(engine.make_request(sp, prompt=ids)))
    assert out.finish_reason == "stop", out.text
    body = completion_body(Endpoint.CHAT, "id", "m", [(out.text, FinishReason.STOP)], 1,
                           len(out.token_ids), tool_mode=req.tool_mode())
    [choice_out] = body["choices"]
    assert choice_out["finish_reason"] == "tool_calls"
    assert choice_out["message"]["content"] is None
    calls = choice_out["message"]["tool_calls"]
    assert calls and all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert isinstance(args["city"], str) and set(args) <= {"city", "unit"}
        else:
            assert call["function"]["name"] == "get_time" and args["zone"] in ("UTC", "CET")
    if isinstance(choice, dict):
        assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_streamed_calls_arrive_as_one_delta_at_the_end_and_a_cut_call_stays_text():
    mode = _request(tool_choice="required").tool_mode()
    text = '[{"name": "get_time", "parameters": {"zone": "UTC"}}]'

    async def chunks(pieces, finish):
        async def deltas():
            for k, piece in enumerate(pieces):
                yield 0, StreamDelta(piece, [k], finish if k == len(pieces) - 1 else None)
        return [c async for c in stream_chunks(Endpoint.CHAT, "id", "m", 3, deltas(), False,
                                               tool_mode=mode)]
    got = asyncio.run(chunks([text[:10], text[10:30], text[30:]], FinishReason.STOP))
    deltas = [c["choices"][0]["delta"] for c in got]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(d.get("content") in ("", None) for d in deltas)
    [last] = [c["choices"][0] for c in got if c["choices"][0]["finish_reason"]]
    assert last["finish_reason"] == "tool_calls"
    [call] = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_time",
                                                        "arguments": '{"zone": "UTC"}'}
    cut = asyncio.run(chunks([text[:10], text[10:20]], FinishReason.LENGTH))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in cut) == text[:20]
    assert cut[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("fields", "match"), [
    ({}, '"auto" needs a tool-call parser'),
    ({"tool_choice": "auto"}, '"auto" needs a tool-call parser'),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool is named"),
    ({"tool_choice": "sometimes"}, 'must be "none"'),
])
def test_choices_that_cannot_be_served_are_400s(fields, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        _request(**fields).sampling_params(16)
    assert info.value.param == "tool_choice"
    assert _request(tool_choice="none").tool_mode() is None  # tools ignored: a text answer
    assert _request(tool_choice="none").template_tools() is None


def test_required_asks_for_calls_of_the_given_tools_only():
    mode = ToolMode.of([WEATHER, TIME], "required")
    schema = json.loads(mode.constraint().spec)
    assert schema["minItems"] == 1
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert "maxItems" not in schema and schema["x-guidance"] == {"whitespace_flexible": False}
    one = json.loads(_request(tool_choice="required", parallel_tool_calls=False)
                     .tool_mode().constraint().spec)
    assert one["maxItems"] == 1  # parallel_tool_calls: false, exactly one call
    assert mode.calls("not json") is None
    with pytest.raises(InvalidRequestError, match="two tools are named"):
        ToolMode.of([WEATHER, WEATHER], "required")


def test_a_conversation_with_calls_and_results_goes_through_the_template(engine):
    msgs = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    req = ChatCompletionRequest.model_validate({"messages": msgs, "tools": [WEATHER],
                                                "tool_choice": "none", "max_tokens": 8})
    text = engine.prompts.chat_text(req.message_dicts(), tools=req.template_tools())
    assert "18C and sunny" in text and text.rstrip().endswith("assistant")


def test_auto_with_a_configured_parser_reads_the_model_s_own_calls():
    """tool_choice auto (or absent) with ingress.tool_call_parser: hermes: the answer is
    unconstrained, its <tool_call> blocks of known tools become tool_calls and the text
    around them the content; an answer without one is plain text."""
    req = _request()  # tools, no tool_choice: auto
    mode = req.tool_mode("hermes")
    assert mode is not None and mode.constraint() is None
    assert req.sampling_params(16, "hermes").constraint is None
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Oslo"}}\n</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    body = completion_body(Endpoint.CHAT, "id", "m", [(text, FinishReason.STOP)], 1, 9,
                           tool_mode=mode)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert choice["message"]["content"].startswith("Let me check.")
    assert '"nope"' in choice["message"]["content"]  # not a known tool: left as text
    plain = completion_body(Endpoint.CHAT, "id", "m", [("It is sunny.", FinishReason.STOP)],
                            1, 3, tool_mode=mode)["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {
        "role": "assistant", "content": "It is sunny."}


def test_the_parser_setting_is_checked():
    from pydantic import ValidationError

    from deployments.args import IngressArgs

    assert IngressArgs(tool_call_parser="hermes").tool_call_parser == "hermes"
    with pytest.raises(ValidationError):
        IngressArgs(tool_call_parser="mistral")
