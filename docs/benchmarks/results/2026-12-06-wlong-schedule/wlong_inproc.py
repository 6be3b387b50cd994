"""W-long in one process, no Serve and no HTTP: the colocated replica's PrefillQueue mixed
into its DecodeLoop (as ColocatedServer wires them), the committed config's engine
settings (bf16 where the CPU has it, 2 threads, 256-token passes, no prefix cache), four
closed-loop clients, 16 prompts of 1,024 random tokens, 16 greedy tokens out each.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/results/2026-12-06-wlong-schedule/wlong_inproc.py [ROUNDS] [--log]

Prints per round the wall time, prompt tok/s, passes (mixed ones) and the passes' compute
time; with --log every pass: (kind, decode rows, chunk sizes, their pasts, max position, ms).
The runt rule's A/B (commit bbcc2e7, reverted) set app.prefill_policy.MAX_RUNT to 0 or 0.25
between rounds, in the order ABBAAB."""
import asyncio, random, sys, time

from app.config import EngineConfig
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.prefill_queue import PrefillQueue
from app.sampling import SamplingParams
from deployments.metrics import PrefillMetrics
from deployments.replica import model_eos_token_ids

rounds = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 2
core = EngineCore.here(EngineConfig(model="smollm2-135m-instruct", dtype="auto", num_threads=2,
                                    max_batch_size=16, max_kv_tokens=65536,
                                    prefill_token_budget=4096, prefill_chunk_tokens=256,
                                    prefix_cache_mb=0))
eos = model_eos_token_ids(core)
LOG = []
if "--log" in sys.argv:
    runner, fm = core.runner, core.runner.forward_mixed

    def mixed(cache, tables, token_ids, positions, chunks, past=None, into=None):
        t = time.perf_counter()
        out = fm(cache, tables, token_ids, positions, chunks, past, into)
        pasts = [0 if p is None else p.shape[3] for p in (past or [None] * len(chunks))]
        LOG.append(("mixed", len(token_ids), [len(c) for c in chunks], pasts,
                    max(positions or [0]), round((time.perf_counter() - t) * 1e3, 1)))
        return out
    runner.forward_mixed = mixed


async def run(seed: int) -> None:
    loop = core.make_decode_loop(eos)
    queue = PrefillQueue(core, 0.0, PrefillMetrics("m", count_waiting=False), eos_token_ids=eos)
    queue.mix_into(loop)
    rng = random.Random(seed)
    prompts = iter(enumerate(tuple(rng.randrange(100, 20000) for _ in range(1024))
                             for _ in range(16)))

    async def client() -> None:
        for i, prompt in prompts:
            sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            package = await queue.enqueue(PrefillRequest(f"r{seed}-{i}", prompt, sampling))
            async for _ in loop.generate(package):
                pass

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(4)))
    wall = time.perf_counter() - start
    print(f"wall {wall:.2f} s, {16384 / wall:.0f} prompt tok/s; passes {queue.passes} "
          f"(mixed {queue.mixed_passes}), pass compute {queue.compute_s_total:.2f} s, "
          f"steps {loop.decoder.steps}", flush=True)
    await loop.close()
    for row in LOG:
        print(row)
    LOG.clear()


for r in range(rounds):
    asyncio.run(run(100 + r))
