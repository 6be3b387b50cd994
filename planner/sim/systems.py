"""What is simulated: the engine's bounds (``EngineLimits``) and the two systems (split, colocated)
on their devices."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from app.prefill_policy import PrefillPolicy
from planner.hardware import DeviceProfile
from planner.sim.constants import COLOCATED_POLICIES, KV_BLOCK_TOKENS, KV_LAYOUTS


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The engine's bounds (``EngineConfig`` / ``AppArgs``; the defaults are
    ``EngineConfig``'s)."""

    max_batch_size: int = 16
    token_budget: int = 4096  # prefill_token_budget
    prefill_max_rows: int = 8  # prefill_max_batch_size
    batch_wait_s: float = 0.005  # prefill_batch_wait_s
    kv_layout: str = "paged"  # "paged" (this engine) | "inplace" | "padded" (KV_LAYOUTS)
    kv_block_tokens: int = KV_BLOCK_TOKENS  # the paged pool's block
    prefill_chunk_tokens: int = 256  # at most this many tokens per prefill pass
    # prefill_batch_tokens: a pass (a step's chunks) takes no more prompts once it holds
    # this many tokens; None: up to the pass
    prefill_batch_tokens: int | None = None
    prefill_fairness_s: float = 5.0  # a prompt that waited this long leads every other pass
    prefill_routing: str = "affinity"  # "affinity" (PrefixAffinityRouter) | "least_loaded"
    affinity_imbalance: int = 4  # PrefixAffinityRouter's imbalance
    # the split app's routing (``AppArgs``, ``SplitPath._prefills_locally``): a prompt
    # shorter than ``local_prefill_threshold`` is prefilled on a decode replica (0: none);
    # one shorter than ``local_prefill_when_busy`` too while the prefill phase is backed up
    # (0: off); backed up from ``prefill_busy_tokens`` (None: one prefill pass)
    local_prefill_threshold: int = 0
    local_prefill_when_busy: int = 128
    prefill_busy_tokens: int | None = None
    # prefill_lanes: a prefill replica runs up to this many passes at once, the extra lanes
    # long prompts only (on hardware of its own they share its device:
    # ``_SplitRun._shares``)
    prefill_lanes: int = 1
    # prefill_max_threads: a pass alone on the machine's cores takes this many threads
    # (``app.idle_cores``; on shared cores with ``SplitSystem.prefill_wide``)
    prefill_max_threads: int = 1

    def __post_init__(self) -> None:
        if self.prefill_lanes < 1:
            raise ValueError("prefill_lanes must be >= 1")
        if self.prefill_max_threads < 1:
            raise ValueError("prefill_max_threads must be >= 1")
        if self.prefill_routing not in ("affinity", "least_loaded"):
            raise ValueError(f"unknown prefill routing {self.prefill_routing!r}")
        if self.local_prefill_threshold < 0 or self.local_prefill_when_busy < 0:
            raise ValueError("local_prefill_threshold and local_prefill_when_busy must be >= 0")
        if self.prefill_busy_tokens is not None and self.prefill_busy_tokens < 1:
            raise ValueError("prefill_busy_tokens must be >= 1")
        if self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        if self.prefill_batch_tokens is not None and self.prefill_batch_tokens < 1:
            raise ValueError("prefill_batch_tokens must be >= 1")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV layout {self.kv_layout!r}; known: {KV_LAYOUTS}")
        if self.kv_block_tokens < 1:
            raise ValueError("kv_block_tokens must be >= 1")

    @property
    def pass_tokens(self) -> int:
        """What one prefill pass computes at most: ``min(token_budget,
        prefill_chunk_tokens)``."""
        return min(self.token_budget, self.prefill_chunk_tokens)

    @property
    def busy_prefill_tokens(self) -> int:
        """``prefill_busy_tokens``, or one prefill pass (``AppArgs.busy_prefill_tokens``)."""
        return max(1, self.prefill_busy_tokens or self.pass_tokens)

    @classmethod
    def from_app_args(cls, args: Any, base: EngineLimits | None = None) -> EngineLimits:
        """The bounds an app runs with: ``args`` an ``AppArgs`` (its engine settings and the
        split's routing), over ``base`` for the simulator-only fields (KV layout, block
        size, prefill routing). ``EngineLimits()``'s defaults are ``AppArgs()``'s (a test
        holds them equal)."""
        e = args.engine
        return replace(
            base or cls(), max_batch_size=e.max_batch_size,
            token_budget=e.prefill_token_budget, prefill_max_rows=e.prefill_max_batch_size,
            batch_wait_s=args.prefill_batch_wait_s, prefill_chunk_tokens=e.prefill_chunk_tokens,
            prefill_batch_tokens=e.prefill_batch_tokens, prefill_fairness_s=e.prefill_fairness_s,
            local_prefill_threshold=args.local_prefill_threshold,
            local_prefill_when_busy=args.local_prefill_when_busy,
            prefill_busy_tokens=args.prefill_busy_tokens, prefill_lanes=e.prefill_lanes,
            prefill_max_threads=e.prefill_max_threads or 1)

    def prefill_policy(self) -> PrefillPolicy:
        """A replica's prefill schedule under these bounds (a fresh one: it keeps state)."""
        return PrefillPolicy(chunk_tokens=self.prefill_chunk_tokens,
                             token_budget=self.token_budget, max_rows=self.prefill_max_rows,
                             batch_tokens=self.prefill_batch_tokens,
                             fairness_s=self.prefill_fairness_s)


@dataclass(frozen=True, slots=True)
class SplitSystem:
    prefill: DeviceProfile
    decode: DeviceProfile
    num_prefill: int = 1
    num_decode: int = 1
    limits: EngineLimits = field(default_factory=EngineLimits)
    # how a decode replica runs the prompts it prefills itself (``DecodeServer``'s queue):
    # "mixed" (``engine.mixed_batch``, the default) | "interleave" (``mixed_batch: false``)
    decode_policy: str = "mixed"
    # every replica and the serving stack on one machine of this many cores (local.yaml: a
    # thread per phase), the stack keeping ``stack_cores`` of them busy while tokens
    # stream: a prefill pass and a decode step each get their share of the cores beside
    # what else runs when they start (``_SplitRun._shares``). None: each replica on
    # hardware of its own (a fleet)
    shared_cores: float | None = None
    stack_cores: float = 0.0
    # on shared_cores, the prefill engine on ``limits.prefill_max_threads`` threads: a pass
    # alone on the machine (no other pass, no stream) runs on it (``app.idle_cores``, which
    # decides again every few layers); None: passes keep to one core
    prefill_wide: DeviceProfile | None = None

    def __post_init__(self) -> None:
        if self.decode_policy not in ("mixed", "interleave"):
            raise ValueError(f"unknown decode replica policy {self.decode_policy!r}; known: "
                             "mixed, interleave")
        if self.shared_cores is not None and self.shared_cores <= 0:
            raise ValueError("shared_cores must be > 0")
        if self.stack_cores < 0:
            raise ValueError("stack_cores must be >= 0")

    @property
    def price_per_hour(self) -> float:
        return (self.num_prefill * self.prefill.price_per_hour
                + self.num_decode * self.decode.price_per_hour)

    def describe(self) -> str:
        p, d = self.prefill.name, self.decode.name
        extra = ", decode interleave" if self.decode_policy == "interleave" else ""
        return f"split {self.num_prefill}x{p} : {self.num_decode}x{d}{extra}"


@dataclass(frozen=True, slots=True)
class ColocatedSystem:
    device: DeviceProfile
    num_replicas: int = 1
    limits: EngineLimits = field(default_factory=EngineLimits)
    # "mixed" (this app: engine.mixed_batch, the default) | "interleave" (this app with
    # mixed_batch: false) | "chunked" (vLLM/Sarathi-style, not this app); COLOCATED_POLICIES
    policy: str = "mixed"
    chunk_tokens: int = 512  # chunked only

    def __post_init__(self) -> None:
        if self.policy not in COLOCATED_POLICIES:
            raise ValueError(f"unknown colocated policy {self.policy!r}; known: "
                             f"{COLOCATED_POLICIES}")

    @property
    def price_per_hour(self) -> float:
        return self.num_replicas * self.device.price_per_hour

    def describe(self) -> str:
        extra = {"mixed": "", "interleave": ", interleave",
                 "chunked": f", chunked {self.chunk_tokens}"}[self.policy]
        return f"colocated {self.num_replicas}x{self.device.name}{extra}"


System = SplitSystem | ColocatedSystem
