"""Medians (min-max) over ab.sh's rounds for each commit, and NEW / BASE per round (rounds
paired by number). python3 summary.py [BASE NEW]"""
import glob
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
BASE, NEW = sys.argv[1:3] if len(sys.argv) > 2 else ("566df23", "d8c2d54")


def figures(commit: str, r: str) -> dict[str, float]:
    out = {}
    p = json.loads((HERE / f"pass-{commit}-{r}.json").read_text())["variants"]["bfloat16"]
    for key in ("whole1024_ms", "chunked1024_ms", "mixed_ms", "mixed_long_ms"):
        out[f"pass_bench 2 threads {key}"] = p[key]["median"]
    d = json.loads((HERE / f"decode-{commit}-{r}.json").read_text())["bfloat16+packed"]
    for key in ("step1_ms", "step8_ms", "prefill1024_ms"):
        out[f"decode_bench 1 thread {key}"] = d[key]
    for line in (HERE / f"products-{commit}-{r}.txt").read_text().splitlines():
        m = re.match(r"(.*): ([\d.]+) ms", line)
        if m:
            out[f"products.py {m.group(1)} ms"] = float(m.group(2))
    return out


rounds = sorted({Path(f).stem.rsplit("-", 1)[1] for f in glob.glob(str(HERE / f"pass-{NEW}-*.json"))})
rows = {r: (figures(BASE, r), figures(NEW, r)) for r in rounds}
print(f"| figure | {BASE} | {NEW} | {NEW} / {BASE} |\n|---|---|---|---|")
for key in rows[rounds[0]][0]:
    b = [rows[r][0][key] for r in rounds]
    n = [rows[r][1][key] for r in rounds]
    q = [rows[r][1][key] / rows[r][0][key] for r in rounds]
    fmt = lambda v: f"{statistics.median(v):,.1f} ({min(v):,.1f}-{max(v):,.1f})"
    print(f"| {key} | {fmt(b)} | {fmt(n)} | {statistics.median(q):.2f}x ({min(q):.2f}-{max(q):.2f}) |")
