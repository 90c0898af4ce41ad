"""Host time per public call: how long the Python side of each numba_attn function takes at sizes where the GPU
work is negligible, with Numba's own launch, with the cached launcher (`_launch.FAST_LAUNCH = True`), and with that
launcher and the decode plans (`_decode_plan.ENABLED = True`: repeated tensor-core `flash_decode` calls skip the
checks; the other functions do not use them).

Each case makes its inputs once (torch or CuPy), warms up, then times ``--calls`` back-to-back calls with a wall
clock and one synchronise at the end: with kernels of a few microseconds the GPU keeps up and the time per call is
the host's. ``--profile`` prints the functions that take the host time for one case (cProfile).

    python scripts/host_overhead.py [--calls 300] [--library torch cupy] [--profile causal_dot_product]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np

import numba_attn
from numba_attn.decode import cached as _decode_plan
from numba_attn.runtime import device as _device
from numba_attn.runtime import launch as _launch

#: (column title, FAST_LAUNCH, decode plans)
MODES = (("numba launch", False, False), ("fast launch", True, False), ("fast + plans", True, True))


def _cases(library: str):
    """name -> (function, args, kwargs): small inputs of ``library``."""
    rng = np.random.default_rng(0)
    if library == "torch":
        import torch

        def make(shape, dtype):
            return torch.as_tensor(rng.standard_normal(shape).astype(dtype), device="cuda")
    else:
        import cupy

        def make(shape, dtype):
            return cupy.asarray(rng.standard_normal(shape).astype(dtype))

    small = (1, 2, 128, 64)
    q16, k16, v16 = (make(small, np.float16) for _ in range(3))
    q32, k32, v32 = (make(small, np.float32) for _ in range(3))
    qd = make((1, 8, 1, 128), np.float16)
    kd, vd = (make((1, 8, 4096, 128), np.float16) for _ in range(2))
    ql, kl, vl = (make((1, 2, 1024, 64), np.float16) for _ in range(3))
    qg = make((1, 32, 1, 128), np.float16)
    kg, vg = (make((1, 4, 4096, 128), np.float16) for _ in range(2))
    o_parts = make((4, 1, 8, 1, 128), np.float32)
    lse_parts = make((4, 1, 8, 1), np.float32)
    return {
        "flash_forward fp16": (numba_attn.flash_forward, (q16, k16, v16), {"causal": True}),
        "flash_forward fp32 simt": (numba_attn.flash_forward, (q32, k32, v32), {}),
        "flash_decode fp16": (numba_attn.flash_decode, (qd, kd, vd), {}),
        "flash_decode fp16 GQA 8 (tensor cores)": (numba_attn.flash_decode, (qg, kg, vg), {}),
        "combine_lse": (numba_attn.combine_lse, (o_parts, lse_parts), {}),
        "causal_dot_product chunked": (numba_attn.causal_dot_product, (ql, kl, vl), {"backend": "chunked"}),
        "causal_dot_product recurrent": (numba_attn.causal_dot_product, (ql, kl, vl), {"backend": "recurrent"}),
        "linear_attention chunked": (numba_attn.linear_attention, (ql, kl, vl), {"backend": "chunked", "causal": True}),
    }


def _sync(library: str):
    if library == "torch":
        import torch

        torch.cuda.synchronize()
    else:
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def _per_call_us(fn, args, kwargs, calls: int, library: str) -> float:
    for _ in range(5):
        fn(*args, **kwargs)
    _sync(library)
    best = float("inf")
    for _ in range(3):  # best of three rounds: the host is shared with nothing, but the first round warms caches
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args, **kwargs)
        _sync(library)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--library", nargs="+", default=["torch", "cupy"])
    parser.add_argument("--profile", default=None, help="case name prefix to profile with cProfile (fast launch)")
    parser.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    parser.add_argument("--lines", type=int, default=18, help="profile lines to print")
    args = parser.parse_args()
    if numba_attn.SIMULATOR:
        raise SystemExit("host_overhead.py needs a GPU")
    print(f"{'case':40s} {'library':8s}" + "".join(f" {title:>14s}" for title, _, _ in MODES) + f" {'saved':>8s}")
    for library in args.library:
        for name, (fn, fargs, kwargs) in _cases(library).items():
            times = []
            for _, fast, plans in MODES:
                _launch.FAST_LAUNCH, _decode_plan.ENABLED = fast, plans
                times.append(_per_call_us(fn, fargs, kwargs, args.calls, library))
            print(f"{name:40s} {library:8s}" + "".join(f" {t:11.1f} us" for t in times)
                  + f" {times[0] / times[-1]:7.2f}x", flush=True)
        _launch.FAST_LAUNCH, _decode_plan.ENABLED = True, True
        if args.profile:
            for name, (fn, fargs, kwargs) in _cases(library).items():
                if name.startswith(args.profile):
                    profiler = cProfile.Profile()
                    profiler.enable()
                    for _ in range(args.calls):
                        fn(*fargs, **kwargs)
                    _sync(library)
                    profiler.disable()
                    text = io.StringIO()
                    pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.lines)
                    print(f"\nprofile of {args.calls} calls: {name} ({library})\n{text.getvalue()}")
                    break
    _launch.FAST_LAUNCH, _decode_plan.ENABLED = True, True


if __name__ == "__main__":
    main()
