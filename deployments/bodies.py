"""The OpenAI response bodies (and the ids, timestamps and error body they carry): typed so
that FastAPI documents them in ``/openapi.json``, built with plain values. The request bodies
are ``deployments.protocol``'s.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from app.messages import FinishReason


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``."""

    cached_tokens: int = Field(
        0, ge=0, description="prompt tokens whose KV came from the prefix cache, not computed")


class Usage(BaseModel):
    """Token counts of a request; with ``n > 1`` the prompt counts once. The details are
    always present (OpenAI's shape; vLLM sends them only behind a flag), so a client can
    read ``cached_tokens`` without knowing the server."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(
                       cached_tokens=min(cached_tokens, prompt_tokens)))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat's ``choices[].logprobs``: one entry per output token."""

    content: list[ChatTokenLogprob] | None


class CompletionLogprobs(BaseModel):
    """The completions API's ``choices[].logprobs``: parallel lists, one item per output
    token; ``top_logprobs`` maps token text to logprob (the chosen token included)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    """A whole answer: ``chat.completion`` (chat) or ``text_completion`` (completions)."""

    id: str
    object: Literal["chat.completion", "text_completion"]
    created: int
    model: str
    choices: list[ChatChoice] | list[CompletionChoice] = Field(..., min_length=1)
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class StreamChunk(BaseModel):
    """One SSE event of a stream; the last one carries only ``usage`` when it was asked for
    (``stream_options.include_usage``)."""

    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ChatChunkChoice] | list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "splitserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


def new_id(prefix: str, client_id: str) -> str:
    """A request's id inside the system (the response's ``id``, the key of its decode stream,
    in every process's logs): the client's id for the request, so logs everywhere carry it,
    plus a random suffix, so two requests that share a client id never share this one."""
    return f"{prefix}-{client_id}-{uuid.uuid4().hex[:16]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(message=message, type=err_type, param=param,
                                           code=code)).model_dump()
