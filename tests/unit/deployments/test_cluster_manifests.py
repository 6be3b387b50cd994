"""The cluster manifests: KubeRay RayService and Anyscale service.

Both parse; the Serve config inside validates against Ray's schema and builds; every resource
a deployment's replica asks for (its phase tag, GPUs, CPUs) is offered together by some node
group, with enough nodes for the deployment's most replicas; the images hold the code.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve import Application
from ray.serve.schema import ServeDeploySchema

from deployments.args import AppArgs

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).parents[3]
CONFIGS = ROOT / "serve_configs"


@dataclass(frozen=True)
class NodeGroup:
    name: str
    max_nodes: int
    offers: dict[str, float]  # Ray resources of one node: CPU, GPU, custom tags


def _kuberay() -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())


def _anyscale() -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / "anyscale-service.yaml").read_text())


def _kuberay_serve_config() -> dict[str, Any]:
    return yaml.safe_load(_kuberay()["spec"]["serveConfigV2"])


def _quantity(value: Any) -> float:
    """A Kubernetes quantity for CPU/GPU counts: 8, "8", "8000m"."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _ray_start_resources(params: dict[str, str]) -> dict[str, float]:
    """rayStartParams.resources: a JSON object, quoted for the shell as KubeRay expects."""
    raw = params.get("resources")
    if raw is None:
        return {}
    text = raw.strip()
    if text.startswith('"') and text.endswith('"'):
        text = text[1:-1].replace('\\"', '"')
    return {k: float(v) for k, v in json.loads(text).items()}


def _kuberay_group(name: str, max_nodes: int, spec: dict[str, Any]) -> NodeGroup:
    params = spec["rayStartParams"]
    [container] = spec["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    offers = {
        "CPU": _quantity(params.get("num-cpus", limits["cpu"])),
        "GPU": _quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
        **_ray_start_resources(params),
    }
    return NodeGroup(name, max_nodes, offers)


def _kuberay_groups() -> tuple[NodeGroup, list[NodeGroup]]:
    cluster = _kuberay()["spec"]["rayClusterConfig"]
    head = _kuberay_group("head", 1, cluster["headGroupSpec"])
    workers = [_kuberay_group(g["groupName"], g["maxReplicas"], g)
               for g in cluster["workerGroupSpecs"]]
    return head, workers


def _anyscale_groups() -> tuple[NodeGroup, list[NodeGroup]]:
    compute = _anyscale()["compute_config"]
    head = NodeGroup("head", 1, {k: float(v) for k, v in compute["head_node"]["resources"].items()})
    workers = [NodeGroup(g["name"], g["max_nodes"], {k: float(v) for k, v in
                                                     g["resources"].items()})
               for g in compute["worker_nodes"]]
    return head, workers


def _replica_needs(actor_options: dict[str, Any]) -> dict[str, float]:
    needs = {"CPU": float(actor_options.get("num_cpus", 1)),
             "GPU": float(actor_options.get("num_gpus", 0))}
    needs.update({k: float(v) for k, v in actor_options.get("resources", {}).items()})
    return {k: v for k, v in needs.items() if v > 0}


def _replicas_per_node(needs: dict[str, float], offers: dict[str, float]) -> int:
    return min(math.floor(offers.get(name, 0.0) / amount + 1e-9)
               for name, amount in needs.items())


def _capacity(needs: dict[str, float], groups: list[NodeGroup]) -> int:
    """The most replicas with these needs that the groups hold at their largest."""
    return sum(g.max_nodes * _replicas_per_node(needs, g.offers) for g in groups)


def _deployments(args: AppArgs) -> dict[str, tuple[dict[str, float], int]]:
    """Per deployment: one replica's resource needs and its most replicas."""
    out = {}
    for phase in ("prefill", "decode"):
        opts = args.deployment_options(phase)
        most = (opts["autoscaling_config"]["max_replicas"] if "autoscaling_config" in opts
                else opts["num_replicas"])
        out[phase] = (_replica_needs(opts["ray_actor_options"]), most)
    ingress = args.ingress.deployment_options()
    out["ingress"] = (_replica_needs(ingress["ray_actor_options"]), ingress["num_replicas"])
    return out


MANIFESTS = {
    "kuberay": (lambda: _kuberay_serve_config()["applications"], _kuberay_groups),
    "anyscale": (lambda: _anyscale()["applications"], _anyscale_groups),
}


def test_manifests_parse_as_what_they_claim():
    service = _kuberay()
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert isinstance(service["spec"]["serveConfigV2"], str)  # KubeRay takes it as text
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]

    anyscale = _anyscale()
    assert anyscale["name"] and anyscale["applications"]
    assert ("image_uri" in anyscale) != ("containerfile" in anyscale)  # exactly one
    for group in anyscale["compute_config"]["worker_nodes"]:
        assert 0 <= group["min_nodes"] <= group["max_nodes"]


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_serve_config_validates_and_builds(manifest):
    applications = MANIFESTS[manifest][0]()
    schema = ServeDeploySchema.model_validate({"applications": applications})
    [app] = schema.applications
    module_name, attr = app.import_path.split(":")
    builder = getattr(importlib.import_module(module_name), attr)
    assert isinstance(builder(app.args), Application)
    args = AppArgs.model_validate(app.args)
    eng = args.engine
    assert (eng.device, eng.dtype, eng.kv_dtype) == ("cuda", "bfloat16", "bfloat16")
    for phase in ("prefill", "decode"):
        assert "autoscaling_config" in args.deployment_options(phase)  # each phase scales


def test_both_manifests_run_the_same_app():
    [kuberay_app] = _kuberay_serve_config()["applications"]
    [anyscale_app] = _anyscale()["applications"]
    assert kuberay_app == anyscale_app


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_every_deployment_fits_its_node_groups_at_max_replicas(manifest):
    [app] = MANIFESTS[manifest][0]()
    head, workers = MANIFESTS[manifest][1]()
    deployments = _deployments(AppArgs.model_validate(app["args"]))
    for name, (needs, most) in deployments.items():
        assert any(k not in ("CPU", "GPU") for k in needs), f"{name} asks for no resource tag"
        groups = [head] if name == "ingress" else workers
        capacity = _capacity(needs, groups)
        assert capacity >= most, (
            f"{manifest}: {name} may scale to {most} replicas of {needs}, node groups hold "
            f"{capacity}")
    # the phases cannot land on the head, and the head has no accelerator
    assert head.offers.get("GPU", 0) == 0
    for phase in ("prefill", "decode"):
        assert _replicas_per_node(deployments[phase][0], head.offers) == 0


def test_capacity_check_catches_a_short_group():
    """The check above fails when a group is too small, misses the tag or the GPUs."""
    needs = {"CPU": 8.0, "GPU": 2.0, "decode_accel": 1.0}
    ok = NodeGroup("d", 6, {"CPU": 10, "GPU": 2, "decode_accel": 1})
    assert _capacity(needs, [ok]) == 6
    assert _capacity(needs, [NodeGroup("d", 5, ok.offers)]) == 5
    assert _capacity(needs, [NodeGroup("d", 6, {"CPU": 10, "GPU": 1, "decode_accel": 1})]) == 0
    assert _capacity(needs, [NodeGroup("d", 6, {"CPU": 10, "GPU": 2})]) == 0
    assert _capacity(needs, [NodeGroup("d", 2, {"CPU": 32, "GPU": 8, "decode_accel": 4})]) == 8
    assert _ray_start_resources({"resources": '"{\\"x\\": 2}"'}) == {"x": 2.0}


def test_kuberay_phases_run_on_different_gpu_kinds_with_shared_memory():
    cluster = _kuberay()["spec"]["rayClusterConfig"]
    _, workers = _kuberay_groups()
    kinds = {}
    for group, parsed in zip(cluster["workerGroupSpecs"], workers, strict=True):
        pod = group["template"]["spec"]
        tags = {k for k in parsed.offers if k not in ("CPU", "GPU")}
        [tag] = tags  # each group offers one phase
        kinds[tag] = pod["nodeSelector"]["nvidia.com/gpu.product"]
        [container] = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == parsed.offers["GPU"]
    assert set(kinds) == {"prefill_accel", "decode_accel"}
    assert kinds["prefill_accel"] != kinds["decode_accel"]
    # the KV hop goes through the object store in /dev/shm: every pod needs a real one
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        volumes = {v["name"]: v for v in pod["volumes"]}
        [container] = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


def test_decode_spreads_over_its_gpus_and_prefill_does_not():
    [app] = _kuberay_serve_config()["applications"]
    args = AppArgs.model_validate(app["args"])
    decode, prefill = args.engine_config("decode"), args.engine_config("prefill")
    assert (decode.device_map, decode.num_gpus) == (args.engine.device_map, 2)
    assert (prefill.device_map, prefill.num_gpus) == (None, 1)


def test_images_carry_the_code_and_its_dependencies():
    # Anyscale builds the same image as KubeRay: from the Containerfile, nothing added
    anyscale = _anyscale()
    assert anyscale["containerfile"] == "serve_configs/Containerfile"
    assert not {"image_uri", "requirements", "working_dir"} & set(anyscale)
    # the image: Ray's, the project installed with every package it ships and its deps
    containerfile = (CONFIGS / "Containerfile").read_text()
    assert "pip install --no-cache-dir ." in containerfile  # pyproject's dependencies
    copied = set(re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)", containerfile, flags=re.M))
    packages = {p.rstrip("*") for p in
                tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                ["packages"]["find"]["include"]}
    assert packages <= copied and "pyproject.toml" in copied
    for source in copied:
        assert (ROOT / source).exists(), f"Containerfile copies missing {source}"
    ray_version = _kuberay()["spec"]["rayClusterConfig"]["rayVersion"]
    assert f"rayproject/ray:{ray_version}-" in containerfile
    import ray

    assert ray_version == ray.__version__  # the image runs the Ray the app is tested with
