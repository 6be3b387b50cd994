"""OpenAI-compatible request and response bodies (pydantic: the HTTP edge only).

Requests forbid unknown fields, so an option this server does not implement gets a 400 that
names it instead of being silently ignored. Fields that OpenAI clients commonly send with
their neutral value (``presence_penalty=0``, ``logprobs=false``...) are accepted only with
that value.
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.messages import FinishReason
from app.sampling import SamplingParams

MAX_STOP = 16
MAX_N = 8  # answers per request (n): one prefill, n decode streams


class _Neutral(BaseModel):
    """Options accepted only at the value that means 'off'."""

    model_config = ConfigDict(extra="forbid")

    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(
        1, description=f"Number of answers (1 to {MAX_N}): the prompt is prefilled once and "
        "answer k samples with seed + k.")
    best_of: int | None = Field(None, description="Only 1 (or unset) is supported.")
    presence_penalty: float | None = Field(0.0, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(0.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported (must be empty).")
    user: str | None = Field(None, description="End-user id; accepted and ignored.")

    @model_validator(mode="after")
    def _neutral_only(self):
        checks = {
            "best_of": self.best_of in (None, 1),
            "presence_penalty": not self.presence_penalty,
            "frequency_penalty": not self.frequency_penalty,
            "logit_bias": not self.logit_bias,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: only the default value is supported by this server")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="Send a final chunk with token usage.")
    continuous_usage_stats: bool = Field(False, description="Accepted for vLLM compatibility.")


class _SamplingFields(_Neutral):
    model: str | None = Field(None, description="Model name; must match the served model.")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Maximum tokens to generate (default: 16 for completions, "
        "the rest of the context for chat, capped by the server).")
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = Field(
        None, description="0 is greedy; default 1.0.")
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = Field(None, description="Nucleus.")
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="-1/0 disables.")
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = Field(
        None, description="Seed: the same seed gives the same tokens.")
    stop: str | list[str] | None = Field(None, description="Up to 16 stop strings.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="Token ids that end the output (vLLM extension).")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (vLLM extension).")
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = Field(
        None, description="Penalty on tokens already seen (vLLM extension); 1.0 is off.")
    stream: bool = Field(False, description="Stream Server-Sent Events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop_tuple(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
        )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation.")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="OpenAI's newer name for max_tokens.")
    logprobs: bool | None = Field(False, description="Not supported (must be false).")

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.logprobs:
            raise ValueError("logprobs: not supported by this server")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="Text or token ids (one prompt per request).")
    echo: bool = Field(False, description="Not supported (must be false).")
    logprobs: int | None = Field(None, description="Not supported (must be null).")
    suffix: str | None = Field(None, description="Not supported (must be null).")

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.echo:
            raise ValueError("echo: not supported by this server")
        if self.logprobs is not None:
            raise ValueError("logprobs: not supported by this server")
        if self.suffix is not None:
            raise ValueError("suffix: not supported by this server")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("prompt: one prompt per request is supported")
            self.prompt = p[0]
        return self


# ---- endpoints --------------------------------------------------------------------------


class Endpoint(str, enum.Enum):
    """The two generation routes; everything that differs between them hangs off this."""

    CHAT = "chat"
    COMPLETION = "completion"

    @property
    def request_model(self) -> type[ChatCompletionRequest] | type[CompletionRequest]:
        return ChatCompletionRequest if self is Endpoint.CHAT else CompletionRequest

    @property
    def prompt_param(self) -> str:
        """The request field a bad prompt is reported against."""
        return "messages" if self is Endpoint.CHAT else "prompt"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self is Endpoint.CHAT else "cmpl"

    @property
    def object_name(self) -> str:
        return "chat.completion" if self is Endpoint.CHAT else "text_completion"

    @property
    def chunk_object_name(self) -> str:
        return "chat.completion.chunk" if self is Endpoint.CHAT else "text_completion"


# ---- response bodies ----------------------------------------------------------------------
# Typed so that FastAPI documents them in /openapi.json; built with plain values.


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: None = None


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
    logprobs: None = None


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, err_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(message=message, type=err_type, param=param,
                                           code=code)).model_dump()
