"""One streaming request to an OpenAI-compatible server, timed the way ``vllm bench serve``
times it: TTFT at the first chunk with non-empty content, ITL between content chunks, output
tokens from the final usage chunk (``stream_options.include_usage``), else chunks counted; and
the one reader of server-sent events every client here uses (:func:`sse_events`, its sync twin
:func:`iter_sse_events`)."""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from load_tests.metrics import RequestRecord

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
LOCAL_HOSTS = frozenset({"localhost"})


def is_local_url(url: str) -> bool:
    """True when ``url`` points at this machine's loopback interface."""
    host = urlsplit(url).hostname or ""
    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_DONE = object()  # the data: [DONE] line


def _sse_chunk(line: str) -> Any:
    """One line of a server-sent event stream: the JSON chunk of a ``data:`` line, ``_DONE`` at
    ``data: [DONE]``, None for a line without data (blank separators, comments, event: lines)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return _DONE if data == "[DONE]" else json.loads(data)


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The parsed JSON chunks of a streaming OpenAI response, up to ``data: [DONE]``; a chunk
    that is not JSON raises ValueError."""
    async for line in response.aiter_lines():
        chunk = _sse_chunk(line)
        if chunk is _DONE:
            return
        if chunk is not None:
            yield chunk


def iter_sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """:func:`sse_events` for a response read with a synchronous client."""
    for line in response.iter_lines():
        chunk = _sse_chunk(line)
        if chunk is _DONE:
            return
        if chunk is not None:
            yield chunk


def _content(chunk: dict[str, Any], endpoint: str) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        if endpoint == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


def _error_message(payload: Any, status: int | None = None) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        msg = f"{err.get('type') or 'error'}: {err.get('message')}"
    elif err is not None:
        msg = str(err)
    else:
        msg = str(payload)[:200]
    return f"HTTP {status}: {msg}" if status is not None else msg


async def _http_error(resp: httpx.Response) -> str:
    """The message of a non-200 answer: its OpenAI error body, else its text."""
    raw = await resp.aread()
    try:
        payload: Any = json.loads(raw)
    except ValueError:
        payload = raw.decode(errors="replace")
    return _error_message(payload, resp.status_code)


@dataclass(slots=True)
class _ChunkClock:
    """What a stream's chunks tell so far: when content first and last arrived, how many
    content chunks, and the completion tokens of the usage chunk."""

    first: float | None = None
    last_content: float | None = None
    chunks: int = 0
    usage_tokens: int | None = None

    def add(self, rec: RequestRecord, chunk: dict[str, Any], endpoint: str,
            now: float) -> None:
        if rec.request_id is None and isinstance(chunk.get("id"), str):
            rec.request_id = chunk["id"]
        if _content(chunk, endpoint):
            self.chunks += 1
            if self.first is None:
                self.first = now
            else:
                assert self.last_content is not None
                rec.itl_s.append(now - self.last_content)
            self.last_content = now
        usage = chunk.get("usage")
        if usage:
            self.usage_tokens = usage.get("completion_tokens")
            rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)


async def send_streaming(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         endpoint: str, request_class: str, run_start: float,
                         prompt_tokens: int | None = None) -> RequestRecord:
    """Send one streaming request and time it; never raises for a failed request.

    ``run_start`` is the ``time.perf_counter()`` the run started at; record times are relative
    to it.
    """
    sent = time.perf_counter()
    rec = RequestRecord(request_class, sent - run_start, prompt_tokens=prompt_tokens)
    clock = _ChunkClock()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                rec.error = await _http_error(resp)
                return rec
            async with aclosing(sse_events(resp)) as chunks:
                async for chunk in chunks:
                    now = time.perf_counter()
                    if "error" in chunk:
                        rec.error = "stream error: " + _error_message(chunk)
                        return rec
                    clock.add(rec, chunk, endpoint, now)
        end = time.perf_counter()
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return rec
    except (ValueError, KeyError, TypeError) as exc:
        rec.error = f"bad response: {exc}"
        return rec
    rec.e2e_s = end - sent
    # a response without any content (an empty answer) has its first token at the end
    rec.ttft_s = (clock.first if clock.first is not None else end) - sent
    rec.output_tokens = clock.usage_tokens if clock.usage_tokens is not None else clock.chunks
    rec.ok = True
    return rec


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id the server lists (``GET /v1/models``)."""
    resp = await client.get(base_url.rstrip("/") + "/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url} lists no models; pass --model")
    return str(data[0]["id"])
