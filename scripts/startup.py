"""Startup and host time: what a user's script pays before its first answer, and per call after that.

* ``import``: seconds to import torch (or CuPy), then numba_attn on top, in a fresh process;
* ``first call``: per public function, a fresh process imports, makes small inputs and times its first call to a
  synchronised result, once with empty caches (``NUMBA_CACHE_DIR`` and ``NUMBA_ATTN_CACHE_DIR`` in a new temporary
  directory per family) and once more with the caches that run left (warm);
* ``host time``: per call of every public function with tiny inputs queued back to back (``queued``: the larger of
  the host's and the GPU's time per call), beside torch SDPA's in the same process. With torch, each case also
  gives ``host`` (the calls queued while a sleeping kernel holds the GPU: the host's time alone), ``gpu`` (CUDA
  events around calls that run back to back after the sleep: the GPU's time alone) and whether its repeated calls
  replay a plan (``runtime.replay``; ``flash_decode``: ``decode.cached``) or take the checked path, and why.
  ``--linear-min-rows N`` adds the non-causal ``linear_attention`` case once more with the recurrent passes' old
  ``min_rows_per_block`` (an A/B in one process).

    python scripts/startup.py [--only import,first,host] [--library torch|cupy] [--calls 300] [--json FILE]
                              [--cases decode,sdpa]   # only the cases whose names hold one of these (first
                                                      # calls: or of that cache family, e.g. linear_backward)
                              [--linear-min-rows 256]

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

    q16, k16, v16, do16 = (mk((1, 2, 128, 64), "float16") for _ in range(4))
    q32, k32, v32 = (mk((1, 2, 128, 64), "float32") for _ in range(3))
    qd = mk((1, 8, 1, 128), "float16")
    kd, vd = (mk((1, 8, 1024, 128), "float16") for _ in range(2))
    ql, kl, vl, dol = (mk((1, 2, 256, 64), "float16") for _ in range(4))
    o_parts, lse_parts = mk((4, 1, 8, 1, 128), "float32"), mk((4, 1, 8, 1), "float32")
    # a paged cache of 1024 keys (64 pages of 16) with device cache_seqlens and block table, as a server keeps it
    kp, vp = (mk((64, 16, 8, 128), "float16") for _ in range(2))
    table, lengths = ints(np.arange(64).reshape(1, 64)), ints([1000])
    # three packed sequences of 256 tokens, the offsets on the host (their values key the plan) and on the device
    qv, kv, vv, dov = (mk((256, 2, 64), "float16") for _ in range(4))
    cu_host = np.array([0, 100, 130, 256], np.int32)
    cu_device = ints(cu_host)
    o16, lse16 = numba_attn.flash_forward(q16, k16, v16, causal=True, return_lse=True)
    ov, lsev = numba_attn.flash_forward_varlen(qv, kv, vv, cu_host, cu_host, causal=True, return_lse=True)
    cases = {
        "flash_forward fp16 causal": lambda: numba_attn.flash_forward(q16, k16, v16, causal=True),
        "flash_forward fp32": lambda: numba_attn.flash_forward(q32, k32, v32),
        "flash_forward_varlen fp16 host cu": lambda: numba_attn.flash_forward_varlen(qv, kv, vv, cu_host, cu_host,
                                                                                     causal=True),
        "flash_forward_varlen fp16 device cu": lambda: numba_attn.flash_forward_varlen(
            qv, kv, vv, cu_device, cu_device, max_seqlen_q=126, max_seqlen_k=126, causal=True),
        "flash_backward fp16 causal": lambda: numba_attn.flash_backward(do16, q16, k16, v16, o16, lse16, causal=True),
        "flash_backward_varlen fp16 host cu": lambda: numba_attn.flash_backward_varlen(
            dov, qv, kv, vv, ov, lsev, cu_host, cu_host, causal=True),
        "flash_decode fp16": lambda: numba_attn.flash_decode(qd, kd, vd),
        "flash_decode fp16 paged": lambda: numba_attn.flash_decode(qd, kp, vp, cache_seqlens=lengths,
                                                                   block_table=table),
        "combine_lse": lambda: numba_attn.combine_lse(o_parts, lse_parts),
        "causal_dot_product fp16": lambda: numba_attn.causal_dot_product(ql, kl, vl),
        "causal_dot_product_backward fp16": lambda: numba_attn.causal_dot_product_backward(dol, ql, kl, vl),
        "linear_attention fp16": lambda: numba_attn.linear_attention(ql, kl, vl),
        "linear_attention fp16 causal": lambda: numba_attn.linear_attention(ql, kl, vl, causal=True),
        "linear_attention_backward fp16": lambda: numba_attn.linear_attention_backward(dol, ql, kl, vl),
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


def _replay_status(fn) -> str:
    """Whether repeated calls of ``fn`` replay a plan: ``replays k/3`` over three calls after a first one, and what
    that first call's recording came to (``replay.last_outcome``; flash_decode keeps plans of its own)."""
    from numba_attn.decode import cached
    from numba_attn.runtime import replay

    replay.clear()
    cached.clear()
    replay._local.outcome = None
    fn()
    outcome = replay.last_outcome() or "not recorded"
    used = []
    originals = replay.Plan.run, cached.DecodePlan.run
    replay.Plan.run = lambda self, layouts: used.append(1) or originals[0](self, layouts)
    cached.DecodePlan.run = lambda self, layouts: used.append(1) or originals[1](self, layouts)
    try:
        for _ in range(3):
            fn()
    finally:
        replay.Plan.run, cached.DecodePlan.run = originals
    return f"replays {len(used)}/3 ({outcome})"


def _split_times(torch, fn, calls: int) -> tuple:
    """``(host us, gpu us)`` per call: ``calls`` calls queued behind a sleeping kernel (the host's time alone, while
    the queue has room: at most ``calls`` x launches per call), with CUDA events around them (they then run back to
    back: the GPU's time alone). Best of three."""
    host = gpu = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # ~0.1 s at 1.98 GHz: longer than the host needs to queue the calls
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        host = min(host, (t1 - t0) / calls * 1e6)
        gpu = min(gpu, start.elapsed_time(end) * 1e3 / calls)
    return host, gpu


def host_times(lib: str, calls: int, only: str | None = None, linear_min_rows: int | None = None) -> dict:
    cases = _host_cases(lib)
    if linear_min_rows is not None:
        cases[f"linear_attention fp16 [min_rows_per_block={linear_min_rows}]"] = cases["linear_attention fp16"]
    if only:
        cases = {name: fn for name, fn in cases.items() if any(part in name for part in only.split(","))}
    torch = None
    if lib == "torch":
        import torch

        sync = torch.cuda.synchronize
    else:
        import cupy

        sync = cupy.cuda.Device().synchronize
    results = {}
    for name, fn in cases.items():
        restore = _linear_rows(linear_min_rows) if "min_rows_per_block" in name else None
        try:
            status = "-" if name.startswith("torch") else _replay_status(fn)
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
            line = f"host time per call  {name:44s} queued {best:7.1f} us"
            results[name] = {"queued": best, "replay": status}
            if torch is not None:
                host, gpu = _split_times(torch, fn, 50)
                results[name].update(host=host, gpu=gpu)
                line += f" | host {host:6.1f} us | gpu {gpu:7.1f} us"
            print(f"{line} | {status}", flush=True)
        finally:
            if restore is not None:
                restore()
    return results


def _linear_rows(rows: int):
    """Run the recurrent non-causal passes with ``min_rows_per_block = rows`` (plans forgotten before and after);
    returns the undo."""
    import dataclasses

    from numba_attn.linear import recurrent_plan
    from numba_attn.runtime import replay

    before = recurrent_plan.GPU_CONFIG
    recurrent_plan.GPU_CONFIG = dataclasses.replace(before, min_rows_per_block=rows)
    replay.clear()

    def restore():
        recurrent_plan.GPU_CONFIG = before
        replay.clear()

    return restore


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="first,host")
    parser.add_argument("--library", default="torch", choices=("torch", "cupy"))
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cases", default=None, help="only the cases whose names hold one of these (comma-separated; "
                        "first calls: or whose cache family is one of them, e.g. linear_backward)")
    parser.add_argument("--linear-min-rows", type=int, default=None,
                        help="host times: also the non-causal linear_attention with this min_rows_per_block")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    report = {"library": args.library}
    if "first" in parts:
        report["first_calls"] = first_calls(args.library, args.cases)
    if "host" in parts:
        report["host_us"] = host_times(args.library, args.calls, args.cases, args.linear_min_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
