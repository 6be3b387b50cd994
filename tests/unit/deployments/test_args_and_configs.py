"""App args validate at deploy time and derive every setting from its one home; every serve
config validates against Ray's schema."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from app.config import EngineConfig
from deployments.args import DEFAULT_KV_FRACTION, AppArgs, PhaseArgs
from deployments.builder import build_app

CONFIGS = Path(__file__).parents[3] / "serve_configs"


def _serve_configs() -> list[Path]:
    return [p for p in sorted(CONFIGS.glob("*.yaml"))
            if "applications" in yaml.safe_load(p.read_text())]


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


def test_config_files_exist():
    names = {p.name for p in _serve_configs()}
    assert {"local.yaml", "local-colocated.yaml", "gpu-cluster.yaml"} <= names


@pytest.mark.parametrize("path", _serve_configs(), ids=lambda p: p.name)
def test_serve_config_validates_against_ray_schema(path, monkeypatch):
    # the configs, not this machine's cluster: no placement check against a Ray that an
    # earlier test of the session may have left connected (it has no GPU nodes)
    monkeypatch.setattr("deployments.builder.ray.is_initialized", lambda: False)
    config = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(config)
    for app in schema.applications:
        assert app.import_path == "deployments.builder:build_app"
        args = AppArgs.model_validate(app.args)
        assert build_app(app.args) is not None
        for phase in args.phases:
            placement = args.phase(phase)
            assert placement.resource_tag or placement.accelerator_type or args.is_colocated


def test_local_config_one_thread_one_replica_per_phase():
    args = _args("local.yaml")
    assert args.prefill.resource_tag == "prefill_accel"
    assert args.decode.resource_tag == "decode_accel"
    for phase in ("prefill", "decode"):
        opts = args.deployment_options(phase)
        assert opts["num_replicas"] == 1 and opts["ray_actor_options"]["num_cpus"] == 1
        assert args.engine_config(phase).num_threads == 1
    # the decode step's thread above the serving stack's; prefill at the process's priority
    assert args.engine_config("decode").nice == -10
    assert args.engine_config("prefill").nice is None
    assert args.model_name == "smollm2-135m-instruct"
    config = yaml.safe_load((CONFIGS / "local.yaml").read_text())
    assert config["http_options"]["host"] == "127.0.0.1"


def test_engine_settings_have_one_home():
    """Every engine default is EngineConfig's own; a phase changes only threads, nice and
    GPUs."""
    args = AppArgs.model_validate({"engine": {"max_batch_size": 4}})
    assert args.engine == dataclasses.replace(EngineConfig(), max_batch_size=4)
    prefill = args.engine_config("prefill")
    assert dataclasses.replace(prefill, num_threads=None) == args.engine
    assert prefill.num_threads == 1
    with pytest.raises(ValidationError, match="set per phase"):
        AppArgs.model_validate({"engine": {"num_threads": 2}})
    with pytest.raises(ValidationError, match="set per phase"):
        AppArgs.model_validate({"engine": {"num_gpus": 2}})
    with pytest.raises(ValidationError, match="set per phase"):
        AppArgs.model_validate({"engine": {"nice": -5}})


def test_a_phases_nice_reaches_its_engine_only():
    args = AppArgs.model_validate({"decode": {"nice": -10}})
    assert args.engine_config("decode").nice == -10
    assert args.engine_config("prefill").nice is None
    with pytest.raises(ValidationError, match="nice"):
        AppArgs.model_validate({"decode": {"nice": -21}})


def test_phase_options_are_serve_options_over_the_defaults():
    args = AppArgs.model_validate({
        "prefill": {"resource_tag": "p", "deployment_config": {
            "num_replicas": 3, "ray_actor_options": {"num_cpus": 2}}},
        "decode": {"resource_tag": "d", "deployment_config": {
            "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}},
    })
    p = args.deployment_options("prefill")
    assert p["num_replicas"] == 3
    assert p["ray_actor_options"] == {"num_cpus": 2, "resources": {"p": 1.0}}
    assert p["max_ongoing_requests"] == PhaseArgs.DEFAULTS["max_ongoing_requests"]
    d = args.deployment_options("decode")
    assert d["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in d
    # an ingress keeps its own defaults
    ingress = args.ingress.deployment_options()
    assert ingress["max_ongoing_requests"] == 1024 and ingress["num_replicas"] == 1


def test_decode_policy_targets_default_to_the_engine_limits():
    args = AppArgs.model_validate({
        "engine": {"max_batch_size": 8, "max_kv_tokens": 4096},
        "decode": {"deployment_config": {"autoscaling_config": {"max_replicas": 2}}}})
    kwargs = args.deployment_options("decode")["autoscaling_config"]["policy"]["policy_kwargs"]
    assert kwargs["sequences_per_replica"] == 8
    assert kwargs["kv_tokens_per_replica"] == 4096 * DEFAULT_KV_FRACTION


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"prefill": {"deployment_config": {"ray_actor_options": {"num_cpus": -1}}}},
         "num_cpus"),
        ({"decode": {"deployment_config": {"num_replicas": 0}}}, "num_replicas"),
        ({"decode": {"deployment_config": {"num_replicaz": 2}}}, "num_replicaz"),
        ({"prefill": {"deployment_config": {"num_replicas": 2,
                                            "autoscaling_config": {"max_replicas": 2}}}},
         "num_replicas"),
        ({"engine": {"dtype": "float8"}}, "dtype"),
        ({"engine": {"max_batch_size": 0}}, "max_batch_size"),
        ({"engine": {"device": "tpu"}}, "device"),
        ({"engine": {"frobnicate": 1}}, "frobnicate"),
        ({"prefil": {}}, "prefil"),
        ({"max_batch_size": 4}, "max_batch_size"),  # engine settings live under engine:
        ({"prefill": {"scaling": {"mode": "requests"}}}, "mode"),
        ({"decode": {"scaling": {"sequences_per_replica": 0}}}, "sequences_per_replica"),
    ],
)
def test_invalid_args_fail_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as info:
        build_app(bad)
    assert field in str(info.value)


def test_gpu_config_asks_for_different_accelerators():
    args = _args("gpu-cluster.yaml")
    assert args.prefill.accelerator_type and args.decode.accelerator_type
    assert args.prefill.accelerator_type != args.decode.accelerator_type
    opts = args.deployment_options("decode")
    assert opts["ray_actor_options"]["accelerator_type"] == args.decode.accelerator_type
    assert "resources" not in opts["ray_actor_options"]  # placed by accelerator alone
    assert "autoscaling_config" in opts and "num_replicas" not in opts


def _gpus(n: float) -> dict:
    return {"deployment_config": {"ray_actor_options": {"num_gpus": n}}}


def test_gpu_args_per_phase_device_map():
    args = AppArgs.model_validate({
        "engine": {"device": "cuda", "dtype": "bfloat16"},
        "prefill": _gpus(1), "decode": _gpus(4)})
    assert args.engine_config("prefill").device_map is None  # one GPU: no spreading
    decode = args.engine_config("decode")
    assert (decode.device, decode.device_map, decode.num_gpus) == ("cuda", "auto", 4)
    assert args.deployment_options("decode")["ray_actor_options"]["num_gpus"] == 4
    assert AppArgs.model_validate({
        "engine": {"device": "cuda", "device_map": "balanced"}, "prefill": _gpus(0.5),
        "decode": _gpus(2)}).engine_config("decode").device_map == "balanced"
    # on the cpu num_gpus spreads nothing
    assert AppArgs.model_validate({"decode": _gpus(2)}).engine_config(
        "decode").device_map is None


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"engine": {"device": "cuda"}, "prefill": _gpus(1)}, "decode: device 'cuda' needs"),
        ({"engine": {"device": "cuda"}, "decode": _gpus(1)}, "prefill: device 'cuda' needs"),
        ({"decode": _gpus(1.5)}, "whole number"),
        ({"engine": {"device": "cuda:1"}, "prefill": _gpus(2), "decode": _gpus(1)},
         "needs device 'cuda' \\(no index\\)"),
        ({"engine": {"device_map": "everywhere"}}, "device_map"),
    ],
)
def test_gpu_args_refused_at_deploy_time(bad, match):
    with pytest.raises(ValidationError, match=match):
        AppArgs.model_validate(bad)


# ---- the colocated baseline ---------------------------------------------------------------


def test_local_colocated_differs_from_local_only_in_the_split():
    split, colo = _args("local.yaml"), _args("local-colocated.yaml")
    assert not split.is_colocated and colo.is_colocated and colo.phases == ("colocated",)
    engine_split, engine_colo = split.engine_config("decode"), colo.engine_config("colocated")
    # same model and limits; only the thread count differs (one replica has both threads,
    # where the split's prefill passes take the decode replica's core while it is idle), and
    # the split's passes take two chats at a time (prefill_batch_tokens; the colocated app
    # served 30% fewer chat tokens with 64, BENCHMARKS.md section 7, so it keeps passes
    # up to the chunk), and the split's prefill replica runs two passes at once
    # (prefill_lanes; the colocated engine's chunks ride in its decode steps instead); the
    # split's decode thread runs at nice -10 (the colocated app's at its own: a higher
    # priority for both of its threads served W-long no faster and answered first later)
    assert engine_split.prefill_batch_tokens == 128 and engine_colo.prefill_batch_tokens is None
    assert engine_split.prefill_lanes == 2 and engine_colo.prefill_lanes == 1
    assert engine_split.nice == -10 and engine_colo.nice is None
    assert dataclasses.replace(engine_colo, num_threads=1, prefill_max_threads=2,
                               prefill_batch_tokens=128, prefill_lanes=2,
                               nice=-10) == engine_split
    assert split.engine_config("prefill").prefill_max_threads == 2
    assert colo.prefill_batch_wait_s == split.prefill_batch_wait_s
    # same total cores: one replica with 2 CPUs / 2 threads vs prefill 1 + decode 1
    colo_opts = colo.deployment_options("colocated")
    assert colo_opts["num_replicas"] == 1
    cpus = [split.deployment_options(p)["ray_actor_options"]["num_cpus"]
            for p in ("prefill", "decode")]
    assert colo_opts["ray_actor_options"]["num_cpus"] == sum(cpus) == 2
    assert engine_colo.num_threads == 2


def test_colocated_switch_builds_ingress_over_one_server():
    app = build_app({"colocated": {"num_threads": 2, "deployment_config": {
        "ray_actor_options": {"num_cpus": 2}}}})
    deps = _deployments(app)
    assert set(deps) == {"Ingress", "ColocatedServer"}
    ingress = app._bound_deployment
    assert ingress.init_args[0] is None  # no prefill deployment
    assert ingress.init_args[2]["colocated"]["num_threads"] == 2
    assert deps["ColocatedServer"].ray_actor_options["num_cpus"] == 2
    split = _deployments(build_app({}))
    assert set(split) == {"Ingress", "PrefillServer", "DecodeServer"}


@pytest.mark.parametrize(("bad", "field"), [
    ({"colocated": {"num_threads": 0}}, "num_threads"),
    ({"colocated": {"deployment_config": {"ray_actor_options": {"num_cpus": -1}}}},
     "num_cpus"),
    ({"mode": "colocated"}, "mode"),
])
def test_invalid_colocated_args_fail_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as info:
        build_app(bad)
    assert field in str(info.value)


def test_the_kernel_switches_are_one_setting_and_their_old_names_say_where_they_went():
    args = AppArgs(engine={"kernels": {"linear": "onednn", "fused_layers": False}})
    kernels = args.engine_config("prefill").kernels
    assert (kernels.linear, kernels.attention, kernels.fused_layers) == ("onednn", True, False)
    with pytest.raises(ValidationError, match=r"engine\.fused_decode moved to "
                                              r"engine\.kernels\.fused_decode"):
        AppArgs(engine={"fused_decode": False})
    with pytest.raises(ValidationError, match=r"engine\.pack_weights moved"):
        AppArgs(engine={"pack_weights": False, "max_batch_size": 4})
    with pytest.raises(ValidationError, match=r"kernels\.linear must be one of"):
        AppArgs(engine={"kernels": {"linear": "fast"}})
    with pytest.raises(ValidationError):
        AppArgs(engine={"kernels": {"fused": True}})  # no such part
