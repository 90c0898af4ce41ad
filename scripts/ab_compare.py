"""Compare two sweep runs (``results.json`` of ``scripts/sweep.py``) case by case: time of B over time of A.

    python scripts/ab_compare.py bench_a/results.json bench_b/results.json [--provider numba_attn] [--limit 3]
    python scripts/ab_compare.py a1/results.json,a2/results.json b1/results.json,b2/results.json

For the A/B of a change on one lease: run the same sweep on the tree before (A) and after (B), then this prints a
Markdown table of every case's median time in both runs (queued calls, and CUDA-graph replays where the sweep timed
them), the ratio B/A, and marks the cases whose ratio lies outside ``1 +- limit %`` so they can be re-run. With
several runs per side (comma-separated), each case takes the lowest of its runs' medians: host jitter on a shared
machine only ever adds time.
"""
from __future__ import annotations

import argparse
import json
import sys


def _cases(paths: str, provider: str) -> dict:
    cases: dict = {}
    for path in paths.split(","):
        with open(path) as f:
            results = json.load(f)["results"]
        for r in results:
            if r["provider"] != provider or r.get("status") != "ok":
                continue
            key = (r["sweep"], r["config"], r["dtype"], r.get("causal"), r["size"])
            best = cases.setdefault(key, dict(r))
            for field in ("ms", "graph_ms"):
                if r.get(field) and (not best.get(field) or r[field] < best[field]):
                    best[field] = r[field]
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--provider", default="numba_attn")
    parser.add_argument("--limit", type=float, default=3.0, help="percent; cases outside 1 +- limit are marked [3]")
    args = parser.parse_args()
    a, b = _cases(args.a, args.provider), _cases(args.b, args.provider)
    print("| sweep | config | dtype | causal | size | A ms | B ms | B/A | A graph ms | B graph ms | B/A graph |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios, outliers = [], 0
    for key in sorted(a.keys() & b.keys(), key=lambda k: tuple(str(x) for x in k)):
        ra, rb = a[key], b[key]
        ratio = rb["ms"] / ra["ms"]
        ratios.append(ratio)
        cells = [f"{ra['ms']:.4f}", f"{rb['ms']:.4f}", f"{ratio:.3f}"]
        mark = abs(ratio - 1) * 100 > args.limit
        if ra.get("graph_ms") and rb.get("graph_ms"):
            graph_ratio = rb["graph_ms"] / ra["graph_ms"]
            ratios.append(graph_ratio)
            mark = mark or abs(graph_ratio - 1) * 100 > args.limit
            cells += [f"{ra['graph_ms']:.4f}", f"{rb['graph_ms']:.4f}", f"{graph_ratio:.3f}"]
        else:
            cells += ["-", "-", "-"]
        outliers += mark
        sweep, config, dtype, causal, size = key
        name = f"**{size}**" if mark else str(size)
        print(f"| {sweep} | {config} | {dtype} | {causal} | {name} | " + " | ".join(cells) + " |")
    missing = sorted(a.keys() ^ b.keys(), key=str)
    if ratios:
        print(f"\n{len(ratios)} timings, B/A from {min(ratios):.3f} to {max(ratios):.3f}; "
              f"{outliers} cases outside +-{args.limit:g} %; {len(missing)} cases in one run only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
