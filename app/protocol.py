"""OpenAI-compatible request and response bodies (pydantic: the HTTP edge only).

Field policy (``FIELD_POLICY``, the same table as README's "Request fields"), like vLLM's:
clients (LangChain, LiteLLM, newer OpenAI SDKs) send fields that change nothing here, and a
400 for those breaks them. So an unknown field is ignored, and reported (``ignored_fields``:
the ingress logs it and returns it in ``X-Ignored-Fields``). A known field that this server
cannot honour is accepted only at its neutral value (``tools: []``, ``echo: false``...);
any other value would change the output, so it gets a 400 naming the field.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from app.errors import InvalidRequestError
from app.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from app.structured import Constraint
from app.structured_fields import StructuredFields
from app.tools import ToolMode, check_tools

MAX_STOP = 16
MAX_N = 8  # answers per request (n): one prefill, n decode streams
MAX_COMPLETION_LOGPROBS = 5  # the completions API's bound (chat allows MAX_LOGPROBS)

SUPPORTED, IGNORED = "supported", "ignored"


def _neutral(value: str) -> str:
    return f"neutral only: {value}"


# Every field of the generation bodies: "supported" (honoured), "ignored" (any value, changes
# nothing here) or "neutral only: <value>" (any other value is a 400 naming the field). Nested
# fields are "parent.field". A field not listed is unknown: ignored and reported. README's
# "Request fields" table is this one (tests/unit/deployments/test_field_policy.py).
FIELD_POLICY: dict[str, str] = {
    "model": SUPPORTED,
    "messages": SUPPORTED,
    "messages.role": SUPPORTED,
    "messages.content": SUPPORTED,
    "messages.name": SUPPORTED,
    "messages.tool_calls": SUPPORTED,
    "messages.tool_call_id": SUPPORTED,
    "prompt": SUPPORTED,
    "max_tokens": SUPPORTED,
    "max_completion_tokens": SUPPORTED,
    "temperature": SUPPORTED,
    "top_p": SUPPORTED,
    "top_k": SUPPORTED,
    "seed": SUPPORTED,
    "stop": SUPPORTED,
    "stop_token_ids": SUPPORTED,
    "ignore_eos": SUPPORTED,
    "repetition_penalty": SUPPORTED,
    "presence_penalty": SUPPORTED,
    "frequency_penalty": SUPPORTED,
    "min_p": SUPPORTED,
    "min_tokens": SUPPORTED,
    "logit_bias": SUPPORTED,
    "logprobs": SUPPORTED,
    "top_logprobs": SUPPORTED,
    "n": SUPPORTED,
    "stream": SUPPORTED,
    "stream_options": SUPPORTED,
    "stream_options.include_usage": SUPPORTED,
    "stream_options.continuous_usage_stats": IGNORED,
    "best_of": _neutral("1 or null"),
    "echo": _neutral("false"),
    "suffix": _neutral("null"),
    "tools": SUPPORTED,
    "tool_choice": SUPPORTED,
    "functions": _neutral("null or []"),
    "function_call": _neutral('null or "none"'),
    "response_format": SUPPORTED,
    "structured_outputs": SUPPORTED,
    "guided_json": SUPPORTED,
    "guided_regex": SUPPORTED,
    "guided_choice": SUPPORTED,
    "guided_grammar": SUPPORTED,
    "store": _neutral("false or null"),
    "parallel_tool_calls": SUPPORTED,
    "metadata": IGNORED,
    "user": IGNORED,
    "service_tier": IGNORED,
}


class _Lenient(BaseModel):
    """A body that ignores unknown keys and remembers which it ignored (``ignored_fields``)."""

    model_config = ConfigDict(extra="ignore")
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: Any) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, _Lenient):
            model._ignored = tuple(str(k) for k in data if k not in cls.model_fields)
        return model

    def ignored_fields(self) -> list[str]:
        """The unknown keys of this body and of its nested objects, as dotted paths without
        list indices (``stream_options.foo``, ``messages.refusal``), sorted, each once."""
        names = set(self._ignored)
        for field in type(self).model_fields:
            value = getattr(self, field)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, _Lenient):
                    names.update(f"{field}.{n}" for n in item.ignored_fields())
        return sorted(names)


def _only(field: str, ok: bool, neutral: str) -> None:
    if not ok:
        raise ValueError(f"{field}: only {neutral} is supported by this server (any other "
                         "value would change the output)")


class _ToolFields(StructuredFields, _Lenient):
    """OpenAI options this server cannot honour, accepted at the values that change nothing."""

    tools: list[dict[str, Any]] | None = Field(
        None, description='Functions the model may call (chat): {"type": "function", '
        '"function": {"name", "description", "parameters"}}.')
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='"none", "required" or {"type": "function", "function": {"name": '
        '...}}; "auto" (the default with tools) needs a tool-call parser: a 400 here.')
    functions: list[dict[str, Any]] | None = Field(None, description="Only null or [].")
    function_call: str | dict[str, Any] | None = Field(None, description='Only null or "none".')
    store: bool | None = Field(None, description="Only false or null (nothing is stored).")
    parallel_tool_calls: bool | None = Field(
        None, description="false: tool_choice required makes exactly one call.")
    metadata: dict[str, Any] | None = Field(None, description="Ignored.")
    service_tier: str | None = Field(None, description="A hint; ignored.")

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v: list[dict[str, Any]] | None, info: ValidationInfo) -> Any:
        _only(str(info.field_name), not v, "null or [] (use tools)")
        return v

    def tool_mode(self, parser: str | None = None) -> ToolMode | None:
        """The call the answer must or may be (``app.tools``; ``parser``: the configured
        tool-call parser, for ``auto``), or None for a text answer."""
        return ToolMode.of(self.tools, self.tool_choice, self.parallel_tool_calls is not False,
                           parser)

    def output_constraint(self, parser: str | None = None) -> Constraint | None:
        """What the answer must match: a forced tool call's JSON or a structured output."""
        tool, structured = self.tool_mode(parser), self.constraint()
        if tool is not None and structured is not None:
            raise InvalidRequestError(f"{structured.param}: not with a forced tool call "
                                      "(tool_choice)", param=structured.param)
        return structured if tool is None else tool.constraint()

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v: Any) -> Any:
        _only("function_call", v in (None, "none"), 'null or "none"')
        return v

    @field_validator("store")
    @classmethod
    def _no_store(cls, v: bool | None) -> Any:
        _only("store", not v, "false")
        return v


class _Neutral(_ToolFields):
    """Options accepted only at the value that means 'off'."""

    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(
        1, description=f"Number of answers (1 to {MAX_N}): the prompt is prefilled once and "
        "answer k samples with seed + k.")
    best_of: int | None = Field(None, description="Only 1 (or unset) is supported.")
    user: str | None = Field(None, description="End-user id; accepted and ignored.")

    @model_validator(mode="after")
    def _neutral_only(self):
        checks = {
            "best_of": self.best_of in (None, 1),
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: only the default value is supported by this server")
        return self


class StreamOptions(_Lenient):
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


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
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


class TokenizeRequest(_Lenient):
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


class DetokenizeRequest(_Lenient):
    model: str | None = Field(None, description="Model name; must match the served model.")
    tokens: list[int] = Field(..., description="Token ids of the model's vocabulary.")
