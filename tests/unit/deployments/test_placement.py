"""The build-time placement check: a cluster that offers none (or too little) of a phase's
resource tag fails the build at once, naming the tags and the ``ray start`` that offers them,
instead of leaving replicas pending forever; where nodes may still come (the explicit switch,
or an autoscaler whose node types offer the tags) it only warns."""

from __future__ import annotations

import pytest

from deployments import builder
from deployments.args import AppArgs
from deployments.builder import PlacementError, check_placement, required_resources

SPLIT = {"prefill_accel": 1.0, "decode_accel": 1.0}


def test_required_resources_sum_the_first_replicas_of_each_phase():
    args = AppArgs.model_validate({
        "prefill": {"deployment_config": {"num_replicas": 2}},
        "decode": {"accelerator_type": "A100", "deployment_config": {
            "autoscaling_config": {"min_replicas": 0, "max_replicas": 4}}},
        "ingress": {"resource_tag": "head"}})
    assert required_resources(args) == pytest.approx({
        "prefill_accel": 2, "decode_accel": 1, "accelerator_type:A100": 0.001, "head": 0.01})
    colocated = AppArgs.model_validate({"colocated": {"resource_tag": "prefill_accel"}})
    assert required_resources(colocated) == {"prefill_accel": 1}


def test_a_cluster_with_the_tags_passes():
    check_placement(AppArgs(), {"CPU": 4, **SPLIT}, warn=pytest.fail)


def test_missing_tags_fail_with_the_ray_start_that_offers_them():
    with pytest.raises(PlacementError) as err:
        check_placement(AppArgs(), {"CPU": 4, "prefill_accel": 1}, warn=pytest.fail)
    message = str(err.value)
    assert "decode_accel (needs 1, the cluster offers 0)" in message
    assert "prefill_accel (" not in message
    assert """ray start --address=HEAD:6379 --resources='{"decode_accel": 1.0}'""" in message
    assert "allow_pending_resources" in message


def test_too_few_units_for_the_replicas_fail():
    args = AppArgs.model_validate({"decode": {"deployment_config": {"num_replicas": 3}}})
    with pytest.raises(PlacementError, match=r"decode_accel \(needs 3, the cluster offers 2\)"):
        check_placement(args, {"prefill_accel": 1, "decode_accel": 2})


def test_a_missing_accelerator_type_is_named():
    args = AppArgs.model_validate({"prefill": {"resource_tag": None,
                                               "accelerator_type": "H100"}})
    with pytest.raises(PlacementError, match="accelerator type H100"):
        check_placement(args, {"decode_accel": 1})


def test_pending_resources_allowed_explicitly_or_by_an_autoscaler(monkeypatch):
    warnings: list[str] = []
    allowed = AppArgs.model_validate({"allow_pending_resources": True})
    check_placement(allowed, {}, warn=warnings.append)
    assert "allow_pending_resources" in warnings[-1]

    monkeypatch.setenv(builder.ALLOW_PENDING_ENV, "1")
    check_placement(AppArgs(), {}, warn=warnings.append)
    monkeypatch.delenv(builder.ALLOW_PENDING_ENV)

    check_placement(AppArgs(), {}, scalable={"prefill_accel": 4, "decode_accel": 8},
                    warn=warnings.append)
    assert "autoscaler" in warnings[-1] and len(warnings) == 3
    with pytest.raises(PlacementError):  # the autoscaler's node types lack decode_accel
        check_placement(AppArgs(), {}, scalable={"prefill_accel": 4}, warn=warnings.append)


def test_build_app_checks_the_connected_cluster(monkeypatch):
    monkeypatch.setattr(builder.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(builder.ray, "cluster_resources", lambda: {"CPU": 2})
    monkeypatch.setattr(builder, "_autoscaler_max_resources", lambda: None)
    with pytest.raises(PlacementError, match="prefill_accel"):
        builder.build_app({})
    monkeypatch.setattr(builder.ray, "cluster_resources", lambda: {"CPU": 2, **SPLIT})
    assert builder.build_app({}) is not None
