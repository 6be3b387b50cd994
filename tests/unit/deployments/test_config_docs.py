"""docs/configuration.md is generated from the settings' descriptions in the code
(``deployments.config_docs``): every field has one, and the committed file is what the code
generates today."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from app.config import EngineConfig, KernelConfig
from deployments import config_docs
from deployments.args import AppArgs, DecodePhaseArgs, IngressArgs, PhaseArgs, PrefillPhaseArgs
from deployments.autoscaling import DecodeParams, PrefillParams

ROOT = Path(__file__).resolve().parents[3]

# Every model the app's args nest, at the path where a serve config sets its fields.
MODELS = {"": AppArgs, "engine": EngineConfig, "engine.kernels": KernelConfig,
          "prefill": PrefillPhaseArgs,
          "prefill.scaling": PrefillParams, "decode": DecodePhaseArgs,
          "decode.scaling": DecodeParams, "colocated": PhaseArgs, "ingress": IngressArgs}


def field_names(model: type) -> list[str]:
    if issubclass(model, BaseModel):
        return list(model.model_fields)
    return [f.name for f in dataclasses.fields(model)]


@pytest.fixture(scope="module")
def tables() -> list[config_docs.Table]:
    return config_docs.tables()


def test_one_table_per_nested_model_with_every_field(tables):
    assert {t.path: t.model for t in tables} == MODELS
    for table in tables:
        prefix = f"{table.path}." if table.path else ""
        assert [r.path for r in table.rows] == [prefix + n for n in field_names(table.model)]


def test_every_field_has_a_description(tables):
    missing = config_docs.undocumented(tables)
    assert not missing, (
        f"fields without a description: {missing}. Describe each where it is defined: "
        "Field(description=...) in deployments/args.py, the attribute docstring right below "
        "the field in app/config.py (EngineConfig) and deployments/autoscaling.py")


@pytest.mark.parametrize("model", [EngineConfig, KernelConfig, PrefillParams, DecodeParams])
def test_dataclass_docstrings_name_their_own_fields(model):
    # a docstring below a field documents that field, and none documents a non-field
    docs = config_docs.attribute_docs(model)
    assert set(docs) == set(field_names(model))
    assert all(d.strip() for d in docs.values())


def test_defaults_are_the_code_defaults(tables):
    rows = {r.path: r for t in tables for r in t.rows}
    assert rows["engine.prefill_chunk_tokens"].default == "`256`"
    assert rows["engine.model"].default == f"`{EngineConfig().model!r}`"
    assert rows["prefill.resource_tag"].default == "`'prefill_accel'`"
    assert rows["colocated.resource_tag"].default == "`None`"
    assert rows["ingress.max_in_flight"].default == f"`{IngressArgs().max_in_flight}`"
    assert rows["decode.scaling.scale_down_ratio"].default == "`0.6`"
    assert rows["colocated"].default == "`None`" and rows["engine"].default == ""
    assert rows["ingress.tool_call_parser"].type == "Literal['hermes'] | None"


def test_committed_file_is_current():
    committed = config_docs.DOC.read_text() if config_docs.DOC.exists() else ""
    assert committed == config_docs.render(), (
        f"docs/configuration.md is stale: regenerate it with `{config_docs.REGENERATE}` "
        "and commit the result")


def test_check_mode(tmp_path):
    doc = tmp_path / "configuration.md"
    assert config_docs.main(["--check"], path=doc) == 1  # missing
    assert config_docs.main([], path=doc) == 0
    assert config_docs.main(["--check"], path=doc) == 0
    doc.write_text(doc.read_text().replace("| `engine.model` |", "| `engine.modle` |"))
    assert config_docs.main(["--check"], path=doc) == 1


def test_intro_example_is_valid_app_args_and_links_exist():
    text = config_docs.render()
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S)[1])
    AppArgs.model_validate(example["applications"][0]["args"])
    for link in re.findall(r"\]\(\.\./([^)#]+)\)", text):
        assert (ROOT / link).is_file(), link
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        titles = [line[3:] for line in text.splitlines() if line.startswith("## ")]
        assert anchor in {config_docs.anchor(t) for t in titles}, anchor
