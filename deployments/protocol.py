"""The OpenAI-compatible request bodies (pydantic: the HTTP edge only) and ``Endpoint``.

Each field's policy (supported, ignored, neutral only) and the lenient base these bodies
stand on are in ``deployments.field_policy``; the response bodies in ``deployments.bodies``.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from app.errors import InvalidRequestError
from app.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from app.tools import check_tools
from deployments.field_policy import Lenient, NeutralFields

MAX_STOP = 16
MAX_COMPLETION_LOGPROBS = 5  # the completions API's bound (chat allows MAX_LOGPROBS)


class StreamOptions(Lenient):
    include_usage: bool = Field(False, description="Send a final chunk with token usage.")
    continuous_usage_stats: bool = Field(False, description="Accepted for vLLM compatibility.")


class _SamplingFields(NeutralFields):
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
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = Field(
        None, description="Subtracted from the logit of every token already in the output.")
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = Field(
        None, description="Subtracted from a token's logit once per time it is in the output.")
    logit_bias: dict[str, float] | None = Field(
        None, description=f"Token id (as a string) -> bias in [-100, 100] added to its logit; "
        f"at most {MAX_LOGIT_BIAS} entries.")
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        None, description="Drop tokens less likely than min_p x the most likely (vLLM "
        "extension); 0 is off.")
    min_tokens: Annotated[int, Field(ge=0)] | None = Field(
        None, description="EOS, stop_token_ids and stop strings cannot end the output "
        "before this many tokens (vLLM extension).")
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

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
        for token, bias in v.items():
            if not (token.isascii() and token.isdigit() and len(token) <= 18):
                raise ValueError(f"keys must be token ids (non-negative integers), got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {token}")
        return v

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per output token when logprobs were asked for, else None."""
        return None

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, default_max_tokens: int,
                        tool_parser: str | None = None) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        min_tokens = self.min_tokens or 0
        if min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})",
                param="min_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stop_tuple(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_p=self.min_p or 0.0,
            min_tokens=min_tokens,
            logit_bias=tuple(sorted({int(t): b for t, b in (self.logit_bias or {}).items()}
                                    .items())),
            logprobs=self.top_logprobs_wanted(),
            constraint=self.output_constraint(tool_parser),
        )


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="Required but on an assistant message.")
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="An assistant's calls: {id, type: function, function: {name, "
        "arguments}}.")
    tool_call_id: str | None = Field(None, description="A tool result's call id.")

    @field_validator("tool_calls")
    @classmethod
    def _check_tool_calls(cls, v: list[dict[str, Any]] | None) -> Any:
        for call in v or []:
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError('each must be {"id", "type": "function", "function": '
                                 '{"name", "arguments"}}')
        return v

    @model_validator(mode="after")
    def _content_or_assistant(self):
        if self.content is None and self.role != "assistant":
            raise ValueError("content: null only on an assistant message")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation.")
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="OpenAI's newer name for max_tokens.")
    logprobs: bool | None = Field(
        False, description="Return each output token's logprob (of the model's raw "
        "distribution, before temperature, penalties and biases).")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description=f"With logprobs: also the 0 to {MAX_LOGPROBS} most likely tokens "
        "at each position.")

    @model_validator(mode="after")
    def _chat_checks(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        return self

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template is given (none when tool_choice is "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        check_tools(self.tools)
        return self.tools


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="Text or token ids (one prompt per request).")
    echo: bool = Field(False, description="Not supported (must be false).")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = Field(
        None, description=f"Return each output token's logprob (of the model's raw "
        f"distribution) and the 0 to {MAX_COMPLETION_LOGPROBS} most likely tokens at its "
        "position.")
    suffix: str | None = Field(None, description="Not supported (must be null).")

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.echo:
            raise ValueError("echo: not supported by this server")
        if self.suffix is not None:
            raise ValueError("suffix: not supported by this server")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools: chat only (/v1/chat/completions)")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("prompt: one prompt per request is supported")
            self.prompt = p[0]
        return self

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


GenerationRequest = ChatCompletionRequest | CompletionRequest


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


class TokenizeRequest(Lenient):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages`` (through the chat
    template)."""

    model: str | None = Field(None, description="Model name; must match the served model.")
    prompt: str | None = Field(None, description="Text, tokenized as /v1/completions does.")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A conversation, tokenized as /v1/chat/completions "
        "does.")
    add_generation_prompt: bool = Field(
        True, description="With messages: end with the assistant's turn header.")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        return self


class DetokenizeRequest(Lenient):
    model: str | None = Field(None, description="Model name; must match the served model.")
    tokens: list[int] = Field(..., description="Token ids of the model's vocabulary.")
