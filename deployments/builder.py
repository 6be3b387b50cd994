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
    or, with ``colocated:`` set, the baseline: Ingress -> ColocatedServer (both phases).

    Invalid args raise pydantic's ValidationError naming the field, at deploy time.
    """
    parsed = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    plain = parsed.model_dump(mode="json")
    ingress = Ingress.options(**parsed.ingress.deployment_options())
    if parsed.is_colocated:
        server = ColocatedServer.options(**parsed.deployment_options("colocated")).bind(plain)
        return ingress.bind(None, server, plain)
    prefill = PrefillServer.options(**parsed.deployment_options("prefill")).bind(plain)
    decode = DecodeServer.options(**parsed.deployment_options("decode")).bind(plain)
    return ingress.bind(prefill, decode, plain)
