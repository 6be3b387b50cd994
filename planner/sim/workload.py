"""What arrives: requests (``Arrival``), workloads drawn from length distributions, and traces of
real runs."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from load_tests.workloads import LengthDist, arrival_gaps
from planner.sim.constants import PREFIX_BLOCK_TOKENS


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
