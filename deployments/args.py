"""The app's arguments: what a serve config's ``args:`` holds, validated at deploy time."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.config import DEFAULT_MODEL, EngineConfig
from deployments.autoscaling import DecodeParams, PrefillParams

# Prompts shorter than this are prefilled on the decode replica. Measured on the development
# machine (BENCHMARKS.md, issue 4; `python -m load_tests.local_prefill_bench`): the hop costs
# 12-34 ms of TTFT at every length from 4 to 256 tokens, while a local prefill of even 4 tokens
# stretches the running streams' longest token gap by over 100 ms more than the hop does, so
# the hop pays at every length there and every prompt hops by default.
DEFAULT_LOCAL_PREFILL_THRESHOLD = 0


class ScalingArgs(BaseModel):
    """Which signal a phase scales on, once its ``autoscaling_config`` is set."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["load", "slo", "ongoing_requests"] = Field(
        "load", description="'load': the phase's own load (prefill: waiting + in-flight prompt "
        "tokens; decode: sequences and KV tokens held); 'slo': its measured latency against "
        "ttft_target_ms (prefill) / tpot_target_ms (decode); 'ongoing_requests': Ray Serve's "
        "default request-count policy (target_ongoing_requests), for comparison.")
    target_queue_delay_s: float = Field(
        0.5, gt=0, description="Prefill, load policy: one replica's capacity is the prompt "
        "tokens it prefills within this delay (tokens/s x delay).")
    prefill_tokens_per_s: float | None = Field(
        None, gt=0, description="Prefill, load policy: one replica's prefill throughput in "
        "tokens/s. None: what the replicas measure on their own batches.")
    target_sequences: int | None = Field(
        None, ge=1, description="Decode, load policy: sequences one replica should run. "
        "None: max_batch_size.")
    target_kv_fraction: float = Field(
        0.8, gt=0, le=1, description="Decode, load policy: the fraction of max_kv_tokens one "
        "replica should hold.")
    scale_down_ratio: float = Field(
        0.6, gt=0, le=1, description="Hysteresis: scale up once the replicas are over "
        "capacity, scale down only when the load would fill one replica fewer to at most this "
        "fraction of its capacity (slo policy: its latency target).")
    ttft_target_ms: float | None = Field(
        None, gt=0, description="Prefill, slo policy: target for the prefill share of time to "
        "first token (arrival at the prefill replica -> KV package ready).")
    tpot_target_ms: float | None = Field(
        None, gt=0, description="Decode, slo policy: target time per output token (decode "
        "step).")
    latency_window_s: float = Field(
        10.0, gt=0, description="Replicas report the mean latency of the requests or steps of "
        "the last this-many seconds.")


class PhaseArgs(BaseModel):
    """Placement and scale of one phase (prefill or decode)."""

    model_config = ConfigDict(extra="forbid")

    resource_tag: str | None = Field(
        None, description="Custom Ray resource each replica asks one unit of; the nodes that "
        "offer it decide where this phase runs. None: no tag.")
    resource_amount: float = Field(
        1.0, gt=0, description="Units of resource_tag per replica (fractions pack replicas).")
    accelerator_type: str | None = Field(
        None, description="Ray accelerator_type (e.g. 'H100', 'L4') each replica asks for.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica.")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs per replica (set device: cuda). A fraction packs replicas "
        "on one GPU; more than 1 (a whole number) spreads the model over the replica's GPUs "
        "with accelerate's device_map (see AppArgs.device_map).")
    num_threads: int | None = Field(
        1, ge=1, description="torch intra-op threads per replica; None leaves torch's default.")
    num_replicas: int | None = Field(
        1, ge=1, description="Fixed replica count; ignored when autoscaling_config is set.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config for this phase (min_replicas, "
        "max_replicas, initial_replicas, upscale_delay_s, downscale_delay_s, "
        "look_back_period_s, metrics_interval_s...). The phase's policy (see scaling) is "
        "added unless it names its own 'policy'.")
    scaling: ScalingArgs = Field(
        default_factory=ScalingArgs, description="The signal and targets this phase scales "
        "on when autoscaling_config is set.")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests one replica accepts at once before Serve queues them.")
    graceful_shutdown_timeout_s: float = Field(
        600.0, ge=0, description="A stopping replica (scale-down, redeploy) takes no new "
        "requests and waits up to this long for its in-flight ones, then is killed. Long "
        "enough for the longest decode stream (max_model_len x step time), so scaling decode "
        "down never cuts a stream; an idle replica stops at once whatever this is.")
    graceful_shutdown_wait_loop_s: float = Field(
        1.0, gt=0, description="How often a stopping replica checks that its in-flight "
        "requests are done.")
    max_queued_requests: int = Field(
        256, ge=1, description="Requests Serve queues for this phase (beyond those the "
        "replicas hold) before refusing at once; the client then gets 503 + Retry-After.")
    health_check_period_s: float = Field(
        5.0, gt=0, description="How often Serve runs the replica's health check.")
    health_check_timeout_s: float = Field(
        30.0, gt=0, description="A health check slower than this fails the replica.")

    @field_validator("num_gpus")
    @classmethod
    def _whole_gpus(cls, v: float) -> float:
        if v > 1 and v != int(v):
            raise ValueError(f"num_gpus above 1 must be a whole number, got {v}")
        return v

    def ray_actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            opts["num_gpus"] = self.num_gpus
        if self.resource_tag:
            opts["resources"] = {self.resource_tag: self.resource_amount}
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        return opts

    def deployment_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "ray_actor_options": self.ray_actor_options(),
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": self.graceful_shutdown_wait_loop_s,
            "max_queued_requests": self.max_queued_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = self.autoscaling_config
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


def _default_prefill() -> PhaseArgs:
    return PhaseArgs(resource_tag="prefill_accel")


def _default_decode() -> PhaseArgs:
    return PhaseArgs(resource_tag="decode_accel")


class IngressArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved by the ingress replica.")
    resource_tag: str | None = Field(
        None, description="Custom resource the ingress asks for (pins it, e.g. to the head).")
    num_replicas: int = Field(1, ge=1, description="Ingress replicas (CPU only, no weights).")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="Requests one ingress replica holds at once (Serve's bound; "
        "max_in_flight answers 429 before it is reached).")
    max_queued_requests: int = Field(
        256, ge=1, description="Requests the proxy queues for the ingress before 503.")
    max_in_flight: int = Field(
        512, ge=1, description="Requests the ingress serves at once; past it, new requests "
        "get 429 with Retry-After at once.")
    max_body_bytes: int = Field(
        1 << 20, ge=1024, description="Largest request body accepted; larger gets 413.")
    api_key: str | None = Field(
        None, description="If set (or if the SPLITSERVE_API_KEY environment variable is set "
        "in the ingress replica), every route but /health needs 'Authorization: Bearer KEY'.")
    trace_history: int = Field(
        1024, ge=0, description="Finished requests whose server-side timings (queueing, "
        "prefill, KV hop, decode) the ingress keeps for GET /debug/requests; 0 turns it off.")

    def ray_actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resource_tag:
            opts["resources"] = {self.resource_tag: 0.01}
        return opts


class AppArgs(BaseModel):
    """Arguments of the app (``deployments.builder:build_app``): split, or the colocated
    baseline with ``mode: colocated``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, description="Alias, .gguf file, local HF dir or hub id.")
    served_model_name: str | None = Field(
        None, description="Name clients put in 'model'; default: the model setting.")
    dtype: str = Field("float32", description="Weights dtype: float32, bfloat16, float16.")
    kv_dtype: str | None = Field(
        None, description="dtype of the KV package that crosses the object store; default: dtype. "
        "The decode batch holds KV in the model's dtype (a package is cast once on joining).")
    device: str = Field("cpu", description="'cpu' or 'cuda' for both phases.")
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] = Field(
        "auto", description="With device 'cuda', how a replica with num_gpus > 1 spreads the "
        "model's layers over its GPUs (accelerate's device_map strategy); each layer's KV "
        "stays on its layer's GPU. Unused for replicas with one GPU or less.")
    max_model_len: int | None = Field(
        None, ge=2, description="Context cap in tokens; default: the model's own.")
    max_batch_size: int = Field(16, ge=1, description="Decode: sequences per step at most.")
    max_kv_tokens: int = Field(
        65536, ge=128, description="Decode: KV buffer bound in tokens (rows x capacity).")
    max_waiting: int = Field(
        64, ge=1, description="Decode: sequences waiting for a batch row before 429.")
    prefill_token_budget: int = Field(
        4096, ge=16, description="Prefill: padded tokens per forward pass.")
    prefill_max_batch_size: int = Field(8, ge=1, description="Prefill: prompts per pass.")
    prefill_batch_wait_s: float = Field(
        0.005, ge=0, le=1.0, description="Prefill: how long a batch waits to fill.")
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens when a chat request gives none.")
    local_prefill_threshold: int = Field(
        DEFAULT_LOCAL_PREFILL_THRESHOLD, ge=0, description="Conditional disaggregation: a "
        "prompt shorter than this many tokens is prefilled on the decode replica itself (no "
        "KV hop); a longer one goes to the prefill deployment. 0: every prompt hops.")
    prefill: PhaseArgs = Field(default_factory=_default_prefill, description="Prefill phase.")
    decode: PhaseArgs = Field(default_factory=_default_decode, description="Decode phase.")
    ingress: IngressArgs = Field(default_factory=IngressArgs, description="HTTP/handle ingress.")
    mode: Literal["split", "colocated"] = Field(
        "split", description="'split': prefill and decode deployments, each KV cache through "
        "the object store. 'colocated': the baseline, one deployment (see colocated) runs both "
        "phases on the same cores, prefilling new prompts between its decode steps; prefill "
        "and decode settings are then unused, the engine limits are the same.")
    colocated: PhaseArgs = Field(
        default_factory=PhaseArgs, description="Placement and scale of the colocated "
        "deployment (mode: colocated).")
    cache_dir: str | None = Field(None, description="Where converted GGUF models are cached.")
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
    enable_fault_injection: bool = Field(
        False, description="Expose replica methods that stall or crash the engine, for fault "
        "tests only. Never enable in production.")

    @field_validator("dtype", "kv_dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v is not None and v not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {v!r}; expected float32, bfloat16 or float16")
        return v

    @model_validator(mode="after")
    def _engine_config_valid(self):
        # both phases build their engine from these fields: fail at deploy time, not in a replica
        for phase in ("prefill", "decode"):
            self.engine_config(phase)
            self.policy_kwargs(phase)
        if self.mode == "colocated":
            self.engine_config("colocated")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self, phase: str) -> EngineConfig:
        """The engine of one deployment: ``prefill``, ``decode`` or ``colocated``."""
        args = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[phase]
        try:
            on_gpu = self.device.startswith("cuda")
            if on_gpu and args.num_gpus == 0:
                raise ValueError(f"device {self.device!r} needs num_gpus > 0 (Ray gives a "
                                 "replica without GPUs none to see)")
            spread = on_gpu and args.num_gpus > 1
            return EngineConfig(
                model=self.model,
                dtype=self.dtype,
                kv_dtype=self.kv_dtype,
                device=self.device,
                device_map=self.device_map if spread else None,
                num_gpus=int(args.num_gpus) if spread else 1,
                num_threads=args.num_threads,
                max_model_len=self.max_model_len,
                max_batch_size=self.max_batch_size,
                max_kv_tokens=self.max_kv_tokens,
                max_waiting=self.max_waiting,
                prefill_token_budget=self.prefill_token_budget,
                prefill_max_batch_size=self.prefill_max_batch_size,
                cache_dir=self.cache_dir,
            )
        except ValueError as exc:
            raise ValueError(f"{phase}: {exc}") from exc

    def policy_kwargs(self, phase: str) -> dict[str, Any]:
        """The ``policy_kwargs`` of the phase's autoscaling policy (checked here, at deploy
        time, rather than in the Serve controller)."""
        sc = (self.prefill if phase == "prefill" else self.decode).scaling
        mode = "load" if sc.policy == "ongoing_requests" else sc.policy
        try:
            if phase == "prefill":
                params: Any = PrefillParams(
                    mode=mode, target_queue_delay_s=sc.target_queue_delay_s,
                    tokens_per_s=sc.prefill_tokens_per_s,
                    scale_down_ratio=sc.scale_down_ratio, ttft_target_ms=sc.ttft_target_ms)
            else:
                params = DecodeParams(
                    mode=mode, sequences_per_replica=sc.target_sequences or self.max_batch_size,
                    kv_tokens_per_replica=self.max_kv_tokens * sc.target_kv_fraction,
                    scale_down_ratio=sc.scale_down_ratio, tpot_target_ms=sc.tpot_target_ms)
        except ValueError as exc:
            raise ValueError(f"{phase}.scaling: {exc}") from exc
        return {name: getattr(params, name) for name in params.__dataclass_fields__}

    def deployment_options(self, phase: str) -> dict[str, Any]:
        """Serve options of one phase's deployment: placement, scale and, when it autoscales,
        its phase policy (``deployments.autoscaling``) unless the config names its own."""
        args = self.prefill if phase == "prefill" else self.decode
        opts = args.deployment_options()
        config = opts.get("autoscaling_config")
        if config is not None and "policy" not in config \
                and args.scaling.policy != "ongoing_requests":
            policy = "PrefillPolicy" if phase == "prefill" else "DecodePolicy"
            opts["autoscaling_config"] = {**config, "policy": {
                "policy_function": f"deployments.autoscaling:{policy}",
                "policy_kwargs": self.policy_kwargs(phase)}}
        return opts
