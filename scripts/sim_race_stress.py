"""Hunt shared-memory races of the backward kernels under the CUDA simulator (CPU only, no GPU needed).

    python scripts/sim_race_stress.py                        # the case of test_flash_backward's 9 x 21 fp16 id
    python scripts/sim_race_stress.py --runs 20 --switch 0.2 --seed 3
    python scripts/sim_race_stress.py --lq 13 --lk 11 --dtype float32 --no-causal --deterministic

The simulator runs each block's threads as Python threads, but the GIL hands over rarely (every 5 ms), so the
interleavings a missing barrier needs seldom happen. Here every simulated thread (``threading.settrace``) sleeps,
with probability ``--switch`` per line of ``numba_attn`` code it runs, for 0, 10 or 100 us: the other threads run
meanwhile, in an order drawn from ``--seed``. A race-free call gives the same bits on every run (the simulator
runs blocks one after another and each dQ atomic element gets its adds in block order); a run whose dq, dk or dv
differs from the first, untraced run prints DIFFERS and the exit status is 1. Checked on known races: with
``dkdv_kernel``'s barrier before it stages a query tile removed, 4 runs of 4 differed (dk, dv errors 0.03-0.24);
with its barrier after the P^T, dS^T stores removed, 3 of 3 (dq errors 0.057-0.070). The unchanged kernels: the
same bits on every run (~6 s a run for the default case).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numba_attn  # noqa: E402  (decides simulator or GPU before numba.cuda is imported)
import reference  # noqa: E402

TOLERANCE = {"float32": 1e-5, "float16": 2e-3}


def _rel(x, ref) -> float:
    return float(np.linalg.norm(x.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-300))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--switch", type=float, default=0.05, help="chance of a sleep per traced line")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--lq", type=int, default=9)
    parser.add_argument("--lk", type=int, default=21)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float16")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--sm-scale", type=float, default=0.3)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args(argv)
    if not numba_attn.SIMULATOR:
        print("SKIP: a GPU is visible; this script stresses the simulator's thread interleavings")
        return 0

    rng = np.random.default_rng(args.lq * 100 + args.lk)  # (test_flash_backward's seed)
    q = rng.standard_normal((1, args.heads, args.lq, args.head_dim)).astype(args.dtype)
    k, v = (rng.standard_normal((1, args.kv_heads, args.lk, args.head_dim)).astype(args.dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(args.dtype)
    options = dict(causal=args.causal, sm_scale=args.sm_scale)
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    out, lse = out.astype(args.dtype), lse.astype(np.float32)
    refs = reference.attention_backward(dout, q, k, v, **options)

    def call():
        return numba_attn.flash_backward(dout, q, k, v, out, lse, deterministic=args.deterministic, **options)

    first = call()
    draw = random.Random(args.seed)
    package = os.path.join(ROOT, "numba_attn") + os.sep

    def traced_line(frame, event, arg):
        if event == "line" and draw.random() < args.switch:
            time.sleep(draw.choice((0.0, 0.0, 1e-5, 1e-4)))
        return traced_line

    def tracer(frame, event, arg):  # only numba_attn code (the kernels' bodies), only in the simulator's threads
        return traced_line if frame.f_code.co_filename.startswith(package) else None

    threading.settrace(tracer)
    failed = False
    try:
        for run in range(args.runs):
            start = time.time()
            grads = call()
            errors = [_rel(g, r) for g, r in zip(grads, refs)]
            same = all(np.array_equal(g.view(np.uint8), f.view(np.uint8)) for g, f in zip(grads, first))
            bad = not same or max(errors) >= TOLERANCE[args.dtype]
            failed |= bad
            print(f"{'DIFFERS' if not same else 'FAIL' if bad else 'PASS'} run {run}: dq {errors[0]:.3g} "
                  f"dk {errors[1]:.3g} dv {errors[2]:.3g} ({time.time() - start:.1f} s)", flush=True)
    finally:
        threading.settrace(None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
