"""docs/configuration.md, generated from the settings' own descriptions.

Every setting of the app is described where it is defined: ``Field(description=...)`` on the
pydantic models of ``deployments.args`` (``AppArgs`` and the phase and ingress models it
nests), and an attribute docstring (the string right below the field) on the dataclasses
``app.config.EngineConfig`` and ``deployments.autoscaling.PrefillParams`` / ``DecodeParams``.
This module walks ``AppArgs`` and everything it nests and writes one table per model::

    python -m deployments.config_docs           # (re)write docs/configuration.md
    python -m deployments.config_docs --check   # exit 1 if it differs from the code

``tests/unit/deployments/test_config_docs.py`` fails while a field has no description or the
committed file is stale.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from deployments.args import AppArgs

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REGENERATE = "python -m deployments.config_docs"

ROOT_TITLE = "App arguments"
EXAMPLE_CONFIG = "serve_configs/local.yaml"
OTHER_CONFIGS = ("serve_configs/local-colocated.yaml", "serve_configs/gpu-cluster.yaml",
                 "serve_configs/kuberay-rayservice.yaml", "serve_configs/anyscale-service.yaml")


@dataclasses.dataclass(frozen=True)
class Row:
    path: str  # dotted, from the app's args: engine.dtype, prefill.scaling.mode
    type: str  # the annotation as written in the code
    default: str  # rendered; "" for a nested model (its own table)
    description: str  # one line; "" when the code gives none
    nested: bool = False


@dataclasses.dataclass(frozen=True)
class Table:
    path: str  # "" for the app's args themselves
    model: type
    intro: str
    rows: tuple[Row, ...]

    @property
    def title(self) -> str:
        return f"`{self.path}`" if self.path else ROOT_TITLE


def attribute_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of ``cls`` and its bases: field name -> the string literal
    right below the field's annotated assignment in the class body."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # a class without Python source (builtins, pydantic's)
            continue
        node = ast.parse(source).body[0]
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt, after in zip(node.body, node.body[1:], strict=False):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = after.value.value
    return docs


def one_line(text: str | None) -> str:
    """``text`` on one line, whitespace collapsed, ready for a Markdown table cell."""
    return " ".join((text or "").split()).replace("|", "\\|")


def annotations(cls: type) -> dict[str, str]:
    """Each field's annotation as written in the code (the modules use postponed
    annotations, so these are the source's strings), over the class and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for name, annotation in inspect.get_annotations(klass).items():
            out[name] = annotation if isinstance(annotation, str) else _type_name(annotation)
    return out


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or repr(annotation)


def nested_model(annotation: Any) -> type | None:
    """The model (pydantic model or dataclass) a field holds, ``X | None`` unwrapped."""
    candidates = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        candidates = [a for a in typing.get_args(annotation) if a is not type(None)]
    for candidate in candidates:
        if isinstance(candidate, type) and (issubclass(candidate, BaseModel)
                                            or dataclasses.is_dataclass(candidate)):
            return candidate
    return None


def render_value(value: Any) -> str:
    return repr(value)


def _fields(model: type, instance: Any = None) -> Iterator[tuple[str, Any, Any, str | None]]:
    """(name, resolved annotation, default value or PydanticUndefined, description); the
    defaults are ``instance``'s values where the parent model's default gives one."""
    if issubclass(model, BaseModel):
        for name, info in model.model_fields.items():
            default = (getattr(instance, name) if instance is not None
                       else info.get_default(call_default_factory=True))
            yield name, info.annotation, default, info.description
        return
    docs = attribute_docs(model)
    hints = typing.get_type_hints(model)
    for field in dataclasses.fields(model):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = PydanticUndefined
        if instance is not None:
            default = getattr(instance, field.name)
        yield field.name, hints[field.name], default, docs.get(field.name)


def tables(model: type = AppArgs, path: str = "", intro: str = "",
           instance: Any = None) -> list[Table]:
    """One table for ``model`` at ``path``, followed by those of the models it nests, in
    field order, depth first. ``instance``: the model's default where it has one."""
    written = annotations(model)
    rows: list[Row] = []
    below: list[Table] = []
    for name, annotation, default, description in _fields(model, instance):
        dotted = f"{path}.{name}" if path else name
        inner = nested_model(annotation)
        text = one_line(description)
        if inner is not None:
            below += tables(inner, dotted, intro=text, instance=default)
            more = f"Its fields: [`{dotted}`](#{anchor(f'`{dotted}`')})."
            rows.append(Row(dotted, written[name], "" if default is not None else "`None`",
                            f"{text} {more}".strip(), nested=True))
            continue
        shown = "required" if default is PydanticUndefined else f"`{render_value(default)}`"
        rows.append(Row(dotted, written[name], shown, text))
    return [Table(path, model, intro, tuple(rows)), *below]


def undocumented(all_tables: list[Table] | None = None) -> list[str]:
    """Dotted paths of the fields that have no description."""
    return [row.path for t in (all_tables or tables()) for row in t.rows if not row.description]


def anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _qualified(model: type) -> str:
    return f"{model.__module__}.{model.__qualname__}"


def _summary(model: type) -> str:
    """The first paragraph of the model's own docstring, if it has one (not the signature
    that ``dataclass`` writes for a class without one)."""
    doc = model.__dict__.get("__doc__")
    if not doc or doc.startswith(f"{model.__name__}("):
        return ""
    return one_line(inspect.cleandoc(doc).split("\n\n")[0])


def _serve_defaults(table: Table) -> list[str]:
    defaults = getattr(table.model, "DEFAULTS", None)
    if not defaults:
        return []
    lines = [f"`{table.path}.deployment_config` starts from these Serve options: what a config "
             "gives is merged over them (`ray_actor_options` one level deep), and an "
             "`autoscaling_config` replaces `num_replicas`.", ""]
    lines += [f"- `{key}`: `{render_value(value)}`" for key, value in defaults.items()]
    return [*lines, ""]


INTRO = f"""\
# Configuration

<!-- Generated by `{REGENERATE}` from the descriptions in the code
(app/config.py, deployments/args.py, deployments/autoscaling.py): edit those, then
regenerate; tests/unit/deployments/test_config_docs.py fails while this file is stale. -->

The app (`deployments.builder:build_app`) takes its settings from a Ray Serve config: each
entry of `applications[]` that imports it gives them as `args:`, validated when it deploys
(`deployments.args.AppArgs`; an unknown or invalid key fails the deploy, naming it).

- `engine:` holds the engine's settings (`app.config.EngineConfig`), shared by every phase.
  Only a phase's torch threads (`prefill.num_threads`, ...) and GPUs
  (`deployment_config.ray_actor_options.num_gpus`) are set per phase.
- `prefill:` and `decode:` place and scale the two phases of the split app; `colocated:`,
  when set, selects the colocated baseline instead (one deployment runs both phases).
  Each phase's `deployment_config` takes Ray Serve's own deployment options (replicas,
  `autoscaling_config`, `ray_actor_options`, ...), checked against Serve's deployment schema,
  and `scaling` holds its autoscaling policy's parameters.
- `ingress:` sets the HTTP ingress; the rest of the top level sets request handling.

[`{EXAMPLE_CONFIG}`](../{EXAMPLE_CONFIG}) is a commented example:

```yaml
applications:
  - name: splitserve
    import_path: deployments.builder:build_app
    args:
      engine:                  # EngineConfig
        model: smollm2-135m-instruct
        dtype: auto
        prefill_batch_tokens: 128
      prefill:                 # a phase
        resource_tag: prefill_accel
        num_threads: 1
        deployment_config:     # Ray Serve's deployment options
          num_replicas: 1
      decode:
        resource_tag: decode_accel
        num_threads: 1
      ingress:
        max_in_flight: 512
```

Other examples: {", ".join(f"[`{c}`](../{c})" for c in OTHER_CONFIGS)}.
A Serve config's `deployments:` entries can override a phase's Serve options too, but one
that sets `autoscaling_config` replaces the app's whole `autoscaling_config`, phase policy
included, and the phase's replicas then refuse to start unless it names that policy: set
autoscaling in the phase's `deployment_config` (and `scaling`) instead.

Defaults are shown as Python values: `None` is YAML's `null` (or the key left out), `True` and
`False` are `true` and `false`. A path such as `prefill.scaling.mode` is where the setting
goes under `args:`.
"""


def render(all_tables: list[Table] | None = None) -> str:
    all_tables = all_tables or tables()
    lines = [INTRO, "Tables:", ""]
    lines += [f"- [{t.title}](#{anchor(t.title)})" for t in all_tables]
    for table in all_tables:
        lines += ["", f"## {table.title}", ""]
        about = " ".join(filter(None, [f"`{_qualified(table.model)}`.", table.intro,
                                       _summary(table.model)]))
        lines += [about, ""]
        lines += _serve_defaults(table)
        lines += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        for row in table.rows:
            kind = one_line(row.type)
            default = row.default or "(below)"
            lines.append(f"| `{row.path}` | `{kind}` | {default} | {row.description} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, path: Path = DOC) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the file differs from what the code generates")
    args = parser.parse_args(argv)
    all_tables = tables()
    missing = undocumented(all_tables)
    if missing:
        print(f"fields without a description: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render(all_tables)
    current = path.read_text() if path.exists() else None
    if args.check:
        if current != text:
            print(f"{path} is stale: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
