"""Serve's own deployment options as this app takes them: checked against Serve's deployment
schema, merged over a phase's defaults, and the autoscaling policy a phase names."""

from __future__ import annotations

from typing import Any

from ray.serve.schema import DeploymentSchema

_SERVE_FIELDS = frozenset(DeploymentSchema.model_fields) - {"name"}


def merged(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` over ``defaults``, dicts merged one level deep (``ray_actor_options``)."""
    out = dict(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = {**out[key], **value}
        out[key] = value
    return out


def check_deployment_config(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Raise ValueError unless Serve's own deployment schema accepts ``options``."""
    unknown = sorted(set(options) - _SERVE_FIELDS)
    if unknown:
        raise ValueError(f"unknown Serve deployment option(s) {unknown}; "
                         f"see ray.serve.schema.DeploymentSchema")
    DeploymentSchema.model_validate({"name": name, **options})
    return options


def policy_path(policy: Any) -> str:
    """``module:name`` of an autoscaling policy given as an import path or the object."""
    if isinstance(policy, str):
        return policy
    return f"{policy.__module__}:{policy.__qualname__}"


def scaling_override(phase: str, actual: str, expected: str) -> str:
    """Why a replica refuses to run under another autoscaling policy than its phase's."""
    return (f"{phase} autoscales with {actual}, not its phase policy {expected}: a Serve "
            f"config's deployments: entry that sets autoscaling_config replaces the app's "
            f"whole autoscaling_config, policy included. Set it in the app's args instead "
            f"({phase}.deployment_config.autoscaling_config, and {phase}.scaling for the "
            f"policy's parameters), or name the policy in the override (policy: "
            f"{{policy_function: {expected}, policy_kwargs: ...}}); to scale on request "
            f"counts, name Serve's policy in the args' autoscaling_config.")
