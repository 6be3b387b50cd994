"""The docs a newcomer reads: README.md stays short, and every relative link in README.md,
docs/*.md, load_tests/README.md and planner/README.md points at a file or folder that exists
(http(s) links and pure ``#anchor`` links are not checked; for ``path#anchor`` only the path
is)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200

# [text](target) or [text](target "title"); images ![alt](target) match too.
_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto: ...


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "load_tests" / "README.md", ROOT / "planner" / "README.md"]
    return [f for f in files if f.is_file()]


def relative_links(text: str) -> list[str]:
    """The relative link targets of a Markdown text, code blocks and code spans left out."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    return [t for t in _LINK.findall(text) if not _EXTERNAL.match(t) and not t.startswith("#")]


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_checked_docs_exist():
    names = {f.relative_to(ROOT).as_posix() for f in doc_files()}
    assert {"README.md", "load_tests/README.md", "planner/README.md"} <= names


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in relative_links(doc.read_text()):
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (doc.parent / path)
        resolved = resolved.resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to nothing: {broken}"


def test_link_finder():
    text = ("[a](docs/api.md) [b](../x.md#sec) [c](#only) [d](https://e.org) "
            "`[e](code.md)` ![f](img.png \"t\")\n```\n[g](fenced.md)\n```\n")
    assert relative_links(text) == ["docs/api.md", "../x.md#sec", "img.png"]
