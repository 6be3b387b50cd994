"""The app builder that ``serve run`` imports: ``import_path: deployments.builder:build_app``."""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from deployments.args import AppArgs
from deployments.decode_server import DecodeServer
from deployments.ingress import Ingress
from deployments.prefill_server import PrefillServer


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    """Build the split app: Ingress -> PrefillServer (KV package) -> DecodeServer (tokens).

    Invalid args raise pydantic's ValidationError naming the field, at deploy time.
    """
    parsed = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    plain = parsed.model_dump(mode="json")
    prefill = PrefillServer.options(**parsed.deployment_options("prefill")).bind(plain)
    decode = DecodeServer.options(**parsed.deployment_options("decode")).bind(plain)
    ingress = Ingress.options(
        num_replicas=parsed.ingress.num_replicas,
        max_ongoing_requests=parsed.ingress.max_ongoing_requests,
        ray_actor_options=parsed.ingress.ray_actor_options(),
    )
    return ingress.bind(prefill, decode, plain)
