"""A Serve config's ``deployments:`` override of a phase's ``autoscaling_config`` replaces the
app's whole dict, policy included (Serve's ``override_deployment_info``): the phase's replicas
refuse to start with another policy than theirs rather than scale on request counts without
a word."""

from __future__ import annotations

import pytest
from ray.serve.config import AutoscalingConfig

from deployments import autoscaling
from deployments.args import AppArgs

SCALING = {"min_replicas": 1, "max_replicas": 2}


def _deployed(args: AppArgs, phase: str, override: dict | None = None) -> AutoscalingConfig:
    """The autoscaling_config Serve deploys: the app's, or a deployments: entry's in its
    place (Serve updates the deployment's options one level deep)."""
    config = override if override is not None else \
        args.deployment_options(phase)["autoscaling_config"]
    return AutoscalingConfig(**config)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_the_app_s_own_autoscaling_keeps_the_phase_policy(phase):
    args = AppArgs.model_validate({phase: {"deployment_config": {
        "autoscaling_config": SCALING}}})
    deployed = _deployed(args, phase)
    assert deployed.policy.policy_function.startswith("deployments.autoscaling:")
    args.check_scaling_policy(phase, deployed)
    args.check_scaling_policy(phase, None)  # fixed replicas: nothing to check


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_an_override_that_drops_the_policy_is_refused(phase):
    args = AppArgs.model_validate({phase: {"deployment_config": {
        "autoscaling_config": SCALING}}})
    deployed = _deployed(args, phase, override={"min_replicas": 1, "max_replicas": 8})
    assert "default_autoscaling_policy" in deployed.policy.policy_function  # Serve's default
    with pytest.raises(ValueError, match=rf"{phase} autoscales with "
                       r"ray.serve.autoscaling_policy:default_autoscaling_policy") as err:
        args.check_scaling_policy(phase, deployed)
    assert f"{phase}.deployment_config.autoscaling_config" in str(err.value)


def test_an_override_on_fixed_replicas_is_refused_too():
    args = AppArgs()  # num_replicas: 1; a deployments: entry adds autoscaling
    with pytest.raises(ValueError, match="not its phase policy"):
        args.check_scaling_policy("decode", _deployed(args, "decode", override=SCALING))


def test_an_override_that_names_the_phase_policy_is_kept():
    override = {**SCALING, "policy": {"policy_function": "deployments.autoscaling:DecodePolicy"}}
    AppArgs().check_scaling_policy("decode", _deployed(AppArgs(), "decode", override))
    # the policy given as the object (Serve may deserialize it) is the same policy
    deployed = _deployed(AppArgs(), "decode", override)
    deployed.policy.policy_function = autoscaling.DecodePolicy
    AppArgs().check_scaling_policy("decode", deployed)


def test_serve_s_policy_named_in_the_args_is_kept():
    default = "ray.serve.autoscaling_policy:default_autoscaling_policy"
    args = AppArgs.model_validate({"prefill": {"deployment_config": {"autoscaling_config": {
        **SCALING, "policy": {"policy_function": default}}}}})
    args.check_scaling_policy("prefill", _deployed(args, "prefill"))
    colocated = AppArgs.model_validate({"colocated": {"deployment_config": {
        "autoscaling_config": SCALING}}})
    colocated.check_scaling_policy("colocated", _deployed(colocated, "colocated"))
