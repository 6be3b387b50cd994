"""App args validate at deploy time; every serve config validates against Ray's schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.args import AppArgs
from deployments.builder import build_app

CONFIGS = sorted((Path(__file__).parents[3] / "serve_configs").glob("*.yaml"))


def _serve_configs() -> list[Path]:
    return [p for p in CONFIGS if "applications" in yaml.safe_load(p.read_text())]


def test_config_files_exist():
    names = {p.name for p in _serve_configs()}
    assert {"local.yaml", "gpu-cluster.yaml"} <= names


@pytest.mark.parametrize("path", _serve_configs(), ids=lambda p: p.name)
def test_serve_config_validates_against_ray_schema(path):
    config = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(config) if hasattr(
        ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(config)
    for app in schema.applications:
        assert app.import_path == "deployments.builder:build_app"
        args = AppArgs.model_validate(app.args)
        # the builder accepts the args and asks for the tags the config names
        built = build_app(app.args)
        assert built is not None
        for phase in (args.prefill, args.decode):
            assert phase.resource_tag or phase.accelerator_type


def test_local_config_one_thread_one_replica_per_phase():
    config = yaml.safe_load((CONFIGS[0].parent / "local.yaml").read_text())
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert args.prefill.resource_tag == "prefill_accel"
    assert args.decode.resource_tag == "decode_accel"
    for phase in (args.prefill, args.decode):
        assert phase.num_threads == 1 and phase.num_replicas == 1
    assert args.model == "smollm2-135m-instruct"
    assert config["http_options"]["host"] == "127.0.0.1"


def test_gpu_config_asks_for_different_accelerators():
    config = yaml.safe_load((CONFIGS[0].parent / "gpu-cluster.yaml").read_text())
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert args.prefill.accelerator_type and args.decode.accelerator_type
    assert args.prefill.accelerator_type != args.decode.accelerator_type
    opts = args.decode.deployment_options()
    assert opts["ray_actor_options"]["accelerator_type"] == args.decode.accelerator_type
    assert "autoscaling_config" in opts and "num_replicas" not in opts


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"prefill": {"num_cpus": -1}}, "prefill.num_cpus"),
        ({"decode": {"num_replicas": 0}}, "decode.num_replicas"),
        ({"dtype": "float8"}, "dtype"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"device": "tpu"}, "device"),
        ({"prefil": {}}, "prefil"),
    ],
)
def test_invalid_args_fail_naming_the_field(bad, field):
    with pytest.raises(ValidationError) as info:
        build_app(bad)
    assert field.split(".")[-1] in str(info.value)


def test_phase_options_map_to_ray_options():
    args = AppArgs.model_validate({
        "prefill": {"resource_tag": "p", "num_replicas": 3, "num_cpus": 2},
        "decode": {"resource_tag": "d", "autoscaling_config": {"min_replicas": 1,
                                                               "max_replicas": 4}},
    })
    p = args.prefill.deployment_options()
    assert p["num_replicas"] == 3
    assert p["ray_actor_options"] == {"num_cpus": 2, "resources": {"p": 1.0}}
    d = args.decode.deployment_options()
    assert d["autoscaling_config"]["max_replicas"] == 4
    assert args.engine_config("prefill").num_threads == 1


def test_gpu_args_per_phase_device_map():
    args = AppArgs.model_validate({
        "device": "cuda", "dtype": "bfloat16",
        "prefill": {"resource_tag": "p", "num_gpus": 1},
        "decode": {"resource_tag": "d", "num_gpus": 4},
    })
    assert args.engine_config("prefill").device_map is None  # one GPU: no spreading
    decode = args.engine_config("decode")
    assert (decode.device, decode.device_map, decode.num_gpus) == ("cuda", "auto", 4)
    assert args.decode.ray_actor_options()["num_gpus"] == 4  # Ray gives it all four
    assert AppArgs.model_validate({
        "device": "cuda", "device_map": "balanced", "prefill": {"num_gpus": 0.5},
        "decode": {"num_gpus": 2}}).engine_config("decode").device_map == "balanced"
    # on the cpu num_gpus spreads nothing
    assert AppArgs.model_validate({"decode": {"num_gpus": 2}}).engine_config(
        "decode").device_map is None


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"device": "cuda", "prefill": {"num_gpus": 1}}, "decode: device 'cuda' needs num_gpus"),
        ({"device": "cuda", "decode": {"num_gpus": 1}}, "prefill: device 'cuda' needs num_gpus"),
        ({"decode": {"num_gpus": 1.5}}, "whole number"),
        ({"device": "cuda:1", "prefill": {"num_gpus": 2}, "decode": {"num_gpus": 1}},
         "needs device 'cuda' \\(no index\\)"),
        ({"device_map": "everywhere"}, "device_map"),
    ],
)
def test_gpu_args_refused_at_deploy_time(bad, match):
    with pytest.raises(ValidationError, match=match):
        AppArgs.model_validate(bad)
