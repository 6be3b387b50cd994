"""The decode step against the machine's floor, on the decode replica's thread count.

Prints, for each variant asked for (a dtype; ``+packed`` for linear weights copied into a
kernel's layout, ``app.packed_linear``: the engine's own panel kernel where it builds, or
oneDNN's with ``+packed+onednn``; ``+gather`` for decode attention through a gathered copy and
SDPA instead of the in-place kernel, ``app.attention`` (its pool then in the compute dtype);
``+unfused`` for a decode step through the model's modules instead of one call to the fused
kernel, ``app.fused_decode``;
``+avx2`` for the kernels kept to an AVX2-only CPU's paths on one that has AVX-512 (no
AVX-512 tiles, bf16 or VNNI dot products: ``bfloat16+packed+avx2`` holds widened bf16 panels;
``SPLITSERVE_KERNEL_ISA=avx2`` does it for every variant and for torch's own choice too
with ``ATEN_CPU_CAPABILITY=avx2``); ``+kvf32``
for a float32 KV pool (and packages) where the dtype would hold them in bf16; ``+int8``
for weight-only int8 panels, ``+int8-g32`` (any ``int8-g<N>``) with a scale per 32 of k,
``+gguf`` for a GGUF model's own blocks in them (``EngineConfig.weights``; a
``bfloat16+packed`` variant holds bf16 panels, app.packed_linear.weight_plan); side by side,
interleaved in rounds so that a busy spell of a shared machine hits every figure alike):

* the floor: one GEMV (``[1, K] @ [K, N]``) over as many bytes as the model's weights, the
  least a decode step must read;
* the engine's decode step (``Decoder.step``: paged KV, sampling included) at batch 1 and
  batch 8 over 64-token contexts, as multiples of the floor, and batch 8 over batch 1;
* a 1024-token prompt's prefill in one pass (``ModelRunner.forward_prefill``, 1,024 rows);
* a 1024-token sequence joining a running batch of 8: the longest step of the join against
  the median step;
* KV memory: tokens the running sequences hold over the tokens their blocks in use hold.

    python -m load_tests.decode_bench [--variants float32+packed,float32+packed+onednn,float32]
        [--threads 1] [--rounds 5] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from app import cpu_kernels
from app.config import DEFAULT_MODEL, EngineConfig, KernelConfig, kernel_isa
from app.decode import Decoder
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.packed_linear import PanelLinear
from app.sampling import SamplingParams
from app.sequence import Sequence

CONTEXT = 64
JOIN_LENGTH = 1024


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


class Floor:
    """One GEMV over ``nbytes`` of weights in ``dtype``, laid out as the model's linear
    layers hold theirs (``[out, in]``, read through ``F.linear``)."""

    def __init__(self, nbytes: int, dtype: torch.dtype) -> None:
        k = 4096
        n = nbytes // (k * torch.tensor([], dtype=dtype).element_size())
        self.w = torch.randn(n, k).to(dtype)  # [N, K]
        self.x = torch.randn(1, k).to(dtype)  # [1, K]

    @torch.inference_mode()
    def __call__(self) -> None:
        torch.nn.functional.linear(self.x, self.w)


class Batch:
    """A Decoder running ``lengths``-token greedy sequences that never finish."""

    def __init__(self, core: EngineCore, lengths: list[int], seed: int) -> None:
        rng = random.Random(seed)
        self.core = core
        self.decoder = Decoder(core.runner, eos_token_ids=frozenset(), max_batch_size=32,
                               max_kv_tokens=core.config.max_kv_tokens)
        self.sampling = SamplingParams(max_tokens=4000 - max(lengths), temperature=0.0,
                                       ignore_eos=True)
        for i, n in enumerate(lengths):
            self.add(f"s{seed}-{i}", [rng.randrange(100, 20000) for _ in range(n)])
        self.decoder.step()  # joins outside any timing

    def add(self, request_id: str, prompt: list[int]) -> None:
        [pkg] = self.core.make_prefiller().make_packages(
            [PrefillRequest(request_id, tuple(prompt), self.sampling)])
        seq = Sequence(pkg.request_id, pkg.prompt_ids, pkg.sampling)
        seq.append(pkg.first_token, eos_token_ids=frozenset(),
                   max_model_len=self.core.runner.max_model_len)
        self.decoder.add(seq, pkg)

    def step(self) -> None:
        self.decoder.step()

    def kv_efficiency(self) -> float:
        """Tokens the running sequences hold over the tokens their blocks in use hold."""
        st = self.decoder.stats()
        return st.kv_tokens_live / st.kv_tokens_used


def join_gap(core: EngineCore, steps: int) -> dict[str, float]:
    """Steps of a batch of 8 before, during and after a 1024-token sequence joins."""
    batch = Batch(core, [CONTEXT] * 8, seed=7)
    before = [_median_ms(batch.step, 1) for _ in range(steps)]
    batch.add("joiner", [random.Random(1).randrange(100, 20000) for _ in range(JOIN_LENGTH)])
    during = [_median_ms(batch.step, 1) for _ in range(steps)]
    median = statistics.median(before + during[1:])
    return {"median_step_ms": median, "join_step_ms": during[0],
            "longest_over_median": max(during) / median,
            "kv_efficiency_after_join": batch.kv_efficiency()}


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter but the input embedding's (a
    step reads only its rows); an LM head tied to the embedding is read once, as the head;
    a panel-packed linear is read as its panels (and int8 scales and offsets as the kernel
    holds them), not as its parameter (a
    tied head's bf16 or int8 panels, where the parameter stays the float32 embedding)."""
    embedding = model.get_input_embeddings()
    seen: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if module is embedding:
            continue
        if isinstance(module, PanelLinear):
            for t in (module.panels, module.kernel_scale, module.bias):
                if t is not None:
                    seen[id(t)] = t
            continue
        for p in module.parameters(recurse=False):
            seen[id(p)] = p
    return sum(p.numel() * p.element_size() for p in seen.values())


class Variant:
    """One engine (dtype, packed or not) with its floor and its batch-1 and batch-8 runs."""

    def __init__(self, name: str, threads: int, prefill: bool = True,
                 model: str = DEFAULT_MODEL) -> None:
        dtype, *flags = name.split("+")
        weights = [f for f in flags if f.startswith("int8") or f == "gguf"]
        unknown = set(flags) - {"packed", "onednn", "gather", "unfused", "avx2", "kvf32",
                                *weights[:1]}
        if unknown:
            raise ValueError(f"variant {name!r}: unknown flags {sorted(unknown)}")
        self.avx512 = "avx2" not in flags and kernel_isa() == "native"
        self.activate()  # before the load: the weights' kind follows the CPU's paths
        self.core = EngineCore.here(EngineConfig(
            model=model, dtype=dtype, num_threads=threads,
            weights=weights[0] if weights else None,
            kv_dtype="float32" if "kvf32" in flags else None,
            kernels=KernelConfig(
                linear=("torch" if "packed" not in flags
                        else "onednn" if "onednn" in flags else "auto"),
                attention="gather" not in flags,
                fused_decode="unfused" not in flags)))
        self.weight_bytes = step_weight_bytes(self.core.model)
        self.floor = Floor(self.weight_bytes, self.core.runner.dtype)
        self.b1 = Batch(self.core, [CONTEXT], seed=1)
        self.b8 = Batch(self.core, [CONTEXT] * 8, seed=2)
        self.prompt = ([random.Random(3).randrange(100, 20000) for _ in range(JOIN_LENGTH)]
                       if prefill else None)
        self.rows: dict[str, list[float]] = {"floor_ms": [], "step1_ms": [], "step8_ms": []}
        if prefill:
            self.rows["prefill1024_ms"] = []

    def activate(self) -> None:
        """The kernels' vector paths are per process: set this variant's before it runs."""
        if cpu_kernels.kernel_unavailable() is None:
            cpu_kernels.load_kernel().panel_limit_avx2(int(not self.avx512))

    def round(self, steps: int) -> None:
        self.activate()
        self.rows["floor_ms"].append(_median_ms(self.floor, steps))
        self.rows["step1_ms"].append(_median_ms(self.b1.step, steps))
        self.rows["step8_ms"].append(_median_ms(self.b8.step, steps))
        if self.prompt is not None:
            self.rows["prefill1024_ms"].append(
                _median_ms(lambda: self.core.runner.forward_prefill([self.prompt]), 1))

    def summary(self, steps: int, join: bool = True) -> dict[str, float]:
        out = {k: statistics.median(v) for k, v in self.rows.items()}
        out.update(weight_mb=self.weight_bytes / 1e6, kv_efficiency_batch8=self.b8.kv_efficiency())
        if join:
            self.activate()
            out.update(join_gap(self.core, steps))
        out["step1_over_floor"] = out["step1_ms"] / out["floor_ms"]
        out["step8_over_step1"] = out["step8_ms"] / out["step1_ms"]
        out["ideal8_fraction"] = out["floor_ms"] / out["step8_ms"]  # tok/s / (8 per floor)
        return out


def measure(names: list[str], threads: int, rounds: int, steps: int,
            join: bool = True, prefill: bool = True,
            model: str = DEFAULT_MODEL) -> dict[str, dict]:
    """Every variant's figures; rounds interleave the variants (and, in each, the floor,
    both batches and the prefill) so that a slow spell of a shared machine hits all of them
    alike."""
    torch.set_num_threads(threads)
    variants = {name: Variant(name, threads, prefill, model) for name in names}
    for _ in range(rounds):
        for variant in variants.values():
            variant.round(steps)
    return {name: v.summary(steps, join) for name, v in variants.items()}


def main(argv: list[str] | None = None) -> int:
    global CONTEXT
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="float32+packed,float32,bfloat16",
                        help="comma-separated dtype[+packed[+onednn]][+gather][+unfused]"
                             "[+avx2]")
    parser.add_argument("--context", type=int, default=CONTEXT,
                        help="tokens each batch row holds (default 64)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-join", action="store_true",
                        help="skip the 1024-token join")
    parser.add_argument("--no-prefill", action="store_true",
                        help="skip the 1024-token prefill")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="engine.model: the embedded default, a local HF folder or a hub id")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    CONTEXT = args.context
    results = measure(args.variants.split(","), args.threads, args.rounds, args.steps,
                      join=not args.no_join, prefill=not args.no_prefill, model=args.model)
    keys = ["weight_mb", "floor_ms", "step1_ms", "step8_ms", "prefill1024_ms", "step1_over_floor",
            "step8_over_step1", "ideal8_fraction", "median_step_ms", "join_step_ms",
            "longest_over_median", "kv_efficiency_batch8", "kv_efficiency_after_join"]
    print(f"decode step, {args.threads} thread(s), {CONTEXT}-token contexts")
    width = max(16, *(len(v) + 2 for v in results))
    print(f"{'figure':<26}" + "".join(f"{v:>{width}}" for v in results))
    for k in keys:
        if all(k in r for r in results.values()):
            print(f"{k:<26}" + "".join(f"{results[v][k]:>{width}.2f}" for v in results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
