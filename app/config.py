"""Engine configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    """Map a dtype name (``float32``, ``bfloat16``, ``float16``) to a torch dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo``; None where it cannot be read."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 products natively (AVX512-BF16 or AMX-BF16)."""
    flags = cpu_flags() or frozenset()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> tuple[str, str]:
    """``dtype`` with ``auto`` decided for ``device``, and why: on a GPU bfloat16; on the CPU
    bfloat16 where it computes bf16 natively (its products then run at twice fp32's rate
    and read half the bytes), else float32."""
    if dtype != "auto":
        return dtype, "set in the config"
    if device != "cpu":
        return "bfloat16", "auto: a GPU serves in bfloat16"
    if cpu_has_native_bf16():
        return "bfloat16", "auto: the CPU has native bf16 products (avx512_bf16)"
    return "float32", "auto: the CPU has no native bf16 products (no avx512_bf16)"


# EngineConfig.weights' values: None keeps the weights in the dtype; "int8": weight-only int8
# with one scale per output channel (CPU, the engine's panel kernel; app.packed_linear)
WEIGHT_FORMATS = (None, "int8")


# accelerate's placement strategies for a model spread over several GPUs (``device_map``).
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


# EngineConfig.linear_layout's values (app.packed_linear)
LINEAR_LAYOUTS = ("auto", "panels", "onednn")


def default_cache_dir() -> Path:
    """Where converted models live: ``$SPLITSERVE_CACHE`` or ``~/.cache/splitserve``."""
    env = os.environ.get("SPLITSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "splitserve"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs to load a model and bound its work.

    ``max_kv_tokens`` is the size of the decoder's paged KV pool (``app.kv_cache``); admission
    reserves each sequence's whole need in it, so a running sequence never runs out of KV
    memory; ``max_model_len`` caps one sequence.

    ``device_map`` (with ``device="cuda"``) spreads the layers of a model too large for one GPU
    over the first ``num_gpus`` visible GPUs with accelerate; each layer's KV lives on that
    layer's GPU. ``None`` puts the whole model on ``device``.
    """

    model: str = DEFAULT_MODEL
    # float32, bfloat16, float16 (GPU) or auto (resolve_dtype). On the CPU, bfloat16 holds the
    # linear weights in bf16 panels for the engine's kernels (products at bf16 rate where the
    # CPU has native bf16) with float32 sums, activations and KV pool (app.model_loader)
    dtype: str = "float32"
    kv_dtype: str | None = None  # KV package (wire) dtype; None: same as dtype
    # None: the linear weights in the dtype; "int8": weight-only int8, one scale per output
    # channel, quantized at load (CPU: the engine's panel kernel, activations float32)
    weights: str | None = None
    device: str = "cpu"
    device_map: str | None = None  # one of DEVICE_MAPS; None: the whole model on `device`
    num_gpus: int = 1  # GPUs a device_map may use (a Ray replica sees exactly its own)
    num_threads: int | None = None  # None: leave torch's default
    # a prefill pass may take up to this many threads while the rest of the machine leaves
    # cores idle (app.idle_cores; for phases that share one machine's cores); None: num_threads
    prefill_max_threads: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    max_batch_size: int = 16
    max_kv_tokens: int = 65536
    max_waiting: int = 64
    prefill_token_budget: int = 4096
    prefill_max_batch_size: int = 8
    # a prefill pass computes at most this many tokens: long prompts in chunks of it, short
    # ones together up to it (app.prefill)
    prefill_chunk_tokens: int = 256
    # a prefill pass (or a decode step's chunks) stops taking more prompts once it holds this
    # many tokens: every prompt in a pass waits for the whole pass, and on a CPU a pass of
    # 64-128 tokens already computes about as fast per token as a longer one, so a wave of
    # chats is answered a few at a time, not all at the end (app.prefill); None: up to
    # prefill_chunk_tokens (an accelerator, which needs large passes to fill)
    prefill_batch_tokens: int | None = None
    # a prompt that has waited this long leads every other prefill pass
    prefill_fairness_s: float = 5.0
    # a prefill replica runs up to this many passes at once, each on an engine thread of its
    # own, the extra ones on one torch thread each at the lowest CPU priority (nice 19) and
    # for long prompts only, no pass taking idle cores (prefill_max_threads) while another
    # runs: where the phases share a machine, a second document's pass takes what the
    # decode replica and the serving stack leave of their core, with no OpenMP barrier
    # between the two passes' threads (deployments.prefill_queue.PrefillQueue); 1: one at a time
    prefill_lanes: int = 1
    # a prefill pass runs this many layers at a time, and between two runs a prompt that
    # arrived meanwhile and needs at most half the pass's tokens gets its own pass
    # first (deployments.prefill_queue.PrefillQueue); 0: passes run whole
    prefill_preempt_layers: int = 4
    # where one engine both prefills and decodes (the colocated app): while sequences are
    # decoding, prompt chunks ride in the decode steps, one forward pass for both under the
    # prefill pass budget (min(prefill_token_budget, prefill_chunk_tokens) tokens, decode rows
    # included); False: separate prefill passes between the steps
    mixed_batch: bool = True
    # KV of recent prompt prefixes kept by a prefill engine (app.prefix_cache); 0: off
    prefix_cache_mb: int = 512
    cache_dir: str | None = None
    trust_remote_code: bool = False
    # float32 on the CPU: a second copy of each linear weight in a layout made for its kernel
    # (app.packed_linear; faster decode and prefill, twice the linear weights' memory); False
    # keeps the model's own layers only
    pack_weights: bool = True
    # which copy: "panels" (the engine's own AVX2 kernel, app.cpu_kernels, built on first
    # use), "onednn" (oneDNN's blocked layout for 2+ rows), "auto" (panels where it builds)
    linear_layout: str = "auto"
    # CPU, float32 KV: decode attention reads each row's keys and values where they lie in
    # the paged pool (the engine's kernel, app/csrc/paged_attention.c), and prefill passes
    # and prompt chunks attend through app/csrc/prefill_attention.c;
    # False: gather + SDPA, and the model's SDPA for prefill
    cpu_attention_kernel: bool = True
    # a Llama-style model with panel-packed linears and in-place attention: each decode step's
    # layers run as one call to the engine's C kernel (app.fused_decode); False: through the
    # model's modules
    fused_decode: bool = True

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.weights == "int8" and self.device != "cpu":
            raise ValueError("weights: int8 runs on the CPU's panel kernel; use device 'cpu'")
        if self.kv_dtype is not None:
            parse_dtype(self.kv_dtype)
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("float16 is not supported on cpu; use float32 or bfloat16")
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {self.num_gpus}")
        if self.device_map is not None:
            if self.device_map not in DEVICE_MAPS:
                raise ValueError(
                    f"device_map must be one of {list(DEVICE_MAPS)}, got {self.device_map!r}"
                )
            if self.device != "cuda":
                raise ValueError(
                    f"device_map spreads a model over GPUs: it needs device 'cuda' (no index), "
                    f"got {self.device!r}"
                )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.prefill_max_threads is not None and self.prefill_max_threads < 1:
            raise ValueError(f"prefill_max_threads must be >= 1, got {self.prefill_max_threads}")
        for name in ("max_batch_size", "max_kv_tokens", "max_waiting", "prefill_token_budget",
                     "prefill_max_batch_size", "prefill_chunk_tokens", "prefill_lanes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.linear_layout not in LINEAR_LAYOUTS:
            raise ValueError(
                f"linear_layout must be one of {LINEAR_LAYOUTS}, got {self.linear_layout!r}"
            )
        if self.prefill_batch_tokens is not None and self.prefill_batch_tokens < 1:
            raise ValueError(f"prefill_batch_tokens must be >= 1, got {self.prefill_batch_tokens}")
        if self.prefill_preempt_layers < 0:
            raise ValueError(f"prefill_preempt_layers must be >= 0, got "
                             f"{self.prefill_preempt_layers}")
        if self.prefill_fairness_s < 0 or self.prefix_cache_mb < 0:
            raise ValueError("prefill_fairness_s and prefix_cache_mb must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def resolved_dtype(self) -> str:
        """``dtype``, with ``auto`` decided for this machine (:func:`resolve_dtype`)."""
        return resolve_dtype(self.dtype, self.device)[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.resolved_dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return parse_dtype(self.kv_dtype or self.resolved_dtype)

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()
