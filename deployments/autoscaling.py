"""Per-phase autoscaling: each phase scales on its own signal.

Prefill load is prompt tokens (waiting + in flight), not requests: a 2,000-token prompt costs a
hundred 20-token ones. Decode load is sequences held and KV tokens held, against the batch and
KV budget of one replica.

Three layers, each usable alone:

* **Arithmetic** (``replicas_with_hysteresis``, ``prefill_desired_replicas``,
  ``decode_desired_replicas``, ``slo_desired_replicas``): pure functions from measured load to a
  desired replica count. Unit-tested in ``tests/unit/deployments/test_autoscaling.py``.
* **Policies** (``PrefillPolicy``, ``DecodePolicy``): Ray Serve custom autoscaling policies, named
  in an ``autoscaling_config`` as ``policy: {policy_function: deployments.autoscaling:
  PrefillPolicy, policy_kwargs: {...}}``. Each reads the metrics its replicas report
  (``ctx.aggregated_metrics[name][replica_id]``, averaged by Serve over ``look_back_period_s``)
  and returns a desired count; Serve wraps it with ``min_replicas``/``max_replicas`` and the
  ``upscale_delay_s``/``downscale_delay_s`` delays.
* **Replica-side windows** (``ThroughputWindow``, ``LatencyWindow``): what the replicas'
  ``record_autoscaling_stats`` report, under the metric names below.

Hysteresis is two-sided: in magnitude, a phase scales up as soon as its replicas are over
capacity but scales down only when the load would fill the smaller count to at most
``scale_down_ratio`` of its capacity (a dead band between); in time, Serve's delays require a
decision to hold before it is acted on.

Ray pickles this module by value into the Serve controller, so it imports only the standard
library (no torch, no app code).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

# ---- the metric names: replicas report them, policies read them --------------------------

PREFILL_WAITING_TOKENS = "prefill_waiting_tokens"  # prompt tokens queued or running
PREFILL_WAITING_REQUESTS = "prefill_waiting_requests"
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"  # measured compute throughput; 0 = not yet
PREFILL_MEAN_PROMPT_TOKENS = "prefill_mean_prompt_tokens"  # recent prompts; 0 = none yet
PREFILL_LATENCY_MS = "prefill_latency_ms"  # arrival -> KV package ready; 0 = idle
DECODE_SEQUENCES = "decode_sequences"  # streaming + waiting for a row + prefilling here
DECODE_KV_TOKENS = "decode_kv_tokens"  # KV tokens the running sequences hold
DECODE_TPOT_MS = "decode_tpot_ms"  # time per output token (decode step); 0 = idle

POLICY_LOAD = "load"
POLICY_SLO = "slo"

# A per-replica prefill throughput to assume before any replica has measured its own.
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
# Below a capacity this small the arithmetic would divide by ~0.
_MIN_CAPACITY = 1e-6


# ---- arithmetic ---------------------------------------------------------------------------


def replicas_for(load: float, capacity_per_replica: float) -> int:
    """Fewest replicas whose combined capacity holds ``load`` (0 for no load)."""
    if load <= 0:
        return 0
    return math.ceil(load / max(capacity_per_replica, _MIN_CAPACITY) - 1e-9)


def replicas_with_hysteresis(
    signals: list[tuple[float, float]], current: int, scale_down_ratio: float
) -> int:
    """Desired replicas for several (load, capacity per replica) signals at once.

    Up as soon as any signal needs more than ``current`` replicas at full capacity; down only
    to a count that every signal fills to at most ``scale_down_ratio`` of capacity; otherwise
    hold. With ``scale_down_ratio`` < 1 the band between the two keeps a load near a boundary
    from flapping the count.
    """
    if not 0 < scale_down_ratio <= 1:
        raise ValueError(f"scale_down_ratio must be in (0, 1], got {scale_down_ratio}")
    up = max((replicas_for(load, cap) for load, cap in signals), default=0)
    if up > current:
        return up
    down = max((replicas_for(load, cap * scale_down_ratio) for load, cap in signals), default=0)
    return min(current, down)


def slo_desired_replicas(
    measured_ms: float | None, target_ms: float, current: int, minimum: int,
    scale_down_ratio: float,
) -> int:
    """Desired replicas from one latency against its target.

    Over target: grow in proportion (latency per replica falls roughly as 1/replicas when it
    is queueing that makes it slow). Under target: drop one replica only when the latency
    projected for one fewer (``measured * current / (current - 1)``) stays within
    ``scale_down_ratio`` of the target. No measurement (idle, nothing in the window): back to
    ``minimum``.
    """
    if target_ms <= 0:
        raise ValueError(f"target_ms must be > 0, got {target_ms}")
    if current <= 0:
        return current  # Serve's cold-start path scales from zero on queued requests
    if measured_ms is None or measured_ms <= 0:
        return min(current, minimum)
    if measured_ms > target_ms:
        return math.ceil(current * measured_ms / target_ms - 1e-9)
    if current > 1 and measured_ms * current / (current - 1) <= target_ms * scale_down_ratio:
        return current - 1
    return current


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """What the prefill replicas report, summed or combined across replicas."""

    waiting_tokens: float  # queued + in-flight prompt tokens, all replicas
    queued_requests: float = 0.0  # queued at the handles, not yet on a replica
    mean_prompt_tokens: float = 0.0  # turns queued requests into tokens; 0 = unknown
    tokens_per_s: float | None = None  # measured per replica; None = not measured yet
    latency_ms: float | None = None  # worst replica; None = idle

    @property
    def tokens(self) -> float:
        return self.waiting_tokens + self.queued_requests * self.mean_prompt_tokens


@dataclass(frozen=True, slots=True)
class PrefillParams:
    """How the prefill policy turns load into replicas (its ``policy_kwargs``)."""

    mode: str = POLICY_LOAD
    """load: scale on prompt tokens waiting or running against what one replica prefills
    within target_queue_delay_s; slo: scale on the measured prefill latency (arrival to KV
    package ready, worst replica) against ttft_target_ms."""
    target_queue_delay_s: float = 0.5
    """Load mode: how long a prompt may wait for its prefill; one replica's capacity is
    tokens_per_s times this."""
    tokens_per_s: float | None = None
    """Load mode: one replica's prefill throughput in prompt tokens per second; None: what
    the replicas measure (DEFAULT_PREFILL_TOKENS_PER_S until they have)."""
    scale_down_ratio: float = 0.6
    """Hysteresis, in (0, 1]: scale down only to a count the load fills to at most this
    fraction of its capacity (slo mode: whose projected latency stays within this fraction
    of the target); up as soon as the replicas are over capacity."""
    ttft_target_ms: float | None = None
    """SLO mode (required there): the prefill latency target in milliseconds."""

    def __post_init__(self) -> None:
        if self.mode not in (POLICY_LOAD, POLICY_SLO):
            raise ValueError(f"prefill policy mode must be 'load' or 'slo', got {self.mode!r}")
        if self.target_queue_delay_s <= 0:
            raise ValueError("target_queue_delay_s must be > 0")
        if self.tokens_per_s is not None and self.tokens_per_s <= 0:
            raise ValueError("tokens_per_s must be > 0 (or None: measured)")
        if not 0 < self.scale_down_ratio <= 1:
            raise ValueError("scale_down_ratio must be in (0, 1]")
        if self.mode == POLICY_SLO and not (self.ttft_target_ms and self.ttft_target_ms > 0):
            raise ValueError("slo mode needs ttft_target_ms > 0")

    def tokens_per_replica(self, load: PrefillLoad) -> float:
        """Prompt tokens one replica clears within the target queueing delay."""
        rate = self.tokens_per_s or load.tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        return rate * self.target_queue_delay_s


def prefill_desired_replicas(
    load: PrefillLoad, params: PrefillParams, current: int, minimum: int = 1
) -> int:
    """Prefill replicas for ``load``: prompt tokens against what one replica prefills within
    the target queueing delay (load mode), or measured prefill latency against the TTFT
    target (SLO mode)."""
    if params.mode == POLICY_SLO:
        assert params.ttft_target_ms is not None
        return slo_desired_replicas(load.latency_ms, params.ttft_target_ms, current, minimum,
                                    params.scale_down_ratio)
    return replicas_with_hysteresis(
        [(load.tokens, params.tokens_per_replica(load))], current, params.scale_down_ratio)


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """What the decode replicas report, summed or combined across replicas."""

    sequences: float  # streaming + waiting + prefilling locally, all replicas
    kv_tokens: float = 0.0  # KV tokens held, all replicas
    queued_requests: float = 0.0  # streams queued at the handles, not yet on a replica
    tpot_ms: float | None = None  # worst replica; None = idle

    @property
    def total_sequences(self) -> float:
        return self.sequences + self.queued_requests


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """How the decode policy turns load into replicas (its ``policy_kwargs``)."""

    sequences_per_replica: float | None = None
    """Load mode: the batch one replica should run (<= max_batch_size); None until the app
    args fill it in from the engine's max_batch_size."""
    kv_tokens_per_replica: float | None = None
    """Load mode: the KV tokens one replica should hold (<= max_kv_tokens); None until the
    app args fill it in from the engine's max_kv_tokens."""
    mode: str = POLICY_LOAD
    """load: scale on sequences (streaming, waiting, and queued at the handles) against
    sequences_per_replica and on KV tokens held against kv_tokens_per_replica, whichever
    needs more replicas; slo: scale on the measured time per output token (worst replica)
    against tpot_target_ms."""
    scale_down_ratio: float = 0.6
    """Hysteresis, in (0, 1]: scale down only to a count the load fills to at most this
    fraction of its capacity (slo mode: whose projected latency stays within this fraction
    of the target); up as soon as the replicas are over capacity."""
    tpot_target_ms: float | None = None
    """SLO mode (required there): the time per output token target in milliseconds."""

    def __post_init__(self) -> None:
        if self.mode not in (POLICY_LOAD, POLICY_SLO):
            raise ValueError(f"decode policy mode must be 'load' or 'slo', got {self.mode!r}")
        for name in ("sequences_per_replica", "kv_tokens_per_replica"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 < self.scale_down_ratio <= 1:
            raise ValueError("scale_down_ratio must be in (0, 1]")
        if self.mode == POLICY_SLO and not (self.tpot_target_ms and self.tpot_target_ms > 0):
            raise ValueError("slo mode needs tpot_target_ms > 0")


def decode_desired_replicas(
    load: DecodeLoad, params: DecodeParams, current: int, minimum: int = 1
) -> int:
    """Decode replicas for ``load``: sequences against the per-replica batch and KV tokens
    against the per-replica KV budget, whichever needs more (load mode), or the measured time
    per output token against the TPOT target (SLO mode)."""
    if params.mode == POLICY_SLO:
        assert params.tpot_target_ms is not None
        return slo_desired_replicas(load.tpot_ms, params.tpot_target_ms, current, minimum,
                                    params.scale_down_ratio)
    assert params.sequences_per_replica and params.kv_tokens_per_replica, "per-replica targets"
    return replicas_with_hysteresis(
        [(load.total_sequences, params.sequences_per_replica),
         (load.kv_tokens, params.kv_tokens_per_replica)],
        current, params.scale_down_ratio)


# ---- from Serve's metrics to a load ------------------------------------------------------

PerReplica = Mapping[str, Mapping[Hashable, float]]


def _values(metrics: PerReplica, name: str) -> list[float]:
    return [float(v) for v in metrics.get(name, {}).values()]


def _positive_max(values: list[float]) -> float | None:
    positive = [v for v in values if v > 0]
    return max(positive) if positive else None


def _positive_mean(values: list[float]) -> float | None:
    positive = [v for v in values if v > 0]
    return sum(positive) / len(positive) if positive else None


def prefill_load(metrics: PerReplica, queued_requests: float = 0.0) -> PrefillLoad | None:
    """Combine per-replica prefill metrics; None when no replica has reported yet."""
    waiting = _values(metrics, PREFILL_WAITING_TOKENS)
    if not waiting:
        return None
    return PrefillLoad(
        waiting_tokens=sum(waiting),
        queued_requests=queued_requests,
        mean_prompt_tokens=_positive_mean(_values(metrics, PREFILL_MEAN_PROMPT_TOKENS)) or 0.0,
        tokens_per_s=_positive_mean(_values(metrics, PREFILL_TOKENS_PER_S)),
        latency_ms=_positive_max(_values(metrics, PREFILL_LATENCY_MS)),
    )


def decode_load(metrics: PerReplica, queued_requests: float = 0.0) -> DecodeLoad | None:
    """Combine per-replica decode metrics; None when no replica has reported yet."""
    sequences = _values(metrics, DECODE_SEQUENCES)
    if not sequences:
        return None
    return DecodeLoad(
        sequences=sum(sequences),
        kv_tokens=sum(_values(metrics, DECODE_KV_TOKENS)),
        queued_requests=queued_requests,
        tpot_ms=_positive_max(_values(metrics, DECODE_TPOT_MS)),
    )


# ---- the Serve policies ------------------------------------------------------------------


def _queued(ctx: Any) -> float:
    queued = getattr(ctx, "total_queued_requests", None)
    return float(queued or 0.0)


class PrefillPolicy:
    """Ray Serve autoscaling policy for ``PrefillServer`` (``policy_kwargs``: the fields of
    :class:`PrefillParams`)."""

    def __init__(self, **kwargs: Any) -> None:
        self.params = PrefillParams(**kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        load = prefill_load(ctx.aggregated_metrics or {}, _queued(ctx))
        if load is None:  # no replica has reported yet: hold
            return ctx.target_num_replicas, {}
        desired = prefill_desired_replicas(load, self.params, ctx.target_num_replicas,
                                           ctx.capacity_adjusted_min_replicas)
        return desired, {"last_load": asdict(load), "last_desired": desired}


class DecodePolicy:
    """Ray Serve autoscaling policy for ``DecodeServer`` (``policy_kwargs``: the fields of
    :class:`DecodeParams`)."""

    def __init__(self, **kwargs: Any) -> None:
        self.params = DecodeParams(**kwargs)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        load = decode_load(ctx.aggregated_metrics or {}, _queued(ctx))
        if load is None:
            return ctx.target_num_replicas, {}
        desired = decode_desired_replicas(load, self.params, ctx.target_num_replicas,
                                          ctx.capacity_adjusted_min_replicas)
        return desired, {"last_load": asdict(load), "last_desired": desired}


# ---- replica side: what record_autoscaling_stats reports ---------------------------------


class ThroughputWindow:
    """Prefill throughput over the last ``max_batches`` batches (tokens / compute seconds).

    Kept across idle periods: a replica's speed does not change when no prompt arrives.
    """

    def __init__(self, max_batches: int = 32) -> None:
        self._batches: deque[tuple[int, int, float]] = deque(maxlen=max_batches)

    def add(self, prompts: int, tokens: int, seconds: float) -> None:
        self._batches.append((prompts, tokens, seconds))

    @property
    def tokens_per_s(self) -> float:
        seconds = sum(s for _, _, s in self._batches)
        return sum(t for _, t, _ in self._batches) / seconds if seconds > 0 else 0.0

    @property
    def mean_prompt_tokens(self) -> float:
        prompts = sum(p for p, _, _ in self._batches)
        return sum(t for _, t, _ in self._batches) / prompts if prompts else 0.0


class LatencyWindow:
    """Latencies of the requests that finished in the last ``window_s`` seconds, and the ages
    of those still in flight: ``value_ms`` is their mean, raised to the oldest in-flight age
    (a request stuck in a queue counts before it finishes), and 0 when idle."""

    def __init__(self, window_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._done: deque[tuple[float, float]] = deque()  # (finished at, latency s)
        self._in_flight: dict[Hashable, float] = {}

    def start(self, key: Hashable) -> None:
        self._in_flight[key] = self.clock()

    def finish(self, key: Hashable) -> None:
        started = self._in_flight.pop(key, None)
        if started is not None:
            now = self.clock()
            self._done.append((now, now - started))

    def value_ms(self) -> float:
        now = self.clock()
        while self._done and self._done[0][0] < now - self.window_s:
            self._done.popleft()
        mean = sum(lat for _, lat in self._done) / len(self._done) if self._done else 0.0
        oldest = now - min(self._in_flight.values()) if self._in_flight else 0.0
        return max(mean, oldest) * 1000.0
