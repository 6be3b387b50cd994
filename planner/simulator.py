"""Discrete-event simulation of the split app and of the colocated baseline.

The simulated engine follows the app's code path by path:

* **Prefill replica** (``PrefillServer`` → ``PrefillQueue``, ``app.prefill.Prefiller``): a
  prompt joins its replica's queue starting from its cached prefix (``cached_len`` of its
  arrival: only the uncached suffix is computed). The replica runs pass after pass; each
  pass is planned by the engine's rule (``Prefiller.plan_pass``): shortest remaining first,
  except that every other pass is led by the longest-waiting prompt once one has waited
  ``prefill_fairness_s``; each row computes at most ``prefill_chunk_tokens`` of its prompt;
  rows share a pass while ``rows x longest chunk`` fits ``min(token_budget,
  prefill_chunk_tokens)``, padding stays within a quarter of the real tokens, the padded
  pasts within ``token_budget`` and rows within ``prefill_max_rows``, and none joins a pass
  that already holds ``prefill_batch_tokens``. A pass costs
  ``prefill_chunk_s(rows, longest chunk, longest past)``. A prompt that arrives while a
  long one is being computed joins the next pass. A prompt's package leaves when its own
  last chunk ends. An idle queue waits ``batch_wait_s`` after a prompt wakes it.
* **Where a prompt is prefilled** (``SplitPath._prefills_locally``): on a decode replica
  when it is shorter than ``local_prefill_threshold`` (default 0: none), or shorter than
  ``local_prefill_when_busy`` (default 128; 0: off) while the prefill phase is backed up
  (the prompt tokens sent to it whose streams have not started are at least
  ``prefill_busy_tokens``, by default one pass) and the decode side has fewer tokens ahead
  of it (its local prompts not yet streaming) than the prefill phase (its short prompts
  plus at most two passes of longer ones); otherwise on the prefill phase. A prompt's
  tokens count from its routing until its stream starts: a local one when its package is
  made, a remote one when the decode replica holds it (after the hop). An ``n > 1``
  request (``SplitPath.shared_prefill``) is routed the same way and counted nowhere. The
  counts are one ingress replica's (the app keeps them per ingress replica). A local
  prompt goes to the least loaded decode replica's prefill queue (``DecodeServer``), which
  runs as a colocated replica's (below; ``decode_policy``, ``mixed`` by default): its
  chunks ride in that replica's decode steps, no KV hop.
* **Routing to prefill** (``PrefixAffinityRouter``): each prompt has a home replica
  (rendezvous hashing of its first tokens: uniform over replicas here, drawn from a fixed
  seed) and goes there unless the home holds more than ``affinity_imbalance`` requests
  more than the least loaded, which then gets it. ``prefill_routing="least_loaded"`` sends
  every prompt to the least loaded replica instead.
* **KV hop**: ``hop_s(prompt tokens x KV bytes per token)``, the whole prompt (cached part
  included); decode yields the first token the moment it holds the package (TTFT).
* **Several answers** (``n``): one prefill, then each answer is its own decode sequence on
  the least loaded decode replica, each with its own hop and its own KV (the prompt's KV
  held once per answer), all of the request's ``output_len`` tokens. A decode replica's
  load is its sequences and its local prompts (what Serve's router counts).
* **Decode replica** (``Decoder``): continuous batching; before each step it admits waiting
  sequences in order while the batch has a free row and the KV pool has room for the head
  of the queue (which, when it does not fit, holds back every sequence behind it). A step
  gives every running sequence one token and costs ``decode_ctx_s(batch, positions)``,
  ``positions`` being the KV its attention works over. ``kv_layout`` picks the engine:

  - ``"paged"`` (this engine: ``app.kv_cache``, ``app.decode``, ``app.attention``):
    a pool of ``kv_budget_tokens // kv_block_tokens`` blocks (16 tokens, the engine's); a
    sequence reserves its prompt + max_tokens rounded up to whole blocks when it joins and
    gives them back when it ends. The step gathers each row's KV padded to the longest row
    (``rows x longest``) unless that would copy more than twice the positions the rows
    hold, and then exactly those (their sum): rows of alike lengths are charged as a padded
    batch, a long outlier row switches the step to the exact sum (whose one SDPA call also
    scores each row against the other rows' positions, masked: not charged).
  - ``"inplace"``: the same pool, every row attending exactly its own positions (a
    paged-attention kernel that reads blocks in place, as vLLM's does; the default of
    ``python -m planner search``, whose roofline GPU efficiencies are vLLM's).
  - ``"padded"``: the contiguous buffer the engine had before its paged pool, kept to replay
    runs of that engine: ``round_rows(rows) x round_capacity(capacity)`` tokens reserved
    (rows 1, 2, 4 then multiples of 4, positions in multiples of 128, capacity the longest
    prompt + max_tokens) and every row attending the longest row's positions.

  Not modelled: the engine's cap of a reservation at ``max_model_len``, and its refusal of a
  sequence whose reservation does not fit even an empty pool (here it runs alone).
* **Colocated replica** (``ColocatedServer``): one device does both, on one engine thread
  that runs one pass at a time in the order they were submitted; its prefill queue is the
  split's (same planner, same chunks). ``policy``:

  - ``"mixed"`` (this app, ``EngineConfig.mixed_batch``, the default; ``PrefillQueue``
    ``mix_into``/``take_chunks``, ``Prefiller.plan_chunks``, ``Decoder.step(plan)``):
    while the decode loop has sequences, each of its steps carries the queue's next chunks,
    planned before the step from the rows it may run (running + waiting, at most
    ``max_batch_size``): the step computes at most one pass's tokens (``min(token_budget,
    prefill_chunk_tokens)``) decode rows included, the chunks at least a quarter of that;
    prompts in ``plan_pass``'s order (fairness, then shortest remaining first), each up
    to ``prefill_chunk_tokens``, at most ``prefill_max_rows``, laid end to end. The step
    costs one pass (as ``chunked``'s): the chunks' prefill compute (their tokens, and
    attention pairs over each one's past) plus the decode step's, against the weights read
    once, the decode rows' KV read and the chunks' KV written; plus the serving stack's
    per-step cost (``decode_stack``) of the rows it streams.
    With nothing decoding the queue runs passes of its own, as the split's prefill replica
    does; when such a pass finishes a prompt and others wait, the queue plans its next pass
    at once, and the decode loop's first step (planned during that pass, from the prompts
    not in it) follows it; the sequences the loop held when it planned a step are the ones
    that step admits. A prompt finished by a step or pass joins the decode batch at the
    next step the loop plans (in the app, once its stream reaches the loop: that step or
    the one after). With a measured profile (compute only) a mixed step costs what the
    pass and the step cost apart; ``load_tests.mixed_bench`` measured 0.93x of that on
    this CPU (not modelled); a roofline profile reads the weights once.
  - ``"interleave"`` (this app with ``mixed_batch: false``): the queue's passes alternate
    with decode steps while both have work: every running stream waits for one prefill
    pass (one chunk) between two steps.
  - ``"chunked"`` (vLLM/Sarathi-style mixed passes, not what this app does): up to
    ``chunk_tokens`` tokens of the oldest prompt in every decode step, prompts one after
    another.

  An ``n > 1`` request is prefilled once; each answer decodes on the least loaded replica
  (a KV hop when that is another replica).

A request is good when every one of its answers meets every SLO: its record carries the
worst answer's TTFT and TPOT and the last answer's end (``SimRecord``).

Requests are routed to the replica with the least outstanding work (Serve's power-of-two
choice is close to that), prefill as above. Latencies are measured from the client's send
time and the metrics are the load generator's own (``load_tests.metrics``), so a simulated
run and a real one are summarized by the same code.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import random
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.prefill_policy import PrefillPolicy
from load_tests.metrics import RequestRecord, meets_slos, summarize, tpot
from load_tests.workloads import LengthDist, arrival_gaps
from planner.hardware import DeviceProfile

# The prefix cache's block (``app.prefix_cache.DEFAULT_BLOCK_TOKENS``): a prompt's cached
# prefix is a whole number of blocks and leaves at least one token to compute.
PREFIX_BLOCK_TOKENS = 16
# ``app.kv_cache.DEFAULT_BLOCK_SIZE``: tokens per block of the decode replica's KV pool.
KV_BLOCK_TOKENS = 16
# ``app.attention._EXACT_OVER_PADDED``: a decode step gathers exactly (no padding) when
# the padded block would copy more than this many times the positions the rows hold.
EXACT_OVER_PADDED = 2
KV_LAYOUTS = ("paged", "inplace", "padded")
# How a colocated replica shares its engine between prompts and decode steps: this app
# (mixed_batch on, off), then the vLLM-style approximation (the module docstring).
COLOCATED_POLICIES = ("mixed", "interleave", "chunked")

# ---- workload ---------------------------------------------------------------------------


def cached_prefix(input_len: int, hit_rate: float, block: int = PREFIX_BLOCK_TOKENS) -> int:
    """Prompt tokens a prefix hit rate of ``hit_rate`` takes from the cache: whole blocks,
    at most all but the last token (``PrefixCache.match``)."""
    if hit_rate <= 0:
        return 0
    blocks = math.floor(hit_rate * input_len + 1e-9) // block
    return min(blocks, (input_len - 1) // block) * block


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds from the start
    input_len: int
    output_len: int  # tokens of each answer
    request_class: str = "sim"
    n: int = 1  # answers (one prefill, n decode sequences)
    cached_len: int = 0  # prompt tokens the prefix cache holds (not computed)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.cached_len < self.input_len:
            raise ValueError(f"cached_len must be in [0, input_len), got {self.cached_len}")

    def with_prefix_hit_rate(self, hit_rate: float) -> Arrival:
        return replace(self, cached_len=cached_prefix(self.input_len, hit_rate))


@dataclass(frozen=True, slots=True)
class Workload:
    """An open-loop arrival process with length distributions.

    ``prefix_hit_rate``: the fraction of each prompt's tokens the prefix cache holds (whole
    blocks; the rest is computed), e.g. a multi-turn chat resending its conversation.
    ``n``: answers per request, each ``output_len`` tokens long.
    """

    rate: float
    input_len: LengthDist
    output_len: LengthDist
    num_requests: int = 200
    burstiness: float = 1.0
    seed: int = 0
    prefix_hit_rate: float = 0.0
    n: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.prefix_hit_rate <= 1.0:
            raise ValueError(f"prefix_hit_rate must be in [0, 1], got {self.prefix_hit_rate}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    def arrivals(self) -> list[Arrival]:
        rng = random.Random(self.seed)
        gaps = arrival_gaps(self.rate, self.burstiness, rng)
        out, t = [], 0.0
        for i in range(self.num_requests):
            if i:
                t += next(gaps)
            n_in = self.input_len.sample(rng)
            out.append(Arrival(t, n_in, self.output_len.sample(rng), n=self.n,
                               cached_len=cached_prefix(n_in, self.prefix_hit_rate)))
        return out

    def with_rate(self, rate: float) -> Workload:
        return replace(self, rate=rate)


def load_trace(path: str | Path, run: int | None = None) -> list[list[Arrival]]:
    """Arrivals from a load-generator ``results.json`` (one list per run, from each request's
    send time and token counts) or a JSONL file of ``{"at", "input", "output"}`` lines
    (optional ``"n"``, answers, and ``"cached"``, prompt tokens held by the prefix cache)."""
    text = Path(path).read_text()
    if str(path).endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [[Arrival(float(r["at"]), int(r["input"]), int(r["output"]),
                         str(r.get("class", "sim")), int(r.get("n", 1)),
                         int(r.get("cached", 0))) for r in rows]]
    data = json.loads(text)
    runs = data["runs"] if run is None else [data["runs"][run]]
    return [trace_of_run(r) for r in runs]


def trace_of_run(run: dict[str, Any]) -> list[Arrival]:
    out = []
    for r in run["requests"]:
        if r.get("prompt_tokens") is None or not r.get("output_tokens"):
            continue  # failed requests carry no lengths
        out.append(Arrival(float(r["sent_at"]), int(r["prompt_tokens"]),
                           int(r["output_tokens"]), str(r.get("class", "sim"))))
    return sorted(out, key=lambda a: a.at)


# ---- systems ----------------------------------------------------------------------------


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
    # ``_SplitRun._prefill_share``)
    prefill_lanes: int = 1

    def __post_init__(self) -> None:
        if self.prefill_lanes < 1:
            raise ValueError("prefill_lanes must be >= 1")
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
            prefill_busy_tokens=args.prefill_busy_tokens, prefill_lanes=e.prefill_lanes)

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
    # thread per phase), the stack taking ``stack_cpu_per_token_s`` of CPU per streamed
    # token: a prefill pass gets an equal share of the cores the stack leaves, with the
    # decode replicas that are busy when it starts, at most one core (``_SplitRun.
    # _prefill_share``). None: each replica on hardware of its own (a fleet)
    shared_cores: float | None = None
    stack_cpu_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        if self.decode_policy not in ("mixed", "interleave"):
            raise ValueError(f"unknown decode replica policy {self.decode_policy!r}; known: "
                             "mixed, interleave")
        if self.shared_cores is not None and self.shared_cores <= 0:
            raise ValueError("shared_cores must be > 0")
        if self.stack_cpu_per_token_s < 0:
            raise ValueError("stack_cpu_per_token_s must be >= 0")

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


# ---- the event loop ---------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._ids = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._ids), fn))

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()


@dataclass(eq=False, slots=True)
class _Req:
    """One request: its prompt's way through prefill and its answers."""

    arrival: Arrival
    sent_at: float
    uid: int
    done: int = 0  # prompt positions whose KV exists (cached prefix + computed chunks)
    queued_at: float = 0.0  # when it joined its prefill queue (``PrefillJob.arrived``)
    answers: list[_Seq] = field(default_factory=list)
    finished: int = 0  # answers finished
    local: bool = False  # prefilled on the replica that decodes it (colocated, or split local)
    backlog: int = 0  # its tokens in a split backlog count, until its stream starts
    short: bool = False  # counted in the short backlog too

    @property
    def remaining(self) -> int:
        return self.arrival.input_len - self.done

    @property
    def arrived(self) -> float:  # app.prefill_policy.Job
        return self.queued_at


@dataclass(eq=False, slots=True)
class _Seq:
    """One answer: a decode sequence."""

    req: _Req
    first_token_at: float | None = None
    finished_at: float | None = None
    generated: int = 0  # output tokens produced so far (the first comes from prefill)

    @property
    def output_len(self) -> int:
        return self.req.arrival.output_len

    @property
    def kv_len(self) -> int:
        # KV held: the prompt plus every output token fed back so far
        return self.req.arrival.input_len + max(self.generated - 1, 0)

    @property
    def max_total(self) -> int:
        return self.req.arrival.input_len + self.output_len

    def first_token(self, now: float) -> bool:
        """Prefill's token reaches the decoder at ``now``; True when it was the only one."""
        self.first_token_at = now
        self.generated = 1
        if self.output_len <= 1:
            self.finished_at = now
            return True
        return False


def _answers(r: _Req) -> list[_Seq]:
    r.answers = [_Seq(r) for _ in range(r.arrival.n)]
    return r.answers


def _padded_kv_tokens(rows: int, capacity: int) -> int:
    """KV tokens the engine's old contiguous batch buffer reserved (``kv_layout="padded"``;
    ``ModelRunner.kv_tokens_for`` before the paged pool): rows 1, 2, 4 then multiples of 4,
    positions in multiples of 128."""
    rows = 1 << max(0, (rows - 1).bit_length()) if rows <= 4 else -(-rows // 4) * 4
    return rows * max(1, -(-capacity // 128)) * 128


def kv_blocks(tokens: int, block: int = KV_BLOCK_TOKENS) -> int:
    """Blocks that hold ``tokens`` tokens (``BlockAllocator.blocks_for``)."""
    return -(-tokens // block)


def pool_blocks(budget_tokens: int, block: int = KV_BLOCK_TOKENS) -> int:
    """Blocks in a decode replica's pool of ``budget_tokens`` (``Decoder.__init__``)."""
    return max(1, budget_tokens // block)


def gathers_exact(lengths: Sequence[int]) -> bool:
    """Whether the engine's decode step over rows of ``lengths`` positions gathers them
    exactly rather than padded to the longest (``PagedDecodeStep.build``)."""
    return len(lengths) * max(lengths) > EXACT_OVER_PADDED * sum(lengths)


def attended_positions(lengths: Sequence[int], kv_layout: str = "paged") -> int:
    """KV positions a decode step over rows of ``lengths`` positions works over: ``rows x
    longest`` for a padded batch, the rows' own positions (their sum) for an exact one."""
    if kv_layout == "inplace" or (kv_layout == "paged" and gathers_exact(lengths)):
        return sum(lengths)
    return len(lengths) * max(lengths)


@dataclass(slots=True)
class _Busy:
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass(slots=True)
class _Chunks:
    """The prompt part of one mixed step (``app.prefill.ChunkPlan``): the next ``sizes[k]``
    tokens of each prompt of ``rows``; empty when no prompt had tokens left."""

    rows: list[_Req] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


class _PrefillQueue:
    """One replica's prompts waiting for prefill, planned by the engine's own policy
    (``app.prefill_policy.PrefillPolicy``, which ``app.prefill.Prefiller`` calls too:
    ``plan_pass`` for a pass of its own, ``plan_chunks`` for the chunks of a mixed step);
    this class keeps the prompts in the policy's order as they come and go."""

    def __init__(self, device: DeviceProfile, limits: EngineLimits) -> None:
        self.device, self.limits = device, limits
        self.policy = limits.prefill_policy()
        self.chunk_tokens = limits.prefill_chunk_tokens
        self.pass_tokens = limits.pass_tokens
        # live prompts by (remaining, queued_at, uid): shortest remaining first
        self._order: list[tuple[int, float, int, _Req]] = []
        self._by_age: deque[_Req] = deque()  # arrival order; finished ones dropped lazily
        self.idle = True  # the queue's loop sleeps: the next prompt waits batch_wait_s
        self.tokens = 0  # prompt tokens still to compute

    def __len__(self) -> int:
        return len(self._order)

    @staticmethod
    def _key(r: _Req) -> tuple[int, float, int, _Req]:
        return (r.remaining, r.queued_at, r.uid, r)

    def add(self, r: _Req, now: float) -> None:
        r.queued_at, r.done = now, r.arrival.cached_len
        bisect.insort(self._order, self._key(r))
        self._by_age.append(r)
        self.tokens += r.remaining

    def chunk_of(self, r: _Req) -> int:
        return self.policy.chunk_of(r)

    def _candidates(self, busy: Collection[_Req]) -> Iterable[_Req]:
        return (r for _, _, _, r in self._order if r not in busy)

    def _head(self, now: float, busy: Collection[_Req] = ()) -> _Req | None:
        """The prompt that leads the next pass or step (``PrefillPolicy.head``). ``busy``:
        prompts in a pass under way (not planned again)."""
        while self._by_age and self._by_age[0].remaining == 0:
            self._by_age.popleft()
        oldest = next((r for r in self._by_age if r.remaining and r not in busy), None)
        if oldest is None:
            return None
        return self.policy.head(oldest, next(iter(self._candidates(busy))), now)

    def plan(self, now: float, busy: Collection[_Req] = ()) -> list[_Req]:
        """The prompts of the next pass (``PrefillPolicy.plan_pass``); [] when none waits.
        ``busy``: prompts in a pass under way on another lane (not planned again)."""
        head = self._head(now, busy)
        return [] if head is None else self.policy.plan_pass(head, self._candidates(busy))

    def plan_chunks(self, now: float, decode_rows: int, busy: Collection[_Req] = ()) -> _Chunks:
        """The chunks that ride in a decode step of ``decode_rows`` rows
        (``PrefillPolicy.plan_chunks``). ``busy``: prompts in a pass under way."""
        head = self._head(now, busy)
        if head is None:
            return _Chunks()
        rows, sizes = self.policy.plan_chunks(head, self._candidates(busy), decode_rows)
        return _Chunks(rows, sizes)

    def pass_s(self, rows: list[_Req]) -> float:
        """One pass: every row padded to the longest chunk, every past to the longest."""
        return self.device.prefill_chunk_s(len(rows), max(self.chunk_of(r) for r in rows),
                                           max(r.done for r in rows))

    def advance(self, rows: list[_Req], sizes: Sequence[int] | None = None) -> list[_Req]:
        """The pass of ``rows`` ended: each computed its chunk (``sizes``, or its next
        ``chunk_of``). Returns the prompts it finished (their packages leave now)."""
        finished = []
        for k, r in enumerate(rows):
            del self._order[bisect.bisect_left(self._order, self._key(r)[:3])]
            c = self.chunk_of(r) if sizes is None else sizes[k]
            r.done += c
            self.tokens -= c
            if r.remaining:
                bisect.insort(self._order, self._key(r))
            else:
                finished.append(r)
        return finished


class _Decoder:
    """One decode batch (``app.decode.Decoder``) on a device."""

    def __init__(self, device: DeviceProfile, limits: EngineLimits, clock: _Clock,
                 finish: Callable[[_Seq], None]) -> None:
        self.device = device
        self.limits = limits
        self.clock = clock
        self.finish = finish
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.reserved_blocks = 0  # the running sequences' reservations in the paged pool

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def _reservation(self, s: _Seq) -> int:
        """Blocks a sequence reserves in the paged pool: prompt + max_tokens, whole blocks."""
        return kv_blocks(s.max_total, self.limits.kv_block_tokens)

    def _fits(self, seq: _Seq) -> bool:
        """Whether ``seq`` may join the running sequences under the KV budget."""
        budget = self.device.kv_budget_tokens
        if self.limits.kv_layout == "padded":
            capacity = max([s.max_total for s in self.running] + [seq.max_total])
            return _padded_kv_tokens(len(self.running) + 1, capacity) <= budget
        blocks = pool_blocks(budget, self.limits.kv_block_tokens)
        return self.reserved_blocks + self._reservation(seq) <= blocks

    def admit(self, limit: int | None = None) -> None:
        """``limit``: of the waiting sequences, only the first so many may join."""
        limit = len(self.waiting) if limit is None else limit
        while self.waiting and len(self.running) < self.limits.max_batch_size and limit > 0:
            limit -= 1
            seq = self.waiting[0]
            if not self._fits(seq) and self.running:
                break
            self.running.append(self.waiting.popleft())
            self.reserved_blocks += self._reservation(seq)

    def attended(self) -> int:
        """KV positions the step's attention works over (``attended_positions``); each row
        holds its context plus the token the step writes."""
        return attended_positions([s.kv_len + 1 for s in self.running], self.limits.kv_layout)

    def step_cost(self) -> float:
        return self.device.decode_ctx_s(len(self.running), self.attended())

    def start_step(self, busy: _Busy, then: Callable[[], None]) -> bool:
        """Admit the waiting sequences and run one step, charged to ``busy``; ``then`` runs
        when it ends. False (and nothing scheduled) when no sequence is running."""
        self.admit()
        if not self.running:
            return False
        cost = self.step_cost()
        busy.decode_s += cost
        self.clock.at(self.clock.now + cost, lambda: (self.end_step(), then()))
        return True

    def end_step(self) -> None:
        now = self.clock.now
        still = []
        for s in self.running:
            s.generated += 1
            if s.generated >= s.output_len:
                s.finished_at = now
                self.reserved_blocks -= self._reservation(s)
                self.finish(s)
            else:
                still.append(s)
        self.running = still


class _Engines:
    """Replicas whose one engine both decodes and prefills prompts, one pass at a time in
    the order they were submitted: the colocated app's ``ColocatedServer``, and the split
    app's ``DecodeServer`` for the prompts it prefills itself. ``policy`` says how a
    replica's prompts share the engine with its decode steps (``COLOCATED_POLICIES``; the
    module docstring)."""

    def __init__(self, device: DeviceProfile, n: int, limits: EngineLimits, policy: str,
                 clock: _Clock, finish: Callable[[_Seq], None], chunk_tokens: int = 512) -> None:
        self.device, self.limits, self.policy = device, limits, policy
        self.chunk_tokens, self.clock, self.finish = chunk_tokens, clock, finish
        self.busy = [_Busy() for _ in range(n)]
        self.prefills = [_PrefillQueue(device, limits) for _ in range(n)]
        self.mixed_queues: list[deque[_Req]] = [deque() for _ in range(n)]  # chunked
        self.decoders = [_Decoder(device, limits, clock, finish) for _ in range(n)]
        self.active = [False] * n
        self.ready_at = [0.0] * n  # the prefill queue's wake-up wait ends
        self.last_was_prefill = [False] * n  # interleave
        # mixed: the rows of the queue's own pass under way, and the chunks of the step the
        # decode loop planned while it ran (None: none planned)
        self.own_pass: list[list[_Req] | None] = [None] * n
        self.planned: list[_Chunks | None] = [None] * n
        self.planned_joins = [0] * n  # the sequences the loop held then (it admits those)
        self.on_prefilled: Callable[[_Req], None] = lambda r: None  # a prompt's package is made

    def load(self, k: int) -> int:
        """Replica ``k``'s streams and prompts (what Serve's router counts on it)."""
        return self.decoders[k].load + len(self.prefills[k]) + len(self.mixed_queues[k])

    def least_loaded(self) -> int:
        return min(range(len(self.decoders)), key=self.load)

    def add_prompt(self, i: int, r: _Req) -> None:
        """``r`` joins replica ``i``'s prefill queue."""
        now = self.clock.now
        if self.policy == "chunked":
            r.done = r.arrival.cached_len
            self.mixed_queues[i].append(r)
            if not self.active[i]:
                self.active[i] = True
                self.clock.at(now + self.limits.batch_wait_s, lambda: self.next_pass(i))
            return
        q = self.prefills[i]
        q.add(r, now)
        if q.idle:
            q.idle = False
            self.ready_at[i] = now + self.limits.batch_wait_s
            self.clock.at(self.ready_at[i], lambda: self._wake(i))

    def add_seq(self, j: int, s: _Seq, *, defer: bool = False) -> None:
        """An answer whose first token is out joins replica ``j``'s decode loop; ``defer``:
        after the other events of this instant (answers that arrive together join the same
        first step)."""
        self.decoders[j].waiting.append(s)
        if self.active[j]:
            if self.policy == "mixed" and self.own_pass[j] is not None \
                    and self.planned[j] is None:
                # the loop wakes during the queue's pass and plans its first step's chunks
                # now (``DecodeLoop._take_chunks``); the step waits for the pass to end
                self.planned[j] = self._plan_step(j)
            return
        self.active[j] = True
        if defer:
            self.clock.at(self.clock.now, lambda: self.next_pass(j))
        else:
            self.next_pass(j)

    def _wake(self, i: int) -> None:
        if not self.active[i]:
            self.active[i] = True
            self.next_pass(i)

    def next_pass(self, i: int) -> None:
        """What replica ``i`` runs next."""
        if self.policy == "mixed":
            self._next_mixed(i)
            return
        if self.policy == "chunked":
            if self.mixed_queues[i]:
                self._chunked_pass(i)
            elif not self.decoders[i].start_step(self.busy[i], lambda: self.next_pass(i)):
                self.active[i] = False
            return
        # interleave: the engine thread runs what was submitted first; while both loops
        # have work, a prefill pass and a decode step take turns
        q = self.prefills[i]
        prefill_ready = len(q) > 0 and self.clock.now >= self.ready_at[i]
        if prefill_ready and not self.last_was_prefill[i]:
            self._prefill_pass(i)
        elif self.decoders[i].start_step(self.busy[i], lambda: self.next_pass(i)):
            self.last_was_prefill[i] = False
        elif prefill_ready:
            self._prefill_pass(i)
        else:
            self.active[i] = False  # a prompt still in its wake-up wait restarts it

    def _prefilled(self, i: int, r: _Req) -> None:
        """A prompt's prefill ended on replica ``i``: its answer decodes there (``n = 1``) or
        each answer on the least loaded replica, through the object store."""
        self.on_prefilled(r)
        for s in _answers(r):
            j = i
            if r.arrival.n > 1:
                j = min(range(len(self.decoders)), key=lambda k: (self.load(k), k != i))
            if j == i:
                self._to_decode(j, s)
            else:
                hop = self.device.hop_s(r.arrival.input_len * self.device.kv_bytes_per_token)
                self.clock.at(self.clock.now + hop, lambda j=j, s=s: self._to_other(j, s))

    def _to_decode(self, i: int, s: _Seq) -> None:
        if s.first_token(self.clock.now):
            self.finish(s)
        else:
            self.decoders[i].waiting.append(s)

    def _to_other(self, j: int, s: _Seq) -> None:
        if s.first_token(self.clock.now):
            self.finish(s)
        else:
            self.add_seq(j, s)

    # -- interleave ---------------------------------------------------------------------------

    def _prefill_pass(self, i: int) -> None:
        q = self.prefills[i]
        rows = q.plan(self.clock.now)
        cost = q.pass_s(rows)
        self.busy[i].prefill_s += cost
        self.last_was_prefill[i] = True
        self.clock.at(self.clock.now + cost, lambda: self._after_prefill_pass(i, rows))

    def _after_prefill_pass(self, i: int, rows: list[_Req]) -> None:
        q = self.prefills[i]
        for r in q.advance(rows):
            self._prefilled(i, r)
        if not len(q):
            q.idle = True
        self.next_pass(i)

    # -- mixed (this app) ---------------------------------------------------------------------

    def _next_mixed(self, i: int) -> None:
        """While the decode loop has sequences, each of its steps carries the queue's next
        chunks; with none, the queue runs passes of its own (``PrefillQueue._run``)."""
        dec, q = self.decoders[i], self.prefills[i]
        if self.planned[i] is not None or dec.waiting or dec.running:
            self._mixed_step(i)
        elif len(q) and self.clock.now >= self.ready_at[i]:
            self._own_pass(i)
        else:
            self.active[i] = False  # a prompt still in its wake-up wait restarts it
            if not len(q):
                q.idle = True  # the queue's task sleeps until a prompt comes

    def _plan_step(self, i: int) -> _Chunks:
        """The chunks of replica ``i``'s next decode step (``DecodeLoop._take_chunks``: the
        rows it may run, before admission), none of a pass under way."""
        dec = self.decoders[i]
        self.planned_joins[i] = len(dec.waiting)
        rows = min(self.limits.max_batch_size, len(dec.running) + len(dec.waiting))
        return self.prefills[i].plan_chunks(self.clock.now, rows, self.own_pass[i] or ())

    def _mixed_step(self, i: int) -> None:
        dec = self.decoders[i]
        plan, self.planned[i] = self.planned[i], None
        if plan is None:
            plan = self._plan_step(i)
        # sequences that came after the plan was made wait for the next step (the loop
        # applies what was handed over between steps, then plans)
        dec.admit(self.planned_joins[i])
        if plan.rows:
            cost = self._mixed_pass_s(dec, [(n, r.done) for r, n in zip(plan.rows, plan.sizes,
                                                                       strict=True)])
            self.busy[i].prefill_s += cost
        else:
            cost = dec.step_cost()
            self.busy[i].decode_s += cost
        self.clock.at(self.clock.now + cost, lambda: self._after_mixed_step(i, plan))

    def _after_mixed_step(self, i: int, plan: _Chunks) -> None:
        dec = self.decoders[i]
        if dec.running:
            dec.end_step()
        if plan.rows:
            for r in self.prefills[i].advance(plan.rows, plan.sizes):
                self._prefilled(i, r)
        self.next_pass(i)

    def _own_pass(self, i: int) -> None:
        q = self.prefills[i]
        rows = q.plan(self.clock.now)
        cost = q.pass_s(rows)
        self.busy[i].prefill_s += cost
        self.own_pass[i] = rows
        self.clock.at(self.clock.now + cost, lambda: self._after_own_pass(i, rows))

    def _after_own_pass(self, i: int, rows: list[_Req]) -> None:
        dec, q = self.decoders[i], self.prefills[i]
        self.own_pass[i] = None
        loop_busy = self.planned[i] is not None or bool(dec.waiting or dec.running)
        for r in q.advance(rows):
            self._prefilled(i, r)
        if not loop_busy and len(q):
            # the queue's task plans its next pass at once, before the streams of the
            # prompts this pass finished reach the decode loop; the loop's first step is
            # planned during that pass and runs after it
            self._own_pass(i)
            if dec.waiting:
                self.planned[i] = self._plan_step(i)
            return
        self.next_pass(i)

    def _mixed_pass_s(self, dec: _Decoder, chunks: Sequence[tuple[int, int]]) -> float:
        """One pass of prompt chunks (``(tokens, past)`` each, laid end to end, each
        attending to its own past) plus a step of ``dec``'s running sequences: the linear
        layers run once over every token, so compute and memory terms add up, the weights
        read once; a step that streams tokens pays the serving stack's per-step cost."""
        dev = self.device
        tokens = sum(n for n, _ in chunks)
        pairs = sum(n * (n + 2 * past) for n, past in chunks)
        p_compute = dev.prefill.compute(tokens, pairs)
        p_memory = dev.prefill.memory(tokens, 0.0) - dev.prefill.memory.c0
        if dec.running:
            b, ctx_tokens = len(dec.running), dec.attended()
            d_compute = dev.decode.compute(b, ctx_tokens)
            d_memory = dev.decode.memory(b, ctx_tokens)
            stack = dev.decode_stack(b, 0.0)
        else:
            d_compute, d_memory, stack = 0.0, dev.prefill.memory.c0, 0.0
        return dev.decode.overhead_s + max(p_compute + d_compute, p_memory + d_memory) + stack

    # -- chunked (vLLM/Sarathi-style) ---------------------------------------------------------

    def _chunked_pass(self, i: int) -> None:
        # one mixed pass: every running sequence decodes, the oldest prompt advances by up
        # to chunk_tokens (prompts progress one after another)
        dec = self.decoders[i]
        dec.admit()
        r = self.mixed_queues[i][0]
        chunk = min(self.chunk_tokens, r.remaining)
        cost = self._mixed_pass_s(dec, [(chunk, r.done)])
        self.busy[i].prefill_s += cost
        self.clock.at(self.clock.now + cost, lambda: self._after_chunked_pass(i, r, chunk))

    def _after_chunked_pass(self, i: int, r: _Req, chunk: int) -> None:
        dec = self.decoders[i]
        if dec.running:
            dec.end_step()
        r.done += chunk
        if not r.remaining:
            self.mixed_queues[i].popleft()
            self._prefilled(i, r)
        self.next_pass(i)


class _SplitRun:
    """The split app's replicas on a clock: prefill passes, the KV hop, decode batches, and
    the ingress's choice of where a prompt is prefilled (``SplitPath._prefills_locally``)."""

    def __init__(self, sysm: SplitSystem, clock: _Clock, finish: Callable[[_Seq], None]) -> None:
        self.sysm, self.limits, self.clock, self.finish = sysm, sysm.limits, clock, finish
        self.prefill_busy = [_Busy() for _ in range(sysm.num_prefill)]
        # per replica: which of its lanes has a pass under way, and the prompts in them
        self.lane_busy = [[False] * sysm.limits.prefill_lanes for _ in range(sysm.num_prefill)]
        self.in_pass: list[set[_Req]] = [set() for _ in range(sysm.num_prefill)]
        self.prefills = [_PrefillQueue(sysm.prefill, sysm.limits)
                         for _ in range(sysm.num_prefill)]
        # DecodeServer: a decode loop and a prefill queue for the prompts prefilled locally
        self.decode = _Engines(sysm.decode, sysm.num_decode, sysm.limits, sysm.decode_policy,
                               clock, finish)
        self.decode.on_prefilled = self._stream_starts
        self.homes = random.Random(0)  # each prompt's rendezvous-hash home replica
        self.busy_tokens = sysm.limits.busy_prefill_tokens
        # SplitPath's counts: prompt tokens whose streams have not started, sent to the
        # prefill phase, of those the short ones, and sent to a decode replica
        self.prefill_backlog = self.short_backlog = self.local_backlog = 0

    def schedule_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        overhead = self.sysm.prefill.request_overhead_s
        for uid, a in enumerate(arrivals):
            r = _Req(a, a.at, uid)
            self.clock.at(a.at + overhead, lambda r=r: self.request_arrive(r))

    def busy_devices(self) -> list[tuple[DeviceProfile, _Busy]]:
        return ([(self.sysm.prefill, b) for b in self.prefill_busy]
                + [(self.sysm.decode, b) for b in self.decode.busy])

    def _route_prefill(self) -> int:
        qs = self.prefills
        least = min(range(len(qs)), key=lambda k: (len(qs[k]), qs[k].tokens))
        if self.limits.prefill_routing == "least_loaded" or len(qs) == 1:
            return least
        home = self.homes.randrange(len(qs))
        if len(qs[home]) - len(qs[least]) > self.limits.affinity_imbalance:
            return least
        return home

    def _is_short(self, r: _Req) -> bool:
        return r.arrival.input_len < self.limits.local_prefill_when_busy

    def prefills_locally(self, r: _Req) -> bool:
        """``SplitPath._prefills_locally``: under ``local_prefill_threshold``; or short while
        the prefill phase is backed up and the decode side has fewer tokens ahead of it
        (its local prompts not yet streaming) than the prefill phase (its short prompts and
        at most two passes of longer ones)."""
        if r.arrival.input_len < self.limits.local_prefill_threshold:
            return True
        if not self._is_short(r) or self.prefill_backlog < self.busy_tokens:
            return False
        longer = self.prefill_backlog - self.short_backlog
        ahead_there = self.short_backlog + min(longer, 2 * self.busy_tokens)
        return self.local_backlog < ahead_there

    def _count(self, r: _Req, sign: int) -> None:
        """``Backlog._count``."""
        n = sign * r.backlog
        if r.local:
            self.local_backlog += n
        else:
            self.prefill_backlog += n
            if r.short:
                self.short_backlog += n

    def _stream_starts(self, r: _Req) -> None:
        """``r``'s stream starts (``StreamStart``: local, its package made; otherwise on the
        decode replica, the hop done): its tokens leave the backlog counts."""
        if r.backlog:
            self._count(r, -1)
            r.backlog = 0

    def request_arrive(self, r: _Req) -> None:
        r.local = self.prefills_locally(r)
        if r.arrival.n == 1:
            # n > 1 is prefilled once for its answers (``SplitPath.shared_prefill``), whose
            # streams read that package: neither is counted in a backlog
            r.backlog, r.short = r.arrival.input_len, not r.local and self._is_short(r)
            self._count(r, +1)
        if r.local:  # DecodeServer.generate_local: on the least loaded decode replica
            self.decode.add_prompt(self.decode.least_loaded(), r)
            return
        i = self._route_prefill()
        q = self.prefills[i]
        q.add(r, self.clock.now)
        if q.idle:
            q.idle = False
            self.clock.at(self.clock.now + self.limits.batch_wait_s,
                          lambda: self.prefill_start(i))
        elif 0 < self.passes(i) < self.limits.prefill_lanes:
            # the queue's loop is awake (a pass runs): a free lane takes it at once
            # (``PrefillQueue._run_lanes``)
            self.prefill_start(i)

    def passes(self, i: int) -> int:
        """Prefill passes under way on replica ``i`` (one per busy lane)."""
        return sum(self.lane_busy[i])

    def prefill_start(self, i: int) -> None:
        """Passes on replica ``i``'s free lanes, while prompts in no pass wait."""
        q = self.prefills[i]
        while self.passes(i) < self.limits.prefill_lanes:
            lane = self.lane_busy[i].index(False)
            busy: Collection[_Req] = self.in_pass[i]
            if lane > 0:  # an extra lane takes long prompts only (at least half a chunk)
                busy = busy | {e[3] for e in q._order if 2 * e[3].remaining < q.chunk_tokens}
            rows = q.plan(self.clock.now, busy)
            if not rows:
                break
            cost = q.pass_s(rows) / self._prefill_share(i)
            self.lane_busy[i][lane] = True
            self.in_pass[i].update(rows)
            self.prefill_busy[i].prefill_s += cost
            self.clock.at(self.clock.now + cost,
                          lambda rows=rows, lane=lane: self.prefill_end(i, rows, lane))
        if not self.passes(i):
            q.idle = True

    def _prefill_share(self, i: int) -> float:
        """The part of a core a prefill pass starting now runs on (``shared_cores``): the
        cores less what the stack takes streaming the running sequences' tokens (each
        decode replica's rows over its step), shared equally with the busy decode replicas
        and the other passes under way (other replicas', this one's other lanes), at most
        one core; on hardware of one's own 1.0, or that split equally between the replica's
        passes under way (its lanes share its device). Fixed for the pass."""
        cores = self.sysm.shared_cores
        if cores is None:
            return 1.0 / (1 + self.passes(i))
        busy = 1 + sum(self.passes(j) for j in range(len(self.lane_busy)))
        tokens_per_s = 0.0
        for j, dec in enumerate(self.decode.decoders):
            busy += self.decode.active[j]
            if dec.running:
                tokens_per_s += len(dec.running) / dec.step_cost()
        left = max(cores - self.sysm.stack_cpu_per_token_s * tokens_per_s, 0.1 * cores)
        return min(1.0, left / busy)

    def prefill_end(self, i: int, rows: list[_Req], lane: int = 0) -> None:
        """Each prompt this pass finished leaves; each answer hops to decode on its own."""
        dev = self.sysm.prefill
        self.lane_busy[i][lane] = False
        self.in_pass[i].difference_update(rows)
        for r in self.prefills[i].advance(rows):
            hop = dev.hop_s(r.arrival.input_len * dev.kv_bytes_per_token)
            for s in _answers(r):
                self.clock.at(self.clock.now + hop, lambda s=s: self.decode_arrive(s))
        self.prefill_start(i)

    def decode_arrive(self, s: _Seq) -> None:
        self._stream_starts(s.req)
        if s.first_token(self.clock.now):
            self.finish(s)
            return
        self.decode.add_seq(self.decode.least_loaded(), s, defer=True)


class _ColocatedRun(_Engines):
    """The colocated replicas on a clock: each prompt goes to the least loaded replica,
    which prefills it and decodes its answer (``_Engines``)."""

    def __init__(self, sysm: ColocatedSystem, clock: _Clock,
                 finish: Callable[[_Seq], None]) -> None:
        super().__init__(sysm.device, sysm.num_replicas, sysm.limits, sysm.policy, clock,
                         finish, sysm.chunk_tokens)
        self.sysm = sysm

    def schedule_arrivals(self, arrivals: Iterable[Arrival]) -> None:
        overhead = self.device.request_overhead_s
        for uid, a in enumerate(arrivals):
            r = _Req(a, a.at, uid, local=True)
            self.clock.at(a.at + overhead, lambda r=r: self.request_arrive(r))

    def busy_devices(self) -> list[tuple[DeviceProfile, _Busy]]:
        return [(self.device, b) for b in self.busy]

    def request_arrive(self, r: _Req) -> None:
        self.add_prompt(self.least_loaded(), r)


class Simulation:
    """One run of a system on a list of arrivals."""

    def __init__(self, system: System, arrivals: Sequence[Arrival]) -> None:
        self.system = system
        self.arrivals = sorted(arrivals, key=lambda a: a.at)
        self.clock = _Clock()
        self.done: list[_Req] = []

    def run(self) -> SimResult:
        replicas: _SplitRun | _ColocatedRun
        if isinstance(self.system, SplitSystem):
            replicas = _SplitRun(self.system, self.clock, self._finish)
        else:
            replicas = _ColocatedRun(self.system, self.clock, self._finish)
        replicas.schedule_arrivals(self.arrivals)
        self.clock.run()
        return SimResult.build(self.system, self.done, replicas.busy_devices())

    def _finish(self, s: _Seq) -> None:
        s.req.finished += 1
        if s.req.finished == s.req.arrival.n:
            self.done.append(s.req)


# ---- results ----------------------------------------------------------------------------


@dataclass(slots=True)
class SimRecord(RequestRecord):
    """A simulated request. With several answers: ``output_tokens`` counts every answer's,
    ``ttft_s`` is the worst answer's first token, ``e2e_s`` the last answer's end and
    ``tpot_s`` the worst answer's TPOT, so the request meets an SLO exactly when every
    answer does."""

    answers: int = 1
    answer_tokens: int = 0  # each answer's output tokens
    worst_tpot_s: float | None = None
    local_prefill: bool = False  # prefilled where it decodes (colocated; split: no KV hop)

    @property
    def tpot_s(self) -> float | None:
        if self.answers == 1:
            return tpot(self.e2e_s, self.ttft_s, self.output_tokens)
        return self.worst_tpot_s


def meets_all_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """``load_tests.metrics.meets_slos``, answer by answer for a request of several."""
    if isinstance(record, SimRecord) and record.answers > 1 and record.answer_tokens < 2:
        slos = {k: v for k, v in slos.items() if k != "tpot"}  # no answer has a TPOT
    return meets_slos(record, slos)


def _record(r: _Req) -> SimRecord:
    a = r.arrival
    firsts = [s.first_token_at for s in r.answers]
    ends = [s.finished_at for s in r.answers]
    assert None not in firsts and None not in ends
    tpots = [tpot(e - r.sent_at, f - r.sent_at, a.output_len)  # type: ignore[operator]
             for f, e in zip(firsts, ends, strict=True)]
    known = [t for t in tpots if t is not None]
    return SimRecord(
        a.request_class, r.sent_at, prompt_tokens=a.input_len,
        output_tokens=a.output_len * a.n, ttft_s=max(firsts) - r.sent_at,  # type: ignore[type-var]
        e2e_s=max(ends) - r.sent_at, ok=True,  # type: ignore[type-var]
        answers=a.n, answer_tokens=a.output_len, worst_tpot_s=max(known) if known else None,
        local_prefill=r.local)


@dataclass(slots=True)
class SimResult:
    system: str
    records: list[SimRecord]
    duration_s: float
    price_per_hour: float
    energy_j: float

    @classmethod
    def build(cls, system: System, done: Iterable[_Req],
              busy: list[tuple[DeviceProfile, _Busy]]) -> SimResult:
        done = sorted(done, key=lambda r: (r.sent_at, r.uid))
        records = [_record(r) for r in done]
        end = max((r.sent_at + (rec.e2e_s or 0.0) for r, rec in zip(done, records, strict=True)),
                  default=0.0)
        duration = max(end, 1e-9)
        energy = 0.0
        for dev, b in busy:
            idle = max(duration - b.prefill_s - b.decode_s, 0.0)
            energy += (b.prefill_s * dev.power_prefill_w + b.decode_s * dev.power_decode_w
                       + idle * dev.power_idle_w)
        return cls(system.describe(), records, duration, system.price_per_hour, energy)

    def summary(self, slos: dict[str, float] | None = None) -> dict[str, Any]:
        s = summarize(self.records, self.duration_s, slos)
        if slos and any(r.answers > 1 for r in self.records):
            good = sum(1 for r in self.records if meets_all_slos(r, slos))
            s.update(good_requests=good, goodput=good / self.duration_s,
                     good_fraction=good / len(self.records) if self.records else None)
        tokens = s["output_tokens"]
        cost = self.price_per_hour * self.duration_s / 3600.0
        s.update({
            "system": self.system,
            "price_per_hour": self.price_per_hour,
            "cost_per_m_output_tokens": cost / tokens * 1e6 if tokens else None,
            "energy_per_request_j": self.energy_j / len(self.records) if self.records else None,
            "energy_j": self.energy_j,
        })
        return s


def simulate(system: System, arrivals: Sequence[Arrival]) -> SimResult:
    return Simulation(system, arrivals).run()
