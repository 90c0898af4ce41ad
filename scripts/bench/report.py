"""The results as people read them: best-peer ratios, text and markdown tables, CSV, JSON and PNG plots."""
from __future__ import annotations

import csv
import json
import math
import os
from typing import TYPE_CHECKING

from .cases import SWEEPS, size_label

if TYPE_CHECKING:
    from .cli import Options


def _rate(r: dict, prefix: str) -> float | None:
    """The row's rate for its timer: GB/s where bytes are counted, else TFLOP/s (queued calls only)."""
    if r[prefix + "gbs"] is not None:
        return r[prefix + "gbs"]
    return None if prefix else r["tflops"]


def add_comparisons(rows: list, copy_gbs: float | None):
    """Fill ``best_peer`` / ``vs_best_peer`` (time / best peer's time), ``vs_baseline`` (rate / the baseline
    provider's rate: TFLOP/s or GB/s, each counted on its own work) and ``pct_copy_bw`` for every row."""
    groups = {}
    for r in rows:
        groups.setdefault((r["sweep"], r["config"], r["dtype"], r["size"]), []).append(r)
    for group in groups.values():
        for prefix in ("", "graph_"):
            ms = prefix + "ms" if prefix else "ms"
            peers_ok = [r for r in group if not r["ours"] and r["status"] == "ok" and r[ms] is not None]
            best = min(peers_ok, key=lambda r: r[ms]) if peers_ok else None
            base = next((r for r in group if r.get("baseline") and r["status"] == "ok" and _rate(r, prefix)), None)
            for r in group:
                if best is not None:
                    r[prefix + "best_peer"] = best["provider"]
                    if r["status"] == "ok" and r[ms] is not None:
                        r[prefix + "vs_best_peer"] = r[ms] / best[ms]
                if base is not None and r is not base and r["status"] == "ok" and _rate(r, prefix) is not None:
                    r[prefix + "vs_baseline"] = _rate(r, prefix) / _rate(base, prefix)
                if copy_gbs and r[prefix + "gbs"] is not None:
                    r[prefix + "pct_copy_bw"] = 100.0 * r[prefix + "gbs"] / copy_gbs


METRIC_TEXT = {
    "flash": "cell = median ms / TFLOP/s (FLOPs = 4*B*H*N*N*D, halved for causal)",
    "flash_bwd": "backward: cell = median ms / TFLOP/s (FLOPs = 2.5 * 4*B*H*N*N*D, halved for causal); dq checked",
    "decode": "cell = median ms / GB/s (K, V, q read + out written) (% of device copy bandwidth); tables marked "
              "(CUDA graph replays): the same calls captured in a CUDA graph, ms per call",
    "flash_fwdbwd": "forward + backward in one call: cell = median ms / TFLOP/s (FLOPs = 3.5 * 4*B*H*N*N*D, halved "
                    "for causal); dq checked",
    "linear": "cell = median ms",
    "linear_bwd": "backward: cell = median ms; dq checked",
    "linear_fwdbwd": "forward + backward in one call: cell = median ms; dq checked",
    "varlen": "packed sequences of mixed lengths, size = their mean N (n sequences of (2i + 1) N / n tokens): cell = "
              "median ms / TFLOP/s on the real tokens (FLOPs = 4*H*D*sum(L_i^2), halved for causal); the last rows "
              "of the first and last sequences checked",
    "paged": "the decode grid, the cache in pages (numba_attn[paged<size>], shuffled pages) and dense (numba_attn, "
             "the baseline); 'ragged': row b holds L/2 + b*L/(2B) keys: cell = median ms / GB/s (K, V of the held "
             "keys + q read + out written) (% of device copy bandwidth); '<ours> / numba_attn rate' = GB/s over the "
             "dense cache's (> 1: faster); tables marked (CUDA graph replays): the calls in a CUDA graph, ms per call",
    "window": "causal with the window (W, 0) (row i sees min(i, W) + 1 keys), sizes N > W: cell = median ms / "
              "TFLOP/s on the visible pairs (FLOPs = 4*B*H*D*pairs); numba_attn[causal], the baseline, is the full "
              "causal call on the same inputs (FLOPs 4*B*H*N*N*D/2); '<ours> / numba_attn[causal] rate' = TFLOP/s "
              "over its TFLOP/s (> 1: higher rate)",
}

#: the sweeps whose rate is TFLOP/s, and those whose rate is GB/s
FLOP_SWEEPS = ("flash", "flash_bwd", "flash_fwdbwd", "varlen", "window")
BYTE_SWEEPS = ("decode", "paged")


def short_num(x: float) -> str:
    """Short number: one decimal from 10 up, three significant digits below (simulator rates are tiny)."""
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def _cell(r: dict, prefix: str = "") -> str:
    if r["status"] == "FAIL":
        return f"FAIL {r['rel_err']:.0e}"
    if r["status"] != "ok":
        return "skip"
    ms = r[prefix + "ms"]
    if ms is None:
        return "-"
    if r["sweep"] in FLOP_SWEEPS and r["tflops"] is not None and not prefix:
        return f"{ms:.3f} / {short_num(r['tflops'])}"
    if r["sweep"] in BYTE_SWEEPS and r[prefix + "gbs"] is not None:
        pct = f" ({r[prefix + 'pct_copy_bw']:.0f}%)" if r[prefix + "pct_copy_bw"] is not None else ""
        return f"{ms:.3f} / {short_num(r[prefix + 'gbs'])}{pct}"
    return f"{ms:.3f}"


def pivot_tables(rows: list, sweep: str) -> list:
    """``[(title, header, body)]``, one per (config, dtype) and timer (queued calls; CUDA graph replays where
    measured): a row per size, a column per provider, and for each numba_attn provider its time over the best peer's
    (where the table has peers) and its rate over the baseline's (where it has a baseline)."""
    sweep_rows = [r for r in rows if r["sweep"] == sweep]
    tables = []
    groups = {}
    for r in sweep_rows:
        groups.setdefault((r["config"], r["dtype"]), []).append(r)
    for (config, dtype), group in groups.items():
        providers = list(dict.fromkeys(r["provider"] for r in group))
        baselines = list(dict.fromkeys(r["provider"] for r in group if r.get("baseline")))
        ours = [p for p in providers if p not in baselines and any(r["ours"] for r in group if r["provider"] == p)]
        peers = any(not r["ours"] for r in group)  # (the paged tables have none: no best-peer columns)
        header = (["size"] + providers + [f"{p} / best peer" for p in ours if peers]
                  + [f"{p} / {b} rate" for b in baselines for p in ours] + ["best peer"] * peers)
        for prefix, timer in (("", ""), ("graph_", " (CUDA graph replays)")):
            if prefix and not any(r["graph_ms"] is not None for r in group):
                continue
            body = []
            for size in sorted({r["size"] for r in group}):
                by_provider = {r["provider"]: r for r in group if r["size"] == size}
                line = [size_label(size)] + [_cell(by_provider[p], prefix) if p in by_provider else ""
                                             for p in providers]
                for key in ("vs_best_peer",) * peers + ("vs_baseline",) * len(baselines):
                    for p in ours:
                        ratio = by_provider.get(p, {}).get(prefix + key)
                        line.append(f"{ratio:.2f}x" if ratio is not None else "-")
                if peers:
                    best = next((r[prefix + "best_peer"] for r in by_provider.values() if r[prefix + "best_peer"]), "")
                    line.append(best or "-")
                body.append(line)
            tables.append((f"{sweep}: {config}, {dtype}{timer}", header, body))
    return tables


def sweep_notes(rows: list, sweep: str) -> list:
    """Skip reasons, failures and the worst error of each provider, as text lines."""
    lines = []
    sweep_rows = [r for r in rows if r["sweep"] == sweep]
    for name in dict.fromkeys(r["provider"] for r in sweep_rows):
        mine = [r for r in sweep_rows if r["provider"] == name]
        errs = [r["rel_err"] for r in mine if r["rel_err"] is not None]
        ok = sum(r["status"] == "ok" for r in mine)
        fail = sum(r["status"] == "FAIL" for r in mine)
        skip = sum(r["status"] == "skip" for r in mine)
        worst = f", max rel err {max(errs):.1e}" if errs else ""
        lines.append(f"{name}: {ok} ok, {fail} FAIL, {skip} skipped{worst}")
        for reason in dict.fromkeys(r["reason"] for r in mine if r["status"] == "skip" and r["reason"]):
            sizes = ",".join(size_label(r["size"]) for r in mine if r["reason"] == reason)
            lines.append(f"    skipped ({sizes}): {reason}")
        for r in mine:
            if r["status"] == "ok" and r["reason"].startswith("graph:"):
                lines.append(f"    no CUDA graph time for {r['config']} {r['dtype']} {size_label(r['size'])}: "
                             f"{r['reason']}")
            if r["status"] == "FAIL":
                lines.append(f"    FAIL {r['config']} {r['dtype']} {size_label(r['size'])}: rel err "
                             f"{r['rel_err']:.2e} > {r['tol']:.0e} ({r['tol_key']} bound); not timed")
    return lines


def format_text_table(header: list, body: list) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    fmt = lambda line: "  ".join(  # noqa: E731
        str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(line) for line in body])


def format_markdown_table(header: list, body: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(str(x) for x in line) + " |" for line in body]
    return "\n".join(lines)


def print_report(rows: list, meta: dict):
    for sweep in meta["options"]["sweeps"]:
        if not any(r["sweep"] == sweep for r in rows):
            continue
        print(f"\n=== {sweep} === {METRIC_TEXT[sweep]}; '<ours> / best peer' = time ratio (< 1: numba_attn faster)")
        for title, header, body in pivot_tables(rows, sweep):
            print(f"\n{title}")
            print(format_text_table(header, body))
        print()
        for line in sweep_notes(rows, sweep):
            print(line)
    print(flush=True)


def write_markdown(path: str, rows: list, meta: dict):
    out = [f"# numba_attn benchmark sweep ({meta['device']})", ""]
    out.append(f"{meta['date']}; {meta['mode']} grid; timing: {meta['timer']}; median of up to "
               f"{meta['options']['reps']} calls over {meta['options']['rotate']} rotated input sets.")
    if meta["simulator"]:
        out.append("")
        out.append("**Simulator run** (no GPU): the timings measure Numba's CUDA simulator on the CPU, not a kernel.")
    if meta.get("copy_bandwidth_gbs"):
        out.append("")
        out.append(f"Device-to-device copy bandwidth: {meta['copy_bandwidth_gbs']:.0f} GB/s (read + written bytes).")
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    out += ["", f"Versions: {versions}.", "", f"Command: `{meta['command']}`"]
    for sweep in meta["options"]["sweeps"]:
        if not any(r["sweep"] == sweep for r in rows):
            continue
        out += ["", f"## {sweep}", "", METRIC_TEXT[sweep] + "; `<ours> / best peer` is the time ratio "
                "(< 1: numba_attn faster). FAIL: error above the bound, not timed."]
        for title, header, body in pivot_tables(rows, sweep):
            out += ["", f"### {title}", "", format_markdown_table(header, body)]
        out += ["", "Notes:", ""] + [f"- {line.strip()}" for line in sweep_notes(rows, sweep)]
    if meta.get("notes"):
        out += [""] + [f"Note: {n}" for n in meta["notes"]]
    if meta["unavailable_peers"]:
        out += ["", "Peers not available: " + "; ".join(f"{k} ({v})" for k, v in meta["unavailable_peers"].items())]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_csv(path: str, rows: list):
    if not rows:
        with open(path, "w") as f:
            f.write("")
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in r.items()})


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str, rows: list, meta: dict):
    with open(path, "w") as f:
        json.dump(_json_safe({"meta": meta, "results": rows}), f, indent=1)


def write_plot(path: str, rows: list, sweep: str, meta: dict) -> str | None:
    """One PNG per sweep: metric vs size, a line per provider, a subplot per (config, dtype). None if written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"no plot ({type(exc).__name__}: {exc})"
    metric, ylabel = ("tflops", "TFLOP/s") if sweep in FLOP_SWEEPS else ("gbs", "GB/s") if sweep in BYTE_SWEEPS else (
        "ms", "ms")
    sweep_rows = [r for r in rows if r["sweep"] == sweep]
    panels = list(dict.fromkeys((r["config"], r["dtype"]) for r in sweep_rows))
    if not panels:
        return "no rows"
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, (config, dtype) in zip(axes.flat, panels):
        panel = [r for r in sweep_rows if r["config"] == config and r["dtype"] == dtype]
        for name in dict.fromkeys(r["provider"] for r in panel):
            pts = sorted((r["size"], r[metric]) for r in panel
                         if r["provider"] == name and r["status"] == "ok" and r[metric] is not None)
            if not pts:
                continue
            ours = any(r["ours"] for r in panel if r["provider"] == name)
            base = any(r.get("baseline") for r in panel if r["provider"] == name)  # (our reference point)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                            linewidth=2.5 if ours else 1.2, linestyle="-." if base else "-" if ours else "--")
            graph_pts = sorted((r["size"], r["graph_" + metric]) for r in panel if r["provider"] == name
                               and r["status"] == "ok" and r.get("graph_" + metric) is not None)
            if graph_pts:
                ax.plot([p[0] for p in graph_pts], [p[1] for p in graph_pts], marker="x", color=line.get_color(),
                        label=f"{name} (graph)", linewidth=1.0 if ours else 0.8, linestyle=":")
        if sweep in BYTE_SWEEPS and meta.get("copy_bandwidth_gbs"):
            ax.axhline(meta["copy_bandwidth_gbs"], color="gray", linestyle=":", label="device copy")
        ax.set_xscale("log", base=2)
        if sweep.startswith("linear"):
            ax.set_yscale("log")
        sizes = sorted({r["size"] for r in panel})
        ax.set_xticks(sizes)
        ax.set_xticklabels([size_label(s) for s in sizes])
        ax.set_title(f"{config}, {dtype}", fontsize=10)
        ax.set_xlabel({"decode": "KV length", "paged": "KV length", "varlen": "mean sequence length"}.get(
            sweep, "sequence length"))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{sweep} on {meta['device']}" + (" (simulator: not a performance number)" if meta["simulator"]
                                                     else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


#: every file the sweep may write in --out (the three result files and one plot per sweep)
OUTPUT_FILES = ("results.csv", "results.json", "results.md") + tuple(f"{s}.png" for s in SWEEPS)


def write_outputs(rows: list, meta: dict, opts: Options) -> list:
    """Write the result files; remove the sweep's own files that this run did not rewrite (stale plots)."""
    os.makedirs(opts.out, exist_ok=True)
    written = []
    for sweep in opts.sweeps if opts.plot else ():
        path = os.path.join(opts.out, f"{sweep}.png")
        problem = write_plot(path, rows, sweep, meta)
        if problem is None:
            written.append(path)
        else:
            note = f"{sweep}.png not written: {problem}"
            meta.setdefault("notes", []).append(note)
            print(note, flush=True)
    for name, writer in (("results.csv", lambda p: write_csv(p, rows)),
                         ("results.json", lambda p: write_json(p, rows, meta)),
                         ("results.md", lambda p: write_markdown(p, rows, meta))):
        path = os.path.join(opts.out, name)
        writer(path)
        written.append(path)
    for name in OUTPUT_FILES:
        path = os.path.join(opts.out, name)
        if path not in written and os.path.exists(path):
            os.remove(path)
    return written
