"""The request field policy and the lenient base of the OpenAI request bodies
(``deployments.protocol``; pydantic: the HTTP edge only).

Field policy (``FIELD_POLICY``, the same table as docs/api.md's "Request fields"), like vLLM's:
clients (LangChain, LiteLLM, newer OpenAI SDKs) send fields that change nothing here, and a
400 for those breaks them. So an unknown field is ignored, and reported (``ignored_fields``:
the ingress logs it and returns it in ``X-Ignored-Fields``). A known field that this server
cannot honour is accepted only at its neutral value (``tools: []``, ``echo: false``...);
any other value would change the output, so it gets a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

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
from app.structured import Constraint
from app.structured_fields import StructuredFields
from app.tools import ToolMode

MAX_N = 8  # answers per request (n): one prefill, n decode streams

SUPPORTED, IGNORED = "supported", "ignored"


def _neutral(value: str) -> str:
    return f"neutral only: {value}"


# Every field of the generation bodies: "supported" (honoured), "ignored" (any value, changes
# nothing here) or "neutral only: <value>" (any other value is a 400 naming the field). Nested
# fields are "parent.field". A field not listed is unknown: ignored and reported. docs/api.md's
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


class Lenient(BaseModel):
    """A body that ignores unknown keys and remembers which it ignored (``ignored_fields``)."""

    model_config = ConfigDict(extra="ignore")
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: Any) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, Lenient):
            model._ignored = tuple(str(k) for k in data if k not in cls.model_fields)
        return model

    def ignored_fields(self) -> list[str]:
        """The unknown keys of this body and of its nested objects, as dotted paths without
        list indices (``stream_options.foo``, ``messages.refusal``), sorted, each once."""
        names = set(self._ignored)
        for field in type(self).model_fields:
            value = getattr(self, field)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, Lenient):
                    names.update(f"{field}.{n}" for n in item.ignored_fields())
        return sorted(names)


def _only(field: str, ok: bool, neutral: str) -> None:
    if not ok:
        raise ValueError(f"{field}: only {neutral} is supported by this server (any other "
                         "value would change the output)")


class ToolFields(StructuredFields, Lenient):
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


class NeutralFields(ToolFields):
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
