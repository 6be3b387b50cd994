"""One server's structured-output throughput and validity: ``--n`` chat requests (``--concurrency``
at a time) asking for load_tests/structured_bench.py's mid-size schema through
``response_format: json_schema``, sampled (temperature 1, seeds 0..n-1); prints and writes
(``--json``) the output tokens per second over the wall time, how many answers parse and
validate against the schema (jsonschema), and their finish reasons. Any OpenAI-compatible
server: this app, vLLM (load_tests/structured_peer.sh runs both, rotated).

    python -m load_tests.structured_peer --url http://127.0.0.1:8000 --model NAME [--n 24]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

import httpx
import jsonschema

from load_tests.structured_bench import SCHEMA


async def one(client: httpx.AsyncClient, url: str, model: str, seed: int,
              max_tokens: int) -> tuple[int, bool, str]:
    body = {"model": model, "temperature": 1.0, "seed": seed, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "An order record as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "order", "schema": SCHEMA}}}
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    data = r.json()
    text = data["choices"][0]["message"]["content"] or ""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        valid = True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        valid = False
    return data["usage"]["completion_tokens"], valid, data["choices"][0]["finish_reason"]


async def run(url: str, model: str, n: int, concurrency: int, max_tokens: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def gated(seed: int):
            async with gate:
                return await one(client, url, model, seed, max_tokens)
        await asyncio.gather(*(gated(1000 + s) for s in range(2)))  # warm-up, untimed
        start = time.perf_counter()
        results = await asyncio.gather(*(gated(s) for s in range(n)))
        wall = time.perf_counter() - start
    tokens = sum(t for t, _, _ in results)
    return {"url": url, "requests": n, "concurrency": concurrency, "wall_s": wall,
            "output_tokens": tokens, "output_tok_s": tokens / wall,
            "valid": sum(v for _, v, _ in results),
            "finish_reasons": dict(collections.Counter(f for _, _, f in results))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not args.url.startswith(("http://127.0.0.1", "http://localhost")):
        parser.error("load goes to this machine only (127.0.0.1)")
    result = asyncio.run(run(args.url, args.model, args.n, args.concurrency, args.max_tokens))
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
