"""The whole run: parse options, pick the environment and providers, sweep every case, report and write files."""
from __future__ import annotations

import datetime as _dt
import shlex
import sys
from dataclasses import asdict

from .cases import CASES
from .cli import build_parser, resolve_options
from .environment import git_commit, make_env, package_hash, versions
from .providers import build_registry, filter_registry
from .report import add_comparisons, print_report, write_outputs
from .runner import error_text, run_case


def main(argv: list | None = None, *, extra_providers: dict | None = None) -> dict:
    """Run the sweep; returns ``{"rows", "meta", "files"}``.

    ``extra_providers``: ``{sweep: {name: Provider}}`` added to the registry (after the built-in providers), e.g.
    a provider under development or a deliberately wrong one in the tests.
    """
    args = build_parser().parse_args(argv)
    env = make_env()
    opts = resolve_options(args, env.simulator)
    registry, unavailable = build_registry(env, opts)
    for sweep, providers in (extra_providers or {}).items():
        registry.setdefault(sweep, {}).update(providers)
    registry = filter_registry(registry, opts.providers)

    if args.list_providers:
        for sweep in opts.sweeps:
            print(f"{sweep}: " + ", ".join(registry.get(sweep, {})))
        for label, reason in unavailable.items():
            print(f"unavailable: {label}: {reason}")
        return {"rows": [], "meta": {}, "files": []}

    print(f"numba_attn sweep on {env.device_name} ({opts.mode} grid, arrays: {env.kind})", flush=True)
    if env.simulator:
        print("No GPU: running a tiny grid under Numba's CUDA simulator against a NumPy naive peer. "
              "Times measure the simulator, not the kernels.", flush=True)
    for label, reason in unavailable.items():
        print(f"peer {label} unavailable: {reason}", flush=True)

    meta = {
        "device": env.device_name, "simulator": env.simulator, "mode": opts.mode, "arrays": env.kind,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.argv[0] if argv is None else "sweep.py"]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "git_commit": git_commit(), "package_hash": package_hash(), "versions": versions(), "timer": env.timer,
        "options": asdict(opts),
        "copy_bandwidth_gbs": None, "unavailable_peers": unavailable,
        "providers": {s: {n: p.note for n, p in registry.get(s, {}).items()} for s in opts.sweeps},
        "flops": "flash: 4*B*H*Lq*Lk*D, halved for causal; flash_bwd: 2.5 times that; varlen: 4*H*D*sum(L_i^2), "
                 "halved for causal; window: 4*B*H*D*sum_i(min(i, W) + 1) (numba_attn[causal]: as flash causal)",
        "bytes": "decode, paged: K and V read (paged ragged: the keys each row holds) + q read + out written",
        "correctness": f"batch 0, heads first and last, last {opts.check_rows} query rows vs float64 reference "
                       "(varlen: the last rows of the first and last packed sequences)",
    }
    rows: list = []
    files: list = []
    try:
        with env.active():
            if {"decode", "paged"} & set(opts.sweeps) and not env.simulator:
                try:
                    meta["copy_bandwidth_gbs"] = env.copy_bandwidth()
                except Exception as exc:  # noqa: BLE001
                    print(f"copy bandwidth not measured: {error_text(exc)}", flush=True)
                if meta["copy_bandwidth_gbs"]:
                    print(f"device-to-device copy bandwidth: {meta['copy_bandwidth_gbs']:.0f} GB/s "
                          "(1 GiB buffer, read + written bytes)", flush=True)
            for sweep in opts.sweeps:
                providers = registry.get(sweep, {})
                if not providers:
                    print(f"{sweep}: no provider left after --providers; skipped", flush=True)
                    continue
                for case in CASES[sweep](opts):
                    rows.extend(run_case(case, providers, env, opts))
    finally:
        add_comparisons(rows, meta["copy_bandwidth_gbs"])
        print_report(rows, meta)
        files = write_outputs(rows, meta, opts)
        print("wrote " + ", ".join(files), flush=True)
    return {"rows": rows, "meta": meta, "files": files}
