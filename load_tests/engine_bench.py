"""Engine micro-benchmark: decode step, prefill and KV package size against plain transformers.

Run: ``python -m load_tests.engine_bench [--threads 2] [--json out.json] [--quick]``

Everything is measured in one process, side by side:

1. Decode step at batch 1, 8 and 16 (64-token prompts). The raw baseline is a plain
   transformers forward over a ``DynamicCache`` (``model(input_ids=[B, 1], past_key_values=...)``
   plus an argmax); the engine figure is ``Decoder.step()`` (``ModelRunner.decode`` plus greedy
   sampling and sequence bookkeeping). Both are rewound to the 64-token prompt after every
   block of steps (``cache.crop`` for the raw cache, the sequences' KV length for the engine),
   so the context stays between 65 and 64 + steps-per-block for both. Blocks of every batch
   size and of both sides run in a fresh shuffled order each round. Reported: median step
   time, tokens/s and engine/raw.
2. Prefill of one 64-, 256- and 1024-token prompt through ``Prefiller.prefill`` against a
   plain ``model(input_ids)`` forward, interleaved, median of a few runs.
3. KV package bytes per token under pickle protocol 5 (what Ray uses) against theory,
   ``2 * layers * kv_heads * head_dim * dtype bytes``.

This is a benchmark, not a test: it prints PASS/FAIL beside each target and always exits 0.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from app.config import EngineConfig
from app.decode import Decoder
from app.engine_core import EngineCore, apply_thread_setting
from app.kv_package import serialized_sizes
from app.messages import PrefillRequest
from app.sampling import SamplingParams
from app.sequence import Sequence

CONTEXT = 64  # prompt tokens of every decode row
BATCHES = (1, 8, 16)
PREFILL_LENS = (64, 256, 1024)

TARGET_OVERHEAD_B1 = 1.10  # engine / raw step time at batch 1
TARGET_SCALING_B16 = 6.0  # engine tok/s at batch 16 / engine tok/s at batch 1
TARGET_KV_TOLERANCE = 0.05  # measured bytes/token within 5% of theory


@dataclass
class Plan:
    rounds: int  # decode: each round runs one block of every (batch, raw|engine) pair
    min_rounds: int  # past this many rounds, stop once the decode phase exceeds its budget
    decode_budget_s: float  # keeps a run on a busy machine near its usual length
    steps_per_block: int
    warmup_steps: int
    prefill_runs: int


FULL = Plan(rounds=20, min_rounds=10, decode_budget_s=150.0, steps_per_block=4,
            warmup_steps=4, prefill_runs=5)
QUICK = Plan(rounds=2, min_rounds=2, decode_budget_s=0.0, steps_per_block=4, warmup_steps=1,
             prefill_runs=1)


@dataclass
class DecodeRow:
    batch: int
    raw_ms: float
    engine_ms: float
    raw_samples: int
    engine_samples: int
    raw_tok_s: float = field(init=False)
    engine_tok_s: float = field(init=False)
    ratio: float = field(init=False)

    def __post_init__(self) -> None:
        self.raw_tok_s = self.batch * 1000.0 / self.raw_ms
        self.engine_tok_s = self.batch * 1000.0 / self.engine_ms
        self.ratio = self.engine_ms / self.raw_ms


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- 1. decode step ------------------------------------------------------------------------


class RawDecode:
    """Plain transformers: prefill into a DynamicCache, then one-token forwards + argmax."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]]) -> None:
        self.model = model
        # transformers renamed ``past_key_values`` to ``cache``; use whichever forward takes.
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        ids = torch.tensor(prompts, dtype=torch.long)  # [B, CONTEXT], equal lengths: no padding
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
        self.cache = out.cache if hasattr(out, "cache") else out.past_key_values
        self.prompt_len = ids.shape[1]
        self.next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]

    @torch.inference_mode()
    def step(self) -> None:
        out = self.model(input_ids=self.next_ids, use_cache=True, **{self.cache_kw: self.cache})
        self.next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)

    def rewind(self) -> None:
        # a negative argument removes that many tokens (the form every version accepts)
        extra = self.cache.get_seq_length() - self.prompt_len
        if extra > 0:
            self.cache.crop(-extra)


class EngineDecode:
    """The engine's decoder with B running greedy sequences of a 64-token prompt."""

    def __init__(self, core: EngineCore, prompts: list[list[int]], max_tokens: int) -> None:
        self.decoder = Decoder(
            core.runner,
            eos_token_ids=frozenset(),  # never stop early: every step decodes all B rows
            max_batch_size=len(prompts),
            max_kv_tokens=core.config.max_kv_tokens,
        )
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        reqs = [PrefillRequest(f"bench-{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
        packages = core.make_prefiller().make_packages(reqs)
        for pkg in packages:
            seq = Sequence(request_id=pkg.request_id, prompt_token_ids=pkg.prompt_ids,
                           sampling=pkg.sampling)
            seq.append(pkg.first_token, eos_token_ids=frozenset(),
                       max_model_len=core.runner.max_model_len)
            self.decoder.add(seq, pkg)
        self.decoder._admit()  # copy the KV packages into the batch buffer, outside the timing
        assert len(self.decoder.running) == len(prompts)
        self.prompt_len = len(prompts[0])

    def step(self) -> None:
        self.decoder.step()

    def rewind(self) -> None:
        # The engine's equivalent of cache.crop(prompt_len): forget the decoded tokens. KV
        # beyond kv_len is stale but is overwritten before any step reads it.
        for seq in self.decoder.running:
            del seq.output_token_ids[1:]
            seq.kv_len = self.prompt_len
        assert not any(s.is_finished for s in self.decoder.running)


def bench_decode(core: EngineCore, plan: Plan, batches: tuple[int, ...]) -> list[DecodeRow]:
    """Every (batch, raw|engine) pair runs one block per round, in a fresh shuffled order each
    round, so slow spells of a shared machine hit all of them alike (both the engine/raw
    ratios and the batch-16/batch-1 scaling are side-by-side comparisons)."""
    vocab = core.runner.vocab_size
    runners: dict[tuple[int, str], RawDecode | EngineDecode] = {}
    for b in batches:
        prompts = _random_prompts(b, CONTEXT, vocab, seed=b)
        runners[(b, "raw")] = RawDecode(core.model, prompts)
        runners[(b, "engine")] = EngineDecode(core, prompts, max_tokens=plan.steps_per_block + 8)
    gc.freeze()  # model and runners: a gc.collect() between blocks then costs ~nothing
    for runner in runners.values():
        for _ in range(plan.warmup_steps):
            runner.step()
        runner.rewind()
    times: dict[tuple[int, str], list[float]] = {key: [] for key in runners}
    rng = random.Random(0)
    keys = list(runners)
    start = time.perf_counter()
    for r in range(plan.rounds):
        if r >= plan.min_rounds and time.perf_counter() - start > plan.decode_budget_s:
            print(f"  decode: time budget spent after {r} rounds", flush=True)
            break
        rng.shuffle(keys)
        for key in keys:
            runner = runners[key]
            gc.collect()
            for _ in range(plan.steps_per_block):
                times[key].append(_timed(runner.step))
            runner.rewind()
    rows = []
    for b in batches:
        raw, eng = times[(b, "raw")], times[(b, "engine")]
        row = DecodeRow(
            batch=b,
            raw_ms=statistics.median(raw) * 1000,
            engine_ms=statistics.median(eng) * 1000,
            raw_samples=len(raw),
            engine_samples=len(eng),
        )
        print(f"  decode batch {b:2d}: raw {row.raw_ms:6.1f} ms  engine {row.engine_ms:6.1f} ms"
              f"  ({row.raw_samples} steps each)", flush=True)
        rows.append(row)
    return rows


# -- 2. prefill ----------------------------------------------------------------------------


def bench_prefill(core: EngineCore, plan: Plan, lengths: tuple[int, ...]) -> list[dict]:
    prefiller = core.make_prefiller()
    vocab = core.runner.vocab_size
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    for n in lengths:
        [prompt] = _random_prompts(1, n, vocab, seed=1000 + n)
        ids = torch.tensor([prompt], dtype=torch.long)
        req = PrefillRequest(f"prefill-{n}", tuple(prompt), sampling)

        def engine(req=req):
            prefiller.make_packages([req])

        def raw(ids=ids):
            with torch.inference_mode():
                core.model(input_ids=ids)

        engine()  # warm-up (allocator, kernels for this shape)
        raw()
        times: dict[str, list[float]] = {"engine": [], "raw": []}
        for r in range(plan.prefill_runs):
            order = [("engine", engine), ("raw", raw)]
            if r % 2:
                order.reverse()
            for name, fn in order:
                gc.collect()
                times[name].append(_timed(fn))
        row = {
            "tokens": n,
            "engine_ms": statistics.median(times["engine"]) * 1000,
            "raw_ms": statistics.median(times["raw"]) * 1000,
            "runs": plan.prefill_runs,
        }
        row["ratio"] = row["engine_ms"] / row["raw_ms"]
        print(f"  prefill {n:4d} tokens: engine {row['engine_ms']:7.1f} ms"
              f"  raw {row['raw_ms']:7.1f} ms", flush=True)
        out.append(row)
    return out


# -- 3. KV package size --------------------------------------------------------------------


def bench_kv_package(core: EngineCore, lengths: tuple[int, ...]) -> list[dict]:
    prefiller = core.make_prefiller()
    theory = core.runner.layout.bytes_per_token()
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    for n in lengths:
        [prompt] = _random_prompts(1, n, core.runner.vocab_size, seed=2000 + n)
        [pkg] = prefiller.make_packages([PrefillRequest(f"kv-{n}", tuple(prompt), sampling)])
        inband, oob = serialized_sizes(pkg)
        per_token = oob / n
        out.append({
            "tokens": n,
            "out_of_band_bytes": oob,
            "in_band_bytes": inband,
            "bytes_per_token": per_token,
            "theory_bytes_per_token": theory,
            "ratio": per_token / theory,
        })
    return out


# -- report --------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join([line, sep, *body])


def evaluate(decode: list[DecodeRow], kv: list[dict]) -> list[dict]:
    by_b = {r.batch: r for r in decode}
    targets = []
    if 1 in by_b:
        ratio = by_b[1].ratio
        targets.append({
            "name": "engine overhead at batch 1 (engine/raw step time)",
            "value": round(ratio, 3),
            "target": f"<= {TARGET_OVERHEAD_B1:.2f}",
            "pass": ratio <= TARGET_OVERHEAD_B1,
        })
    if 1 in by_b and 16 in by_b:
        scale = by_b[16].engine_tok_s / by_b[1].engine_tok_s
        targets.append({
            "name": "engine tok/s batch 16 / batch 1",
            "value": round(scale, 2),
            "target": f">= {TARGET_SCALING_B16:.1f}",
            "pass": scale >= TARGET_SCALING_B16,
        })
    if kv:
        worst = max(abs(r["ratio"] - 1.0) for r in kv)
        targets.append({
            "name": "KV package bytes/token vs theory (worst length)",
            "value": round(1.0 + worst, 5),
            "target": f"within {TARGET_KV_TOLERANCE:.0%}",
            "pass": worst <= TARGET_KV_TOLERANCE,
        })
    return targets


def report(meta: dict, decode: list[DecodeRow], prefill: list[dict], kv: list[dict],
           targets: list[dict]) -> str:
    out = [
        f"Engine benchmark: {meta['model']} ({meta['dtype']}), torch {meta['torch']}, "
        f"{meta['torch_threads']} torch threads on {meta['cpu_count']} CPUs"
        f"{' [quick]' if meta['quick'] else ''}; 1-min load average at start/end "
        f"{meta['loadavg_1min_start_end'][0]} / {meta['loadavg_1min_start_end'][1]}",
        "",
        f"Decode step, {CONTEXT}-token context (medians of {meta['decode_steps_per_side']} steps "
        "per side, raw and engine blocks interleaved)",
    ]
    b1 = next((r for r in decode if r.batch == 1), None)
    rows = []
    for r in decode:
        scale = f"{r.engine_tok_s / b1.engine_tok_s:.2f}x" if b1 else "-"
        rows.append([str(r.batch), f"{r.raw_ms:.1f}", f"{r.engine_ms:.1f}", f"{r.raw_tok_s:.1f}",
                     f"{r.engine_tok_s:.1f}", f"{r.ratio:.3f}", scale])
    out.append(_table(["batch", "raw ms", "engine ms", "raw tok/s", "engine tok/s",
                       "engine/raw", "engine vs b1"], rows))
    out += ["", f"Prefill, one prompt (median of {meta['prefill_runs']} runs)"]
    rows = [[str(r["tokens"]), f"{r['engine_ms']:.1f}", f"{r['raw_ms']:.1f}", f"{r['ratio']:.3f}"]
            for r in prefill]
    out.append(_table(["tokens", "Prefiller.prefill ms", "model(input_ids) ms", "engine/raw"],
                      rows))
    out += ["", "KV package under pickle protocol 5 (out-of-band = shared-memory buffers)"]
    rows = [[str(r["tokens"]), str(r["out_of_band_bytes"]), str(r["in_band_bytes"]),
             f"{r['bytes_per_token']:.1f}", str(r["theory_bytes_per_token"]),
             f"{r['ratio']:.5f}"] for r in kv]
    out.append(_table(["tokens", "out-of-band B", "in-band B", "B/token", "theory B/token",
                       "ratio"], rows))
    out += ["", "Targets"]
    rows = [[t["name"], str(t["value"]), t["target"], _verdict(t["pass"])] for t in targets]
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else []
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(out)


def _meta(config: EngineConfig, plan: Plan, decode: list[DecodeRow], *, quick: bool,
          load_before: float) -> dict:
    """The run's settings and machine; the load average is read now (the end of the run)."""
    return {
        "model": config.model,
        "dtype": config.dtype,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "quick": quick,
        "context_tokens": CONTEXT,
        "decode_steps_per_side": decode[0].raw_samples if decode else 0,
        "steps_per_block": plan.steps_per_block,
        "prefill_runs": plan.prefill_runs,
        "sampling": "greedy",
        "loadavg_1min_start_end": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def _write_json(path: str, meta: dict, elapsed: float, phases: dict[str, float],
                decode: list[DecodeRow], prefill: list[dict], kv: list[dict],
                targets: list[dict]) -> None:
    doc = {
        "meta": {**meta, "elapsed_s": round(elapsed, 1),
                 "phase_s": {k: round(v, 1) for k, v in phases.items()}},
        "decode": [vars(r) for r in decode],
        "prefill": prefill,
        "kv_package": kv,
        "targets": targets,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m load_tests.engine_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("--quick", action="store_true", help="short smoke run (noisy figures)")
    args = ap.parse_args(argv)
    plan = QUICK if args.quick else FULL

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    config = EngineConfig(num_threads=args.threads)
    apply_thread_setting(config.num_threads)
    print(f"loading {config.model} with {torch.get_num_threads()} torch threads ...", flush=True)
    core = EngineCore.here(config)
    gc.freeze()  # keep the model's objects out of every later collection

    phases: dict[str, float] = {"load": time.perf_counter() - t0}
    print("decode step (raw vs engine, interleaved) ...", flush=True)
    t = time.perf_counter()
    decode = bench_decode(core, plan, BATCHES)
    phases["decode"] = time.perf_counter() - t
    print("prefill ...", flush=True)
    t = time.perf_counter()
    prefill = bench_prefill(core, plan, PREFILL_LENS)
    phases["prefill"] = time.perf_counter() - t
    kv = bench_kv_package(core, PREFILL_LENS)
    targets = evaluate(decode, kv)

    meta = _meta(config, plan, decode, quick=args.quick, load_before=load_before[0])
    print()
    print(report(meta, decode, prefill, kv, targets))
    elapsed = time.perf_counter() - t0
    print(f"\n(total {elapsed:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items())
          + ")")
    if args.json:
        _write_json(args.json, meta, elapsed, phases, decode, prefill, kv, targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
