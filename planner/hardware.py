"""What a phase costs on a device: measured on this machine or derived from a spec (roofline).

A :class:`DeviceProfile` answers the three questions the simulator asks, in seconds:

* ``prefill_s(rows, longest)``: one right-padded prefill forward pass of ``rows`` prompts whose
  longest has ``longest`` tokens (the engine computes ``rows x longest`` tokens);
  ``prefill_chunk_s(rows, chunk, past)`` the same for chunks that follow ``past`` positions
  already computed or cached;
* ``decode_s(batch, span)``: one decode step of ``batch`` sequences whose longest context is
  ``span`` tokens (the engine attends every row over ``span`` positions);
* ``hop_s(nbytes)``: moving one KV package from a prefill to a decode replica.

Each pass costs ``overhead + max(compute, memory)`` where each term is linear in the pass's
features. A measured profile fits the compute term by least squares and leaves the memory term
zero; a roofline profile computes both from FLOP/s and bytes/s with efficiency factors.

Spec figures come from vendor datasheets (the ``source`` of each preset); prices are typical
on-demand cloud list prices per GPU-hour and drift: override them for your own quotes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

# ---- model ------------------------------------------------------------------------------

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape facts a roofline needs, from a transformers config."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected {sorted(_DTYPE_BYTES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @classmethod
    def from_config(cls, config: Any, name: str | None = None,
                    dtype: str | None = None) -> ModelSpec:
        """From a transformers ``PretrainedConfig`` or its ``config.json`` dict (Llama-style
        decoders: Llama, Mistral, Qwen2/3, SmolLM)."""
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        torch_dtype = str(get("torch_dtype") or get("dtype") or "bfloat16").replace("torch.", "")
        return cls(
            name=name or str(get("_name_or_path") or get("model_type") or "model"),
            hidden_size=hidden,
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            dtype=dtype or torch_dtype,
        )

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Matmul parameters of the decoder layers (norms are negligible and left out)."""
        kv_dim = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (self.q_dim + 2 * kv_dim) + self.q_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.layer_params + self.lm_head_params + embed

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward pass reads: every matmul weight once (embedding rows are few)."""
        return (self.layer_params + self.lm_head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


# Source: huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json
LLAMA_31_8B = ModelSpec("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256, False, "bfloat16")
# Source: huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json
LLAMA_31_70B = ModelSpec("llama-3.1-70b", 8192, 80, 64, 8, 128, 28672, 128256, False, "bfloat16")
# Source: huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json (this
# project's default model, run in float32 here)
SMOLLM2_135M = ModelSpec("smollm2-135m", 576, 30, 9, 3, 64, 1536, 49152, True, "float32")
MODELS = {m.name: m for m in (LLAMA_31_8B, LLAMA_31_70B, SMOLLM2_135M)}


# ---- hardware ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One accelerator, as its datasheet states it, plus what it costs to rent."""

    name: str
    dense_tflops: float  # dense BF16 tensor-core TFLOP/s (no sparsity)
    mem_bw_tbs: float  # HBM/GDDR bandwidth, TB/s
    mem_gb: float
    interconnect_gbs: float  # GPU-to-GPU bandwidth within a node, GB/s (one direction)
    network_gbs: float  # per-GPU network to another node, GB/s (e.g. 400 Gb/s NIC = 50)
    tdp_w: float
    price_per_hour: float  # USD per device-hour
    source: str = ""


# Datasheet figures; prices are typical 2025 on-demand list prices per GPU-hour (Lambda, RunPod,
# Google Cloud), which vary by provider and month: pass your own to roofline_profile
# (price_per_hour).
HARDWARE: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec(
            "H100", 989.0, 3.35, 80, 900, 50, 700, 2.99,
            "NVIDIA H100 Tensor Core GPU datasheet, SXM5 column "
            "(nvidia.com/en-us/data-center/h100/): BF16 1,979 TFLOPS with sparsity = 989 "
            "dense, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s, TDP up to 700 W; network: "
            "ConnectX-7 400 Gb/s per GPU (DGX H100 datasheet); price: Lambda on-demand "
            "H100 SXM, 2025"),
        HardwareSpec(
            "H200", 989.0, 4.8, 141, 900, 50, 700, 3.79,
            "NVIDIA H200 Tensor Core GPU datasheet, SXM column "
            "(nvidia.com/en-us/data-center/h200/): BF16 1,979 TFLOPS with sparsity = 989 "
            "dense, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s, TDP up to 700 W; network "
            "400 Gb/s per GPU; price: typical 2025 on-demand H200 SXM"),
        HardwareSpec(
            "A100", 312.0, 2.039, 80, 600, 25, 400, 1.79,
            "NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column "
            "(nvidia.com/en-us/data-center/a100/): BF16 312 TFLOPS dense, 2,039 GB/s HBM2e, "
            "80 GB, NVLink 600 GB/s, TDP 400 W; network: 200 Gb/s HDR per GPU (DGX A100); "
            "price: Lambda on-demand A100 SXM 80GB, 2025"),
        HardwareSpec(
            "MI300X", 1307.4, 5.3, 192, 896, 50, 750, 2.99,
            "AMD Instinct MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/"
            "mi300x.html): BF16 1,307.4 TFLOPS dense, 5.3 TB/s HBM3, 192 GB, Infinity Fabric "
            "7 x 128 GB/s = 896 GB/s peer, TBP 750 W; network 400 Gb/s per GPU; price: "
            "typical 2025 on-demand MI300X"),
        HardwareSpec(
            "L4", 121.0, 0.3, 24, 32, 12.5, 72, 0.80,
            "NVIDIA L4 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/l4/): BF16 "
            "242 TFLOPS with sparsity = 121 dense, 300 GB/s GDDR6, 24 GB, PCIe Gen4 x16 "
            "(~32 GB/s one way, no NVLink), 72 W; network 100 Gb/s; price: Google Cloud "
            "g2-standard-8 (1 x L4) on-demand, 2025"),
    )
}


# ---- profiles ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Linear:
    """``c0 + c1 * x1 + c2 * x2``: one term of a pass's cost."""

    c0: float = 0.0
    c1: float = 0.0
    c2: float = 0.0

    def __call__(self, x1: float, x2: float) -> float:
        return self.c0 + self.c1 * x1 + self.c2 * x2


@dataclass(frozen=True, slots=True)
class PassCost:
    """``overhead + max(compute(x1, x2), memory(x1, x2))`` seconds."""

    overhead_s: float = 0.0
    compute: Linear = field(default_factory=Linear)
    memory: Linear = field(default_factory=Linear)

    def __call__(self, x1: float, x2: float) -> float:
        return self.overhead_s + max(self.compute(x1, x2), self.memory(x1, x2))


def _scaled(cost: PassCost, factor: float) -> PassCost:
    lin = [Linear(x.c0 * factor, x.c1 * factor, x.c2 * factor)
           for x in (cost.compute, cost.memory)]
    return PassCost(cost.overhead_s * factor, lin[0], lin[1])


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """What one replica of a phase costs in time, money and power.

    Prefill features: (tokens computed = rows x longest, attention pairs = rows x longest^2).
    Decode features: (batch, attended context = batch x span).
    """

    name: str
    prefill: PassCost
    decode: PassCost
    kv_bytes_per_token: int
    kv_budget_tokens: int  # KV a decode replica may hold
    hop_latency_s: float = 0.0  # fixed cost of one KV hop (calls, metadata)
    hop_gbs: float = 10.0  # KV hop bandwidth, GB/s
    request_overhead_s: float = 0.0  # fixed per-request cost outside the engine (HTTP, routing)
    # What streaming costs a decode step in the serving stack, beyond the engine's pass:
    # ``c0 + c1 x batch`` seconds (Ray streaming items, detokenizing, SSE, the cores they
    # take from the engine). Zero for a bare engine profile; ``profile.stack_device`` fits it.
    decode_stack: Linear = field(default_factory=Linear)
    # how much slower than the engine alone ``prefill`` is (``slowed_prefill``: the serving
    # stack's effect on a lone prompt's pass, fitted by ``profile.stack_device``)
    prefill_slowdown: float = 1.0
    price_per_hour: float = 1.0
    power_prefill_w: float = 0.0  # busy in a prefill pass
    power_decode_w: float = 0.0  # busy in a decode step
    power_idle_w: float = 0.0
    source: str = ""

    def prefill_s(self, rows: int, longest: int) -> float:
        return self.prefill(rows * longest, rows * longest * longest)

    def prefill_chunk_s(self, rows: int, chunk: int, past: int) -> float:
        """One pass of ``rows`` prompt chunks padded to ``chunk`` tokens, each after ``past``
        positions whose KV exists (earlier chunks, a cached prefix; padded to the longest).
        The attention feature counts the causal pairs twice, as ``prefill_s`` does for a
        whole prompt (``rows x longest^2``): ``chunk x (chunk + 2 x past)`` per row, so the
        chunks of a prompt add up to the prompt's own feature. ``past = 0`` is
        ``prefill_s``."""
        return self.prefill(rows * chunk, rows * chunk * (chunk + 2 * past))

    def decode_s(self, batch: int, span: int) -> float:
        """A step that attends every row over ``span`` positions (a padded batch: rows of
        alike lengths, as ``profile`` measures the engine's step)."""
        return self.decode(batch, batch * span) + self.decode_stack(batch, 0.0)

    def decode_ctx_s(self, batch: int, context_tokens: int, share: float = 1.0) -> float:
        """A step whose attention works over ``context_tokens`` KV positions in all (the
        simulator's ``attended_positions``: ``batch x longest`` padded, the rows' own
        contexts exact), the engine on ``share`` of its device (the cores shared)."""
        return self.decode(batch, context_tokens) / share + self.decode_stack(batch, 0.0)

    def hop_s(self, nbytes: int) -> float:
        return self.hop_latency_s + nbytes / (self.hop_gbs * 1e9)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceProfile:
        d = dict(d)
        for key in ("prefill", "decode"):
            p = dict(d[key])
            d[key] = PassCost(p["overhead_s"], Linear(**p["compute"]), Linear(**p["memory"]))
        if "decode_stack" in d:
            d["decode_stack"] = Linear(**d["decode_stack"])
        return cls(**d)

    def slowed(self, factor: float) -> DeviceProfile:
        """Every engine pass ``factor`` times slower (the cores shared with the serving stack)."""
        return replace(self, prefill=_scaled(self.prefill, factor),
                       decode=_scaled(self.decode, factor))

    def slowed_prefill(self, factor: float) -> DeviceProfile:
        """Prefill passes ``factor`` times slower, decode steps unchanged."""
        return replace(self, prefill=_scaled(self.prefill, factor),
                       prefill_slowdown=self.prefill_slowdown * factor)


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of datasheet peaks a serving engine reaches, and fixed per-pass costs.

    Defaults are typical of vLLM/SGLang on Hopper-class GPUs for 8B-70B dense models: about 60%
    of peak FLOP/s in large prefills, about 75% of peak bandwidth in decode, a few hundred
    microseconds of launch/scheduling per pass.
    """

    compute: float = 0.6
    memory: float = 0.75
    network: float = 0.8
    pass_overhead_s: float = 0.0005
    hop_latency_s: float = 0.002
    mem_for_kv: float = 0.9  # fraction of device memory usable for weights + KV
    # power drawn as a fraction of TDP: compute-bound prefill runs near TDP, memory-bound decode
    # well below it; an idle device draws little (assumptions, not datasheet figures)
    power_prefill: float = 1.0
    power_decode: float = 0.7
    power_idle: float = 0.15


def roofline_profile(hw: HardwareSpec, model: ModelSpec, *, tp: int = 1,
                     eff: Efficiency | None = None, hop_gbs: float | None = None,
                     price_per_hour: float | None = None) -> DeviceProfile:
    """A replica of ``tp`` devices of kind ``hw`` serving ``model`` (tensor parallel).

    Prefill: FLOPs = 2 x layer params x tokens + 2 x lm_head params x rows (logits only at each
    prompt's last token) + 2 x layers x q_dim x sum(n^2) (causal QK^T and AV); bytes = weights
    + KV written. Decode: FLOPs = 2 x all matmul params x batch + 4 x layers x q_dim x context;
    bytes = weights + KV read (context) + KV written. The hop goes over the per-GPU network.
    """
    eff = eff or Efficiency()
    flops = hw.dense_tflops * 1e12 * eff.compute * tp
    bw = hw.mem_bw_tbs * 1e12 * eff.memory * tp
    kvb = model.kv_bytes_per_token
    w = model.weight_bytes
    attn = 2 * model.num_layers * model.q_dim
    # prefill's lm_head term is per row; rows ~ tokens / mean length, small: folded in at the
    # cost of one row per pass
    prefill = PassCost(
        eff.pass_overhead_s,
        compute=Linear(2 * model.lm_head_params / flops, 2 * model.layer_params / flops,
                       attn / flops),
        memory=Linear(w / bw, kvb / bw, 0.0),
    )
    decode = PassCost(
        eff.pass_overhead_s,
        compute=Linear(0.0, 2 * (model.layer_params + model.lm_head_params) / flops,
                       2 * attn / flops),
        memory=Linear(w / bw, kvb / bw, kvb / bw),
    )
    usable = hw.mem_gb * 1e9 * tp * eff.mem_for_kv - w
    if usable <= 0:
        raise ValueError(f"{model.name} ({w / 1e9:.0f} GB) does not fit {tp} x {hw.name}")
    name = hw.name if tp == 1 else f"{tp}x{hw.name}"
    return DeviceProfile(
        name=name,
        prefill=prefill,
        decode=decode,
        kv_bytes_per_token=kvb,
        kv_budget_tokens=int(usable // kvb),
        hop_latency_s=eff.hop_latency_s,
        hop_gbs=hop_gbs if hop_gbs is not None else hw.network_gbs * tp * eff.network,
        price_per_hour=(price_per_hour if price_per_hour is not None
                        else hw.price_per_hour) * tp,
        power_prefill_w=hw.tdp_w * tp * eff.power_prefill,
        power_decode_w=hw.tdp_w * tp * eff.power_decode,
        power_idle_w=hw.tdp_w * tp * eff.power_idle,
        source=f"roofline of {hw.name} ({hw.source}); efficiency {asdict(eff)}",
    )
