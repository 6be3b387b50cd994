"""What the unit tests of the real replica classes share: the classes run without Ray."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.engine_core import EngineCore
from deployments import metrics, replica


class _NoMetric:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def stub_ray_and_metrics(monkeypatch) -> None:
    """A fixed node id and no-op metrics, for replica classes built in this process."""
    import ray

    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: SimpleNamespace(get_node_id=lambda: "node"))
    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(metrics, cls, _NoMetric)


@pytest.fixture
def rayless_replicas(monkeypatch, tiny_model) -> None:
    """Replica classes built in this process: a fixed node id, no-op metrics, and an engine
    on the tiny model with the suite's thread setting (not the phase's)."""
    stub_ray_and_metrics(monkeypatch)
    threads = torch.get_num_threads()
    monkeypatch.setattr(replica, "EngineCore", lambda cfg: EngineCore(
        dataclasses.replace(cfg, num_threads=threads), model=tiny_model))
