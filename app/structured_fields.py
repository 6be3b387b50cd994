"""The request fields that ask for structured output, in OpenAI's and vLLM's shapes, read into
one :class:`~app.structured.Constraint` (or none):

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
  "strict": ...}}``;
- vLLM's ``structured_outputs``: one of ``json`` (a schema, or its JSON text), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (Lark or GBNF), ``json_object: true``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one of them may ask; a constraint that does not compile is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from app.errors import InvalidRequestError
from app.structured import Constraint

_ANY_OBJECT = {"type": "object"}


def _schema(value: Any, param: str) -> dict[str, Any] | bool:
    """A JSON schema given as an object (or a boolean schema) or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param}: not JSON: {exc}", param=param) from exc
    if not isinstance(value, dict | bool):
        raise InvalidRequestError(f"{param}: a JSON schema must be an object", param=param)
    return value


def _from_response_format(rf: dict[str, Any]) -> Constraint | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_schema(_ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequestError("response_format: json_schema needs "
                                      '{"name": ..., "schema": {...}}', param="response_format")
        return Constraint.json_schema(_schema(spec["schema"], "response_format"),
                                      "response_format")
    raise InvalidRequestError(f"response_format: type must be text, json_object or "
                              f"json_schema, got {kind!r}", param="response_format")


def _one(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json":
        return Constraint.json_schema(_schema(value, param), param)
    if kind == "choice":
        return Constraint.choice(value if isinstance(value, list) else [], param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param}: {kind} must be a non-empty string", param=param)
    return Constraint(kind, value, param)


def _from_structured_outputs(so: dict[str, Any]) -> Constraint | None:
    asked = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar",
                                                    "json_object") and v not in (None, False)}
    if not asked:
        return None
    if len(asked) > 1:
        raise InvalidRequestError(f"structured_outputs: one of json, regex, choice, grammar, "
                                  f"json_object, got {sorted(asked)}", param="structured_outputs")
    ((kind, value),) = asked.items()
    if kind == "json_object":
        return Constraint.json_schema(_ANY_OBJECT, "structured_outputs")
    return _one(kind, value, "structured_outputs")


class StructuredFields(BaseModel):
    """The structured-output fields of a generation body."""

    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": '
        '{"name", "schema", "strict"}}.')
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM: one of json, regex, choice, grammar, json_object.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM: a JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM: a regular expression.")
    guided_choice: list[str] | None = Field(None, description="vLLM: the allowed outputs.")
    guided_grammar: str | None = Field(None, description="vLLM: a Lark or GBNF grammar.")

    def constraint(self) -> Constraint | None:
        """The one constraint the body asks for (compiled: a 400 when it does not)."""
        found = [c for c in (
            _from_response_format(self.response_format) if self.response_format else None,
            _from_structured_outputs(self.structured_outputs) if self.structured_outputs
            else None,
            *(_one(kind, value, f"guided_{kind}") for kind, value in (
                ("json", self.guided_json), ("regex", self.guided_regex),
                ("choice", self.guided_choice), ("grammar", self.guided_grammar))
              if value is not None)) if c is not None]
        if len(found) > 1:
            raise InvalidRequestError(
                f"{found[1].param}: ask for one structured output, got "
                + ", ".join(c.param for c in found), param=found[1].param)
        if not found:
            return None
        found[0].grammar()  # compiles it now: a bad schema is this request's 400
        return found[0]
