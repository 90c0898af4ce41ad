"""Startup and host time: what a user's script pays before its first answer, and per call after that.

* ``import``: seconds to import torch (or CuPy), then numba_attn on top, in a fresh process;
* ``first call``: per public function, a fresh process imports, makes small inputs and times its first call to a
  synchronised result, once with empty caches (``NUMBA_CACHE_DIR`` and ``NUMBA_ATTN_CACHE_DIR`` in a new temporary
  directory per family) and once more with the caches that run left (warm);
* ``host time``: per call of every function with tiny inputs queued back to back (the GPU never waits: the time is
  the host's), beside torch SDPA's in the same process.

    python scripts/startup.py [--only import,first,host] [--library torch|cupy] [--calls 300] [--json FILE]
                              [--cases decode,sdpa]   # only the cases whose names hold one of these (first
                                                      # calls: or of that cache family, e.g. linear_backward)

Run on a GPU. Each fresh process inherits this one's environment apart from the cache directories.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

#: name -> (family, code making inputs and calling the function once; ``lib`` is torch or cupy, ``mk(shape,
#: dtype)`` makes random inputs)
CASES = {
    "flash_forward fp16": ("forward", "a = [mk((4, 16, 4096, 128), 'float16') for _ in range(3)]; "
                                      "f = lambda: numba_attn.flash_forward(*a, causal=True)"),
    "flash_forward fp32": ("forward_fp32", "a = [mk((1, 8, 1024, 64), 'float32') for _ in range(3)]; "
                                           "f = lambda: numba_attn.flash_forward(*a)"),
    "flash_decode fp16": ("decode", "q = mk((8, 32, 1, 128), 'float16'); k, v = (mk((8, 8, 8192, 128), 'float16') "
                                    "for _ in range(2)); f = lambda: numba_attn.flash_decode(q, k, v)"),
    "combine_lse": ("decode", "o, l = mk((4, 2, 8, 1, 128), 'float32'), mk((4, 2, 8, 1), 'float32'); "
                              "f = lambda: numba_attn.combine_lse(o, l)"),
    "causal_dot_product fp16": ("linear", "a = [mk((4, 8, 4096, 64), 'float16') for _ in range(3)]; "
                                          "f = lambda: numba_attn.causal_dot_product(*a)"),
    "linear_attention fp16": ("linear", "a = [mk((4, 8, 4096, 64), 'float16') for _ in range(3)]; "
                                        "f = lambda: numba_attn.linear_attention(*a)"),
    # (inputs made, and the forwards the backward needs run, before the timed first call)
    "flash_forward_varlen fp16": ("varlen", "a = [mk((4096, 16, 128), 'float16') for _ in range(3)]; "
                                            "cu = np.array([0, 1000, 3000, 4096], np.int32); "
                                            "f = lambda: numba_attn.flash_forward_varlen(*a, cu, cu, causal=True)"),
    "flash_backward fp16": ("backward", "a = [mk((4, 16, 4096, 128), 'float16') for _ in range(4)]; "
                                        "o, l = numba_attn.flash_forward(*a[:3], causal=True, return_lse=True); "
                                        "f = lambda: numba_attn.flash_backward(a[3], *a[:3], o, l, causal=True)"),
    "causal_dot_product_backward fp16": ("linear_backward",
                                         "a = [mk((4, 8, 4096, 64), 'float16') for _ in range(4)]; "
                                         "f = lambda: numba_attn.causal_dot_product_backward(a[3], *a[:3])"),
    "linear_attention_backward fp16": ("linear_backward",
                                       "a = [mk((4, 8, 4096, 64), 'float16') for _ in range(4)]; "
                                       "f = lambda: numba_attn.linear_attention_backward(a[3], *a[:3])"),
}

_CHILD = """
import time, json, sys
t0 = time.perf_counter()
import {lib} as lib
t1 = time.perf_counter()
import numba_attn
t2 = time.perf_counter()
import numpy as np
rng = np.random.default_rng(0)
def mk(shape, dtype):
    x = rng.standard_normal(shape).astype(dtype)
    return lib.as_tensor(x, device="cuda") if "{lib}" == "torch" else lib.asarray(x)
def sync():
    lib.cuda.synchronize() if "{lib}" == "torch" else lib.cuda.Device().synchronize()
{setup}
sync()
t3 = time.perf_counter()
f()
sync()
t4 = time.perf_counter()
f()
sync()
t5 = time.perf_counter()
print("RESULT " + json.dumps({{"import_lib": t1 - t0, "import_numba_attn": t2 - t1, "first": t4 - t3,
                              "second": t5 - t4}}))
"""


def _child(lib: str, setup: str, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache, "numba"), NUMBA_ATTN_CACHE_DIR=os.path.join(cache, "na"))
    code = _CHILD.format(lib=lib, setup=textwrap.dedent(setup))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _selected(name: str, family: str, only: str | None) -> bool:
    """Whether ``--cases`` takes this case: a part of it in the case's name or its family (all without ``--cases``)."""
    return not only or any(part in name or part == family for part in only.split(","))


def first_calls(lib: str, only: str | None = None) -> dict:
    results, caches = {}, {}
    with tempfile.TemporaryDirectory() as root:
        for name, (family, setup) in CASES.items():
            if not _selected(name, family, only):
                continue
            cache = caches.setdefault(family, os.path.join(root, family))
            empty = _child(lib, setup, cache)
            warm = _child(lib, setup, cache)
            results[name] = {"empty": empty, "warm": warm}
            print(f"{name:28s} import {lib} {warm['import_lib']:5.2f} s, numba_attn {warm['import_numba_attn']:5.2f} s"
                  f" | first call: empty caches {empty['first']:6.2f} s, warm {warm['first']:6.2f} s"
                  f" | second call {warm['second'] * 1e3:7.1f} ms", flush=True)
    return results


def _host_cases(lib: str):
    import numpy as np

    import numba_attn

    rng = np.random.default_rng(0)
    if lib == "torch":
        import torch

        def mk(shape, dtype):
            return torch.as_tensor(rng.standard_normal(shape).astype(dtype), device="cuda")

        def ints(values):
            return torch.as_tensor(np.asarray(values, np.int32), device="cuda")
    else:
        import cupy

        def mk(shape, dtype):
            return cupy.asarray(rng.standard_normal(shape).astype(dtype))

        def ints(values):
            return cupy.asarray(np.asarray(values, np.int32))

    q16, k16, v16 = (mk((1, 2, 128, 64), "float16") for _ in range(3))
    q32, k32, v32 = (mk((1, 2, 128, 64), "float32") for _ in range(3))
    qd = mk((1, 8, 1, 128), "float16")
    kd, vd = (mk((1, 8, 1024, 128), "float16") for _ in range(2))
    ql, kl, vl = (mk((1, 2, 256, 64), "float16") for _ in range(3))
    o_parts, lse_parts = mk((4, 1, 8, 1, 128), "float32"), mk((4, 1, 8, 1), "float32")
    # a paged cache of 1024 keys (64 pages of 16) with device cache_seqlens and block table, as a server keeps it
    kp, vp = (mk((64, 16, 8, 128), "float16") for _ in range(2))
    table, lengths = ints(np.arange(64).reshape(1, 64)), ints([1000])
    cases = {
        "flash_forward fp16 causal": lambda: numba_attn.flash_forward(q16, k16, v16, causal=True),
        "flash_forward fp32": lambda: numba_attn.flash_forward(q32, k32, v32),
        "flash_decode fp16": lambda: numba_attn.flash_decode(qd, kd, vd),
        "flash_decode fp16 paged": lambda: numba_attn.flash_decode(qd, kp, vp, cache_seqlens=lengths,
                                                                   block_table=table),
        "combine_lse": lambda: numba_attn.combine_lse(o_parts, lse_parts),
        "causal_dot_product fp16": lambda: numba_attn.causal_dot_product(ql, kl, vl),
        "linear_attention fp16": lambda: numba_attn.linear_attention(ql, kl, vl),
    }
    if lib == "torch":
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v, causal):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        # plain calls (the backend context costs host time of its own): torch picks flash for these
        cases["torch sdpa forward fp16 causal"] = lambda: F.scaled_dot_product_attention(q16, k16, v16, is_causal=True)
        cases["torch sdpa decode fp16"] = lambda: F.scaled_dot_product_attention(qd, kd, vd)
        sdpa(q16, k16, v16, True)
    return cases


def host_times(lib: str, calls: int, only: str | None = None) -> dict:
    cases = _host_cases(lib)
    if only:
        cases = {name: fn for name, fn in cases.items() if any(part in name for part in only.split(","))}
    if lib == "torch":
        import torch

        sync = torch.cuda.synchronize
    else:
        import cupy

        sync = cupy.cuda.Device().synchronize
    results = {}
    for name, fn in cases.items():
        for _ in range(10):
            fn()
        sync()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        results[name] = best
        print(f"host time per call  {name:34s} {best:7.1f} us", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="first,host")
    parser.add_argument("--library", default="torch", choices=("torch", "cupy"))
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cases", default=None, help="only the cases whose names hold one of these (comma-separated; "
                        "first calls: or whose cache family is one of them, e.g. linear_backward)")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    report = {"library": args.library}
    if "first" in parts:
        report["first_calls"] = first_calls(args.library, args.cases)
    if "host" in parts:
        report["host_us"] = host_times(args.library, args.calls, args.cases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
