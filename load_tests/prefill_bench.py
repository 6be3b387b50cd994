"""Prefill on the engine: chunking, the prefix cache, multi-turn chat (issue 14's engine
figures; the HTTP side by side is ``peer_bench.sh W-mixed``).

Prints, on the prefill replica's thread count:

* **a chat behind a document**: a 1024-token prompt starts; a 64-token prompt arrives as
  its first pass begins. The chat's time to its KV package, chunked (``--chunk``) and
  unchunked (the whole document in one pass), and what the document pays for chunking;
* **a chat during a document's pass, through the replica's queue**
  (``app.prefill_queue.PrefillQueue``): a 1024-token prompt is queued, a 64-token prompt
  arrives 50-300 ms later (the same random delays for both): the chat's time to its package
  with passes paused between layers for it (``prefill_preempt_layers``, the default 4) and
  with passes run whole (0), and the document's time;
* **a repeated prefix**: a 1024-token prefix with a fresh 64-token suffix, cold (no cache)
  and warm (the prefix cached by an earlier prompt): time to the package, warm / cold;
* **multi-turn chat**: each turn resends the whole conversation (the previous prompt, a
  64-token answer, a 32-token new message): prompt tokens computed per turn with the cache.

    python -m load_tests.prefill_bench [--threads 1] [--chunk 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import torch

from app.config import DEFAULT_MODEL, EngineConfig
from app.engine_core import EngineCore
from app.messages import PrefillRequest
from app.prefill import Prefiller
from app.prefill_queue import PrefillQueue
from app.prefix_cache import PrefixCache
from app.sampling import SamplingParams
from deployments.metrics import PrefillMetrics

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 20000) for _ in range(n)]


def chat_behind_document(core: EngineCore, chunk: int, rng: random.Random) -> dict[str, float]:
    """Run passes by hand: the chat joins the queue once the document's first pass began."""
    prefiller = Prefiller(core.runner, core.fingerprint, None)
    prefiller.chunk_tokens = chunk
    doc = prefiller.new_job(PrefillRequest("doc", tuple(_tokens(rng, 1024)), GREEDY))
    jobs = [doc]
    start = time.perf_counter()
    chat = None
    chat_arrived = chat_done = doc_done = None
    while any(j.remaining for j in jobs):
        rows = prefiller.plan_pass(jobs)
        if chat is None:  # arrives while the first pass runs: it can only join the next
            chat = prefiller.new_job(PrefillRequest("chat", tuple(_tokens(rng, 64)), GREEDY))
            chat_arrived = time.perf_counter()
            jobs.append(chat)
        for job, pkg in zip(rows, prefiller.run_pass(rows), strict=True):
            if pkg is not None and job is chat:
                chat_done = time.perf_counter()
            elif pkg is not None:
                doc_done = time.perf_counter()
    return {"chat_wait_s": chat_done - chat_arrived, "doc_s": doc_done - start}


async def chat_during_document(core: EngineCore, delay: float,
                               rng: random.Random) -> dict[str, float]:
    """Through the prefill replica's own queue: the chat arrives ``delay`` s after the
    document, mid-pass."""
    queue = PrefillQueue(core, 0.0, PrefillMetrics("prefill_bench"))
    start = time.perf_counter()
    doc = asyncio.create_task(queue.enqueue(
        PrefillRequest("doc", tuple(_tokens(rng, 1024)), GREEDY)))
    await asyncio.sleep(delay)
    arrived = time.perf_counter()
    await queue.enqueue(PrefillRequest("chat", tuple(_tokens(rng, 64)), GREEDY))
    chat_s = time.perf_counter() - arrived
    await doc
    return {"chat_wait_s": chat_s, "doc_s": time.perf_counter() - start,
            "preemptions": queue.preemptions}


def repeated_prefix(core: EngineCore, rng: random.Random) -> dict[str, float]:
    prefix = _tokens(rng, 1024)
    cold = Prefiller(core.runner, core.fingerprint, None)
    warm = Prefiller(core.runner, core.fingerprint, PrefixCache(core.fingerprint, 1 << 30))
    warm.make_packages([PrefillRequest("seed", tuple(prefix + _tokens(rng, 64)), GREEDY)])
    req = PrefillRequest("q", tuple(prefix + _tokens(rng, 64)), GREEDY)
    times = {}
    for name, prefiller in (("cold_s", cold), ("warm_s", warm)):
        start = time.perf_counter()
        [pkg] = prefiller.make_packages([req])
        times[name] = time.perf_counter() - start
        times[name.replace("_s", "_cached_tokens")] = pkg.cached_tokens
    return times


def multi_turn(core: EngineCore, rng: random.Random, turns: int = 6) -> list[int]:
    prefiller = core.make_prefiller()
    conversation = _tokens(rng, 200)  # a system prompt and the first message
    computed = []
    for turn in range(turns):
        [pkg] = prefiller.make_packages([PrefillRequest(f"t{turn}", tuple(conversation),
                                                        GREEDY)])
        computed.append(len(conversation) - pkg.cached_tokens)
        conversation += _tokens(rng, 64) + _tokens(rng, 32)  # the answer, the next message
    return computed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    core = EngineCore.here(EngineConfig(model=DEFAULT_MODEL, num_threads=args.threads,
                                        prefill_chunk_tokens=args.chunk))
    whole = EngineCore.here(EngineConfig(model=DEFAULT_MODEL, num_threads=args.threads,
                                         prefill_chunk_tokens=args.chunk,
                                         prefill_preempt_layers=0))
    rng = random.Random(0)
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so a busy spell hits each alike
        for label, chunk in (("chunked", args.chunk), ("whole", 4096)):
            for key, value in chat_behind_document(core, chunk, rng).items():
                rows.setdefault(f"{label}_{key}", []).append(value)
        delay = rng.uniform(0.05, 0.3)
        for label, engine in (("preempt", core), ("passes_whole", whole)):
            result = asyncio.run(chat_during_document(engine, delay, rng))
            for key, value in result.items():
                rows.setdefault(f"queue_{label}_{key}", []).append(value)
        for key, value in repeated_prefix(core, rng).items():
            rows.setdefault(key, []).append(value)
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["warm_over_cold"] = out["warm_s"] / out["cold_s"]
    out["chat_wait_chunked_over_whole"] = out["chunked_chat_wait_s"] / out["whole_chat_wait_s"]
    out["doc_chunked_over_whole"] = out["chunked_doc_s"] / out["whole_doc_s"]
    out["queue_chat_wait_preempt_over_whole"] = (out["queue_preempt_chat_wait_s"]
                                                 / out["queue_passes_whole_chat_wait_s"])
    out["queue_doc_preempt_over_whole"] = (out["queue_preempt_doc_s"]
                                           / out["queue_passes_whole_doc_s"])
    turns = multi_turn(core, rng)
    print(f"prefill, {args.threads} thread(s), chunk {args.chunk}, medians of {args.repeats}")
    for key, value in out.items():
        print(f"{key:<32}{value:>10.3f}")
    print(f"{'multi-turn computed tokens':<32}{turns} (each turn adds 96 tokens)")
    if args.json:
        args.json.write_text(json.dumps({**out, "multi_turn_computed": turns}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
