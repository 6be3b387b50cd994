"""Autoscaling arithmetic: measured load -> desired replicas, per phase, with hysteresis; the
Serve policies on a real AutoscalingContext; the replica-side windows; the app args."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from deployments import autoscaling as a
from deployments.args import AppArgs

# ---- hysteresis ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("load", "current", "expected"),
    [
        (0, 1, 0),  # no load: as few as the bounds allow
        (100, 1, 1),  # at capacity: hold
        (101, 1, 2),  # over: up
        (250, 1, 3),  # far over: straight to what the load needs
        (150, 2, 2),  # in the band (60..100 per replica): hold
        (120, 2, 2),  # exactly 0.6 x 2 x 100: still 2 (down needs one fewer to fit at 60%)
        (60, 2, 1),  # one replica at 60%: down
        (59, 3, 1),  # far under: straight down
    ],
)
def test_hysteresis_band(load, current, expected):
    assert a.replicas_with_hysteresis([(load, 100.0)], current, 0.6) == expected


def test_hysteresis_does_not_flap_on_a_load_that_wobbles_near_a_boundary():
    current = 1
    history = []
    for load in [90, 105, 95, 110, 80, 102, 85, 99, 104, 90]:  # around one replica's 100
        current = max(1, a.replicas_with_hysteresis([(load, 100.0)], current, 0.6))
        history.append(current)
    # it goes up once at the first crossing and stays: 80..110 over 2 replicas is inside the band
    assert history == [1, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    # whereas without a band (ratio 1) the same load flaps
    current, flaps = 1, 0
    for load in [90, 105, 95, 110, 80, 102, 85, 99, 104, 90]:
        new = max(1, a.replicas_with_hysteresis([(load, 100.0)], current, 1.0))
        flaps += new != current
        current = new
    assert flaps >= 6


def test_hysteresis_takes_the_signal_that_needs_most():
    # sequences fit in 1, KV needs 3
    assert a.replicas_with_hysteresis([(4, 16.0), (2500, 1000.0)], 1, 0.6) == 3
    # down only to a count where every signal is under 60%
    assert a.replicas_with_hysteresis([(4, 16.0), (1100, 1000.0)], 3, 0.6) == 2


def test_hysteresis_rejects_a_ratio_outside_0_1():
    with pytest.raises(ValueError, match="scale_down_ratio"):
        a.replicas_with_hysteresis([(1, 1.0)], 1, 1.5)


# ---- prefill -------------------------------------------------------------------------------


def test_prefill_counts_tokens_not_requests():
    params = a.PrefillParams(target_queue_delay_s=0.5, tokens_per_s=2000.0)  # 1000 per replica
    one_long = a.PrefillLoad(waiting_tokens=2000.0)  # one 2,000-token prompt
    many_short = a.PrefillLoad(waiting_tokens=20 * 20.0)  # twenty 20-token prompts
    assert a.prefill_desired_replicas(one_long, params, current=1) == 2
    assert a.prefill_desired_replicas(many_short, params, current=1) == 1


def test_prefill_capacity_from_measured_throughput_unless_configured():
    load = a.PrefillLoad(waiting_tokens=3000.0, tokens_per_s=1000.0)
    measured = a.PrefillParams(target_queue_delay_s=1.0)  # 1000 tokens per replica measured
    assert a.prefill_desired_replicas(load, measured, current=1) == 3
    configured = a.PrefillParams(target_queue_delay_s=1.0, tokens_per_s=4000.0)
    assert a.prefill_desired_replicas(load, configured, current=1) == 1
    # nothing measured, nothing configured: the default rate
    fresh = a.PrefillLoad(waiting_tokens=a.DEFAULT_PREFILL_TOKENS_PER_S * 1.5)
    assert a.prefill_desired_replicas(fresh, measured, current=1) == 2


def test_prefill_counts_requests_queued_at_the_handles_as_tokens():
    params = a.PrefillParams(target_queue_delay_s=1.0, tokens_per_s=1000.0)
    load = a.PrefillLoad(waiting_tokens=800.0, queued_requests=3, mean_prompt_tokens=500.0)
    assert load.tokens == 2300.0
    assert a.prefill_desired_replicas(load, params, current=1) == 3


def test_prefill_scales_down_only_below_the_band():
    params = a.PrefillParams(target_queue_delay_s=1.0, tokens_per_s=1000.0, scale_down_ratio=0.5)
    assert a.prefill_desired_replicas(a.PrefillLoad(900.0), params, current=2) == 2
    assert a.prefill_desired_replicas(a.PrefillLoad(500.0), params, current=2) == 1


def test_prefill_params_validate():
    with pytest.raises(ValueError, match="ttft_target_ms"):
        a.PrefillParams(mode="slo")
    with pytest.raises(ValueError, match="mode"):
        a.PrefillParams(mode="requests")
    with pytest.raises(ValueError, match="target_queue_delay_s"):
        a.PrefillParams(target_queue_delay_s=0)


# ---- decode --------------------------------------------------------------------------------


def test_decode_scales_on_sequences_against_the_batch():
    params = a.DecodeParams(sequences_per_replica=4, kv_tokens_per_replica=10_000)
    assert a.decode_desired_replicas(a.DecodeLoad(sequences=4), params, current=1) == 1
    assert a.decode_desired_replicas(a.DecodeLoad(sequences=9), params, current=1) == 3
    # streams queued at the handle count as sequences too
    queued = a.DecodeLoad(sequences=4, queued_requests=2)
    assert a.decode_desired_replicas(queued, params, current=1) == 2
    # hold in the band, down below it
    assert a.decode_desired_replicas(a.DecodeLoad(sequences=3), params, current=2) == 2
    assert a.decode_desired_replicas(a.DecodeLoad(sequences=2), params, current=2) == 1


def test_decode_scales_on_kv_tokens_when_sequences_are_long():
    params = a.DecodeParams(sequences_per_replica=16, kv_tokens_per_replica=8000)
    long_ones = a.DecodeLoad(sequences=6, kv_tokens=20_000)  # 6 sequences fit, their KV does not
    assert a.decode_desired_replicas(long_ones, params, current=1) == 3


# ---- SLO mode -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("measured", "current", "expected"),
    [
        (None, 3, 1),  # idle: back to the minimum
        (0.0, 2, 1),
        (300.0, 1, 2),  # 1.5x over: proportional
        (900.0, 2, 9),  # 4.5x over at 2: 9
        (200.0, 2, 2),  # at target: hold
        (120.0, 2, 2),  # 120 * 2/1 = 240 > 0.6 * 200: removing one would break the band
        (60.0, 2, 1),  # 60 * 2 = 120 <= 120: one fewer stays within 60% of the target
    ],
)
def test_slo_latency_against_target(measured, current, expected):
    assert a.slo_desired_replicas(measured, 200.0, current, 1, 0.6) == expected


def test_slo_steps_down_one_at_a_time():
    assert a.slo_desired_replicas(80.0, 200.0, 4, 1, 0.6) == 3  # 80 * 4/3 = 107 <= 120
    assert a.slo_desired_replicas(100.0, 200.0, 4, 1, 0.6) == 4  # 100 * 4/3 = 133 > 120


def test_slo_mode_uses_each_phases_own_latency():
    prefill = a.PrefillParams(mode="slo", ttft_target_ms=500.0)
    # lots of waiting tokens but latency within target: the SLO mode holds
    calm = a.PrefillLoad(waiting_tokens=10**6, latency_ms=400.0)
    assert a.prefill_desired_replicas(calm, prefill, current=2) == 2
    slow = a.PrefillLoad(waiting_tokens=10.0, latency_ms=1500.0)
    assert a.prefill_desired_replicas(slow, prefill, current=1) == 3
    decode = a.DecodeParams(sequences_per_replica=4, kv_tokens_per_replica=1e4, mode="slo",
                            tpot_target_ms=50.0)
    assert a.decode_desired_replicas(a.DecodeLoad(sequences=1, tpot_ms=120.0), decode, 1) == 3
    assert a.decode_desired_replicas(a.DecodeLoad(sequences=99, tpot_ms=None), decode, 2) == 1


# ---- from per-replica metrics -------------------------------------------------------------


def test_loads_from_per_replica_metrics():
    assert a.prefill_load({}) is None and a.decode_load({"other": {"r1": 1.0}}) is None
    p = a.prefill_load({
        a.PREFILL_WAITING_TOKENS: {"r1": 1000.0, "r2": 500.0},
        a.PREFILL_TOKENS_PER_S: {"r1": 3000.0, "r2": 0.0},  # r2 has not measured yet
        a.PREFILL_MEAN_PROMPT_TOKENS: {"r1": 400.0, "r2": 200.0},
        a.PREFILL_LATENCY_MS: {"r1": 80.0, "r2": 120.0},
    }, queued_requests=2)
    assert p == a.PrefillLoad(1500.0, 2, 300.0, 3000.0, 120.0)
    d = a.decode_load({
        a.DECODE_SEQUENCES: {"r1": 3.0, "r2": 5.0},
        a.DECODE_KV_TOKENS: {"r1": 100.0, "r2": 300.0},
        a.DECODE_TPOT_MS: {"r1": 0.0, "r2": 0.0},
    })
    assert d == a.DecodeLoad(8.0, 400.0, 0.0, None)


# ---- the Serve policies, as Serve calls them ----------------------------------------------


def _ctx(policy_config: AutoscalingConfig, metrics, target: int, state=None, queued=0.0):
    return AutoscalingContext(
        deployment_id=None, deployment_name="D", app_name="app",
        current_num_replicas=target, target_num_replicas=target,
        running_replicas=[], total_num_requests=0.0, total_queued_requests=queued,
        aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=policy_config.min_replicas,
        capacity_adjusted_max_replicas=policy_config.max_replicas,
        policy_state=state or {}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=policy_config)


def _serve_policy(config: AutoscalingConfig):
    """The policy as Serve runs it: loaded from its import path, instantiated with its kwargs,
    wrapped with the delays."""
    raw = config.policy.get_policy()
    assert isinstance(raw, type)
    return _apply_autoscaling_config(raw(**config.policy.policy_kwargs))


def test_prefill_policy_through_serve_wrapper_with_delays():
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=2, upscale_delay_s=0, downscale_delay_s=3600,
        policy=AutoscalingPolicy(policy_function="deployments.autoscaling:PrefillPolicy",
                                 policy_kwargs={"tokens_per_s": 1000.0,
                                                "target_queue_delay_s": 1.0}))
    policy = _serve_policy(config)
    heavy = {a.PREFILL_WAITING_TOKENS: {"r1": 1500.0}}
    n, state = policy(_ctx(config, heavy, target=1))
    assert n == 2 and state["last_load"]["waiting_tokens"] == 1500.0
    # load gone: wants 0 (bounded to min by Serve) but the downscale delay holds it
    n, state = policy(_ctx(config, {a.PREFILL_WAITING_TOKENS: {"r1": 0.0, "r2": 0.0}},
                           target=2, state=state))
    assert n == 2
    # no replica has reported: hold whatever Serve decided
    n, _ = policy(_ctx(config, {}, target=2))
    assert n == 2


def test_decode_policy_ignores_prefill_load_and_counts_handle_queue():
    config = AutoscalingConfig(
        min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0,
        policy=AutoscalingPolicy(policy_function="deployments.autoscaling:DecodePolicy",
                                 policy_kwargs={"sequences_per_replica": 4,
                                                "kv_tokens_per_replica": 1e5}))
    policy = _serve_policy(config)
    metrics = {a.DECODE_SEQUENCES: {"r1": 4.0}, a.PREFILL_WAITING_TOKENS: {"p": 1e9}}
    assert policy(_ctx(config, metrics, target=1))[0] == 1
    assert policy(_ctx(config, metrics, target=1, queued=5.0))[0] == 3
    idle = {a.DECODE_SEQUENCES: {"r1": 0.0, "r2": 0.0}}
    assert policy(_ctx(config, idle, target=2))[0] == 1  # Serve bounds this at min_replicas


# ---- replica-side windows -----------------------------------------------------------------


def test_throughput_window_keeps_the_last_batches():
    w = a.ThroughputWindow(max_batches=2)
    assert w.tokens_per_s == 0.0 and w.mean_prompt_tokens == 0.0
    w.add(prompts=1, tokens=100, seconds=1.0)
    w.add(prompts=2, tokens=1000, seconds=0.5)
    assert w.tokens_per_s == pytest.approx(1100 / 1.5)
    w.add(prompts=1, tokens=500, seconds=0.5)  # the first batch drops out
    assert w.tokens_per_s == pytest.approx(1500.0) and w.mean_prompt_tokens == 500.0


def test_latency_window_counts_in_flight_age_and_forgets_old_requests():
    now = [100.0]
    w = a.LatencyWindow(window_s=10.0, clock=lambda: now[0])
    assert w.value_ms() == 0.0
    w.start("a")
    now[0] += 0.2
    w.finish("a")
    assert w.value_ms() == pytest.approx(200.0)
    w.start("b")  # stuck in a queue
    now[0] += 3.0
    assert w.value_ms() == pytest.approx(3000.0)
    w.finish("b")
    now[0] += 20.0  # both out of the window
    assert w.value_ms() == 0.0


# ---- the app args -------------------------------------------------------------------------


def _autoscaled(**config) -> dict:
    return {"deployment_config": {"autoscaling_config": config}}


def test_args_add_the_phase_policy_to_an_autoscaling_config():
    args = AppArgs.model_validate({
        "engine": {"max_batch_size": 8, "max_kv_tokens": 4096},
        "prefill": {**_autoscaled(min_replicas=1, max_replicas=3),
                    "scaling": {"target_queue_delay_s": 0.25, "tokens_per_s": 5000}},
        "decode": {**_autoscaled(min_replicas=1, max_replicas=2),
                   "scaling": {"kv_tokens_per_replica": 2048}},
    })
    p = args.deployment_options("prefill")["autoscaling_config"]
    assert p["policy"]["policy_function"] == "deployments.autoscaling:PrefillPolicy"
    assert p["policy"]["policy_kwargs"]["tokens_per_s"] == 5000
    assert p["policy"]["policy_kwargs"]["target_queue_delay_s"] == 0.25
    d = args.deployment_options("decode")
    assert d["autoscaling_config"]["policy"]["policy_kwargs"]["sequences_per_replica"] == 8
    assert d["autoscaling_config"]["policy"]["policy_kwargs"]["kv_tokens_per_replica"] == 2048
    # Serve accepts what the args produce and can load the policy from it
    for opts in (p, d["autoscaling_config"]):
        config = AutoscalingConfig(**opts)
        assert callable(config.policy.get_policy())
    # scale-down drains: a stopping decode replica waits for its streams
    assert d["graceful_shutdown_timeout_s"] >= 300


def test_args_keep_an_explicit_policy():
    """Naming Serve's own request-count policy is how a phase scales on ongoing requests."""
    own = {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}
    args = AppArgs.model_validate({
        "prefill": _autoscaled(max_replicas=2, policy=own),
        "decode": _autoscaled(max_replicas=2)})
    assert args.deployment_options("prefill")["autoscaling_config"]["policy"] == own
    decode = args.deployment_options("decode")["autoscaling_config"]["policy"]
    assert decode["policy_function"] == "deployments.autoscaling:DecodePolicy"
    fixed = AppArgs.model_validate({}).deployment_options("decode")
    assert fixed["num_replicas"] == 1 and "autoscaling_config" not in fixed


def test_slo_policy_needs_its_phase_target():
    with pytest.raises(ValidationError, match="ttft_target_ms"):
        AppArgs.model_validate({"prefill": {"scaling": {"mode": "slo"}}})
    with pytest.raises(ValidationError, match="tpot_target_ms"):
        AppArgs.model_validate({"decode": {"scaling": {"mode": "slo"}}})
    ok = AppArgs.model_validate({
        "decode": {**_autoscaled(max_replicas=2),
                   "scaling": {"mode": "slo", "tpot_target_ms": 40}}})
    kwargs = ok.deployment_options("decode")["autoscaling_config"]["policy"]["policy_kwargs"]
    assert kwargs["mode"] == "slo" and kwargs["tpot_target_ms"] == 40


def test_local_prefill_threshold_is_validated():
    assert AppArgs.model_validate({"local_prefill_threshold": 64}).local_prefill_threshold == 64
    with pytest.raises(ValidationError, match="local_prefill_threshold"):
        AppArgs.model_validate({"local_prefill_threshold": -1})


def test_the_prefill_phase_counts_as_busy_from_one_pass_unless_set():
    # default: one prefill pass, the smaller of the token budget and the chunk
    assert AppArgs.model_validate({}).busy_prefill_tokens == 256
    assert AppArgs.model_validate(
        {"engine": {"prefill_chunk_tokens": 2048, "prefill_token_budget": 1024}}
    ).busy_prefill_tokens == 1024
    assert AppArgs.model_validate({"prefill_busy_tokens": 40}).busy_prefill_tokens == 40
    assert AppArgs.model_validate({}).local_prefill_when_busy == 128
    for bad in ({"prefill_busy_tokens": 0}, {"local_prefill_when_busy": -1}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            AppArgs.model_validate(bad)


def test_gpu_cluster_config_scales_each_phase_on_its_own_policy():
    from pathlib import Path

    import yaml

    path = Path(__file__).parents[3] / "serve_configs" / "gpu-cluster.yaml"
    args = AppArgs.model_validate(yaml.safe_load(path.read_text())["applications"][0]["args"])
    for phase, policy in (("prefill", "PrefillPolicy"), ("decode", "DecodePolicy")):
        config = AutoscalingConfig(**args.deployment_options(phase)["autoscaling_config"])
        assert config.policy.policy_function == f"deployments.autoscaling:{policy}"
        assert config.max_replicas > config.min_replicas
    assert args.deployment_options("decode")["graceful_shutdown_timeout_s"] >= 600
