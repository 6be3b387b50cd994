"""The app builder that ``serve run`` imports: ``import_path: deployments.builder:build_app``."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ray
from ray.serve import Application

from deployments.args import AppArgs
from deployments.colocated_server import ColocatedServer
from deployments.decode_server import DecodeServer
from deployments.ingress import Ingress
from deployments.prefill_server import PrefillServer

logger = logging.getLogger(__name__)

ALLOW_PENDING_ENV = "SPLITSERVE_ALLOW_PENDING_RESOURCES"
_ACCELERATOR = "accelerator_type:"


class PlacementError(RuntimeError):
    """No node of the cluster offers what a phase's replicas ask for."""


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """Build the split app: Ingress -> PrefillServer (KV package) -> DecodeServer (tokens),
    or, with ``colocated:`` set, the baseline: Ingress -> ColocatedServer (both phases).

    Invalid args raise pydantic's ValidationError naming the field, and a cluster that
    cannot place the replicas raises PlacementError, at deploy time.
    """
    parsed = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    if ray.is_initialized():
        check_placement(parsed, ray.cluster_resources(), _autoscaler_max_resources())
    plain = parsed.model_dump(mode="json")
    ingress = Ingress.options(**parsed.ingress.deployment_options())
    if parsed.is_colocated:
        server = ColocatedServer.options(**parsed.deployment_options("colocated")).bind(plain)
        return ingress.bind(None, server, plain)
    prefill = PrefillServer.options(**parsed.deployment_options("prefill")).bind(plain)
    decode = DecodeServer.options(**parsed.deployment_options("decode")).bind(plain)
    return ingress.bind(prefill, decode, plain)


def _first_replicas(options: dict[str, Any]) -> int:
    """Replicas a deployment starts with; at least one, since a phase with none still needs
    a node to scale up on."""
    scaling = options.get("autoscaling_config")
    if scaling:
        start = scaling.get("initial_replicas") or scaling.get("min_replicas") or 0
    else:
        start = options.get("num_replicas", 1)
    return max(1, int(start))


def required_resources(args: AppArgs) -> dict[str, float]:
    """Custom resources (tags, ``accelerator_type:X``) the first replicas of every deployment
    ask for, summed over deployments (phases may share nodes and tags)."""
    need: dict[str, float] = defaultdict(float)
    deployments = [args.ingress.deployment_options()]
    deployments += [args.deployment_options(phase) for phase in args.phases]
    for options in deployments:
        n = _first_replicas(options)
        actor = options.get("ray_actor_options") or {}
        for name, amount in (actor.get("resources") or {}).items():
            need[name] += amount * n
        if actor.get("accelerator_type"):
            need[_ACCELERATOR + actor["accelerator_type"]] += 0.001 * n
    return dict(need)


def _autoscaler_max_resources() -> dict[str, float] | None:
    """The most of each resource Ray's autoscaler could provide (its node types times their
    max counts), or None without an autoscaler (a fixed cluster, ``ray start``)."""
    try:
        return ray._private.state.state.get_max_resources_from_cluster_config()
    except Exception:  # a private API: without it, only the explicit switch remains
        return None


def check_placement(args: AppArgs, cluster: dict[str, float],
                    scalable: dict[str, float] | None = None,
                    warn: Callable[[str], None] = logger.warning) -> None:
    """Raise PlacementError naming the tags that the cluster (``ray.cluster_resources()``)
    lacks for the first replicas, with the ``ray start`` that offers them: Serve would
    otherwise leave those replicas pending forever. Warn instead where they may come:
    ``allow_pending_resources`` (or its environment variable), or an autoscaler whose node
    types (``scalable``) offer them."""
    short = {name: (need, cluster.get(name, 0.0))
             for name, need in required_resources(args).items()
             if cluster.get(name, 0.0) + 1e-9 < need}
    if not short:
        return
    listed = ", ".join(f"{name} (needs {need:g}, the cluster offers {have:g})"
                       for name, (need, have) in sorted(short.items()))
    if args.allow_pending_resources or os.environ.get(ALLOW_PENDING_ENV, "") in ("1", "true"):
        warn(f"replicas wait for resources no node offers yet: {listed}; deploying anyway "
             "(allow_pending_resources)")
        return
    if scalable and all(scalable.get(name, 0.0) + 1e-9 >= need
                        for name, (need, _) in short.items()):
        warn(f"replicas wait for resources no node offers yet: {listed}; Ray's autoscaler "
             "has node types that offer them and will add nodes")
        return
    tags = {name: need for name, (need, _) in short.items() if not name.startswith(_ACCELERATOR)}
    accelerators = sorted(name.removeprefix(_ACCELERATOR) for name in short
                          if name.startswith(_ACCELERATOR))
    how = []
    if tags:
        how.append(f"start nodes that offer the tags, e.g. on the head or a new node: "
                   f"ray start --address=HEAD:6379 --resources='{json.dumps(tags)}'")
    if accelerators:
        how.append(f"add nodes with accelerator type {', '.join(accelerators)}")
    raise PlacementError(
        f"this Ray cluster cannot place the app's replicas, which would wait forever: "
        f"{listed}. To fix it: {'; '.join(how)}; or change the phases' resource_tag / "
        f"accelerator_type; or, where an autoscaler adds such nodes, set "
        f"allow_pending_resources: true in the args (or {ALLOW_PENDING_ENV}=1).")
