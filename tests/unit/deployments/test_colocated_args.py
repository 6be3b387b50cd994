"""The colocated baseline's args and config: one deployment, same engine and limits, same
total cores as the split app."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.args import AppArgs
from deployments.builder import build_app, build_colocated_app

CONFIGS = Path(__file__).parents[3] / "serve_configs"


def _args(name: str) -> AppArgs:
    config = yaml.safe_load((CONFIGS / name).read_text())
    return AppArgs.model_validate(config["applications"][0]["args"])


def _deployments(app) -> dict[str, object]:
    """Deployment name -> bound deployment, walking the ingress's bound arguments."""
    root = app._bound_deployment
    found = {root.name: root}
    for arg in root.init_args:
        bound = getattr(arg, "_bound_deployment", None)  # a bound child Application
        if bound is not None:
            found[bound.name] = bound
    return found


def test_local_colocated_differs_from_local_only_in_the_split():
    split, colo = _args("local.yaml"), _args("local-colocated.yaml")
    assert split.mode == "split" and colo.mode == "colocated"
    engine_split = split.engine_config("decode")
    engine_colo = colo.engine_config("colocated")
    # same model and limits; only the thread count differs (one replica has both threads)
    for field in ("model", "dtype", "kv_dtype", "max_model_len", "max_batch_size",
                  "max_kv_tokens", "max_waiting", "prefill_token_budget",
                  "prefill_max_batch_size"):
        assert getattr(engine_colo, field) == getattr(engine_split, field), field
    assert colo.prefill_batch_wait_s == split.prefill_batch_wait_s
    # same total cores: one replica with 2 CPUs / 2 threads vs prefill 1 + decode 1
    assert colo.colocated.num_replicas == 1
    assert colo.colocated.num_cpus == split.prefill.num_cpus + split.decode.num_cpus == 2
    assert engine_colo.num_threads == (split.prefill.num_threads
                                       + split.decode.num_threads) == 2


def test_colocated_mode_builds_ingress_over_one_server():
    app = build_app({"mode": "colocated", "colocated": {"num_cpus": 2, "num_threads": 2}})
    deps = _deployments(app)
    assert set(deps) == {"Ingress", "ColocatedServer"}
    ingress = app._bound_deployment
    assert ingress.init_args[0] is None  # no prefill deployment
    assert ingress.init_args[2]["mode"] == "colocated"
    assert deps["ColocatedServer"].ray_actor_options["num_cpus"] == 2
    split = _deployments(build_app({}))
    assert set(split) == {"Ingress", "PrefillServer", "DecodeServer"}
    # the convenience builder forces the mode and keeps the other args
    forced = build_colocated_app({"max_batch_size": 4})
    assert set(_deployments(forced)) == {"Ingress", "ColocatedServer"}
    assert forced._bound_deployment.init_args[2]["max_batch_size"] == 4


@pytest.mark.parametrize(("bad", "field"), [
    ({"mode": "colocated", "colocated": {"num_threads": 0}}, "num_threads"),
    ({"mode": "fused"}, "mode"),
    ({"mode": "colocated", "colocated": {"num_cpus": -1}}, "num_cpus"),
])
def test_invalid_colocated_args_fail_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as info:
        build_app(bad)
    assert field in str(info.value)
