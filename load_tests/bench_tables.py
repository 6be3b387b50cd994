"""BENCHMARKS.md's generated tables, rebuilt from the committed raw results.

A generated table sits between two comments in the Markdown file::

    <!-- generated: peer_rounds docs/benchmarks/results/<run>/smollm-r1 ... -->
    | ... the table ... |
    <!-- /generated -->

The first word after ``generated:`` names a generator below, the rest are its arguments
(shell quoting; paths relative to the Markdown file's folder). Generators:

- ``peer_rounds ROUND_DIR... [--servers ...] [--figure WORKLOAD:FIGURE ...]``: ratios to vLLM
  over rotated ``peer_bench.sh`` rounds (``load_tests/peer_rounds.py``); a ROUND_DIR with
  ``*`` is a glob, its folders in sorted order.
- ``structured_peer FOLDER``: ``structured_peer.sh``'s ``<round>-<server>.json`` files,
  vLLM against the split app per round, the ratio as the median of the rounds' with min-max.
- ``stream_bw FILE_GLOB [--dtype DTYPE]``: the read bandwidth and the decode floor over the
  rounds of ``make bench-peers`` (``load_tests/stream_bw.py --summarize``).
- ``structured_bench FILE``: ``structured_bench.py --json``'s step cost by constrained rows.
- ``weights_quality FILE``: ``weights_quality.py``'s JSON, each variant against float32.

    python -m load_tests.bench_tables [--file BENCHMARKS.md]    # rewrite every block
    python -m load_tests.bench_tables --check                   # exit 1 if any block differs

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from load_tests import peer_rounds, stream_bw

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^<!-- generated: (?P<args>.+?) -->\n(?P<body>.*?)^<!-- /generated -->$",
                   re.MULTILINE | re.DOTALL)
OPEN = re.compile(r"^<!-- generated:", re.MULTILINE)


class BlockError(ValueError):
    """A marked block that cannot be generated (unknown generator, bad arguments, no end)."""


class _Parser(argparse.ArgumentParser):
    """A generator's arguments: a mistake is a BlockError, not an exit."""

    def error(self, message: str):
        raise BlockError(f"{self.prog}: {message}")


def _parser(prog: str) -> argparse.ArgumentParser:
    return _Parser(prog=prog, add_help=False)


def gen_peer_rounds(args: list[str], base: Path) -> str:
    ap = _parser("peer_rounds")
    ap.add_argument("rounds", nargs="+")
    ap.add_argument("--servers", nargs="+", default=peer_rounds.SERVERS)
    ap.add_argument("--figure", action="append", default=[])
    ap.add_argument("--baseline", default="vllm")
    ns = ap.parse_args(args)
    if ns.baseline not in ns.servers:
        raise BlockError(f"peer_rounds: --baseline {ns.baseline} is not one of --servers")
    rounds: list[Path] = []
    for r in ns.rounds:
        if any(c in r for c in "*?["):
            found = [p for p in sorted(base.glob(r)) if p.is_dir()]
            if not found:
                raise BlockError(f"peer_rounds: no round folder matches {r}")
            rounds += found
        elif (base / r).is_dir():
            rounds.append(base / r)
        else:
            raise BlockError(f"peer_rounds: no such round folder: {base / r}")
    try:
        table = peer_rounds.load(rounds, ns.servers, peer_rounds.with_figures(ns.figure))
    except ValueError as exc:
        raise BlockError(f"peer_rounds: {exc}") from exc
    return peer_rounds.render(table, ns.servers, ns.baseline)


def gen_stream_bw(args: list[str], base: Path) -> str:
    """``stream_bw --dtype DTYPE FILE_GLOB``: the read bandwidth and decode floor over the
    rounds' ``stream.json`` files (``load_tests/stream_bw.py --summarize``)."""
    ap = _parser("stream_bw")
    ap.add_argument("files")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(stream_bw.WEIGHT_BYTES))
    ns = ap.parse_args(args)
    paths = sorted(p for p in base.glob(ns.files) if p.is_file())
    if not paths:
        raise BlockError(f"stream_bw: no file matches {ns.files}")
    return stream_bw.summarize([str(p) for p in paths], ns.dtype)


def _ratio_range(values: list[float]) -> str:
    """The median ratio with the rounds' min-max, as peer_rounds writes it."""
    return (f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}, "
            f"{len(values)} rounds)")


def gen_structured_peer(args: list[str], base: Path) -> str:
    ap = _parser("structured_peer")
    ap.add_argument("folder")
    ap.add_argument("--servers", nargs=2, default=["vllm", "split"])
    ns = ap.parse_args(args)
    folder = base / ns.folder
    peer, app = ns.servers
    rounds: dict[str, dict[str, dict]] = {}
    for path in sorted(folder.glob("*-*.json")):
        round_, _, server = path.stem.partition("-")
        if server in (peer, app):
            rounds.setdefault(round_, {})[server] = json.loads(path.read_text())
    rounds = {r: v for r, v in rounds.items() if len(v) == 2}
    if not rounds:
        raise BlockError(f"structured_peer: no round with both {peer} and {app} in {folder}")
    order = sorted(rounds, key=lambda r: (len(r), r))
    names = {"vllm": "vLLM-CPU", "split": "split app"}

    def cells(read: Callable[[dict], float], fmt: str) -> list[str]:
        return [" / ".join(format(read(rounds[r][s]), fmt) for r in order) for s in (peer, app)]

    ratios = [rounds[r][app]["output_tok_s"] / rounds[r][peer]["output_tok_s"] for r in order]
    rr = " / ".join(order)
    head = f"| figure (round {rr}) | {names.get(peer, peer)} | {names.get(app, app)} | " \
        f"{app} / {peer} (median, min-max) |"
    n = rounds[order[0]][peer]["requests"]
    lines = [head, "|---|---|---|---|",
             "| output tok/s | " + " | ".join(cells(lambda d: d["output_tok_s"], ".1f"))
             + f" | {_ratio_range(ratios)} |",
             f"| answers valid against the schema (of {n}) | "
             + " | ".join(cells(lambda d: d["valid"], "d")) + " | |"]
    reasons = sorted({k for r in order for s in (peer, app)
                      for k in rounds[r][s].get("finish_reasons", {})})
    for reason in reasons:
        lines.append(f"| finish_reason {reason} | " + " | ".join(
            cells(lambda d, k=reason: d.get("finish_reasons", {}).get(k, 0), "d")) + " | |")
    return "\n".join(lines)


def _json_file(prog: str, args: list[str], base: Path) -> dict:
    """The one argument of a generator that reads a JSON file, read."""
    ap = _parser(prog)
    ap.add_argument("file")
    return json.loads((base / ap.parse_args(args).file).read_text())


def gen_structured_bench(args: list[str], base: Path) -> str:
    data = _json_file("structured_bench", args, base)
    lines = ["| rows constrained (of 8) | step ms (median) | min-max | added to 0 rows |",
             "|---|---|---|---|"]
    for k in (0, 1, 8):
        step = data[f"step8_{k}_constrained_ms"]
        lo, hi = data[f"step8_{k}_constrained_range_ms"]
        added = f"{100 * data[f'added_by_{k}_constrained']:+.1f}%" if k else ""
        lines.append(f"| {k} | {step:.1f} | {lo:.1f}-{hi:.1f} | {added} |")
    lines += ["", f"Schema compile: {data['compile_cold_ms']:.2f} ms cold, "
              f"{data['compile_cached_ms']:.2f} ms cached."]
    return "\n".join(lines)


def gen_weights_quality(args: list[str], base: Path) -> str:
    data = _json_file("weights_quality", args, base)
    lines = ["| variant (kind) | greedy identical | tokens before first difference | "
             "mean abs dlogp | mean dlogp | top-1 agreement |", "|---|---|---|---|---|---|"]
    for name, r in data["results"].items():
        lines.append(f"| {name} (`{r['kind']}`) | {r['greedy_identical']} / {r['prompts']} | "
                     f"{r['mean_tokens_before_difference']:.1f} | "
                     f"{r['mean_abs_logprob_diff']:.4f} | {r['mean_logprob_diff']:+.4f} | "
                     f"{r['top1_agreement']:.3f} |")
    return "\n".join(lines)


GENERATORS: dict[str, Callable[[list[str], Path], str]] = {
    "peer_rounds": gen_peer_rounds,
    "structured_peer": gen_structured_peer,
    "structured_bench": gen_structured_bench,
    "weights_quality": gen_weights_quality,
    "stream_bw": gen_stream_bw,
}


def generate(spec: str, base: Path) -> str:
    """The table a block's ``generated:`` arguments produce (without a trailing newline)."""
    words = shlex.split(spec)
    if not words or words[0] not in GENERATORS:
        raise BlockError(f"unknown generator in {spec!r}: one of {sorted(GENERATORS)}")
    try:
        return GENERATORS[words[0]](words[1:], base).rstrip("\n")
    except (OSError, KeyError, ValueError) as exc:
        raise BlockError(f"{spec!r}: {exc}") from exc


def rewrite(text: str, base: Path) -> tuple[str, list[str]]:
    """``text`` with every generated block rebuilt; the specs of the blocks that changed."""
    blocks = list(BLOCK.finditer(text))
    if len(OPEN.findall(text)) != len(blocks):
        raise BlockError("a '<!-- generated: ... -->' line without its '<!-- /generated -->'")
    changed, out, pos = [], [], 0
    for m in blocks:
        spec = m.group("args")
        body = generate(spec, base) + "\n"
        if body != m.group("body"):
            changed.append(spec)
        out += [text[pos:m.start("body")], body]
        pos = m.end("body")
    out.append(text[pos:])
    return "".join(out), changed


def blocks(text: str) -> list[tuple[str, str]]:
    """(spec, body) of every generated block in ``text``."""
    return [(m.group("args"), m.group("body")) for m in BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a block differs from what the results give")
    args = ap.parse_args(argv)
    text = args.file.read_text()
    try:
        new, changed = rewrite(text, args.file.resolve().parent)
    except BlockError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    count = len(blocks(text))
    if args.check:
        for spec in changed:
            print(f"{args.file}: out of date: {spec}", file=sys.stderr)
        print(f"{args.file}: {count} generated blocks, {len(changed)} out of date")
        return 1 if changed else 0
    if changed:
        args.file.write_text(new)
    print(f"{args.file}: {count} generated blocks, {len(changed)} rewritten")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
