"""What structured outputs cost the engine: a batch-8 decode step with 0, 1 and 8 of its rows
constrained by a mid-size JSON schema, and the schema's compile time cold and cached.

The steps run through ``Decoder.step`` (fused kernel, sampling, the masks) on the decode
replica's thread count, the three batches interleaved in rounds so that a busy spell of a
shared machine hits each alike; each batch is refilled (fresh sequences, 48-token prompts)
whenever a row finishes, outside the timing. A constrained row's mask is computed on the
engine thread in the step (llguidance), then applied to its logits.

    python -m load_tests.structured_bench [--threads 1] [--dtype auto] [--rounds 5]
        [--steps 30] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from app.config import EngineConfig, cpu_flags
from app.decode import Decoder
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from app.sequence import Sequence
from app.structured import Constraint, _compile

# a mid-size schema: nested objects, an array of objects, enums, numbers, strings
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "customer", "items", "status", "notes"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "customer": {"type": "object", "additionalProperties": False,
                     "required": ["name", "email", "tier"],
                     "properties": {"name": {"type": "string"},
                                    "email": {"type": "string"},
                                    "tier": {"enum": ["free", "pro", "enterprise"]}}},
        "items": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "required": ["sku", "qty", "price"],
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"},
                           "price": {"type": "number"}}}},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "notes": {"type": "string"}}}
PROMPT_LEN = 48


class Batch:
    """A Decoder holding 8 rows, ``constrained`` of them under SCHEMA (sampled, seeded)."""

    def __init__(self, core: EngineCore, constrained: int, eos: frozenset[int]) -> None:
        self.core, self.constrained, self.eos = core, constrained, eos
        self.decoder = Decoder(core.runner, eos_token_ids=eos, max_batch_size=8,
                               max_kv_tokens=8 * 1024, grammars=core.grammars)
        self.rng = random.Random(constrained)
        self.serial = 0
        self.fill()

    def fill(self) -> None:
        while len(self.decoder.running) + len(self.decoder.waiting) < 8:
            k = self.serial
            self.serial += 1
            c = (Constraint.json_schema(SCHEMA, "bench")
                 if len(self.decoder.running) + len(self.decoder.waiting) < self.constrained
                 else None)
            sp = SamplingParams(max_tokens=400, temperature=1.0, seed=k, constraint=c,
                                ignore_eos=c is None)
            prompt = tuple(self.rng.randrange(100, 20000) for _ in range(PROMPT_LEN))
            [pkg] = self.core.make_prefiller(self.eos).make_packages(
                [PrefillRequest(f"b{self.constrained}-{k}", prompt, sp)])
            seq = Sequence(pkg.request_id, list(pkg.prompt_ids), pkg.sampling)
            seq.append(pkg.first_token, eos_token_ids=self.eos, max_model_len=2048)
            self.decoder.add(seq, pkg)
        self.decoder.step()  # joins them, outside any timing

    def timed_steps(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            if len(self.decoder.running) < 8:
                self.fill()
            start = time.perf_counter()
            self.decoder.step()
            times.append(time.perf_counter() - start)
        return times


def compile_times() -> dict[str, float]:
    """A new schema's grammar, cold (first compile: llguidance's import included on the
    first call of a process) and cached (the same schema again), in ms."""
    schema = {**SCHEMA, "title": f"fresh-{time.time_ns()}"}
    start = time.perf_counter()
    _compile("json", json.dumps(schema, sort_keys=True), "bench")
    cold = time.perf_counter() - start
    start = time.perf_counter()
    _compile("json", json.dumps(schema, sort_keys=True), "bench")
    return {"compile_cold_ms": cold * 1e3, "compile_cached_ms": (time.perf_counter() - start) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (default: auto)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    core = EngineCore(EngineConfig(num_threads=args.threads, dtype=args.dtype))
    eos = frozenset({2})
    core.grammars.warm(eos)
    compile_times()  # llguidance imported and warm: the next figures are a schema's own
    figures = compile_times()
    batches = {n: Batch(core, n, eos) for n in (0, 1, 8)}
    rows: dict[int, list[float]] = {n: [] for n in batches}
    for _ in range(args.rounds):
        for n, batch in batches.items():
            rows[n].append(statistics.median(batch.timed_steps(args.steps)) * 1e3)
    for n in batches:
        figures[f"step8_{n}_constrained_ms"] = statistics.median(rows[n])
        figures[f"step8_{n}_constrained_range_ms"] = [min(rows[n]), max(rows[n])]
    base = figures["step8_0_constrained_ms"]
    for n in (1, 8):
        figures[f"added_by_{n}_constrained"] = figures[f"step8_{n}_constrained_ms"] / base - 1
    flags = cpu_flags() or set()
    print(f"CPU: {platform.processor() or platform.machine()}; "
          f"{' '.join(sorted(f for f in flags if f.startswith(('avx', 'amx'))))}")
    print(f"decode step, batch 8, {core.config.resolved_dtype}, {args.threads} thread(s), "
          f"medians of {args.rounds} rounds of {args.steps} steps")
    for key, value in figures.items():
        print(f"{key:32s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
