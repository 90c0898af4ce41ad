"""Time the backward of the causal dot product (and of the linear-attention layer) by variant, on a GPU.

    python scripts/time_linear_backward.py --seqlens 1k,4k,16k --dtypes fp16,bf16,fp32 [--layer] [--host-profile]

B=4 H=8 E=M=64 (``--batch`` / ``--heads`` / ``--dim``). For every (dtype, N) the variants are timed in ``--rounds``
interleaved rounds (so that drift of the machine hits them alike); per variant one line::

    T fp16 N4096 ours         call 0.402 ms (min 0.398)  gpu 0.151 ms in 6 kernels (span 0.160)  host 0.210 ms

``call``: median over the rounds of the median time of a call between CUDA events, one synchronise per call (the
measure of ``check_linear_backward.py`` and issue #28); ``gpu``: the kernels' own time in one call (torch profiler,
CUPTI sees our kernels) and their span; ``host``: wall time of the call's Python side, the GPU idle before it.
Variants: ``ours`` (``causal_dot_product_backward`` as dispatched: three separate walks, replayed from its plan),
``unplanned`` (the same on the checked path every call: ``runtime.replay.ENABLED = False``, the code before this
branch), ``fused`` (``chunked_backward.FUSED``: the walks as problems of two launches), ``chunked`` / ``recurrent``
(``backend=``, at N <= 2k: where the dispatch threshold sits), ``tf32`` / ``fused-tf32`` (float32 with
``allow_tf32``), ``split`` (float32 3xTF32: the fused STATES launch, then one walking launch per walk,
``chunked_backward.SPLIT_3XTF32``), ``fla`` (fla's
``chunk_linear_attn(scale=1, normalize=False)`` backward through autograd), ``fp16-data`` (bfloat16 cases: the
float16 kernels on the same data). ``CHECK`` lines compare the gradients of
the variants of one precision with ``ours`` (relative norm of the difference). ``--layer``: the kernels of one
``linear_attention_backward`` call (causal, and the default non-causal one, also through the ones block's
products: ``layer_backward.NONCAUSAL_KEY_SUMS = False``) in order with their times. ``--host-profile``: cProfile of the
backward's host side (fp16, the first N).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import median_ms  # noqa: E402

DTYPES = ("fp16", "bf16", "fp32")


def say(line: str) -> None:
    print(line, flush=True)


def _torch_dtype(name):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _switch(fused, planned: bool = True, split: bool = False):
    """A setter of ``chunked_backward.FUSED`` / ``SPLIT_3XTF32`` and of replayed calls (``runtime.replay.ENABLED``);
    None where the module has no FUSED switch and ``fused`` is False."""
    from numba_attn.linear import chunked_backward
    from numba_attn.runtime import replay

    if not hasattr(chunked_backward, "FUSED") and not fused:
        return None

    def set_it():
        chunked_backward.FUSED = fused
        chunked_backward.SPLIT_3XTF32 = split
        replay.ENABLED = planned

    return set_it


def variants(dtype: str, n: int, q, k, v, g):
    """name -> (setup or None, fn returning the gradients)."""
    import numba_attn

    bwd = numba_attn.causal_dot_product_backward
    out = {"ours": (_switch(False), lambda: bwd(g, q, k, v))}  # the default: separate walks, replayed
    out["unplanned"] = (_switch(False, False), lambda: bwd(g, q, k, v))  # every call on the checked path
    out["fused"] = (_switch(True), lambda: bwd(g, q, k, v))
    if dtype == "fp32":
        out["tf32"] = (_switch(False), lambda: bwd(g, q, k, v, allow_tf32=True))
        out["fused-tf32"] = (_switch(True), lambda: bwd(g, q, k, v, allow_tf32=True))
        out["split"] = (_switch(True, split=True), lambda: bwd(g, q, k, v))  # 3xTF32: a walking launch per walk
    if dtype == "bf16":  # the float16 kernels on the same data, interleaved: does bfloat16 itself cost time?
        halves = [x.half() for x in (g, q, k, v)]
        out["fp16-data"] = (_switch(False), lambda: bwd(*halves))
    if n <= 2048:
        out["chunked"] = (_switch(False), lambda: bwd(g, q, k, v, backend="chunked"))
        if dtype != "bf16":
            out["recurrent"] = (_switch(False), lambda: bwd(g, q, k, v, backend="recurrent"))
    try:
        import torch
        from bench.peers import fla_linear

        leaves = [fla_linear.to_fla_layout(x).detach().clone().requires_grad_(True) for x in (q, k, v)]
        tg = fla_linear.to_fla_layout(g)
        o = fla_linear.chunk_linear_attn(*leaves, scale=1.0, normalize=False)[0]
        out["fla"] = (None, lambda: torch.autograd.grad(o, leaves, tg, retain_graph=True))
    except Exception as exc:  # noqa: BLE001
        say(f"INFO fla not timed: {type(exc).__name__}: {exc}")
    return out


def _call_ms(fn, reps: int) -> float:
    return median_ms(fn, reps, warmup=0)


def _host_ms(fn, reps: int) -> float:
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def _kernels(fn):
    """[(name, start us, duration us)] of the kernels one call runs, in order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.events():
        if evt.device_type.name == "CUDA" and "memcpy" not in evt.name.lower() and "memset" not in evt.name.lower():
            rows.append((evt.name, evt.time_range.start, evt.time_range.end - evt.time_range.start))
    return sorted(rows, key=lambda r: r[1])


def _short(name: str) -> str:
    """A readable kernel name: the length-prefixed pieces of Numba's mangled name (``_ZN6cudapy10numba_attn...``)."""
    if "::" in name:  # demangled by the profiler: numba_attn::linear::state::walk_kernel::_3clocals_3e::kernel[abi..
        parts = [p for p in name.split("[")[0].split("::") if p not in ("numba_attn", "linear", "_3clocals_3e")]
        return ".".join(parts)[:70]
    if not name.startswith("_ZN"):
        return name[:70]
    parts, i = [], 3
    while i < len(name) and name[i].isdigit():
        j = i
        while j < len(name) and name[j].isdigit():
            j += 1
        size = int(name[i:j])
        parts.append(name[j:j + size])
        i = j + size
    keep = [p for p in parts if p not in ("cudapy", "numba_attn", "linear", "_3clocals_3e") and not p.startswith("B")]
    return ".".join(keep)[:70]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def case(dtype: str, n: int, args) -> None:
    import torch

    torch.manual_seed(n)
    b, h, d = args.batch, args.heads, args.dim
    q, k, v, g = (torch.randn(b, h, n, d, device="cuda", dtype=_torch_dtype(dtype)) for _ in range(4))
    table = variants(dtype, n, q, k, v, g)
    results = {}
    for name, (setup, fn) in table.items():  # warm up (compiles) and keep the gradients
        if setup:
            setup()
        for _ in range(3):
            grads = fn()
        results[name] = [x for x in grads[:3]]
    for name in table:  # against the variant of the same precision
        ref = "tf32" if name.endswith("tf32") else "ours"
        if name in ("ours", "tf32", "fla", "fp16-data"):
            continue
        say(f"CHECK {dtype} N{n} {name} vs {ref}: " + " ".join(
            f"{x}={_rel(a, r):.1e}" for x, a, r in zip(("dq", "dk", "dv"), results[name], results[ref])))
    calls = {name: [] for name in table}
    for _ in range(args.rounds):
        for name, (setup, fn) in table.items():
            if setup:
                setup()
            calls[name].append(_call_ms(fn, args.reps))
    for name, (setup, fn) in table.items():
        if setup:
            setup()
        host = _host_ms(fn, args.reps)
        kernels = _kernels(fn)
        gpu = sum(r[2] for r in kernels) / 1e3
        span = (kernels[-1][1] + kernels[-1][2] - kernels[0][1]) / 1e3 if kernels else 0.0
        say(f"T {dtype} N{n} {name:13s} call {statistics.median(calls[name]):.3f} ms (min {min(calls[name]):.3f})  "
            f"gpu {gpu:.3f} ms in {len(kernels)} kernels (span {span:.3f})  host {host:.3f} ms")
        if args.kernels and name in ("ours", "unfused"):  # (replayed calls launch what the checked path did)
            say("    " + "; ".join(f"{_short(r[0])} {r[2]:.0f}us" for r in kernels))
    _switch(False)()


def _key_sums(on: bool):
    """A setter of ``layer_backward.NONCAUSAL_KEY_SUMS`` (the non-causal normaliser from column sums, or from the
    ones block's products) and of the switches ``_switch`` sets (replayed, not fused); None where the module has no
    such switch."""
    from numba_attn.linear import layer_backward

    if not hasattr(layer_backward, "NONCAUSAL_KEY_SUMS"):
        return None
    plain = _switch(False)

    def set_it():
        plain()
        layer_backward.NONCAUSAL_KEY_SUMS = on

    return set_it


def layer(n: int, args) -> None:
    """The layer's forward and backward (fp16): causal (the backward also unfused on the checked path,
    ``unplanned``, and fused), and non-causal (the default: the normaliser from column sums, and through the ones
    block's products, ``products``, where this version has the switch): call ms, and the kernels of the default
    backwards in order. The variants of each ``causal`` are timed in interleaved rounds."""
    import torch

    import numba_attn

    q, k, v, g = (torch.randn(args.batch, args.heads, n, args.dim, device="cuda", dtype=torch.float16)
                  for _ in range(4))
    causal = lambda: numba_attn.linear_attention_backward(g, q, k, v, causal=True)  # noqa: E731
    noncausal = lambda: numba_attn.linear_attention_backward(g, q, k, v)  # noqa: E731
    groups = (
        (("forward", _switch(False), lambda: numba_attn.linear_attention(q, k, v, causal=True)),
         ("backward", _switch(False), causal), ("backward unplanned", _switch(False, False), causal),
         ("backward fused", _switch(True), causal)),
        (("noncausal forward", _switch(False), lambda: numba_attn.linear_attention(q, k, v)),
         ("noncausal backward", _key_sums(True) or _switch(False), noncausal))
        + ((("noncausal backward products", _key_sums(False), noncausal),) if _key_sums(False) else ()),
    )
    reference = None
    for cases in groups:
        for label, setup, fn in cases:  # warm up (compiles); the non-causal gradients of the variants compared
            setup()
            for _ in range(3):
                grads = fn()
            if label.startswith("noncausal backward"):
                if reference is None:
                    reference = [x.float() for x in grads]
                else:
                    say(f"CHECK fp16 N{n} layer {label} vs noncausal backward: " + " ".join(
                        f"{x}={_rel(a, r):.1e}" for x, a, r in zip(("dq", "dk", "dv"), grads, reference)))
        calls = {label: [] for label, _, _ in cases}
        for _ in range(args.rounds):
            for label, setup, fn in cases:
                setup()
                calls[label].append(_call_ms(fn, args.reps))
        for label, setup, fn in cases:
            setup()
            kernels = _kernels(fn)
            say(f"L fp16 N{n} layer {label}: call {statistics.median(calls[label]):.3f} ms (min "
                f"{min(calls[label]):.3f}), gpu {sum(r[2] for r in kernels) / 1e3:.3f} ms in {len(kernels)} kernels, "
                f"host {_host_ms(fn, args.reps):.3f} ms")
            if label in ("backward", "noncausal backward", "noncausal backward products"):
                say("    " + "; ".join(f"{_short(name)} {dur:.0f}us" for name, _, dur in kernels))
    _switch(False)()
    if _key_sums(True):
        _key_sums(True)()


def host_profile(n: int, args) -> None:
    import torch

    import numba_attn

    q, k, v, g = (torch.randn(args.batch, args.heads, n, args.dim, device="cuda", dtype=torch.float16)
                  for _ in range(4))
    for _ in range(3):
        numba_attn.causal_dot_product_backward(g, q, k, v)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(100):
        numba_attn.causal_dot_product_backward(g, q, k, v)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    say("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-3000:])


def _warm(job) -> str:
    """One (dtype, variant) at N = 2048 in a worker process: its kernels compile there, in parallel with the others,
    and land in the kernel cache, where the timing process finds them."""
    dtype, name, args = job
    try:
        import torch

        q, k, v, g = (torch.randn(args.batch, args.heads, 2048, args.dim, device="cuda", dtype=_torch_dtype(dtype))
                      for _ in range(4))
        setup, fn = variants(dtype, 2048, q, k, v, g)[name]
        if setup:
            setup()
        fn()
        if name == "ours" and args.layer and dtype == "fp16":
            import numba_attn

            numba_attn.linear_attention(q, k, v, causal=True)
            numba_attn.linear_attention_backward(g, q, k, v, causal=True)
            numba_attn.linear_attention(q, k, v)
            for on in (True, False):  # the non-causal normaliser both ways (layer())
                setter = _key_sums(on)
                if setter:
                    setter()
                    numba_attn.linear_attention_backward(g, q, k, v)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # noqa: BLE001
        return f"INFO warm-up {dtype} {name}: {type(exc).__name__}: {exc}"


def warm_up(dtypes, args) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    names = ("ours", "tf32", "fused", "fused-tf32", "split", "recurrent", "fp16-data")
    jobs = [(d, name, args) for d in dtypes for name in names
            if (not name.endswith("tf32") or d == "fp32") and not (name == "recurrent" and d == "bf16")
            and (name != "split" or d == "fp32") and (name != "fp16-data" or d == "bf16")]
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_warm, jobs):
            if line and "KeyError" not in line:
                say(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="1k,4k,16k")
    parser.add_argument("--dtypes", default="fp16,bf16,fp32", help="'none': only --layer / --host-profile")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--kernels", action="store_true", help="list the kernels of ours / unfused")
    parser.add_argument("--layer", action="store_true", help="the layer's backward (causal and not) at the last N, "
                        "kernel by kernel")
    parser.add_argument("--host-profile", action="store_true")
    parser.add_argument("--no-warm-up", action="store_true", help="skip the parallel compile step")
    args = parser.parse_args()
    import numba_attn

    if numba_attn.SIMULATOR:
        say("ERROR needs a GPU")
        return 1
    t0 = time.time()
    seqlens = [int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in args.seqlens.split(",")]
    if not args.no_warm_up and args.dtypes != "none":
        warm_up(args.dtypes.split(","), args)
        say(f"INFO warm-up (parallel compiles) took {time.time() - t0:.0f}s")
    dtypes = [] if args.dtypes == "none" else args.dtypes.split(",")
    for dtype in dtypes:
        for n in seqlens:
            case(dtype, n, args)
    if args.layer:
        layer(seqlens[-1], args)
    if args.host_profile:
        host_profile(seqlens[0], args)
    say(f"INFO total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
