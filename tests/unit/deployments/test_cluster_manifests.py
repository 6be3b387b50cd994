"""The cluster manifests: KubeRay RayService and Anyscale service.

Both parse; the Serve config inside validates against Ray's schema and builds; every resource
a deployment's replica asks for (its phase tag, GPUs, CPUs) is offered together by some node
group, with enough nodes for the deployment's most replicas; the images hold the code. And
no single machine takes the service down (issue 16): the head runs no replica, the GCS
survives the head (KubeRay: external Redis, password from a Secret), every node with a
replica runs a proxy, and the ingress runs at least two replicas on different nodes.
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
from ray.serve.config import ProxyLocation
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
    min_nodes: int = 0


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


def _kuberay_group(name: str, max_nodes: int, spec: dict[str, Any],
                   min_nodes: int = 0) -> NodeGroup:
    params = spec["rayStartParams"]
    [container] = spec["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    offers = {
        "CPU": _quantity(params.get("num-cpus", limits["cpu"])),
        "GPU": _quantity(params.get("num-gpus", limits.get("nvidia.com/gpu", 0))),
        **_ray_start_resources(params),
    }
    return NodeGroup(name, max_nodes, offers, min_nodes)


def _kuberay_groups() -> tuple[NodeGroup, list[NodeGroup]]:
    cluster = _kuberay()["spec"]["rayClusterConfig"]
    head = _kuberay_group("head", 1, cluster["headGroupSpec"], 1)
    workers = [_kuberay_group(g["groupName"], g["maxReplicas"], g, g["minReplicas"])
               for g in cluster["workerGroupSpecs"]]
    return head, workers


def _anyscale_groups() -> tuple[NodeGroup, list[NodeGroup]]:
    compute = _anyscale()["compute_config"]
    head = NodeGroup("head", 1, {k: float(v) for k, v in
                                 compute["head_node"]["resources"].items()}, 1)
    workers = [NodeGroup(g["name"], g["max_nodes"],
                         {k: float(v) for k, v in g["resources"].items()}, g["min_nodes"])
               for g in compute["worker_nodes"]]
    return head, workers


def _replica_needs(actor_options: dict[str, Any]) -> dict[str, float]:
    needs = {"CPU": float(actor_options.get("num_cpus", 1)),
             "GPU": float(actor_options.get("num_gpus", 0))}
    needs.update({k: float(v) for k, v in actor_options.get("resources", {}).items()})
    return {k: v for k, v in needs.items() if v > 0}


def _replicas_per_node(needs: dict[str, float], offers: dict[str, float],
                       per_node: int | None = None) -> int:
    """Replicas one node holds; ``per_node``: the deployment's max_replicas_per_node."""
    fit = min(math.floor(offers.get(name, 0.0) / amount + 1e-9)
              for name, amount in needs.items())
    return fit if per_node is None else min(fit, per_node)


def _capacity(needs: dict[str, float], groups: list[NodeGroup], per_node: int | None = None,
              nodes: str = "max_nodes") -> int:
    """The most replicas with these needs that the groups hold at their largest (or, with
    nodes="min_nodes", at their smallest: without waiting for a new node)."""
    return sum(getattr(g, nodes) * _replicas_per_node(needs, g.offers, per_node)
               for g in groups)


@dataclass(frozen=True)
class Deployment:
    needs: dict[str, float]  # one replica's resources
    most: int  # its most replicas
    per_node: int | None  # max_replicas_per_node


def _deployments(args: AppArgs) -> dict[str, Deployment]:
    out = {}
    for phase in ("prefill", "decode"):
        opts = args.deployment_options(phase)
        most = (opts["autoscaling_config"]["max_replicas"] if "autoscaling_config" in opts
                else opts["num_replicas"])
        out[phase] = Deployment(_replica_needs(opts["ray_actor_options"]), most,
                                opts.get("max_replicas_per_node"))
    ingress = args.ingress.deployment_options()
    out["ingress"] = Deployment(_replica_needs(ingress["ray_actor_options"]),
                                ingress["num_replicas"], ingress.get("max_replicas_per_node"))
    return out


def _manifest_deployments(manifest: str) -> dict[str, Deployment]:
    [app] = MANIFESTS[manifest][0]()
    return _deployments(AppArgs.model_validate(app["args"]))


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
    _, workers = MANIFESTS[manifest][1]()
    for name, d in _manifest_deployments(manifest).items():
        assert any(k not in ("CPU", "GPU") for k in d.needs), f"{name} asks for no resource tag"
        capacity = _capacity(d.needs, workers, d.per_node)
        assert capacity >= d.most, (
            f"{manifest}: {name} may scale to {d.most} replicas of {d.needs}, node groups "
            f"hold {capacity}")


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_head_holds_no_replica(manifest):
    """Losing the head loses no replica: it offers no CPU, GPU or tag a replica asks for."""
    head, _ = MANIFESTS[manifest][1]()
    assert head.offers.get("CPU") == 0 and head.offers.get("GPU", 0) == 0
    assert set(head.offers) <= {"CPU", "GPU"}, f"{manifest}: head offers {head.offers}"
    for name, d in _manifest_deployments(manifest).items():
        assert _replicas_per_node(d.needs, head.offers) == 0, f"{manifest}: {name} fits the head"


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_ingress_runs_spread_on_workers(manifest):
    """Two or more ingress replicas, at most one per node, all running from the start on the
    smallest cluster (min nodes), on worker groups only."""
    head, workers = MANIFESTS[manifest][1]()
    ingress = _manifest_deployments(manifest)["ingress"]
    assert ingress.most >= 2 and ingress.per_node == 1
    hosts = [g for g in workers if _replicas_per_node(ingress.needs, g.offers)]
    assert hosts, f"{manifest}: no worker group offers {ingress.needs}"
    assert _capacity(ingress.needs, hosts, 1, nodes="min_nodes") >= ingress.most
    assert _replicas_per_node(ingress.needs, head.offers) == 0


def test_kuberay_ingress_pods_on_different_machines():
    """Ray's one-per-node is one per pod; Kubernetes must keep the pods on different machines."""
    cluster = _kuberay()["spec"]["rayClusterConfig"]
    ingress = _manifest_deployments("kuberay")["ingress"]
    _, workers = _kuberay_groups()
    hosting = [spec for spec, g in zip(cluster["workerGroupSpecs"], workers, strict=True)
               if _replicas_per_node(ingress.needs, g.offers)]
    assert hosting
    for spec in hosting:
        terms = (spec["template"]["spec"]["affinity"]["podAntiAffinity"]
                 ["requiredDuringSchedulingIgnoredDuringExecution"])
        assert {"labelSelector": {"matchLabels": {"ray.io/group": spec["groupName"]}},
                "topologyKey": "kubernetes.io/hostname"} in terms


def _all_keys_and_values(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in [k, *_all_keys_and_values(v)]]
    if isinstance(node, list):
        return [x for v in node for x in _all_keys_and_values(v)]
    return [node]


def test_kuberay_gcs_survives_the_head():
    """GCS fault tolerance through KubeRay >= 1.3's gcsFaultToleranceOptions: a Redis
    address and the password from a Secret, never written in the manifest."""
    service = _kuberay()
    ft = service["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    host, _, port = ft["redisAddress"].rpartition(":")
    assert host and port.isdigit()
    ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"]
    assert set(ft["redisPassword"]) == {"valueFrom"}  # no literal `value`
    # not also the pre-1.3 way (KubeRay refuses a password set in both places)
    assert "ray.io/ft-enabled" not in service["metadata"].get("annotations", {})
    flat = [str(x).lower() for x in _all_keys_and_values(service)]
    assert not any("redis_address" in x or "redis-password" in x for x in flat)
    # the Secret holding it is created beside the RayService, not in this file
    assert len(list(yaml.safe_load_all((CONFIGS / "kuberay-rayservice.yaml").read_text()))) == 1


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_clients_enter_at_proxies_on_every_node(manifest):
    """Serve runs a proxy on every node with a replica; KubeRay's Service leaves the head's
    out, so no client connection dies with the head."""
    if manifest == "kuberay":
        spec = _kuberay()["spec"]
        config = ServeDeploySchema.model_validate(_kuberay_serve_config())
        assert config.proxy_location == ProxyLocation.EveryNode
        assert spec["excludeHeadPodFromServeSvc"] is True
        # ignored since KubeRay 1.1 (readiness probes on the proxies replaced them)
        assert not {"serviceUnhealthySecondThreshold",
                    "deploymentUnhealthySecondThreshold"} & set(spec)
    else:
        # an Anyscale service config has no proxy setting: Serve's default applies
        assert "proxy_location" not in _anyscale()
        assert ServeDeploySchema.model_fields["proxy_location"].default == \
            ProxyLocation.EveryNode


def test_anyscale_asks_for_head_node_fault_tolerance():
    storage = _anyscale()["ray_gcs_external_storage_config"]
    assert storage["enabled"] is True
    # the cloud's store by default; never credentials in the file
    assert set(storage) <= {"enabled", "address", "certificate_path"}
    assert "@" not in storage.get("address", "")


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
        if not parsed.offers["GPU"]:
            continue  # the ingress group
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
