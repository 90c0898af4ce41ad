"""One case at a time: inputs and reference made once, then every provider checked and, if correct, timed."""
from __future__ import annotations

import contextlib
import warnings

import numpy as np

from .cases import Case, make_inputs
from .checks import CheckSlice, PackedSlice, check_slice, reference_output, rel_error, tolerance_for
from .cli import Options
from .environment import Env, to_numpy
from .providers import Provider
from .report import short_num
from .timing import measure


def error_text(exc: BaseException, caught=()) -> str:
    """A row's reason: the exception's first line, plus the first line of each warning caught (torch explains why
    an SDPA backend refuses inputs in a warning, not in the error)."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
    hints = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    if hints:
        text += " | " + " | ".join(dict.fromkeys(hints))[:400]
    return text


def _row(case: Case, name: str, provider: Provider, **fields) -> dict:
    row = {
        "sweep": case.sweep, "config": case.config, "dtype": case.dtype, "size": case.size, "provider": name,
        "ours": provider.ours, "status": "skip", "reason": "", "rel_err": None, "tol_key": "", "tol": None,
        "ms": None, "ms_min": None, "reps": 0, "tflops": None, "gbs": None, "pct_copy_bw": None,
        "vs_best_peer": None, "best_peer": "", "graph_ms": None, "graph_gbs": None, "graph_pct_copy_bw": None,
        "graph_vs_best_peer": None, "graph_best_peer": "", "baseline": provider.baseline, "vs_baseline": None,
        "graph_vs_baseline": None, "batch": case.batch, "heads": case.heads,
        "kv_heads": case.kv_heads, "seqlen_q": case.seqlen_q, "seqlen_k": case.seqlen_k,
        "head_dim": case.head_dim, "value_dim": case.value_dim, "causal": case.causal, "flops": case.flops,
        "bytes": case.nbytes, "lengths": ",".join(str(n) for n in case.lengths), "window": case.window,
    }
    row.update(fields)
    return row


def _progress(case: Case, name: str, row: dict):
    head = f"[{case.label}] {name:<22}"
    if row["status"] == "ok":
        text = f"ok    err {row['rel_err']:.1e}  {row['ms']:9.3f} ms"
        if row["tflops"] is not None:
            text += f"  {short_num(row['tflops']):>7} TFLOP/s"
        if row["gbs"] is not None:
            text += f"  {short_num(row['gbs']):>7} GB/s"
        text += f"  ({row['reps']} reps)"
        if row["graph_ms"] is not None:
            text += f"  graph {row['graph_ms']:.4f} ms"
            if row["graph_gbs"] is not None:
                text += f" {short_num(row['graph_gbs'])} GB/s"
    elif row["status"] == "FAIL":
        text = f"FAIL  err {row['rel_err']:.1e} > {row['tol']:.0e} ({row['tol_key']})  {row['reason']}".rstrip()
    else:
        text = f"skip  {row['reason']}"
    print(f"{head} {text}", flush=True)


def run_provider(case: Case, name: str, provider: Provider, input_sets: list, ref: np.ndarray,
                 sl: CheckSlice | PackedSlice, env: Env, opts: Options) -> dict:
    """Check one provider on one case and, if it is correct, time it. Never raises (except KeyboardInterrupt).

    A provider with a ``variant`` computes another case on the same inputs: its reference, FLOPs and bytes are the
    variant's (computed here), its row the swept case's."""
    tol_key, tol = tolerance_for(case, provider, opts.tolerances)
    own = provider.variant(case) if provider.variant else case
    base = dict(tol_key=tol_key, tol=tol, flops=own.flops, bytes=own.nbytes)
    try:
        reason = provider.check(case, env)
    except Exception as exc:  # noqa: BLE001
        reason = error_text(exc)
    if reason:
        return _row(case, name, provider, reason=reason, **base)

    prepared = []
    try:
        # 1. correctness on input set 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if own is not case:
                    ref = reference_output(own, input_sets[0], sl)
                first = provider.prepare(case, input_sets[0], env)
                prepared.append(first)
                with first.context():
                    out = first.post(first.fn())
                env.sync()
                if tuple(out.shape) != own.out_shape():
                    raise ValueError(f"output shape {tuple(out.shape)}, expected {own.out_shape()}")
                got = to_numpy(sl.of(out))
                del out
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001
                return _row(case, name, provider, reason=error_text(exc, caught), **base)
        err = rel_error(got, ref)
        if not err <= tol:
            return _row(case, name, provider, status="FAIL", rel_err=err, reason="not timed", **base)

        # 2. timing over the rotated input sets
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                prepared += [provider.prepare(case, x, env) for x in input_sets[1:]]
                with first.context():
                    timing = measure(env, [p.fn for p in prepared], opts)
                env.sync()
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001
                return _row(case, name, provider, rel_err=err, reason="timing: " + error_text(exc), **base)
            graph = {}
            if case.sweep in opts.graph_sweeps and provider.graphs:
                try:
                    with first.context():
                        graph_ms = env.graph_call_ms([p.fn for p in prepared], opts.graph_steps,
                                                     opts.graph_replays)
                    if graph_ms is not None:
                        graph = dict(graph_ms=graph_ms,
                                     graph_gbs=own.nbytes / (graph_ms * 1e-3) / 1e9 if own.nbytes else None)
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # noqa: BLE001
                    graph = dict(reason="graph: " + error_text(exc))
                    with contextlib.suppress(Exception):
                        env.sync()
        seconds = timing.median_ms * 1e-3
        return _row(
            case, name, provider, status="ok", rel_err=err, ms=timing.median_ms, ms_min=timing.min_ms,
            reps=timing.reps, tflops=own.flops / seconds / 1e12 if own.flops else None,
            gbs=own.nbytes / seconds / 1e9 if own.nbytes else None, **base, **graph,
        )
    finally:
        prepared.clear()
        with contextlib.suppress(Exception):
            env.free()


def run_case(case: Case, providers: dict, env: Env, opts: Options) -> list:
    """All providers on one case: inputs and reference made once, shared by every provider."""
    rows = []
    try:
        per_set = case.input_bytes()
        count = max(1, min(opts.rotate, int(opts.input_mem_bytes // max(per_set, 1))))
        input_sets = [make_inputs(env, case, seed) for seed in range(count)]
        env.sync()
        sl = check_slice(case, opts.check_rows)
        ref = reference_output(case, input_sets[0], sl)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001
        reason = "inputs: " + error_text(exc)
        for name, provider in providers.items():
            rows.append(_row(case, name, provider, reason=reason))
            _progress(case, name, rows[-1])
        with contextlib.suppress(Exception):
            env.free()
        return rows
    for name, provider in providers.items():
        row = run_provider(case, name, provider, input_sets, ref, sl, env, opts)
        rows.append(row)
        _progress(case, name, row)
    del input_sets
    with contextlib.suppress(Exception):
        env.free()
    return rows
