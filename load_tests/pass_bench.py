"""Prefill and mixed passes on the engine, per variant: what the fused layers
(``app.fused_layers``, ``engine.kernels.fused_layers``) and the dtype do to a pass's time.

Prints, per variant, the median (min-max) over interleaved rounds of:

* ``whole1024_ms``: one 1,024-token prompt in one prefill pass (``forward_prefill``);
* ``chunked1024_ms``: the same prompt through the prefiller in four 256-token passes
  (``Prefiller.make_packages`` with ``prefill_chunk_tokens`` 256), each continuing over
  the KV of the ones before, to its package (how the split's prefill replica chunks it);
* ``mixed_ms``: one mixed pass (``forward_mixed``): 8 decode rows at 64-token contexts and a
  248-token prompt chunk, the colocated app's pass while streams run;
* ``mixed_long_ms``: the same with 4 decode rows at 1,024-token contexts and a 252-token
  chunk (the colocated app under W-long: long prompts' streams beside the next one's chunk);
* ``mixed_doc_ms``: a 4,032-token prompt in 16 such mixed passes, each chunk written
  straight into the prompt's KV (``forward_mixed``'s ``into``, as ``ChunkPlan`` hands it);
* ``attention_ms``: prefill attention alone (``app.prefill_attention``'s kernel, with the
  products the variant's passes take) for every layer of a 1,024-token prompt in four
  256-token chunks, each over its past: the model's query and KV heads, random q, k, v;

and, for a variant ``X`` run beside ``X+modules`` (the same engine with ``kernels.fused_layers:
false``: the model's modules around the same kernels) or ``X+fp32attn`` (prefill attention
with float32 products where X takes bf16 ones: ``app.prefill_attention``) or ``X+gather``
(a mixed pass's decode rows over a gathered copy of their blocks where X reads the pool in
place: ``app.attention.MixedCacheView``) or ``X+copy`` (``mixed_doc_ms``'s chunks each
joined to a copy of their past, a layer at a time, and copied out after the pass), the
ratio of X to it per round. Variants: ``dtype[+modules][+fp32attn][+gather][+copy]`` with
dtype float32, bfloat16 (bf16 panels) or auto.

    python -m load_tests.pass_bench [--threads 2] [--rounds 5]
        [--variants bfloat16,bfloat16+fp32attn,bfloat16+modules,float32,float32+modules]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from app.config import DEFAULT_MODEL, EngineConfig, cpu_flags
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.prefill_attention import _kernel_prefill_attention
from app.sampling import SamplingParams

PROMPT, CHUNK, ROWS, CONTEXT = 1024, 256, 8, 64
LONG_ROWS, LONG_CONTEXT = 4, 1024
DOC_CHUNKS = 16  # mixed_doc_ms: a prompt of this many (CHUNK - LONG_ROWS)-token chunks
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
FIGURES = ("whole1024_ms", "chunked1024_ms", "mixed_ms", "mixed_long_ms", "mixed_doc_ms",
           "attention_ms")
FLAGS = ("modules", "fp32attn", "gather", "copy")


class Variant:
    def __init__(self, name: str, threads: int) -> None:
        dtype, *flags = name.split("+")
        unknown = set(flags) - set(FLAGS)
        if unknown:
            raise ValueError(f"variant {name!r}: unknown flags {sorted(unknown)}")
        self.core = EngineCore.here(EngineConfig(
            model=DEFAULT_MODEL, dtype=dtype, num_threads=threads,
            kernels={"fused_layers": "modules" not in flags},
            prefill_chunk_tokens=CHUNK, prefix_cache_mb=0))
        self.runner = self.core.runner
        self.prefiller = self.core.make_prefiller()
        self.rounds = 0
        # benchmark switches, not settings: what bf16 attention and in-place reads save
        if "fp32attn" in flags:
            self.runner.prefill_bf16 = False
        if "gather" in flags:
            self.runner.inplace_attention = False
        self.copy_chunks = "copy" in flags
        rng = random.Random(1)
        self.prompt = [rng.randrange(100, 20000) for _ in range(PROMPT)]
        self.doc = [rng.randrange(100, 20000) for _ in range(DOC_CHUNKS * (CHUNK - LONG_ROWS))]
        # the document's KV, as a ChunkPlan's rows hold it: the runner's dtype, with room
        _, [doc_kv] = self.runner.forward_prefill([self.doc])
        self.doc_kv = doc_kv.to(self.runner.dtype).contiguous()
        self.cache, self.tables = self._rows(ROWS, CONTEXT)
        self.long_cache, self.long_tables = self._rows(LONG_ROWS, LONG_CONTEXT)
        heads, layout = self.runner.model.config.num_attention_heads, self.runner.layout
        gen = torch.Generator().manual_seed(1)
        self.attention_inputs = {  # per chunk: its queries, and keys/values with its past
            past: (torch.randn(1, heads, CHUNK, layout.head_dim, generator=gen),
                   *(torch.randn(1, layout.num_kv_heads, past + CHUNK, layout.head_dim,
                                 generator=gen) for _ in range(2)))
            for past in range(0, PROMPT, CHUNK)}
        self.rows: dict[str, list[float]] = {f: [] for f in FIGURES}

    def _rows(self, rows: int, context: int):
        """A pool holding ``rows`` sequences of ``context`` tokens, and their block tables."""
        per = context // 16 + 2
        cache = self.runner.make_kv_cache(rows * per, 16)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]
        _, kvs = self.runner.forward_prefill([self.prompt[i * 8 : i * 8 + context]
                                              for i in range(rows)])
        for table, kv in zip(tables, kvs, strict=True):
            cache.write(table, kv)
        return cache, tables

    def _chunked(self) -> None:
        self.rounds += 1  # a new request id each time; no prefix cache (prefix_cache_mb 0)
        req = PrefillRequest(f"doc{self.rounds}", tuple(self.prompt), GREEDY)
        [package] = self.prefiller.make_packages([req])
        assert package.kv_tensor().shape[3] == PROMPT

    def _mixed(self) -> None:
        self.runner.forward_mixed(self.cache, self.tables, [5] * ROWS, [CONTEXT] * ROWS,
                                  [self.prompt[: CHUNK - ROWS]])

    def _mixed_long(self) -> None:
        self.runner.forward_mixed(self.long_cache, self.long_tables, [5] * LONG_ROWS,
                                  [LONG_CONTEXT] * LONG_ROWS, [self.prompt[: CHUNK - LONG_ROWS]])

    def _mixed_doc(self) -> None:
        n, whole = CHUNK - LONG_ROWS, self.doc_kv
        for i in range(DOC_CHUNKS):  # as ChunkPlan hands them: every chunk in place
            past = whole[:, :, :, : i * n]
            if self.copy_chunks:
                past = None if i == 0 else past.contiguous()
            self.runner.forward_mixed(self.long_cache, self.long_tables, [5] * LONG_ROWS,
                                      [LONG_CONTEXT] * LONG_ROWS, [self.doc[i * n : (i + 1) * n]],
                                      [past], [None if self.copy_chunks else whole])

    def _attention(self) -> None:
        for past, (q, k, v) in self.attention_inputs.items():
            starts = torch.tensor([past])
            for _ in range(self.runner.layout.num_layers):
                _kernel_prefill_attention(q, k, v, starts, past, None, self.runner.prefill_bf16)

    def round(self) -> None:
        for figure, fn in (("whole1024_ms", lambda: self.runner.forward_prefill([self.prompt])),
                           ("chunked1024_ms", self._chunked), ("mixed_ms", self._mixed),
                           ("mixed_long_ms", self._mixed_long), ("mixed_doc_ms", self._mixed_doc),
                           ("attention_ms", self._attention)):
            start = time.perf_counter()
            fn()
            self.rows[figure].append((time.perf_counter() - start) * 1e3)


def measure(names: list[str], threads: int, rounds: int) -> dict[str, dict]:
    torch.set_num_threads(threads)
    variants = {name: Variant(name, threads) for name in names}
    for v in variants.values():  # a warm-up round each
        v.round()
        v.rows = {f: [] for f in FIGURES}
    for _ in range(rounds):
        for v in variants.values():
            v.round()
    out: dict[str, dict] = {}
    for name, v in variants.items():
        fig: dict = {"paths": v.runner.kernel_paths()}
        for f, xs in v.rows.items():
            fig[f] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        for other in FLAGS:
            base = variants.get(f"{name}+{other}")
            if base is None:
                continue
            for f in FIGURES:
                ratios = [a / b for a, b in zip(v.rows[f], base.rows[f], strict=True)]
                fig[f"{f}_over_{other}"] = {"median": statistics.median(ratios),
                                            "min": min(ratios), "max": max(ratios)}
        out[name] = fig
    return out


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (else the machine's architecture)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="bfloat16,bfloat16+fp32attn,bfloat16+modules,"
                        "float32,float32+modules")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    flags = sorted(f for f in (cpu_flags() or ()) if f.startswith(("avx", "amx", "fma")))
    print(f"CPU: {cpu_model()}; flags: {' '.join(flags)}; "
          f"threads {args.threads}, {args.rounds} rounds")
    result = measure(args.variants.split(","), args.threads, args.rounds)
    for name, fig in result.items():
        cells = [f"{f} {fig[f]['median']:.0f} ({fig[f]['min']:.0f}-{fig[f]['max']:.0f})"
                 for f in FIGURES]
        print(f"{name:>20}: " + ", ".join(cells))
        for other in FLAGS:
            for f in FIGURES:
                r = fig.get(f"{f}_over_{other}")
                if r:
                    print(f"{'':>22}{f} / +{other}: {r['median']:.2f}x "
                          f"({r['min']:.2f}-{r['max']:.2f})")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds,
                                         "cpu": cpu_model(), "cpu_flags": flags,
                                         "variants": result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
