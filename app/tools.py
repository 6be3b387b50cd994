"""Tool calls (OpenAI's ``tools`` and ``tool_choice``) as structured output.

``tool_choice: "required"`` and a named function work for every model: the answer is
constrained (app.structured) to the call's JSON, and the server turns that JSON into
``message.tool_calls`` with ``finish_reason: "tool_calls"``, as vLLM does:

- a named function: the answer is the function's arguments, an object of its
  ``parameters`` schema;
- ``required``: the answer is a JSON array of at least one ``{"name": ..., "parameters":
  {...}}``, each name one of the tools, its parameters of that tool's schema.

The tools reach the model through its chat template (``tools=``), with the conversation's
assistant ``tool_calls`` and ``role: "tool"`` results. ``tool_choice: "auto"`` would need the
model's own tool-call format and a parser for it, named by ``ingress.tool_call_parser``
(``hermes``: ``<tool_call>{...}</tool_call>`` blocks, the format of Qwen2.5 and Hermes
models); without one, ``auto`` with tools is a 400 that says to use ``required`` or a named
function. ``none`` ignores the tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from app.errors import InvalidRequestError
from app.structured import Constraint

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _bad(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {why}", param=param)


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The tools by name, each ``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``; a 400 naming ``tools`` otherwise."""
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad("tools", f'tools[{i}] must be {{"type": "function", "function": '
                       '{"name": ..., "parameters": {...}}}')
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise _bad("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        if fn["name"] in by_name:
            raise _bad("tools", f"two tools are named {fn['name']!r}")
        by_name[fn["name"]] = params
    return by_name


@dataclass(frozen=True, slots=True)
class ToolMode:
    """A request whose answer is a call: ``name`` set for a named function, else
    ``required`` (any of ``schemas``, one or more calls)."""

    schemas: tuple[tuple[str, str], ...]  # (name, parameters schema as JSON text)
    name: str | None = None
    parallel: bool = True  # required: more than one call allowed (parallel_tool_calls)
    parser: str | None = None  # auto: the model's own format, read by this parser

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, choice: Any, parallel: bool = True,
           parser: str | None = None) -> ToolMode | None:
        """The mode ``tools`` and ``tool_choice`` ask for (``parser``: the configured
        tool-call parser, for ``auto``); None when the answer is text."""
        if choice == "none" or (not tools and choice in (None, "auto")):
            return None  # a text answer
        if not tools:
            raise _bad("tool_choice", f"{choice!r} needs tools")
        by_name = check_tools(tools)
        schemas = tuple((n, json.dumps(s, sort_keys=True)) for n, s in by_name.items())
        if choice in (None, "auto"):
            if parser is not None:
                return cls(schemas, parser=parser)
            raise _bad("tool_choice", '"auto" needs a tool-call parser for this model, and none '
                       'is configured (ingress.tool_call_parser): use "required" or a named '
                       'function ({"type": "function", "function": {"name": ...}})')
        if choice == "required":
            return cls(schemas, parallel=parallel)
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
            raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": '
                       '"function", "function": {"name": ...}}')
        if name not in by_name:
            raise _bad("tool_choice", f"no tool is named {name!r}")
        return cls(schemas, name)

    def constraint(self) -> Constraint | None:
        """What the answer must be (None for ``auto``: the model's own text, parsed after):
        the named function's arguments, or the array of calls,
        in compact JSON (whitespace between tokens is not the model's to choose: a small
        model left free to indent can spend its tokens on it)."""
        if self.parser is not None:
            return None
        schemas = {n: json.loads(s) for n, s in self.schemas}
        compact = {"x-guidance": {"whitespace_flexible": False}}
        if self.name is not None:
            return Constraint.json_schema({**schemas[self.name], **compact}, "tool_choice")
        call = [{"type": "object", "additionalProperties": False,
                 "required": ["name", "parameters"],
                 "properties": {"name": {"const": n}, "parameters": s}}
                for n, s in schemas.items()]
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": call}, **compact}
        if not self.parallel:
            calls["maxItems"] = 1
        return Constraint.json_schema(calls, "tool_choice")

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(content, tool_calls) of a finished answer: a forced call's JSON as calls (the
        text as content when it is not a whole call); ``auto``: the calls the parser finds
        and the text around them (None when there is none)."""
        if self.parser is None:
            calls = self.calls(text)
            return (text, None) if calls is None else (None, calls)
        content, found = PARSERS[self.parser](text, {n for n, _ in self.schemas})
        return (text, None) if not found else (content or None, _as_calls(found))

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """A forced answer as OpenAI's ``tool_calls``, or None when it is not a whole call
        (cut short by max_tokens: the text is then returned as content)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        pairs = ([(self.name, value)] if self.name is not None
                 else [(c.get("name"), c.get("parameters")) for c in value])
        return _as_calls(pairs)


def _as_calls(pairs: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": n, "arguments": json.dumps(args)}} for n, args in pairs]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def hermes(text: str, names: set[str]) -> tuple[str, list[tuple[str, Any]]]:
    """Hermes-style calls (Qwen2.5, Hermes 2 Pro...): ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`` blocks; (the text outside them, (name, arguments) of each block
    that is a call of a known tool). A block that is not one stays in the text."""
    found: list[tuple[str, Any]] = []

    def take(match: re.Match) -> str:
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(call, dict) or call.get("name") not in names:
            return match.group(0)
        found.append((call["name"], call.get("arguments", {})))
        return ""
    rest = _HERMES.sub(take, text).strip()
    return rest, found


# tool-call parsers by name (ingress.tool_call_parser), as vLLM's --tool-call-parser
PARSERS = {"hermes": hermes}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's ``tool_calls`` with their
    ``arguments`` as objects (the API sends JSON text), a tool result with its id."""
    out = []
    for msg in messages:
        calls = msg.get("tool_calls")
        if calls:
            msg = {**msg, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": _arguments(c)}}
                for c in calls]}
        out.append(msg)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args
