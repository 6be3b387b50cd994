"""The request field policy has one table in the code (``deployments.field_policy.FIELD_POLICY``)
and the same table in docs/api.md's "Request fields": neither may drift from the other, nor
from the fields the request bodies declare."""

from __future__ import annotations

import re
from pathlib import Path

from deployments.field_policy import FIELD_POLICY
from deployments.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
)

README = Path(__file__).resolve().parents[3] / "docs" / "api.md"
_ROW = re.compile(r"\| `([\w.]+)` \| ([^|]+?) \|")
_POLICY = re.compile(r"supported|ignored|neutral only: .+")


def readme_table() -> dict[str, str]:
    section = README.read_text().split("### Request fields", 1)[1].split("\n### ", 1)[0]
    return {m[1]: m[2] for m in map(_ROW.match, section.splitlines()) if m}


def test_readme_table_is_the_code_table():
    table = readme_table()
    assert list(table) == list(FIELD_POLICY)  # same fields, same order
    assert table == FIELD_POLICY


def test_every_declared_field_has_a_policy_and_every_policy_a_field():
    declared = {*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields,
                *(f"messages.{f}" for f in ChatMessage.model_fields),
                *(f"stream_options.{f}" for f in StreamOptions.model_fields)}
    assert declared == set(FIELD_POLICY)
    assert all(_POLICY.fullmatch(p) for p in FIELD_POLICY.values())
