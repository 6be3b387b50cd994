"""The app's arguments: what a serve config's ``args:`` holds, validated at deploy time."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.config import DEFAULT_MODEL, EngineConfig


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
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (set device: cuda).")
    num_threads: int | None = Field(
        1, ge=1, description="torch intra-op threads per replica; None leaves torch's default.")
    num_replicas: int | None = Field(
        1, ge=1, description="Fixed replica count; ignored when autoscaling_config is set.")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config for this phase (min_replicas, "
        "max_replicas, initial_replicas, delays...).")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests one replica accepts at once before Serve queues them.")
    graceful_shutdown_timeout_s: float = Field(
        60.0, ge=0, description="How long a stopping replica may finish in-flight work.")

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
        256, ge=1, description="Requests one ingress replica holds at once.")

    def ray_actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resource_tag:
            opts["resources"] = {self.resource_tag: 0.01}
        return opts


class AppArgs(BaseModel):
    """Arguments of the split app (``deployments.builder:build_app``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL, description="Alias, .gguf file, local HF dir or hub id.")
    served_model_name: str | None = Field(
        None, description="Name clients put in 'model'; default: the model setting.")
    dtype: str = Field("float32", description="Weights dtype: float32, bfloat16, float16.")
    kv_dtype: str | None = Field(None, description="KV package/cache dtype; default: dtype.")
    device: str = Field("cpu", description="'cpu' or 'cuda' for both phases.")
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
    prefill: PhaseArgs = Field(default_factory=_default_prefill, description="Prefill phase.")
    decode: PhaseArgs = Field(default_factory=_default_decode, description="Decode phase.")
    ingress: IngressArgs = Field(default_factory=IngressArgs, description="HTTP/handle ingress.")
    cache_dir: str | None = Field(None, description="Where converted GGUF models are cached.")

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
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def engine_config(self, phase: str) -> EngineConfig:
        args = self.prefill if phase == "prefill" else self.decode
        try:
            return EngineConfig(
                model=self.model,
                dtype=self.dtype,
                kv_dtype=self.kv_dtype,
                device=self.device,
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
