"""GPU check of the float32 tensor-core backward (``flash_backward(..., backend="tf32")``): correctness, then speed.

    python scripts/check_backward_tf32.py                        # PASS/FAIL lines, then the timing table (< 3 min)
    python scripts/check_backward_tf32.py --configs w8m32c,w4m32 # also time these tiles (tf32.GPU_CANDIDATES)
    python scripts/check_backward_tf32.py --skip-correctness --seqlens 2k,4k,8k
    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/check_backward_tf32.py --compile-only

warm-up      the kernels both parts use are compiled first in parallel worker processes (each runs a small call of
             the same specialisations; the kernel cache on disk hands them to this process).
correctness  float32 torch CUDA tensors: gradients against the float64 reference (``reference.attention_backward``),
             bounded by twice the error of torch's own float32 SDPA backward (memory-efficient backend) on the same
             inputs (1e-5 where torch's cannot run: rows that see no key); ``allow_tf32=True`` bounded by 5e-3.
             Causal or not, GQA, Lq != Lk both ways, lengths no tile divides, head dims 16..256, strided inputs,
             deterministic (two calls bitwise equal) or not.
timing       B=--batch, (D=64, H=48) and (D=128, H=32), N = --seqlens, causal or not: median ms of ``flash_backward``
             as 3xTF32 (the default), one tf32 term (``allow_tf32``), the SIMT kernels (``backend="simt"``; fewer
             calls), and torch SDPA's memory-efficient float32 backward (``torch.autograd.grad`` of one recorded
             forward). TFLOP/s count 2.5 x the forward's 4 B H N^2 D (halved when causal); ``x eff``: torch's time / ours.
--compile-only  no GPU: every key-block and query-block specialisation (head dims 64 / 128 / 256, 3xTF32 or one term,
             atomic dQ or not, vector loads or not, the sm_90 vector reductions or not) compiled for sm_90 and
             assembled by ``ptxas -v`` (registers, spills, stack).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from _timing import median_ms  # noqa: E402
from check_backward import parse_size, say  # noqa: E402


def compile_only(configs) -> int:
    import numba_attn  # noqa: F401
    from numba_attn.runtime.device import SIMULATOR, cuda

    if SIMULATOR:
        say("ERROR --compile-only needs NUMBA_ENABLE_CUDASIM=0 (Numba's compiler, no GPU needed)")
        return 1
    import shutil
    import subprocess
    import tempfile

    import numba.cuda.dispatcher as dispatcher

    from numba_attn.backward import tf32, tf32_kernels

    class _Sm90:
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    ptxas = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")

    def assemble(ptx_src):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx_src)
            res = subprocess.run([ptxas, "-arch=sm_90", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(res.stderr.strip()[:2000])
            return " | ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                              if "Used" in line or "spill" in line)

    failed = 0
    for name, config in configs:
        for d_pad in (64, 128, 256):
            cfg = tf32.gpu_config(d_pad) if config is None else config
            if cfg.shared_bytes(d_pad) > 227 * 1024:
                say(f"SKIP compile {name} d{d_pad}: {cfg.shared_bytes(d_pad)} bytes of shared memory (sm_90: 227 KB)")
                continue
            jobs = []
            for tf32_only in (False, True):
                for want_dv, want_dk in tf32.key_block_passes(cfg, d_pad):
                    # (atomic dQ, sm_90 vector reductions, vector loads): the GPU's, then the others once each
                    combos = [(True, True, True), (False, False, True)] if want_dk else [(False, False, True)]
                    if not tf32_only:
                        combos += [(True, False, True), (True, True, False)] if want_dk else [(False, False, False)]
                    for atomic, vred, vector in combos:
                        label = (f"key d{d_pad} 1x={int(tf32_only)} dv={int(want_dv)} dk={int(want_dk)} "
                                 f"atomic={int(atomic)} v2red={int(vred)} vector={int(vector)}")
                        jobs.append((label, tf32_kernels.key_block_source(
                            cfg, d_pad, tf32_only, vector, want_dv, want_dk, atomic, vred),
                            tf32.KEY_SIGNATURE, cfg.key_launch_bounds()))
                for vector in ((True, False) if not tf32_only else (True,)):
                    jobs.append((f"query d{d_pad} 1x={int(tf32_only)} vector={int(vector)}",
                                 tf32_kernels.query_block_source(cfg, d_pad, tf32_only, vector), tf32.QUERY_SIGNATURE,
                                 cfg.query_launch_bounds()))
            for label, source, signature, bounds in jobs:
                try:
                    t0 = time.time()
                    ptx_src, _ = cuda.compile_ptx(source, signature.args, cc=(9, 0), launch_bounds=bounds)
                    info = f"{ptx_src.count('mma.sync')} mma | {assemble(ptx_src)} | {time.time() - t0:.0f} s"
                    say(f"PASS compile {name} {label}: {info}")
                except Exception as exc:  # noqa: BLE001
                    failed += 1
                    say(f"ERROR compile {name} {label}: {type(exc).__name__}: {str(exc)[:1500]}")
    say(f"{'ALL COMPILED' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


#: (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic, layout, allow_tf32)
CASES = [
    (2, 4, 2, 1000, 777, 64, False, False, "contig", False),
    (2, 4, 2, 1000, 777, 64, True, True, "contig", False),
    (2, 4, 4, 777, 1000, 128, True, False, "contig", False),
    (1, 8, 1, 2048, 2048, 128, False, True, "contig", False),
    (1, 2, 1, 1, 300, 128, False, False, "contig", False),
    (1, 2, 2, 129, 3, 64, True, False, "contig", False),  # rows 0..125 see no key
    (1, 4, 2, 333, 555, 36, True, False, "blhd", False),
    (1, 2, 1, 300, 513, 96, True, True, "contig", False),
    (1, 2, 1, 300, 513, 256, True, False, "contig", False),
    (1, 2, 1, 513, 300, 256, False, True, "blhd", False),
    (1, 2, 1, 300, 300, 16, True, False, "contig", False),
    (1, 8, 2, 1000, 1000, 20, False, False, "contig", False),  # 80-byte rows: the element-wise loaders
    (2, 4, 2, 1000, 777, 64, True, False, "contig", True),
    (1, 4, 4, 777, 1000, 128, False, True, "contig", True),
]
TF32_BOUND = 5e-3
FP32_BOUND = 1e-5


def _inputs(torch, b, h, hk, lq, lk, d, seed, layout="contig"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, lq, d, device="cuda", generator=g)
    k = torch.randn(b, hk, lk, d, device="cuda", generator=g)
    v = torch.randn(b, hk, lk, d, device="cuda", generator=g)
    dout = torch.randn(b, h, lq, d, device="cuda", generator=g)
    if layout == "blhd":  # strided: memory (batch, seqlen, heads, headdim)
        q, k, v, dout = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, dout))
    return q, k, v, dout


def _warm_case(case, small: bool):
    """A worker process: run ``case`` (or its timing twin) once on short sequences, which compiles (or loads) the same
    kernel specialisations the real call takes and leaves them in the kernel cache on disk."""
    import torch

    import numba_attn

    t0 = time.time()
    if small:  # correctness: the same layout, head dims and flags, 64 rows at most
        b, h, hk, lq, lk, d, causal, det, layout, tf32_1x = case
        q, k, v, dout = _inputs(torch, 1, h, hk, min(lq, 64), min(lk, 64), d, 0, layout)
        out = torch.zeros_like(q)
        lse = torch.zeros(q.shape[:3], device="cuda")
        numba_attn.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, backend="tf32",
                                  allow_tf32=tf32_1x)
    else:  # timing: (d, h, causal, variant)
        d, h, causal, kwargs = case
        q, k, v, dout = _inputs(torch, 1, h, h, 128, 128, d, 0)
        out, lse = numba_attn.flash_forward(q, k, v, causal=causal, return_lse=True)
        numba_attn.flash_backward(dout, q, k, v, out, lse, causal=causal, **kwargs)
    torch.cuda.synchronize()
    return f"{case[:9] if small else case} {time.time() - t0:.0f}s"


def warm(args, timing_variants) -> None:
    import concurrent.futures
    import multiprocessing

    jobs = []
    if not args.skip_correctness:
        jobs += [(case, True) for case in CASES]
    if not args.skip_timing:
        for d, h in ((64, 48), (128, 32)):
            for label, kwargs in timing_variants:
                # (simt: causality is compile-time; tf32: the causal forward of the timing's out and lse)
                for causal in ((False, True) if label in ("simt", "tf32") else (False,)):
                    jobs.append(((d, h, causal, kwargs), False))
    t0 = time.time()
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_warm_case, *job) for job in jobs]
        errors = 0
        for f in futures:
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - the real call reports it again
                errors += 1
                say(f"INFO warm-up: {type(exc).__name__}: {str(exc)[:300]}")
    say(f"INFO warm-up: {len(jobs)} calls compiled in {workers} processes, {time.time() - t0:.0f} s"
        + (f" ({errors} failed)" if errors else ""))


def _errors(got, refs):
    import numpy as np

    out = []
    for g, r in zip(got, refs):
        g = g.double().cpu().numpy()
        denom = np.linalg.norm(r)
        out.append(float("inf") if not np.isfinite(g).all() else float(np.linalg.norm(g - r) / max(denom, 1e-30)))
    return out


def correctness(args, torch) -> int:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_attn
    import reference

    failed = 0
    for b, h, hk, lq, lk, d, causal, det, layout, tf32_1x in CASES:
        name = (f"fp32 B{b} H{h}/{hk} Lq{lq} Lk{lk} D{d} causal={int(causal)} det={int(det)} {layout}"
                f"{' allow_tf32' if tf32_1x else ''}")
        try:
            q, k, v, dout = _inputs(torch, b, h, hk, lq, lk, d, lq * 7 + lk, layout)
            exact = [x.double().cpu().numpy() for x in (dout, q, k, v)]
            out, lse = reference.attention(*exact[1:], causal=causal, return_lse=True)
            out = torch.tensor(out, device="cuda", dtype=torch.float32)
            if layout == "blhd":
                out = out.transpose(1, 2).contiguous().transpose(1, 2)
            lse = torch.tensor(lse, device="cuda", dtype=torch.float32)
            first = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det,
                                              backend="tf32", allow_tf32=tf32_1x)
            torch.cuda.synchronize()
            refs = reference.attention_backward(*exact, causal=causal)
            ours = _errors(first, refs)
            repeat = ""
            if det:
                second = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True,
                                                   backend="tf32", allow_tf32=tf32_1x)
                same = all(torch.equal(x, y) for x, y in zip(first, second))
                repeat = " repeat " + ("bitwise equal" if same else "DIFFERS")
                if not same:
                    ours = [float("inf")] * 3
            theirs = None
            if not tf32_1x and not (causal and lq > lk):  # (torch gives NaN for rows that see no key)
                try:
                    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
                    mask = None
                    if causal:
                        mask = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(lk - lq)
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        o = F.scaled_dot_product_attention(qq, kk.repeat_interleave(h // hk, 1),
                                                           vv.repeat_interleave(h // hk, 1), attn_mask=mask)
                        theirs = _errors(torch.autograd.grad(o, (qq, kk, vv), dout), refs)
                except Exception:  # noqa: BLE001
                    theirs = None
            fixed = TF32_BOUND if tf32_1x else FP32_BOUND
            bounds = [2 * x for x in theirs] if theirs else [fixed] * 3
            ok = all(e <= bnd for e, bnd in zip(ours, bounds))
            detail = "errors dq/dk/dv " + " ".join(f"{e:.1e}" for e in ours) + (
                "  torch-eff " + " ".join(f"{x:.1e}" for x in theirs) if theirs else f"  bound {fixed:.0e}")
            say(f"{'PASS' if ok else 'FAIL'} correct {name}: {detail}{repeat}")
            failed += not ok
        except Exception as exc:  # noqa: BLE001
            failed += 1
            say(f"ERROR correct {name}: {type(exc).__name__}: {str(exc)[:500]}")
        if time.time() > args.deadline:
            say("SKIP correct: time budget used up")
            break
    torch.cuda.empty_cache()
    return failed


def timing(args, torch, variants) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_attn
    from numba_attn.backward import tf32

    names = [label for label, _ in variants] + ["sdpa-eff"]
    say(f"INFO timing: TFLOP/s (ms), float32, B={args.batch}; x eff = sdpa-eff ms / ours (3xTF32 default) ms")
    say(f"{'case':28s} " + " ".join(f"{n:>16s}" for n in names))
    default_config = tf32.default_config
    for d, h in ((64, 48), (128, 32)):
        for causal in (False, True):
            for n in args.seqlens:
                if time.time() > args.deadline:
                    say("SKIP timing: time budget used up")
                    return
                b = args.batch
                flops = 2.5 * 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
                q, k, v, dout = _inputs(torch, b, h, h, n, n, d, n)
                out, lse = numba_attn.flash_forward(q, k, v, causal=causal, return_lse=True)
                cells, ms_of = [], {}
                for label, kwargs in variants:
                    kwargs = dict(kwargs)
                    config = kwargs.pop("config", None)
                    reps = args.reps if kwargs.get("backend") != "simt" else max(2, args.reps // 4)
                    if kwargs.get("backend") == "simt" and n > args.simt_max:
                        cells.append(f"{'-':>16s}")
                        continue
                    try:
                        if config is not None:
                            tf32.default_config = lambda head_dim=128, _c=config: _c
                        ms = median_ms(lambda: numba_attn.flash_backward(
                            dout, q, k, v, out, lse, causal=causal, **kwargs), reps)
                        ms_of[label] = ms
                        cells.append(f"{flops / ms / 1e9:7.1f} ({ms:6.2f})")
                    except Exception as exc:  # noqa: BLE001
                        cells.append(f"{'error':>16s}")
                        say(f"ERROR timing {label} D{d} N{n}: {type(exc).__name__}: {str(exc)[:300]}")
                    finally:
                        tf32.default_config = default_config
                ratio = ""
                try:
                    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                        theirs = median_ms(lambda: torch.autograd.grad(o, (qq, kk, vv), dout,
                                                                               retain_graph=True), args.reps)
                    cells.append(f"{flops / theirs / 1e9:7.1f} ({theirs:6.2f})")
                    if "tf32" in ms_of:
                        ratio = f"  {theirs / ms_of['tf32']:.2f}x eff"
                    del o, qq, kk, vv
                except Exception as exc:  # noqa: BLE001
                    cells.append(f"{'n/a':>16s}")
                    say(f"INFO timing sdpa-eff: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                case = f"D{d} H{h} N{n} {'causal' if causal else 'full'}"
                say(f"{case:28s} " + " ".join(f"{c:>16s}" for c in cells) + ratio)
                del q, k, v, dout, out, lse
                torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="", help="comma-separated names of tf32.GPU_CANDIDATES to time too")
    parser.add_argument("--seqlens", default="1k,2k,4k", help="timing sequence lengths [1k,2k,4k]")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--simt-max", type=parse_size, default=2048, help="longest N the SIMT kernels are timed at")
    parser.add_argument("--budget", type=float, default=175.0, help="seconds for the whole run [175]")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--no-warm", action="store_true", help="no parallel compile first")
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU: compile every specialisation for sm_90 and run ptxas -v (NUMBA_ENABLE_CUDASIM=0)")
    args = parser.parse_args()
    args.deadline = time.time() + args.budget
    args.seqlens = [parse_size(s) for s in args.seqlens.split(",") if s.strip()]
    start = time.time()

    from numba_attn.backward import tf32

    picked = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in picked if n not in tf32.GPU_CANDIDATES]
    if unknown:
        say(f"ERROR --configs: unknown {unknown}; choose from {', '.join(tf32.GPU_CANDIDATES)}")
        return 2
    if args.compile_only:
        return compile_only([("default", None)] + [(n, tf32.GPU_CANDIDATES[n]) for n in picked])
    variants = [("tf32", {}), ("tf32x1", {"allow_tf32": True}), ("simt", {"backend": "simt"})]
    variants += [(f"tf32:{n}", {"config": tf32.GPU_CANDIDATES[n]}) for n in picked]

    import torch

    if not torch.cuda.is_available():
        say("ERROR needs a CUDA GPU and torch with CUDA")
        return 1
    say(f"INFO device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if not args.no_warm:
        warm(args, [(label, kw) for label, kw in variants if "config" not in kw])
    failed = 0
    if not args.skip_correctness:
        failed = correctness(args, torch)
        say(f"INFO correctness: {len(CASES) - failed} of {len(CASES)} passed ({time.time() - start:.0f} s)")
    if not args.skip_timing:
        timing(args, torch, variants)
    say(f"total {time.time() - start:.0f} s; {'ALL PASSED' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
