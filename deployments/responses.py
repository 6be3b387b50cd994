"""The bodies of the OpenAI answers: a whole answer (``completion_body``), the chunks of a
streamed one (``stream_chunks``), their logprobs in the chat and completions shapes, and a
chat answer that is a tool call (``tool_answer``: app.tools). Plain functions of the engine's
deltas; the HTTP framing (SSE, errors) is ``deployments.openai_api``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.messages import FinishReason
from app.output import LogprobText, StreamDelta
from app.tools import ToolMode
from deployments.bodies import (
    AssistantMessage,
    ChatChoice,
    CompletionChoice,
    CompletionResponse,
    Usage,
    now,
)
from deployments.protocol import Endpoint


def _reason(finish: FinishReason | None) -> str | None:
    return None if finish is None else finish.value


def chat_logprobs(entries: list[LogprobText]) -> dict[str, Any]:
    """Chat's ``logprobs`` of some output tokens (``deployments.bodies.ChatLogprobs``)."""
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(*t) for t in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[LogprobText], text_offset: int = 0) -> dict[str, Any]:
    """The completions API's ``logprobs`` of some output tokens, the first at character
    ``text_offset`` of the answer (``deployments.bodies.CompletionLogprobs``)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**dict(e.top), e.token: e.logprob} for e in entries],
            "text_offset": offsets}


def tool_answer(mode: ToolMode | None, text: str, finish: FinishReason | None
                ) -> tuple[str | None, list[dict[str, Any]] | None, FinishReason | None]:
    """(content, tool_calls, finish) of a chat answer (``ToolMode.answer``): its calls with
    ``finish_reason: "tool_calls"`` when it ended with whole ones, else the text as it is."""
    if mode is None or finish is not FinishReason.STOP:
        return text, None, finish
    content, calls = mode.answer(text)
    return (text, None, finish) if calls is None else (content, calls, FinishReason.TOOL_CALLS)


def completion_body(endpoint: Endpoint, request_id: str, model: str,
                    answers: list[tuple[str, FinishReason | None]], prompt_tokens: int,
                    completion_tokens: int,
                    logprobs: list[list[LogprobText]] | None = None,
                    cached_tokens: int = 0, tool_mode: ToolMode | None = None) -> dict[str, Any]:
    """A whole (non-streamed) answer as a JSON-ready dict: one choice per (text, finish),
    with each answer's ``logprobs`` when the request asked for them. ``cached_tokens``:
    prompt tokens the prefix cache supplied (``usage.prompt_tokens_details``); ``tool_mode``:
    a chat answer that is a forced tool call (``tool_answer``)."""
    choices: list[ChatChoice] | list[CompletionChoice]
    shape = chat_logprobs if endpoint is Endpoint.CHAT else completion_logprobs
    lps = ([shape(entries) for entries in logprobs] if logprobs is not None
           else [None] * len(answers))
    if endpoint is Endpoint.CHAT:
        choices = []
        for k, ((text, finish), lp) in enumerate(zip(answers, lps, strict=True)):
            content, calls, reason = tool_answer(tool_mode, text, finish)
            choices.append(ChatChoice(index=k, message=AssistantMessage(
                content=content, tool_calls=calls), finish_reason=reason, logprobs=lp))
    else:
        choices = [CompletionChoice(index=k, text=text, finish_reason=finish, logprobs=lp)
                   for k, ((text, finish), lp) in enumerate(zip(answers, lps, strict=True))]
    body = CompletionResponse(
        id=request_id, object=endpoint.object_name, created=now(), model=model,
        choices=choices, usage=Usage.of(prompt_tokens, completion_tokens, cached_tokens),
    ).model_dump(mode="json")
    for choice in body["choices"]:  # tool_calls only on an answer that is a call
        if choice.get("message", {}).get("tool_calls", 0) is None:
            del choice["message"]["tool_calls"]
    return body


async def stream_chunks(endpoint: Endpoint, request_id: str, model: str, prompt_tokens: int,
                        deltas: AsyncIterator[tuple[int, StreamDelta]],
                        include_usage: bool,
                        cached_tokens: Callable[[], int] = lambda: 0,
                        tool_mode: ToolMode | None = None,
                        ) -> AsyncIterator[dict[str, Any]]:
    """The chunk dicts of a streamed answer (the shape of ``deployments.bodies.StreamChunk``,
    built as plain dicts: this runs once per token). ``deltas`` yields (choice index,
    delta); each choice's first chunk is sent even when empty (it carries the role).
    ``cached_tokens`` is called for the usage chunk, at the end: the prefix cache's share
    of the prompt is known only once the prefill has run. ``tool_mode`` (chat, a forced
    tool call): each answer's text is held back and sent at its end as one
    ``delta.tool_calls`` (or as content when it is not a whole call)."""
    head = {"id": request_id, "object": endpoint.chunk_object_name, "created": now(),
            "model": model}
    chat = endpoint is Endpoint.CHAT
    started: set[int] = set()
    text_offsets: dict[int, int] = {}  # completions' logprobs: characters sent per choice
    n_out = 0
    held: dict[int, str] = {}  # tool mode: each answer's text until it ends
    async for index, delta in deltas:
        n_out += len(delta.token_ids)
        calls = None
        if tool_mode is not None and chat:
            delta, calls = _held_back(tool_mode, held, index, delta)
        first = index not in started
        if not (delta.text or delta.finish_reason or first or delta.logprobs):
            continue
        finish = _reason(delta.finish_reason)
        logprobs = None
        if delta.logprobs and chat:
            logprobs = chat_logprobs(delta.logprobs)
        elif delta.logprobs:
            logprobs = completion_logprobs(delta.logprobs, text_offsets.get(index, 0))
            text_offsets[index] = text_offsets.get(index, 0) + sum(
                len(e.token) for e in delta.logprobs)
        if chat:
            content: dict[str, Any] = ({"role": "assistant", "content": delta.text} if first
                                       else {"content": delta.text})
            if calls is not None:
                content = {**content, "content": delta.text or None,
                           "tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]}
                finish = FinishReason.TOOL_CALLS.value
            choice = {"index": index, "delta": content, "finish_reason": finish,
                      "logprobs": logprobs}
        else:
            choice = {"index": index, "text": delta.text, "finish_reason": finish,
                      "logprobs": logprobs}
        started.add(index)
        yield {**head, "choices": [choice]}
    if include_usage:
        usage = Usage.of(prompt_tokens, n_out, cached_tokens())
        yield {**head, "choices": [], "usage": usage.model_dump()}


def _held_back(mode: ToolMode, held: dict[int, str], index: int, delta: StreamDelta
               ) -> tuple[StreamDelta, list[dict[str, Any]] | None]:
    """A tool-mode delta as it is sent: no text until the answer ends, then its calls (or
    its whole text, when it is not a whole call)."""
    held[index] = held.get(index, "") + delta.text
    if delta.finish_reason is None:
        return dataclasses.replace(delta, text=""), None
    text = held.pop(index)
    content, calls, _ = tool_answer(mode, text, delta.finish_reason)
    return dataclasses.replace(delta, text=content or ""), calls
