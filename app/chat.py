"""Prompt building: chat template or raw text to token ids, with the model's tokenizer."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from app.errors import InvalidRequestError
from app.tools import template_messages

_ROLES = frozenset({"system", "user", "assistant", "developer", "tool"})


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequestError(
                    f"messages[{index}].content: only text content parts are supported",
                    param=f"messages[{index}].content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts",
        param=f"messages[{index}].content",
    )


def normalize_messages(messages: Seq[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidRequestError("messages must contain at least one message", param="messages")
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}",
                param=f"messages[{i}].role",
            )
        # "developer" is OpenAI's newer name for "system"
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": _content_text(msg.get("content") or "", i)}
        for key in ("tool_calls", "tool_call_id"):  # tool calls and their results
            if msg.get(key):
                entry[key] = msg[key]
        if role == "tool" and msg.get("name"):
            entry["name"] = msg["name"]
        out.append(entry)
    return template_messages(out)


class PromptBuilder:
    """Turns chat messages or a prompt into token ids; holds only the tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def chat_text(self, messages: Seq[dict[str, Any]], add_generation_prompt: bool = True,
                  tools: list[dict[str, Any]] | None = None) -> str:
        msgs = normalize_messages(messages)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions with a prompt",
                param="messages",
            )
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, tools=tools,
                                                  add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: Seq[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        # the template already holds the special tokens
        text = self.chat_text(messages, add_generation_prompt, tools)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("a token-id prompt must be a list of integers",
                                          param="prompt")
            return list(prompt)
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string or a list of token ids",
                                      param="prompt")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def eos_token_ids(self, generation_config: Any | None = None) -> frozenset[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = getattr(generation_config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(t) for t in eos)
        return frozenset(ids)
