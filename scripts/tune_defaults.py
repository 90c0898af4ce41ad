#!/usr/bin/env python3
"""Tune ``flash_forward``'s tile configurations for the common shapes on this GPU and write the shipped table of its
family (``numba_attn/forward/tuned/sm<major><minor>.json``); ``--check`` compares a table with full tuning.

    python3 scripts/tune_defaults.py                          # writes numba_attn/forward/tuned/sm90.json on an H100
    python3 scripts/tune_defaults.py --out /tmp/sm90.json     # elsewhere (then copy it into the package)
    python3 scripts/tune_defaults.py --check --table /tmp/sm90.json --report /tmp/check.json

Tuning: for each dtype, head dim, causal flag and shape below, one ``flash_forward`` call inside
``numba_attn.autotune()`` with an empty temporary ``NUMBA_ATTN_CACHE_DIR`` times every candidate of the kernel that
the call runs on (``runtime.autotune.time_on_stream``: warm-up calls, then the median of ``--reps`` samples of
back-to-back calls between CUDA events) -- exactly what a user's tuning does. Shapes (batch, heads, seqlen_q,
seqlen_k; heads 48 at head dims <= 64, 32 at 96 / 128, 16 at 256): B4 and B1 at N = 512 .. 16k, and B1 with 1k queries
against 16k keys (a chunk of a long prefill). Several shapes share a tuner key (``dispatch.tuning_key`` without the SM
count: size classes are powers of 4), and their fastest candidates can differ (e.g. 4 warps at N = 512, 8 at 1k): per
key the script writes the candidate whose worst loss against each shape's fastest is smallest (ties: the smaller mean
loss), the shapes, every candidate's time per shape, and prints that worst loss and the default's.

``--check``: for each shape -- the tuned ones, and two whose keys the tuning run does not make (B16 at 1k, B4 at 256:
the nearest-entry rule) -- with an empty cache each time, the same full tuning, then the table's configuration for
the call's key (as a user gets it: exact key, else nearest size class, else the default) against the fastest
candidate of that run; prints the loss per shape and exits 1 when a loss exceeds ``--tolerance`` percent.
``--then-check`` runs the check of the table just written in the same process (the kernels compiled once).

Budget: kernels compile once per (configuration, padded head dim, dtype) -- most of the time on a fresh machine
(Numba's disk cache keeps them for a second run) --, timing takes seconds. ``--time-limit`` (default 230 s) stops
starting new shapes and writes what is done; ``--merge`` adds a later run's keys to an existing table; ``--take
block_n=128,persistent=True,...`` (with ``--merge``) writes only the keys whose new choice has those fields -- a new
candidate taken where it won, the run's other choices left as they were (the source notes the keys). Needs a GPU,
torch (inputs; bfloat16 is taken only as torch tensors) and numba_attn importable from the repository root.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "scripts")):  # (the package; the sweep's provenance helpers)
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numba_attn  # noqa: E402  (before numba.cuda)
from numba_attn.forward import dispatch  # noqa: E402
from numba_attn.runtime import autotune as _autotune, kernel_cache  # noqa: E402
import _fields  # noqa: E402
from bench.environment import git_commit, package_hash  # noqa: E402
from numba_attn.runtime.device import compute_capability, multiprocessor_count  # noqa: E402

#: heads per head dim: the models of the benchmarks (D64 H48 and D128 H32 at B4), D256 with 16
HEADS = {32: 48, 64: 48, 96: 32, 128: 32, 256: 16}
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
CHUNK = (1024, 16384)  # (seqlen_q, seqlen_k) of a chunk of a long prefill
ABOUT = ("Tile configurations flash_forward uses on GPUs of this family for keys the user has not tuned "
         "(numba_attn/runtime/autotune.py; docs/design/forward.md, 'How a tile configuration is chosen'). Keys: "
         "dtype|padded head dim|causal|size class of batch*heads*seqlen_q|size class of seqlen_k. A key without an "
         "entry takes the entry with the nearest size classes and the same other fields, else the kernel's "
         "default. Each entry: the configuration (of the candidates, the one with the smallest worst loss over the "
         "key's shapes), the shapes it was tuned on (batch, heads, seqlen_q, seqlen_k, head dim), every "
         "candidate's median ms per shape, the chosen one's worst loss in percent and the default's time over "
         "the chosen one's (the largest over the shapes). Written by "
         "scripts/tune_defaults.py; --check compares it with full tuning.")


def shapes(head_dim: int, check: bool) -> list[tuple]:
    heads = HEADS.get(head_dim, 32)
    found = [(4, heads, n, n) for n in SEQLENS] + [(1, heads, n, n) for n in SEQLENS] + [(1, heads) + CHUNK]
    if check:  # keys the tuning run has no entry for: the nearest entry's configuration
        found += [(16, heads, 1024, 1024), (4, heads, 256, 256)]
    return found


def plan(args, check: bool) -> list[tuple]:
    """(dtype, head_dim, causal, shape) in the order they run: one dtype and head dim at a time (their kernels
    compile once), the head dims in the order given."""
    masks = [m == "causal" for m in ("full", "causal") if m in args.masks]
    return [(dtype, d, causal, shape) for d in args.headdims for dtype in args.dtypes for causal in masks
            for shape in shapes(d, check)]


class Inputs:
    """q, k, v as views of three flat buffers per dtype, allocated once and filled with normal values (a view of a
    buffer's start is contiguous: the kernels take it as they take any contiguous input)."""

    def __init__(self, torch, items):
        self.torch = torch
        self.buffers = {}
        need = {}
        for dtype, d, _, (b, h, nq, nk) in items:
            q, kv = need.get(dtype, (0, 0))
            need[dtype] = (max(q, b * h * nq * d), max(kv, b * h * nk * d))
        self.need = need

    def get(self, dtype, d, shape):
        torch = self.torch
        if dtype not in self.buffers:  # (at most 3 x 537 MB per dtype)
            q_elems, kv_elems = self.need[dtype]
            gen = torch.Generator(device="cuda").manual_seed(0)
            self.buffers[dtype] = tuple(
                torch.randn(n, generator=gen, device="cuda", dtype=getattr(torch, dtype))
                for n in (q_elems, kv_elems, kv_elems))
        b, h, nq, nk = shape
        q, k, v = self.buffers[dtype]
        return (q[:b * h * nq * d].view(b, h, nq, d), k[:b * h * nk * d].view(b, h, nk, d),
                v[:b * h * nk * d].view(b, h, nk, d))


def warm_up(torch, seconds=1.0):
    """Bring the clocks up before the first timing."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def tune_one(torch, inputs, dtype, d, causal, shape, backend):
    """One call inside ``autotune()``; returns (tuner, key, timings) of what it tuned, or None (nothing new or a
    failed call, which is printed)."""
    before = {tuner.name: set(tuner.timings) for tuner in dispatch.TUNERS}
    q, k, v = inputs.get(dtype, d, shape)
    try:
        with numba_attn.autotune():
            numba_attn.flash_forward(q, k, v, causal=causal, backend=backend)
        torch.cuda.synchronize()
    except Exception as e:  # keep what the other shapes give
        print(f"  {dtype} {fmt_shape(d, shape)} causal={causal}: {type(e).__name__}: {e}")
        return None
    for tuner in dispatch.TUNERS:
        new = set(tuner.timings) - before[tuner.name]
        if new:
            text = new.pop()
            return tuner, text, tuner.timings[text]
    return None


def fmt_shape(d, shape):
    b, h, nq, nk = shape
    return f"B{b} H{h} N{nq}/{nk} D{d}"


def short(config) -> str:
    fields = dataclasses.asdict(config)
    default = dataclasses.asdict(type(config)())
    changed = {name: value for name, value in fields.items() if value != default[name]}
    return type(config).__name__ + "(" + ", ".join(f"{n}={v}" for n, v in changed.items()) + ")"


def versions(torch):
    from importlib import metadata

    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("numba", "numba-cuda", "numpy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def fresh_cache(root, index, kernels):
    """An empty tuning cache for one shape. Its compiled kernels are the caller's ``kernels`` folder where that
    exists, so that kernels compiled before (by other processes: ``scripts/prewarm_ws.py``) load from disk."""
    path = os.path.join(root, str(index))
    os.makedirs(path, exist_ok=True)
    if os.path.isdir(kernels):
        os.symlink(kernels, os.path.join(path, "kernels"))
    os.environ[_autotune.CACHE_DIR_ENV] = path
    for tuner in dispatch.TUNERS:
        tuner.forget()


def losses(config, runs) -> list[float]:
    """The slowdown (ratio) of ``config`` against the fastest candidate, per run (one run: a shape's timings)."""
    return [timings[repr(config)] / min(timings.values()) for _, timings in runs]


def choose(tuner, runs):
    """The candidate with the smallest worst loss over ``runs``; ties (within 0.1 %) go to the smaller mean."""
    def rank(config):
        found = losses(config, runs)
        return round(max(found), 3), sum(found) / len(found)
    return min(tuner.candidates, key=rank)


def run_tune(args, torch, family):
    items = plan(args, check=False)
    inputs = Inputs(torch, items)
    root = tempfile.mkdtemp(prefix="numba_attn_tune_")
    kernels = kernel_cache.kernels_dir()
    start = time.perf_counter()
    runs, tuners, left = {}, {}, []
    print(f"{family} ({torch.cuda.get_device_name()}, {multiprocessor_count()} SMs): {len(items)} shapes, "
          f"reps {_autotune.REPS}, time limit {args.time_limit:.0f} s, cache {root}")
    for index, (dtype, d, causal, shape) in enumerate(items):
        if time.perf_counter() - start > args.time_limit:
            left.append((dtype, d, causal, shape))
            continue
        fresh_cache(root, index, kernels)  # every shape tunes, also those whose key another shape tuned
        t0 = time.perf_counter()
        result = tune_one(torch, inputs, dtype, d, causal, shape, args.backend)
        key = dispatch.tuning_key(dtype, d, causal, *shape)
        elapsed = time.perf_counter() - start
        if result is None:
            print(f"[{elapsed:6.1f}s] {key.table_text:34s} {fmt_shape(d, shape)}: nothing tuned")
            continue
        tuner, _, timings = result
        tuners[tuner.name] = tuner
        runs.setdefault((tuner.name, key.table_text), []).append(((*shape, d), timings))
        fastest = min(tuner.candidates, key=lambda c: timings[repr(c)])
        print(f"[{elapsed:6.1f}s] {tuner.name:14s} {key.table_text:34s} {fmt_shape(d, shape):22s} fastest "
              f"{short(fastest):30s} {timings[repr(fastest)]:8.3f} ms ({time.perf_counter() - t0:.1f} s)")
    done, worst = {}, []
    print()
    for (name, text), key_runs in runs.items():
        tuner = tuners[name]
        chosen = choose(tuner, key_runs)
        chosen_loss, default_loss = max(losses(chosen, key_runs)), max(losses(tuner.default, key_runs))
        default_over_chosen = max(t[repr(tuner.default)] / t[repr(chosen)] for _, t in key_runs)
        worst.append((chosen_loss, name, text))
        print(f"{name:14s} {text:34s} {len(key_runs)} shape(s): {short(chosen):30s} worst loss "
              f"{100 * (chosen_loss - 1):4.1f} % (default {100 * (default_loss - 1):4.1f} %)")
        done.setdefault(name, {})[text] = {
            "config": dataclasses.asdict(chosen),
            "shapes": [list(shape) for shape, _ in key_runs],
            "timings_ms": [{c: round(ms, 4) for c, ms in t.items()} for _, t in key_runs],
            "worst_loss_pct": round(100 * (chosen_loss - 1), 2),
            "default_over_chosen": round(default_over_chosen, 4),
        }
    total = time.perf_counter() - start
    table = write_table(args, torch, family, done, total)
    print(f"\n{len(runs)} keys tuned from {sum(len(r) for r in runs.values())} shapes in {total:.0f} s; written to "
          f"{args.out}")
    if worst:
        loss, name, text = max(worst)
        print(f"the largest loss of a chosen configuration on a shape it was tuned on: {100 * (loss - 1):.1f} % "
              f"({name} {text})")
    changed = [entry["default_over_chosen"] for entries in done.values() for entry in entries.values()
               if entry["default_over_chosen"] > 1.0]
    print(f"{len(changed)} keys chose another configuration than the default"
          + (f"; the largest gain {100 * (max(changed) - 1):.1f} %" if changed else ""))
    if left:
        head_dims = " ".join(str(d) for d in dict.fromkeys(d for _, d, _, _ in left))
        dtypes = " ".join(dict.fromkeys(dtype for dtype, _, _, _ in left))
        print(f"time limit: {len(left)} shapes not tuned; to add them: python3 scripts/tune_defaults.py --merge "
              f"--out {args.out} --headdims {head_dims} --dtypes {dtypes}")
    return table


def parse_fields(text: str) -> dict:
    """``--take``'s ``name=value,...`` (``_fields.parse_fields``); SystemExit where it is not that."""
    try:
        return _fields.parse_fields(text)
    except ValueError as error:
        raise SystemExit(f"--take: {error}") from None


def takes(text: str, config: dict) -> bool:
    """Whether a chosen configuration (a dict of fields) has every field of ``--take``."""
    wanted = parse_fields(text)
    unknown = sorted(set(wanted) - set(config))
    if unknown:
        raise SystemExit(f"--take: no field {', '.join(unknown)} in the tuned configurations ({', '.join(config)})")
    return all(config[name] == value for name, value in wanted.items())


def write_table(args, torch, family, done, seconds):
    source = {
        "written_by": "scripts/tune_defaults.py", "command": " ".join(["scripts/tune_defaults.py"] + sys.argv[1:]),
        "device": torch.cuda.get_device_name(), "sms": multiprocessor_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(), "package_hash": package_hash(), "versions": versions(torch),
        "reps": _autotune.REPS, "seconds": round(seconds),
        "timer": "runtime.autotune.time_on_stream: warm-up calls, then the median of reps samples of back-to-back "
                 "calls between CUDA events",
    }
    old = {}
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
    if args.take:
        # (the keys of a tuner whose configurations lack the fields -- another kernel's -- are not taken; where no
        # tuner's have them, ``takes`` names the unknown field)
        wanted = set(parse_fields(args.take))
        having = {name: entries for name, entries in done.items()
                  if all(wanted <= set(entry["config"]) for entry in entries.values())}
        if not any(having.values()):
            for entries in done.values():
                for entry in entries.values():
                    takes(args.take, entry["config"])
        done = {name: {key: entry for key, entry in entries.items() if takes(args.take, entry["config"])}
                for name, entries in having.items()}
        source["taken"] = (f"only the keys whose choice has {args.take}: "
                           + (", ".join(sorted(k for e in done.values() for k in e)) or "none"))
    table = {"family": family, "about": ABOUT, "source": source, "tuners": {}}
    if old:
        table["merged_from"] = [old.get("source")] + old.get("merged_from", [])
    for tuner in dispatch.TUNERS:
        entries = dict(old.get("tuners", {}).get(tuner.name, {}).get("entries", {}))
        entries.update(done.get(tuner.name, {}))
        table["tuners"][tuner.name] = {"default": dataclasses.asdict(tuner.default), "entries": entries}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")
    for tuner in dispatch.TUNERS:
        problems = _autotune.TunedTable.read(args.out, tuner)[1]
        if problems:
            raise SystemExit("the table just written does not read back: " + "; ".join(problems))
    return table


def run_check(args, torch, family):
    tables = {tuner.name: _autotune.TunedTable.read(args.table, tuner) for tuner in dispatch.TUNERS}
    for name, (_, problems) in tables.items():
        for problem in problems:
            print("table problem:", problem)
    items = plan(args, check=True)
    inputs = Inputs(torch, items)
    root = tempfile.mkdtemp(prefix="numba_attn_check_")
    kernels = kernel_cache.kernels_dir()
    start = time.perf_counter()
    rows, left = [], 0
    print(f"{family}: checking {args.table} against full tuning, {len(items)} shapes, reps {_autotune.REPS}")
    for index, (dtype, d, causal, shape) in enumerate(items):
        if time.perf_counter() - start > args.time_limit:
            left += 1
            continue
        fresh_cache(root, index, kernels)
        result = tune_one(torch, inputs, dtype, d, causal, shape, args.backend)
        if result is None:
            continue
        tuner, text, timings = result
        key = dispatch.tuning_key(dtype, d, causal, *shape)
        table = tables[tuner.name][0]
        exact = key.table_text in table.entries
        shipped = table.lookup(key) or tuner.default
        best = min(tuner.candidates, key=lambda c: timings[repr(c)])
        best_ms, shipped_ms, default_ms = (timings[repr(c)] for c in (best, shipped, tuner.default))
        loss, default_loss = 100.0 * (shipped_ms / best_ms - 1.0), 100.0 * (default_ms / best_ms - 1.0)
        rows.append({"tuner": tuner.name, "key": key.table_text, "shape": [*shape, d], "exact_entry": exact,
                     "shipped": dataclasses.asdict(shipped), "best": dataclasses.asdict(best),
                     "shipped_ms": shipped_ms, "best_ms": best_ms, "default_ms": default_ms,
                     "shipped_loss_pct": round(loss, 2), "default_loss_pct": round(default_loss, 2)})
        flag = "  OVER" if loss > args.tolerance else ""
        print(f"[{time.perf_counter() - start:6.1f}s] {tuner.name:11s} {key.table_text:34s} "
              f"{fmt_shape(d, shape):22s} {'exact ' if exact else 'nearest'} shipped {short(shipped):30s} "
              f"{shipped_ms:8.3f} ms, best {short(best):30s} {best_ms:8.3f} ms: +{loss:4.1f} % "
              f"(default +{default_loss:4.1f} %){flag}")
    over = [row for row in rows if row["shipped_loss_pct"] > args.tolerance]
    worst = max((row["shipped_loss_pct"] for row in rows), default=0.0)
    worst_default = max((row["default_loss_pct"] for row in rows), default=0.0)
    print(f"\n{len(rows)} shapes checked in {time.perf_counter() - start:.0f} s; the table's configuration is at most "
          f"{worst:.1f} % slower than full tuning (the default: {worst_default:.1f} %); {len(over)} over "
          f"{args.tolerance:g} %" + (f"; {left} shapes not checked (time limit)" if left else ""))
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"family": family, "table": args.table, "device": torch.cuda.get_device_name(),
                       "reps": _autotune.REPS, "tolerance_pct": args.tolerance, "rows": rows}, f, indent=1)
            f.write("\n")
    return 1 if over else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    parser.add_argument("--headdims", nargs="+", type=int, default=[128, 64, 256, 96, 32],
                        help="in the order they run (default: 128 64 256 96 32)")
    parser.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"],
                        help="the keys to tune: without a mask, causal, or both")
    parser.add_argument("--backend", choices=["mma", "wgmma", "wgmma_ws"], default=None,
                        help="force a kernel (default: the one flash_forward picks, as users get it)")
    parser.add_argument("--reps", type=int, default=_autotune.REPS, help="timed calls per candidate")
    parser.add_argument("--time-limit", type=float, default=230.0, help="seconds after which no new shape starts")
    parser.add_argument("--out", help="the table to write (default: the package's numba_attn/forward/tuned/<family>.json)")
    parser.add_argument("--merge", action="store_true", help="keep the entries of --out that this run does not tune")
    parser.add_argument("--take", help="with --merge: write only the keys whose new choice has these fields "
                        "(name=value,...)")
    parser.add_argument("--check", action="store_true", help="compare --table with full tuning instead of tuning")
    parser.add_argument("--table", help="the table --check reads (default: the package's table of this family)")
    parser.add_argument("--tolerance", type=float, default=5.0, help="--check: the loss in percent that fails")
    parser.add_argument("--report", help="--check: also write the rows as JSON here")
    parser.add_argument("--then-check", action="store_true",
                        help="after tuning, check the table just written in the same process")
    parser.add_argument("--check-time-limit", type=float, default=None,
                        help="--then-check: its own time limit (default: --time-limit)")
    args = parser.parse_args()
    if args.take is not None:
        if not args.merge:
            parser.error("--take needs --merge (the keys not taken keep the table's entries)")
        parse_fields(args.take)
    sys.stdout.reconfigure(line_buffering=True)  # progress shows through a pipe (tee) as it comes
    if numba_attn.SIMULATOR:
        raise SystemExit("tune_defaults.py needs a GPU (running under the CUDA simulator)")
    import torch

    family = "sm%d%d" % compute_capability()
    default_path = os.path.join(dispatch.TABLE_DIR, f"{family}.json")
    args.out = args.out or default_path
    args.table = args.table or default_path
    os.environ[_autotune.ENABLE_ENV] = "1"  # tuning even where the caller's environment says 0
    _autotune.REPS = args.reps
    warm_up(torch)
    if args.check:
        return run_check(args, torch, family)
    run_tune(args, torch, family)
    if not args.then_check:
        print(f"next: python3 scripts/tune_defaults.py --check --table {args.out}")
        return 0
    args.table = args.out
    if args.check_time_limit is not None:
        args.time_limit = args.check_time_limit
    print()
    return run_check(args, torch, family)


if __name__ == "__main__":
    sys.exit(main())
