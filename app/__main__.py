"""Command line: ``python -m app generate --prompt "..." [--chat] [--json]`` (structured
output: ``--json-schema FILE``, ``--json-object``, ``--regex``, ``--choice``, ``--grammar``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from app.config import DEFAULT_MODEL, EngineConfig
from app.errors import EngineError
from app.sampling import SamplingParams
from app.structured import Constraint
from app.structured_fields import StructuredFields


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate one completion in this process")
    gen.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--model", default=DEFAULT_MODEL,
                     help="alias, .gguf file, local HF directory or hub id")
    gen.add_argument("--dtype", default="float32",
                     choices=["auto", "float32", "bfloat16", "float16"],
                     help="auto: bfloat16 where the CPU has native bf16 (or on a GPU)")
    gen.add_argument("--weights", default=None,
                     help="int8: weight-only int8 linears (CPU), quantized at load, a scale "
                          "per output; int8-g<N>: a scale per output for each N of k; gguf: a "
                          "GGUF model's own blocks in int8 (no second quantization)")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    shape = gen.add_mutually_exclusive_group()  # structured output (app.structured)
    shape.add_argument("--json-schema", metavar="FILE", type=Path,
                       help="the output is JSON of this schema (a file)")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", help="the output matches this regular expression")
    shape.add_argument("--choice", action="append", help="the output is one of these "
                       "(repeatable)")
    shape.add_argument("--grammar", metavar="FILE", type=Path,
                       help="the output follows this Lark or GBNF grammar (a file)")
    return parser


def _constraint(args: argparse.Namespace) -> Constraint | None:
    """The structured output the arguments ask for, compiled (a bad one: ValueError)."""
    fields: dict[str, Any] = {}
    try:
        if args.json_schema is not None:
            fields["guided_json"] = args.json_schema.read_text()
        elif args.grammar is not None:
            fields["guided_grammar"] = args.grammar.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    if args.json_object:
        fields["response_format"] = {"type": "json_object"}
    if args.regex is not None:
        fields["guided_regex"] = args.regex
    if args.choice:
        fields["guided_choice"] = args.choice
    return StructuredFields(**fields).constraint()


def _settings(args: argparse.Namespace) -> tuple[EngineConfig, SamplingParams]:
    """Validate the arguments before any model is loaded (raises ValueError or EngineError)."""
    config = EngineConfig(model=args.model, dtype=args.dtype, weights=args.weights,
                          device=args.device, num_threads=args.threads)
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
        constraint=_constraint(args),
    )
    return config, sampling


async def _generate(args: argparse.Namespace, config: EngineConfig,
                    sampling: SamplingParams) -> dict:
    from app.engine_core import LocalEngine

    engine = LocalEngine(config)
    if args.chat:
        req = engine.make_request(sampling, messages=[{"role": "user", "content": args.prompt}])
    else:
        req = engine.make_request(sampling, prompt=args.prompt)
    try:
        out = await engine.generate(req)
    finally:
        await engine.close()
    return {
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": None if out.finish_reason is None else out.finish_reason.value,
        "prompt_token_ids": out.prompt_token_ids,
        "usage": out.usage,
        "model": args.model,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config, sampling = _settings(args)
    except (ValueError, EngineError) as exc:  # a bad argument: a message, not a traceback
        print(f"error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(_generate(args, config, sampling))
    except EngineError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
