"""One prompt, several answers (OpenAI's ``n``) against a running app: time and prefill work.

Sends, interleaved in rounds, the same ``--prompt-tokens`` prompt (exact token ids) with
``n = 1`` and ``n = --n`` (temperature 1, a fixed seed, ``--max-tokens`` each, ignore EOS)
and prints the median time of each and their ratio. That the prompt is prefilled once is
checked by ``tests/integration/test_split_app.py::test_n_answers_share_one_prefill``.

    python -m load_tests.n_bench --url http://127.0.0.1:8000 [--n 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import httpx


def one(url: str, prompt: list[int], n: int, max_tokens: int, seed: int) -> float:
    body = {"prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0,
            "seed": seed, "ignore_eos": True}
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    usage = r.json()["usage"]
    assert len(r.json()["choices"]) == n and usage["completion_tokens"] == n * max_tokens
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    times: dict[int, list[float]] = {1: [], args.n: []}
    for r in range(args.rounds):
        for n in (1, args.n):  # a fresh prompt each time: no prefix cache hit
            prompt = [rng.randrange(100, 20000) for _ in range(args.prompt_tokens)]
            times[n].append(one(args.url, prompt, n, args.max_tokens, seed=r))
    t1, tn = statistics.median(times[1]), statistics.median(times[args.n])
    print(f"{args.prompt_tokens}-token prompt, {args.max_tokens} tokens per answer, "
          f"medians of {args.rounds}")
    print(f"n=1: {t1:.2f} s   n={args.n}: {tn:.2f} s   ratio {tn / t1:.2f}x "
          f"(n separate requests would be about {args.n}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
