"""Check and time the backward of the causal dot product and of the linear-attention layer.

    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/check_linear_backward.py --compile-only
    python scripts/check_linear_backward.py            # on a GPU: correctness at real sizes, then timing

--compile-only  no GPU: sm_90 PTX of the kernels the backward adds (the layer's small kernels, the plain
                non-causal products, the walks of the normaliser's 4-column operands, the fused walks of
                ``chunked_backward.FUSED``), then ``ptxas -v``.
correctness     ``causal_dot_product_backward`` (chunked: float16, bfloat16, float32 as 3xTF32 and tf32; initial
                state and dstate) and ``linear_attention_backward`` (causal and not) against float64 references,
                next to the error of torch autograd through a naive implementation in the same dtype. PASS when ours
                is at most twice torch's error or within the usual bound (float32 1e-5, float16 2e-3, bfloat16 1e-2;
                tf32 5e-3).
timing          B=4 H=8 E=M=64 N=16k float16 (``--seqlens`` / ``--dtypes`` / ``--batch`` / ``--heads`` change it): median ms of our
                forward and backward, and fla's ``chunk_linear_attn(scale=1, normalize=False)`` forward and
                backward when fla imports; our layer's forward and backward.

Every line starts with PASS, FAIL, ERROR or INFO; exit status 0 when nothing failed.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if path not in sys.path:
        sys.path.insert(0, path)

#: where the tensors live (a module constant: the script's functions also run on CPU tensors under the simulator,
#: at tiny sizes, to check the script itself)
DEVICE = "cuda"
BOUND = {"float32": 1e-5, "tf32": 5e-3, "float16": 2e-3, "bfloat16": 1e-2}


def say(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# --compile-only
# ---------------------------------------------------------------------------------------------------------------------
def _specs():
    """(name, python function, argument types, launch bounds) of every kernel to compile."""
    from numba import types

    from numba_attn.linear import layer_backward as lb
    from numba_attn.linear import mma_f32, recurrent, shared_state
    from numba_attn.linear.chunk_plan import APPLY, CAUSAL, STATES
    from numba_attn.linear.recurrent_plan import APPLY as R_APPLY
    from numba_attn.linear.recurrent_plan import REDUCE, plan

    f32 = types.Array(types.float32, 4, "A")
    u16 = types.Array(types.uint16, 4, "A")
    cfg = lb.GPU_CONFIG
    specs = []
    for dtype in ("float16", "bfloat16", "float32"):
        raw = f32 if dtype == "float32" else u16
        for key_sums in (True, False):  # non-causal (the normaliser from column sums) / causal
            tag = f"{dtype} key_sums={key_sums}"
            specs.append((f"prepare {tag}", lb.prepare_kernel(dtype, cfg.threads, cfg.row_threads, not key_sums),
                          (raw, raw, raw, f32, f32, f32, f32), (cfg.threads, lb.ROW_KERNEL_BLOCKS)))
            specs.append((f"rows {tag}", lb.rows_kernel(dtype, cfg.row_threads, cfg.rows_per_block, key_sums),
                          (f32, f32, raw, types.float32, f32, f32), (cfg.row_threads * cfg.rows_per_block,)))
            specs.append((f"finish {tag}", lb.finish_kernel(dtype, cfg.threads, cfg.row_threads, key_sums),
                          (f32, f32, raw, raw, f32, f32, raw, raw, f32, raw, f32), (cfg.threads, lb.ROW_KERNEL_BLOCKS)))
    from numba_attn.linear import column_sums

    warps = column_sums.GPU_CONFIG.warps
    specs.append(("column_sums", column_sums.column_sums_kernel(warps), (f32, f32, types.boolean, f32, types.int64),
                  (32 * warps, column_sums.BLOCKS_PER_SM)))
    # the plain non-causal products of the layer's backward (shared-state kernel without feature map / normaliser):
    # E = M = 64 and 256, and the normaliser's four columns (layer_backward.NONCAUSAL_KEY_SUMS = False only)
    config = shared_state.GPU_CONFIG
    for e, m in ((64, 64), (256, 256), (64, 4), (4, 64)):
        tiles = shared_state._fitting_tiles(config, e, m, False, 227 * 1024)
        for mode in (STATES, APPLY):
            for split in (True, False):
                name = f"shared_state plain E={e} M={m} mode={mode} split={split}"
                specs.append((name, shared_state.kernel_source(tiles, mode, "float32", split, False, True),
                              shared_state.signature("float32").args, (32 * tiles.warps, tiles.min_blocks)))
    # the float32 register walks of the normaliser's products (E' or M' = 4)
    for e, m in ((64, 4), (4, 64)):
        for terms in (1, 3):
            tiles = mma_f32.tiles_for(mma_f32.GPU_CONFIG, e, m, terms)
            for mode in (CAUSAL, STATES):
                specs.append((f"mma_f32 E={e} M={m} terms={terms} mode={mode}",
                              mma_f32.kernel_source(tiles, mode, True), mma_f32.SIGNATURE.args,
                              (32 * tiles.warps, tiles.min_blocks)))
    # the backward's walks as problems of one launch (chunked_backward.FUSED): STATES of two, CAUSAL of three with
    # the dk walk borrowing the dv walk's increments, CAUSAL of two (no dv: the layer's normaliser), E = M = 64
    from numba_attn.linear import mma
    from numba_attn.linear.register_launch import signature

    for problems, borrow, mode in ((2, False, STATES), (3, True, CAUSAL), (2, False, CAUSAL)):
        for dtype in ("float16", "bfloat16"):
            tiles = mma.tiles_for(mma.GPU_CONFIG, 64, 64)
            specs.append((f"mma {dtype} problems={problems} borrow={borrow} mode={mode}",
                          mma.kernel_source(tiles, mode, dtype == "bfloat16", True, problems, borrow),
                          signature(types.uint16, problems).args, (32 * tiles.warps, tiles.min_blocks)))
        for terms in (1, 3):
            tiles = mma_f32.tiles_for(mma_f32.GPU_CONFIG, 64, 64, terms)
            specs.append((f"mma_f32 terms={terms} problems={problems} borrow={borrow} mode={mode}",
                          mma_f32.kernel_source(tiles, mode, True, problems, borrow),
                          signature(types.float32, problems).args, (32 * tiles.warps, tiles.min_blocks)))
    # the recurrent plain non-causal passes
    for e, m in ((64, 64), (64, 4), (4, 64)):
        for mode in (REDUCE, R_APPLY):
            p = plan(e, m, mode, False, 1)
            kernel = recurrent.row_walk_kernel(p.layout, mode, False, False)
            f3 = types.Array(types.float32, 4, "A")
            specs.append((f"recurrent plain E={e} M={m} mode={mode}", kernel,
                          (f3, f3, f3, f3, f3, types.float32, types.int64, f3, f3), (p.layout.threads,)))
    return specs


def compile_only(args) -> int:
    import numba_attn  # noqa: F401
    from numba_attn.runtime.device import SIMULATOR, cuda

    if SIMULATOR:
        say("ERROR compile-only needs NUMBA_ENABLE_CUDASIM=0 (Numba's compiler, no GPU needed)")
        return 1
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:  # device functions ask the current device for its compute capability; there is none
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    ptxas = shutil.which("ptxas") or "/usr/local/bin/ptxas"
    failed = 0
    for name, fn, argtypes, bounds in _specs():
        if args.only and args.only not in name:
            continue
        try:
            t0 = time.time()
            py_func = getattr(fn, "py_func", fn)
            src, _ = cuda.compile_ptx(py_func, argtypes, cc=(9, 0), launch_bounds=bounds)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "k.ptx")
                with open(path, "w") as f:
                    f.write(src)
                res = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                                     capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(res.stderr[-2000:])
            info = " | ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                              if "Used" in line or "spill" in line)
            clean = "0 bytes spill stores" in res.stderr
            failed += not clean
            say(f"{'PASS' if clean else 'FAIL'} compile {name}: {info} ({time.time() - t0:.0f}s)")
        except Exception as exc:  # noqa: BLE001
            failed += 1
            say(f"ERROR compile {name}: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------------
# GPU: correctness
# ---------------------------------------------------------------------------------------------------------------------
def _rel(got, ref) -> float:
    import numpy as np

    got = np.asarray(got, np.float64)
    if np.isnan(got).any():
        return float("inf")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _host(x):
    import torch

    return x.detach().float().cpu().double().numpy() if isinstance(x, torch.Tensor) else x


def _naive_cdp(q, k, v, s0):
    """The causal dot product in torch, quadratic, in the inputs' dtype (float32 for the state term)."""
    import torch

    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, 0)
    out = scores @ v
    if s0 is not None:
        out = out + (q.float() @ s0).to(q.dtype)
    return out


def _naive_layer(q, k, v, causal, eps):
    import torch

    phi_q = torch.nn.functional.elu(q) + 1
    phi_k = torch.nn.functional.elu(k) + 1
    if causal:
        num = _naive_cdp(phi_q, phi_k, v, None)
        den = (phi_q * phi_k.cumsum(-2)).sum(-1, keepdim=True) + eps
    else:
        num = phi_q @ (phi_k.transpose(-1, -2) @ v)
        den = (phi_q * phi_k.sum(-2, keepdim=True)).sum(-1, keepdim=True) + eps
    return num / den


def _torch_grads(fn, inputs, dout):
    import torch

    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, dout)


def _verdict(label, ours, torch_errs, bound) -> bool:
    worst = 0
    fails = []
    for name, err, terr in zip(("dq", "dk", "dv", "dS0"), ours, torch_errs + [None] * 4):
        # torch's error counts when finite (a naive float16 normaliser overflows at a few thousand rows)
        limit = max(bound, 2 * terr) if terr is not None and math.isfinite(terr) else bound
        if not err <= limit:
            fails.append(name)
        worst = max(worst, err)
    text = " ".join(f"{n}={e:.2e}" + (f"(torch {t:.2e})" if t is not None else "")
                    for n, e, t in zip(("dq", "dk", "dv", "dS0"), ours, torch_errs + [None] * 4))
    say(f"{'FAIL' if fails else 'PASS'} {label}: {text}")
    return bool(fails)


#: causal_dot_product_backward cases: (label, dtype, allow_tf32, B, H, N, E, M, states); bound by label's first word
PRODUCT_CASES = [
    ("float16", "float16", False, 1, 2, 16384, 64, 64, False),
    ("float16", "float16", False, 2, 2, 4097, 64, 64, True),
    ("bfloat16", "bfloat16", False, 1, 2, 4096, 64, 64, False),
    ("float32", "float32", False, 1, 2, 4096, 64, 64, True),
    ("tf32", "float32", True, 1, 2, 4096, 64, 64, False),
    ("float16 E=M=256 (shared-state kernel)", "float16", False, 1, 1, 2000, 256, 256, True),
]
#: linear_attention_backward cases: (dtype, B, H, Nq, Nk, E, M, causal)
LAYER_CASES = [
    ("float16", 1, 2, 4096, 4096, 64, 64, True),
    ("float16", 1, 2, 3000, 5000, 64, 64, False),
    ("bfloat16", 1, 2, 4096, 4096, 64, 64, True),
    ("float32", 1, 2, 4096, 4096, 64, 64, True),
]


def _product_case(case):
    import torch

    import numba_attn
    import reference

    label, dtype, tf32, b, h, n, e, m, states = case
    name = f"causal_dot_product_backward {label} B{b} H{h} N{n} E{e} M{m} states={states}"
    t = getattr(torch, dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(n + e)
    q, k = (torch.randn(b, h, n, e, device=DEVICE, generator=gen).to(t) for _ in range(2))
    v, g = (torch.randn(b, h, n, m, device=DEVICE, generator=gen).to(t) for _ in range(2))
    s0 = torch.randn(b, h, e, m, device=DEVICE, generator=gen) if states else None
    ds = torch.randn(b, h, e, m, device=DEVICE, generator=gen) if states else None
    ours = numba_attn.causal_dot_product_backward(g, q, k, v, initial_state=s0, dstate=ds, allow_tf32=tf32,
                                                  backend="chunked")
    host = [_host(x) for x in (g, q, k, v)]
    refs = reference.causal_dot_product_backward_chunked(*host, chunk_size=256, initial_state=_host(s0),
                                                         dstate=_host(ds))
    errs = [_rel(_host(x), r) for x, r in zip(ours, refs)]
    terrs = []
    if not states:  # torch's error: autograd of the naive product in the same dtype (states are float32)
        naive = _torch_grads(lambda q, k, v: _naive_cdp(q, k, v, None), (q, k, v), g)
        terrs = [_rel(_host(x), r) for x, r in zip(naive, refs)]
    return name, errs, terrs, BOUND[label.split()[0]]


def _layer_case(case):
    import torch

    import numba_attn
    import reference

    dtype, b, h, nq, nk, e, m, causal = case
    name = f"linear_attention_backward {dtype} B{b} H{h} Nq{nq} Nk{nk} E{e} M{m} causal={causal}"
    t = getattr(torch, dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(nq + nk)
    q = torch.randn(b, h, nq, e, device=DEVICE, generator=gen).to(t)
    k = torch.randn(b, h, nk, e, device=DEVICE, generator=gen).to(t)
    v = torch.randn(b, h, nk, m, device=DEVICE, generator=gen).to(t)
    g = torch.randn(b, h, nq, m, device=DEVICE, generator=gen).to(t)
    ours = numba_attn.linear_attention_backward(g, q, k, v, causal=causal, backend="chunked")
    refs = reference.linear_attention_backward(*(_host(x) for x in (g, q, k, v)), causal=causal)
    errs = [_rel(_host(x), r) for x, r in zip(ours, refs)]
    naive = _torch_grads(lambda q, k, v: _naive_layer(q, k, v, causal, 1e-6), (q, k, v), g)
    terrs = [_rel(_host(x), r) for x, r in zip(naive, refs)]
    return name, errs, terrs, BOUND[dtype]


def _run_case(kind_case):
    """One case in a worker process: (name, errors, torch's errors, bound) or (name, exception text)."""
    kind, case = kind_case
    try:
        return (_product_case if kind == "product" else _layer_case)(case)
    except Exception as exc:  # noqa: BLE001
        return (f"{kind} {case}", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")


def part_correctness(args) -> int:
    """Every case in its own process, ``--workers`` at a time: the first call of each kernel compiles it (seconds,
    one core), so the cases compile in parallel; the compiled kernels land in the kernel cache, where the timing
    part (this process) finds them."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [("product", c) for c in PRODUCT_CASES] + [("layer", c) for c in LAYER_CASES]
    failed = 0
    workers = args.workers or min(len(jobs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for result in pool.map(_run_case, jobs):
            if len(result) == 2:
                failed += 1
                say(f"ERROR {result[0]}: {result[1]}")
            else:
                failed += _verdict(*result)
    return failed


# ---------------------------------------------------------------------------------------------------------------------
# GPU: timing
# ---------------------------------------------------------------------------------------------------------------------
def _time(fn, reps: int) -> float:
    from _timing import median_ms

    return median_ms(fn, reps, warmup=3)


def _timing_case(b, h, n, d, dtype, reps, with_layer):
    """Median ms of our forward and backward and fla's, one (dtype, N); the layer's too when ``with_layer``."""
    import torch

    import numba_attn

    q, k, v, g = (torch.randn(b, h, n, d, device=DEVICE, dtype=dtype) for _ in range(4))
    rows = [("ours causal_dot_product forward", _time(lambda: numba_attn.causal_dot_product(q, k, v), reps)),
            ("ours causal_dot_product_backward (chunked)",
             _time(lambda: numba_attn.causal_dot_product_backward(g, q, k, v), reps))]
    try:
        from bench.peers import fla_linear

        tq, tk, tv, tg = (fla_linear.to_fla_layout(x) for x in (q, k, v, g))
        leaves = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv)]

        def fla_forward():
            with torch.no_grad():
                fla_linear.chunk_linear_attn(*leaves, scale=1.0, normalize=False)

        out = fla_linear.chunk_linear_attn(*leaves, scale=1.0, normalize=False)[0]

        def fla_backward():
            torch.autograd.grad(out, leaves, tg, retain_graph=True)

        rows.append(("fla chunk_linear_attn forward", _time(fla_forward, reps)))
        rows.append(("fla chunk_linear_attn backward", _time(fla_backward, reps)))
    except Exception as exc:  # noqa: BLE001
        say(f"INFO fla not timed ({dtype}, N {n}): {type(exc).__name__}: {exc}")
    if with_layer:
        rows.append(("ours linear_attention forward causal",
                     _time(lambda: numba_attn.linear_attention(q, k, v, causal=True), reps)))
        rows.append(("ours linear_attention_backward causal",
                     _time(lambda: numba_attn.linear_attention_backward(g, q, k, v, causal=True), reps)))
    return dict(rows)


def part_timing(args) -> int:
    """One line per (dtype, N): our forward / backward against fla's; backward time over fla's (<= 1.0 is the
    target of issue #28). The layer is timed at the last length only."""
    import torch

    b, h, d = args.batch, args.heads, 64
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    seqlens = [int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in args.seqlens.split(",")]
    for name in args.dtypes.split(","):
        for n in seqlens:
            t = _timing_case(b, h, n, d, dtypes[name], args.reps, with_layer=n == seqlens[-1] and name == "fp16")
            fla = t.get("fla chunk_linear_attn backward")
            ratio = f"{t['ours causal_dot_product_backward (chunked)'] / fla:.2f}" if fla else "n/a"
            fla_text = (f"fla fwd {t['fla chunk_linear_attn forward']:.3f} bwd {fla:.3f}" if fla else "fla n/a")
            say(f"INFO time B{b} H{h} N{n} D{d} {name}: ours fwd {t['ours causal_dot_product forward']:.3f} bwd "
                f"{t['ours causal_dot_product_backward (chunked)']:.3f} ms; {fla_text} ms; bwd ours/fla {ratio}")
            for key in ("ours linear_attention forward causal", "ours linear_attention_backward causal"):
                if key in t:
                    say(f"INFO time B{b} H{h} N{n} D{d} {name} {key}: {t[key]:.3f} ms")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--only", default="", help="--compile-only: kernels whose name contains this")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seqlens", default="16k", help="timing: lengths, e.g. 1k,2k,4k,8k,16k")
    parser.add_argument("--dtypes", default="fp16", help="timing: fp16,bf16,fp32")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--workers", type=int, default=0,
                        help="processes for the correctness cases (0: one per case, at most one per CPU)")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only(args)
    import numba_attn

    if numba_attn.SIMULATOR:
        say("ERROR needs a GPU (running under the simulator); --compile-only works without one")
        return 1
    t0 = time.time()
    failed = 0 if args.skip_correctness else part_correctness(args)
    say(f"INFO correctness took {time.time() - t0:.0f}s")
    failed += part_timing(args)
    say(f"INFO total {time.time() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
