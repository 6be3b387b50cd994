"""The app's arguments: what a serve config's ``args:`` holds, validated at deploy time.

Every setting has one home, and this module only adds what has none elsewhere:

* the engine's settings are ``app.config.EngineConfig`` itself (``engine:``), shared by every
  phase; only a phase's torch threads, CPU priority and GPUs are set per phase;
* a phase's Serve options are a ``deployment_config`` dict checked against Serve's own
  deployment schema (as Ray Serve LLM does), plus this project's placement fields (resource
  tag, accelerator type, threads, nice);
* a phase's scaling parameters are its policy's own parameter model
  (``deployments.autoscaling.PrefillParams`` / ``DecodeParams``);
* ``colocated:`` set selects the colocated baseline (one deployment for both phases).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.config import EngineConfig, moved_setting
from deployments.autoscaling import DecodeParams, PrefillParams
from deployments.serve_options import check_deployment_config, merged, policy_path, scaling_override

# Prompts shorter than this are prefilled on the decode replica; 0: every prompt hops
# (the measurement behind the default: BENCHMARKS.md, "Split path").
DEFAULT_LOCAL_PREFILL_THRESHOLD = 0
# ... and, while the prefill phase is backed up by at least a pass, prompts shorter than
# this (BENCHMARKS.md §7, the AVX2 runs: a chat waited a pass or more behind document chunks)
DEFAULT_LOCAL_PREFILL_WHEN_BUSY = 128
# The decode policy's default KV target: this fraction of a replica's max_kv_tokens.
DEFAULT_KV_FRACTION = 0.8

class _Deployment(BaseModel):
    """A deployment's Serve options (``deployment_config``) over the project's defaults."""

    model_config = ConfigDict(extra="forbid")
    DEFAULTS: ClassVar[dict[str, Any]] = {}

    deployment_config: dict[str, Any] = Field(
        default_factory=dict, description="Ray Serve deployment options, as in a Serve "
        "config's deployments: num_replicas or autoscaling_config, max_ongoing_requests, "
        "max_queued_requests, graceful_shutdown_timeout_s, health_check_period_s, "
        "ray_actor_options (num_cpus, num_gpus, runtime_env...), ... Validated by Serve's "
        "own deployment schema; merged over this deployment's defaults (DEFAULTS).")

    @field_validator("deployment_config")
    @classmethod
    def _serve_accepts_it(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_deployment_config(cls.__name__, v)

    def _placement(self) -> dict[str, Any]:
        """ray_actor_options this project adds (resource tags, accelerator type)."""
        return {}

    def deployment_options(self) -> dict[str, Any]:
        given = self.deployment_config
        defaults = dict(self.DEFAULTS)
        if "autoscaling_config" in given:
            defaults.pop("num_replicas", None)  # Serve refuses both
        opts = merged(defaults, given)
        opts["ray_actor_options"] = merged(opts.get("ray_actor_options", {}),
                                            self._placement())
        return opts

    @property
    def num_gpus(self) -> float:
        return float(self.deployment_options()["ray_actor_options"].get("num_gpus") or 0)


class PhaseArgs(_Deployment):
    """Placement and scale of one phase (prefill, decode, or the colocated baseline)."""

    DEFAULTS: ClassVar[dict[str, Any]] = {
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 1},
        "max_ongoing_requests": 64,
        # Requests Serve queues beyond what the replicas hold; past it: 503 + Retry-After.
        "max_queued_requests": 256,
        # A stopping replica (scale-down, redeploy) finishes its streams first: long enough
        # for the longest decode stream, so scaling decode down never cuts one.
        "graceful_shutdown_timeout_s": 600.0,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        # Serve's default router, but an ingress's token feed goes to the replica it names
        "request_router_config": {
            "request_router_class": "deployments.token_feed.FeedRouter"},
    }

    resource_tag: str | None = Field(
        None, description="Custom Ray resource each replica asks for; the nodes that offer "
        "it decide where this phase runs. None: no tag.")
    resource_amount: float = Field(
        1.0, gt=0, description="Units of resource_tag per replica (fractions pack replicas).")
    accelerator_type: str | None = Field(
        None, description="Ray accelerator_type (e.g. 'H100', 'L4') each replica asks for.")
    num_threads: int | None = Field(
        1, ge=1, description="torch intra-op threads per replica; None leaves torch's "
        "default.")
    nice: int | None = Field(
        None, ge=-20, le=19, description="CPU priority (Linux nice) of each replica's engine "
        "thread and its OpenMP workers (engine.nice); None: the process's.")
    latency_window_s: float = Field(
        10.0, gt=0, description="Replicas report the mean latency of their requests or "
        "steps of the last this-many seconds (the slo scaling mode reads it).")

    def _placement(self) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if self.resource_tag:
            opts["resources"] = {self.resource_tag: self.resource_amount}
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        return opts

    @model_validator(mode="after")
    def _whole_gpus(self):
        n = self.num_gpus
        if n > 1 and n != int(n):
            raise ValueError(f"ray_actor_options.num_gpus above 1 must be a whole number, "
                             f"got {n}")
        return self


class PrefillPhaseArgs(PhaseArgs):
    # Prompts that start alike go to the replica whose prefix cache holds their start
    # (deployments.prefix_router), unless it is busier than the rest.
    DEFAULTS: ClassVar[dict[str, Any]] = {
        **PhaseArgs.DEFAULTS,
        "request_router_config": {
            "request_router_class": "deployments.prefix_router.PrefixAffinityRouter",
            "request_router_kwargs": {"prefix_tokens": 64, "imbalance": 4},
        },
    }

    resource_tag: str | None = Field(
        "prefill_accel", description="Custom Ray resource each prefill replica asks for; "
        "the nodes that offer it run the prefill phase. None: no tag.")
    scaling: PrefillParams = Field(
        default_factory=PrefillParams, description="The prefill policy's parameters "
        "(deployments.autoscaling.PrefillParams), used once autoscaling_config is set.")


class DecodePhaseArgs(PhaseArgs):
    resource_tag: str | None = Field(
        "decode_accel", description="Custom Ray resource each decode replica asks for; "
        "the nodes that offer it run the decode phase. None: no tag.")
    scaling: DecodeParams = Field(
        default_factory=DecodeParams, description="The decode policy's parameters "
        "(deployments.autoscaling.DecodeParams), used once autoscaling_config is set; "
        "sequences_per_replica defaults to max_batch_size, kv_tokens_per_replica to "
        f"{DEFAULT_KV_FRACTION} x max_kv_tokens.")


class IngressArgs(_Deployment):
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0.5},
        # Serve's bound; max_in_flight answers 429 before it is reached.
        "max_ongoing_requests": 1024,
        "max_queued_requests": 256,
        # A replaced ingress (redeploy) keeps serving its open streams as decode does;
        # Serve's own 20 s would cut any stream longer than that.
        "graceful_shutdown_timeout_s": 600.0,
        "graceful_shutdown_wait_loop_s": 1.0,
    }

    resource_tag: str | None = Field(
        None, description="Custom resource the ingress asks for: it runs only on nodes that "
        "offer it (the cluster manifests: a CPU worker group, never the head, so that losing "
        "the head loses no ingress replica).")
    max_in_flight: int = Field(
        512, ge=1, description="Requests the ingress serves at once; past it, new requests "
        "get 429 with Retry-After at once.")
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body accepted; larger gets 413.")
    api_key: str | None = Field(
        None, description="If set (or if the SPLITSERVE_API_KEY environment variable is set "
        "in the ingress replica), every route but /health needs 'Authorization: Bearer KEY'.")
    max_queue_wait_s: float | None = Field(
        None, gt=0, description="Load shedding: a request whose estimated wait for its first "
        "token (answers waiting here / first tokens per second lately) is over this gets 429 "
        "with Retry-After at once (deployments.admission). None: no estimate, requests queue "
        "until request_timeout_s, as vLLM's do.")
    kv_in_flight_bytes: int | None = Field(
        None, ge=1, description="KV package bytes this ingress replica lets into the object "
        "store: a package stays there from its prefill until its decode stream ends (Ray "
        "keeps a task's argument objects until the task finishes). A prompt that does not fit "
        "waits before prefill, within its deadline (backpressure from decode to prefill: "
        "deployments.kv_budget). None: kv_in_flight_fraction of the smallest node object "
        "store, shared by the ingress replicas.")
    kv_in_flight_fraction: float = Field(
        0.5, gt=0, le=1, description="The default kv_in_flight_bytes as a fraction of the "
        "smallest object store among the cluster's nodes (read when the ingress starts).")
    trace_history: int = Field(
        1024, ge=0, description="Finished requests whose server-side timings (queueing, "
        "prefill, KV hop, decode) the ingress keeps for GET /debug/requests; 0 turns it off.")
    token_feed: bool = Field(
        True, description="Decode replicas send this ingress each step's tokens for all its "
        "streams as one Ray stream item (deployments.token_feed) instead of one item per "
        "token per stream: the same tokens, far less Ray work per token on both sides.")
    tool_call_parser: Literal["hermes"] | None = Field(
        None, description="The model's own tool-call format, read from its answers for "
        'tool_choice "auto" (app.tools.PARSERS); None: "auto" with tools is a 400.')

    def _placement(self) -> dict[str, Any]:
        return {"resources": {self.resource_tag: 0.01}} if self.resource_tag else {}

    @property
    def max_replicas(self) -> int:
        """The most ingress replicas this deployment may run (they share the KV budget)."""
        opts = self.deployment_options()
        scaling = opts.get("autoscaling_config")
        if scaling:
            return int(scaling.get("max_replicas", 1))
        return int(opts.get("num_replicas", 1))


class AppArgs(BaseModel):
    """Arguments of the app (``deployments.builder:build_app``)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The engine every phase runs "
        "(app.config.EngineConfig: its fields are the `engine` table below). Threads, "
        "nice and GPUs are set per phase.")
    served_model_name: str | None = Field(
        None, description="Name clients put in 'model'; default: engine.model.")
    prefill: PrefillPhaseArgs = Field(default_factory=PrefillPhaseArgs,
                                      description="Prefill phase.")
    decode: DecodePhaseArgs = Field(default_factory=DecodePhaseArgs,
                                    description="Decode phase.")
    colocated: PhaseArgs | None = Field(
        None, description="Set: the colocated baseline. One deployment on this placement "
        "runs both phases on the same cores (with engine.mixed_batch, the default, new "
        "prompts' chunks ride in its decode steps; otherwise they are passes between "
        "them); prefill and decode are then unused, the engine is the same.")
    ingress: IngressArgs = Field(default_factory=IngressArgs, description="HTTP/handle ingress.")
    prefill_batch_wait_s: float = Field(
        0.005, ge=0, le=1.0, description="Prefill: how long a batch waits to fill.")
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens when a chat request gives none.")
    local_prefill_threshold: int = Field(
        DEFAULT_LOCAL_PREFILL_THRESHOLD, ge=0, description="Conditional disaggregation: a "
        "prompt shorter than this many tokens is prefilled on the decode replica itself (no "
        "KV hop); a longer one goes to the prefill deployment. 0: every prompt hops.")
    local_prefill_when_busy: int = Field(
        DEFAULT_LOCAL_PREFILL_WHEN_BUSY, ge=0, description="A prompt shorter than this many "
        "tokens may also be prefilled on the decode replica while the prefill phase is "
        "backed up (prefill_busy_tokens): it goes to the side with fewer tokens ahead of it "
        "(decode: local prompts not yet streaming; prefill: the short prompts there and two "
        "passes of longer ones); on the decode replica it rides in the decode steps "
        "(engine.mixed_batch). 0: off.")
    prefill_busy_tokens: int | None = Field(
        None, ge=1, description="The prefill phase counts as backed up while the prompt "
        "tokens an ingress replica has sent it, whose streams have not started, are at least "
        "this many. Default: one prefill pass (min(engine.prefill_token_budget, "
        "engine.prefill_chunk_tokens)). Counted per ingress replica: with several prefill "
        "replicas, raise it in proportion.")
    request_timeout_s: float = Field(
        600.0, gt=0, description="A request running longer is ended with a 504 (an error "
        "event on a stream) and its prefill/decode work is cancelled.")
    max_retries: int = Field(
        2, ge=0, description="Times one request may be re-run after a replica or its node "
        "dies (re-prefill, resume on another decode replica) before the client gets an error.")
    retry_backoff_s: float = Field(
        0.5, ge=0, description="Wait before each retry (doubles each time).")
    decode_stall_timeout_s: float = Field(
        60.0, gt=0, description="A decode replica with work whose loop has not finished a "
        "step for this long fails its health check, so Serve replaces it.")
    allow_pending_resources: bool = Field(
        False, description="Deploy even when no node of the cluster offers a phase's "
        "resource tag or accelerator type yet (an autoscaler will add such nodes); "
        "otherwise the build fails at once naming what is missing. Also set by "
        "SPLITSERVE_ALLOW_PENDING_RESOURCES=1, and implied where Ray's autoscaler has a node "
        "type that offers it.")
    enable_fault_injection: bool = Field(
        False, description="Expose replica methods that stall or crash the engine, for fault "
        "tests only. Never enable in production.")

    @field_validator("engine", mode="before")
    @classmethod
    def _no_moved_settings(cls, value):
        """A setting that moved under engine.kernels is refused by name, with where it went
        (not only as an unexpected keyword)."""
        if isinstance(value, dict):
            moved = [m for m in map(moved_setting, value) if m is not None]
            if moved:
                raise ValueError("; ".join(moved))
        return value

    @model_validator(mode="after")
    def _phases_valid(self):
        for name in ("num_threads", "nice", "num_gpus"):
            if getattr(self.engine, name) != EngineConfig.__dataclass_fields__[name].default:
                raise ValueError(f"engine.{name} is set per phase (prefill/decode/colocated: "
                                 "num_threads, nice, deployment_config.ray_actor_options."
                                 "num_gpus)")
        # every phase builds its engine from these: fail at deploy time, not in a replica
        for phase in self.phases:
            self.engine_config(phase)
            self.deployment_options(phase)
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def is_colocated(self) -> bool:
        return self.colocated is not None

    @property
    def busy_prefill_tokens(self) -> int:
        """``prefill_busy_tokens``, or one prefill pass by default."""
        return self.prefill_busy_tokens or min(self.engine.prefill_token_budget,
                                               self.engine.prefill_chunk_tokens)

    @property
    def phases(self) -> tuple[str, ...]:
        return ("colocated",) if self.is_colocated else ("prefill", "decode")

    def phase(self, name: str) -> PhaseArgs:
        phase = {"prefill": self.prefill, "decode": self.decode,
                 "colocated": self.colocated}[name]
        if phase is None:
            raise ValueError(f"no {name} phase in this app")
        return phase

    def engine_config(self, phase: str) -> EngineConfig:
        """The engine of one deployment: ``prefill``, ``decode`` or ``colocated``."""
        args = self.phase(phase)
        eng = self.engine
        try:
            on_gpu = eng.device.startswith("cuda")
            if on_gpu and args.num_gpus == 0:
                raise ValueError(f"device {eng.device!r} needs ray_actor_options.num_gpus > 0 "
                                 "(Ray gives a replica without GPUs none to see)")
            spread = on_gpu and args.num_gpus > 1
            return dataclasses.replace(
                eng, num_threads=args.num_threads, nice=args.nice,
                num_gpus=int(args.num_gpus) if spread else 1,
                device_map=(eng.device_map or "auto") if spread else None)
        except ValueError as exc:
            raise ValueError(f"{phase}: {exc}") from exc

    def scaling_params(self, phase: str) -> PrefillParams | DecodeParams:
        """The phase policy's parameters, with defaults taken from the engine's limits."""
        if phase == "prefill":
            return self.prefill.scaling
        sc = self.decode.scaling
        return dataclasses.replace(
            sc, sequences_per_replica=sc.sequences_per_replica or self.engine.max_batch_size,
            kv_tokens_per_replica=(sc.kv_tokens_per_replica
                                   or self.engine.max_kv_tokens * DEFAULT_KV_FRACTION))

    def scaling_policy(self, phase: str) -> str | None:
        """The import path of the policy the phase autoscales with: the one its
        ``autoscaling_config`` names, else its phase policy; None: Serve's default."""
        config = self.phase(phase).deployment_options().get("autoscaling_config") or {}
        named = (config.get("policy") or {}).get("policy_function")
        if named is not None:
            return policy_path(named)
        if phase == "colocated":
            return None
        policy = "PrefillPolicy" if phase == "prefill" else "DecodePolicy"
        return f"deployments.autoscaling:{policy}"

    def check_scaling_policy(self, phase: str, autoscaling_config: Any) -> None:
        """Refuse a replica whose deployment autoscales (``autoscaling_config``: Serve's
        ``AutoscalingConfig`` as deployed) with another policy than its phase's.

        A Serve config's ``deployments:`` entry that sets ``autoscaling_config`` replaces the
        app's whole dict (Serve's ``override_deployment_info`` updates options one level
        deep), so the phase policy this app put there is gone and Serve's default, which
        scales on request counts, would run without a word.
        """
        expected = self.scaling_policy(phase)
        if autoscaling_config is None or expected is None:
            return
        actual = policy_path(autoscaling_config.policy.policy_function)
        if actual == expected:
            return
        raise ValueError(scaling_override(phase, actual, expected))

    def deployment_options(self, phase: str) -> dict[str, Any]:
        """Serve options of one phase's deployment: placement, scale and, when it autoscales,
        its phase policy (``deployments.autoscaling``) unless the config names its own."""
        opts = self.phase(phase).deployment_options()
        config = opts.get("autoscaling_config")
        if config is not None and "policy" not in config and phase != "colocated":
            opts["autoscaling_config"] = {**config, "policy": {
                "policy_function": self.scaling_policy(phase),
                "policy_kwargs": dataclasses.asdict(self.scaling_params(phase))}}
        try:
            return check_deployment_config(phase, opts)
        except ValueError as exc:
            raise ValueError(f"{phase}.deployment_config: {exc}") from exc
