"""The app builder that ``serve run`` imports: ``import_path: deployments.builder:build_app``."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.args import AppArgs
from deployments.colocated_server import ColocatedServer
from deployments.decode_server import DecodeServer
from deployments.ingress import Ingress
from deployments.prefill_server import PrefillServer


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """Build the split app: Ingress -> PrefillServer (KV package) -> DecodeServer (tokens),
    or with ``mode: colocated`` the baseline: Ingress -> ColocatedServer (both phases).

    Invalid args raise pydantic's ValidationError naming the field, at deploy time.
    """
    parsed = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    plain = parsed.model_dump(mode="json")
    ingress = Ingress.options(
        num_replicas=parsed.ingress.num_replicas,
        max_ongoing_requests=parsed.ingress.max_ongoing_requests,
        max_queued_requests=parsed.ingress.max_queued_requests,
        ray_actor_options=parsed.ingress.ray_actor_options(),
    )
    if parsed.mode == "colocated":
        server = ColocatedServer.options(**parsed.colocated.deployment_options()).bind(plain)
        return ingress.bind(None, server, plain)
    prefill = PrefillServer.options(**parsed.deployment_options("prefill")).bind(plain)
    decode = DecodeServer.options(**parsed.deployment_options("decode")).bind(plain)
    return ingress.bind(prefill, decode, plain)


def build_colocated_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """The colocated baseline whatever ``mode`` says: same Ingress and engine, one
    deployment for both phases (``import_path: deployments.builder:build_colocated_app``)."""
    plain = args.model_dump(mode="json") if isinstance(args, AppArgs) else dict(args or {})
    return build_app(AppArgs.model_validate({**plain, "mode": "colocated"}))
