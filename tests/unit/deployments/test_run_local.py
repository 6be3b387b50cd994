"""``make run``'s direct ingress option: the head it starts gets Serve's direct-ingress
environment, a cluster it did not start is refused, and the banner names the direct port."""

from __future__ import annotations

from pathlib import Path

import pytest

from deployments import run_local

CONFIG = str(Path(run_local.ROOT) / "serve_configs" / "local.yaml")


def test_direct_ingress_env_names_serves_flag_and_port_range():
    env = run_local.direct_ingress_env(30000)
    assert env == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
                   "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30000",
                   "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "30015"}


@pytest.mark.parametrize("port", [-1, 0, 65535])
def test_direct_ingress_env_refuses_a_port_out_of_range(port):
    with pytest.raises(ValueError, match="direct ingress port"):
        run_local.direct_ingress_env(port)


def test_the_constants_it_sets_are_the_ones_serve_reads(monkeypatch):
    """Serve reads these names at import: a rename in Ray would leave the option inert."""
    import importlib

    import ray.serve._private.constants as constants

    for name, value in run_local.direct_ingress_env(30000).items():
        monkeypatch.setenv(name, value)
    try:
        reloaded = importlib.reload(constants)
        assert reloaded.RAY_SERVE_ENABLE_DIRECT_INGRESS is True
        assert reloaded.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT == 30000
        assert reloaded.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT == 30015
    finally:
        monkeypatch.undo()
        importlib.reload(constants)


class _Exited:
    """A ``serve run`` that ended at once (so main returns without waiting for /health)."""

    def __init__(self, *args, **kwargs):
        pass

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


def test_a_running_cluster_is_refused_with_direct_ingress(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(run_local, "_cluster_reachable", lambda: True)
    monkeypatch.setattr(run_local.subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(run_local.subprocess, "Popen", lambda *a, **k: calls.append(a))
    assert run_local.main(["--config", CONFIG, "--direct-ingress-port", "30000"]) == 2
    assert calls == []  # neither a head started nor the app deployed
    assert "ray stop" in capsys.readouterr().err


@pytest.mark.parametrize("port", [0, 30000])
def test_the_head_it_starts_gets_the_environment(monkeypatch, port):
    runs = []
    monkeypatch.setattr(run_local, "_cluster_reachable", lambda: False)
    monkeypatch.setattr(run_local, "_dashboard_flags", lambda host, p: [])
    monkeypatch.setattr(run_local.subprocess, "run",
                        lambda cmd, **kw: runs.append((cmd, kw.get("env"))))
    monkeypatch.setattr(run_local.subprocess, "Popen", _Exited)
    assert run_local.main(["--config", CONFIG, "--direct-ingress-port", str(port)]) == 0
    (start, env), (stop, _) = runs
    assert start[1:3] == ["start", "--head"] and stop[1:] == ["stop"]
    if port:
        assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
        assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "30000"
    else:
        assert env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") in (None, "0")


def test_the_banner_names_the_direct_port(monkeypatch, capsys):
    monkeypatch.setattr(run_local, "_cluster_reachable", lambda: False)
    monkeypatch.setattr(run_local, "_dashboard_flags", lambda host, p: [])
    monkeypatch.setattr(run_local.subprocess, "run", lambda cmd, **kw: None)
    monkeypatch.setattr(run_local.subprocess, "Popen", _Exited)
    monkeypatch.setattr(run_local, "_wait_ready", lambda url, proc, timeout: True)
    assert run_local.main(["--config", CONFIG, "--direct-ingress-port", "30000"]) == 0
    out = capsys.readouterr().out
    assert "ready at http://127.0.0.1:30000" in out
