"""What the unit tests of the real replica classes share: the classes run without Ray."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.engine_core import EngineCore
from deployments import metrics, prefill_server, replica


class _NoMetric:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def stub_replicas(monkeypatch, model: torch.nn.Module | None = None) -> None:
    """Replica classes built in this process: a fixed node id, no-op metrics, and engines on
    the suite's thread setting (not the phase's), over ``model`` or, without one, the model
    each replica's config names."""
    import ray

    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: SimpleNamespace(get_node_id=lambda: "node"))
    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, cls, _NoMetric)
    threads = torch.get_num_threads()

    def engine(cfg):
        return EngineCore(dataclasses.replace(cfg, num_threads=threads), model=model)
    for module in (replica, prefill_server):  # the modules that build an EngineCore
        monkeypatch.setattr(module, "EngineCore", engine)


@pytest.fixture
def rayless_replicas(monkeypatch, tiny_model) -> None:
    """Replica classes built in this process, their engines on the tiny model."""
    stub_replicas(monkeypatch, tiny_model)
