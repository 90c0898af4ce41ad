"""GPU check of the tensor-core backwards (``flash_backward(..., backend="wgmma" | "mma")``): correctness, then speed.

    python scripts/check_backward.py                    # the issue-#28 command: PASS/FAIL lines, then the table
    python scripts/check_backward.py --dtypes bfloat16 --skip-correctness
    python scripts/check_backward.py --configs w8m64,w4m64 --wgmma-configs g2m64s3,g2m128 --seqlens 2k,8k
    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/check_backward.py --compile-only

precompile   every kernel the run will use compiled first by --jobs processes at once (tiny calls on the GPU), into
             the on-disk kernel cache (``runtime.kernel_cache``), so the run itself only loads them.
correctness  torch CUDA tensors, float16 and bfloat16, each backend of --backends on each case it takes: gradients
             against the float64 reference (``reference.attention_backward``) with the bound twice the error of
             torch's own SDPA backward in the same dtype on the same inputs (fp16 2e-3 / bf16 1e-2 where torch's
             cannot run); causal or not, GQA, Lq != Lk both ways, lengths 1..4096 that no tile divides, head dims
             16..256, strided inputs, deterministic (two calls bitwise equal) or not.
timing       B=4, (D=64, H=48) and (D=128, H=32), N = --seqlens, causal or not, each of --dtypes: median of --reps
             calls (CUDA events) of ``flash_backward`` for each backend of --backends (its default tiles, then each of
             --configs for "mma" and --wgmma-configs for "wgmma") against torch SDPA's flash, cuDNN and efficient
             backends' backward (``torch.autograd.grad`` of one recorded forward); TFLOP/s count 2.5 x the
             forward's 4 B H N^2 D (halved when causal). The last column: the best of ours over torch's flash (> 1:
             faster than FlashAttention-2) and over "mma".
--compile-only  no GPU: every kernel specialisation of "mma" (float16 / bfloat16, head dims 64 / 128 / 256, atomic
             dQ or not, vector loads or not, the sm_90 vector reductions or not, the query-block kernel) compiled for
             sm_90 and assembled by ``ptxas -v`` (registers, spills), and of "wgmma" (head dims 64 / 128, atomic dQ or
             not) for sm_90a, with ptxas's warnings (C7513: wgmma serialised). Causality is a run-time flag.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)

from _timing import median_ms  # noqa: E402
from backward_compile import compile_only  # noqa: E402


def say(*args):
    print(*args, flush=True)


def parse_size(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


# ---------------------------------------------------------------------------------------------------------------------
# precompile: fill the on-disk kernel cache from several processes at once
# ---------------------------------------------------------------------------------------------------------------------
def _use_config(module, config) -> None:
    """Make ``config`` ``module``'s default tiles (None: leave them)."""
    if config is not None:
        module.default_config = lambda head_dim=128, _c=config: _c


def _warm(job) -> str:
    """One tiny call of each kernel a (backend, dtype, head dim, deterministic, tiles) combination launches (and the
    forward that the timing runs), in a process of its own."""
    backend, dtype, d, det, config_name = job
    start = time.time()
    try:
        import torch

        import numba_attn
        from numba_attn.backward import mma, wgmma, wgmma_ws

        module = {"wgmma": wgmma, "wgmma_ws": wgmma_ws}.get(backend, mma)
        chosen = os.environ.get("CHECK_BACKWARD_WGMMA_DEFAULT")
        if chosen:  # --wgmma-default, in a spawned worker
            wgmma.GPU_CONFIG_64 = wgmma.GPU_CONFIG_128 = wgmma.GPU_CANDIDATES[chosen]
        chosen = os.environ.get("CHECK_BACKWARD_WS_DEFAULT")
        if chosen:  # --ws-default
            wgmma_ws.DEFAULT_CONFIG = wgmma_ws.GPU_CANDIDATES[chosen]
        if config_name:
            _use_config(module, module.GPU_CANDIDATES[config_name])

        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        q, k, v, dout = (torch.randn(1, 2, 200, d, device="cuda").to(tdt) for _ in range(4))
        out, lse = numba_attn.flash_forward(q, k, v, causal=True, return_lse=True)
        numba_attn.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=det, backend=backend)
        torch.cuda.synchronize()
        return f"{backend}:{config_name} {dtype} d{d} det={int(det)}: {time.time() - start:.0f} s"
    except Exception as exc:  # noqa: BLE001
        return f"{backend}:{config_name} {dtype} d{d} det={int(det)}: {type(exc).__name__}: {str(exc)[:200]}"


def precompile(args, backends, columns) -> None:
    import concurrent.futures as futures
    import multiprocessing

    jobs = set()
    for dtype in ("float16", "bfloat16") if not args.skip_correctness else args.dtypes:
        for d in ((64, 128, 32, 96, 16, 256) if not (args.skip_correctness or args.quick) else (64, 128)):
            for backend in backends:
                for det in ((False, True) if not args.skip_correctness else (False,)):
                    if _takes(backend, dtype, d) and (backend, d) != ("mma", 16):
                        jobs.add((backend, dtype, d, det, ""))
    for name, backend, _, config in columns:  # the other tiles timed
        if config is not None:
            for dtype in args.dtypes:
                for d in (64, 128):
                    jobs.add((backend, dtype, d, False, name.split(":", 1)[1]))
    start = time.time()
    say(f"INFO precompiling {len(jobs)} combinations with {args.jobs} processes")
    # each job's line as it finishes (with the run's clock), so that a slow or stuck one is named: twice a fresh
    # machine spent a whole call here without a word
    with futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        pending = {pool.submit(_warm, job): job for job in sorted(jobs)}
        for done in futures.as_completed(pending):
            say(f"INFO precompile [{time.time() - start:4.0f} s] {done.result()}")
    say(f"INFO precompiled {len(jobs)} combinations in {time.time() - start:.0f} s with {args.jobs} processes")


# ---------------------------------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------------------------------
#: (dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic, layout)
CASES = [
    ("float16", 2, 4, 2, 1000, 777, 64, False, False, "contig"),
    ("float16", 2, 4, 2, 1000, 777, 64, True, True, "contig"),
    ("float16", 2, 4, 4, 777, 1000, 128, True, False, "contig"),
    ("float16", 1, 8, 1, 2048, 2048, 128, False, True, "contig"),
    ("float16", 1, 4, 2, 4096, 4096, 128, True, False, "contig"),
    ("bfloat16", 2, 4, 2, 1000, 777, 128, True, False, "contig"),
    ("bfloat16", 2, 4, 2, 777, 1000, 64, False, True, "contig"),
    ("bfloat16", 1, 6, 2, 3000, 3000, 64, False, False, "contig"),
    ("float16", 1, 2, 1, 1, 300, 128, False, False, "contig"),
    # (3 keys: with one, the visible rows' dq and dk are exactly 0 and only rounding is left to compare)
    ("float16", 1, 2, 2, 129, 3, 64, True, False, "contig"),
    ("float16", 1, 4, 2, 333, 555, 36, True, False, "blhd"),  # 72-byte rows: the element-wise loaders ("mma")
    ("float16", 1, 4, 2, 333, 555, 64, True, False, "blhd"),  # strided heads, aligned rows
    ("bfloat16", 1, 2, 1, 300, 513, 96, True, True, "contig"),
    ("float16", 1, 2, 1, 300, 513, 32, False, False, "contig"),
    ("float16", 1, 2, 1, 300, 513, 256, True, False, "contig"),
    ("bfloat16", 1, 2, 1, 513, 300, 256, False, True, "blhd"),
    ("float16", 1, 2, 1, 300, 300, 16, True, False, "contig"),
]
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}


def _errors(got, refs):
    import numpy as np

    out = []
    for g, r in zip(got, refs):
        g = g.float().cpu().numpy().astype(np.float64)
        denom = np.linalg.norm(r)
        out.append(float("inf") if not np.isfinite(g).all() else float(np.linalg.norm(g - r) / max(denom, 1e-30)))
    return out


def _takes(backend, dtype, head_dim) -> bool:
    from numba_attn.backward import wgmma

    # (headdim % 8: rows of whole 16-byte pieces; others would run on "mma" under the name "wgmma")
    return backend not in ("wgmma", "wgmma_ws") or (wgmma.supports(dtype, head_dim) and head_dim % 8 == 0)


def correctness(args, torch, backends) -> tuple:
    import torch.nn.functional as F

    import numba_attn
    import reference

    failed = checked = 0
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    for dtype, b, h, hk, lq, lk, d, causal, det, layout in CASES:
        if args.quick and d not in (64, 128):
            continue
        name = f"{dtype:8s} B{b} H{h}/{hk} Lq{lq} Lk{lk} D{d} causal={int(causal)} det={int(det)} {layout}"
        todo = [x for x in backends if _takes(x, dtype, d)]
        if not todo:
            continue
        try:
            g = torch.Generator(device="cuda").manual_seed(lq * 7 + lk)
            q = torch.randn(b, h, lq, d, device="cuda", generator=g).to(tdt[dtype])
            k = torch.randn(b, hk, lk, d, device="cuda", generator=g).to(tdt[dtype])
            v = torch.randn(b, hk, lk, d, device="cuda", generator=g).to(tdt[dtype])
            dout = torch.randn(b, h, lq, d, device="cuda", generator=g).to(tdt[dtype])
            exact = [x.double().cpu().numpy() for x in (dout, q, k, v)]
            out, lse = reference.attention(*exact[1:], causal=causal, return_lse=True)
            out = torch.tensor(out, device="cuda").to(tdt[dtype])
            lse = torch.tensor(lse, device="cuda", dtype=torch.float32)
            ins = [dout, q, k, v, out]
            if layout == "blhd":  # strided: memory (batch, seqlen, heads, headdim)
                ins = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in ins]
            refs = reference.attention_backward(*exact, causal=causal)
            # torch's own backward on the same 16-bit inputs (GQA: K / V repeated, their gradients summed back)
            theirs = None
            try:
                qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
                group = h // hk
                mask = None
                if causal:
                    mask = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(lk - lq)
                o = F.scaled_dot_product_attention(qq, kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1),
                                                   attn_mask=mask)
                theirs = _errors(torch.autograd.grad(o, (qq, kk, vv), dout), refs)
                if causal and lq > lk:  # torch gives NaN for rows that see no key; compare where both are defined
                    theirs = None
            except Exception:  # noqa: BLE001
                theirs = None
            bounds = [2 * t for t in theirs] if theirs else [TOLERANCE[dtype]] * 3
        except Exception as exc:  # noqa: BLE001
            failed += 1
            say(f"ERROR correct {name}: {type(exc).__name__}: {str(exc)[:500]}")
            continue
        for backend in todo:
            checked += 1
            try:
                first = numba_attn.flash_backward(*ins, lse, causal=causal, deterministic=det, backend=backend)
                torch.cuda.synchronize()
                ours = _errors(first, refs)
                repeat = ""
                if det:
                    second = numba_attn.flash_backward(*ins, lse, causal=causal, deterministic=True, backend=backend)
                    same = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(first, second))
                    repeat = " repeat " + ("bitwise equal" if same else "DIFFERS")
                    if not same:
                        ours = [float("inf")] * 3
                ok = all(e <= bnd for e, bnd in zip(ours, bounds))
                detail = "errors dq/dk/dv " + " ".join(f"{e:.1e}" for e in ours) + (
                    "  torch " + " ".join(f"{t:.1e}" for t in theirs) if theirs else f"  bound {TOLERANCE[dtype]:.0e}")
                say(f"{'PASS' if ok else 'FAIL'} correct {backend:5s} {name}: {detail}{repeat}")
                failed += not ok
            except Exception as exc:  # noqa: BLE001
                failed += 1
                say(f"ERROR correct {backend:5s} {name}: {type(exc).__name__}: {str(exc)[:500]}")
        del q, k, v, dout, out, lse, ins
        if time.time() > args.deadline:
            say("SKIP correct: time budget used up")
            break
    torch.cuda.empty_cache()
    return checked, failed


# ---------------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------------
PEERS = (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"), ("effic", "EFFICIENT_ATTENTION"))


def timing(args, torch, columns) -> None:
    """``columns``: (name, backend, module, config or None) of ours to time."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_attn

    names = [name for name, *_ in columns] + [f"sdpa-{p}" for p, _ in PEERS]
    for dtype in args.dtypes:
        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        say(f"INFO timing: TFLOP/s (ms), {dtype}, B={args.batch}; last column: best of ours / sdpa-flash, / mma")
        say(f"{'case':26s} " + " ".join(f"{n:>15s}" for n in names))
        for d, h in ((64, 48), (128, 32)):
            for causal in (False, True):
                for n in args.seqlens:
                    if time.time() > args.deadline:
                        say("SKIP timing: time budget used up")
                        return
                    b = args.batch
                    flops = 2.5 * 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
                    g = torch.Generator(device="cuda").manual_seed(n)
                    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", generator=g).to(tdt) for _ in range(4))
                    out, lse = numba_attn.flash_forward(q, k, v, causal=causal, return_lse=True)
                    cells, ours = [], {}
                    for name, backend, module, config in columns:
                        saved = module.default_config
                        try:
                            _use_config(module, config)
                            ms = median_ms(lambda: numba_attn.flash_backward(
                                dout, q, k, v, out, lse, causal=causal, backend=backend), args.reps)
                            ours[name] = ms
                            cells.append(f"{flops / ms / 1e9:6.0f} ({ms:6.2f})")
                        except Exception as exc:  # noqa: BLE001
                            cells.append(f"{'error':>15s}")
                            say(f"ERROR timing {name} D{d} N{n}: {type(exc).__name__}: {str(exc)[:300]}")
                        finally:
                            module.default_config = saved
                    peers = {}
                    for label, backend in PEERS:
                        try:
                            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
                            with sdpa_kernel(getattr(SDPBackend, backend)):
                                o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                                peers[label] = median_ms(lambda: torch.autograd.grad(
                                    o, (qq, kk, vv), dout, retain_graph=True), args.reps)
                            cells.append(f"{flops / peers[label] / 1e9:6.0f} ({peers[label]:6.2f})")
                            del o, qq, kk, vv
                        except Exception as exc:  # noqa: BLE001
                            cells.append(f"{'n/a':>15s}")
                            say(f"INFO timing sdpa-{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    case = f"D{d} H{h} N{n} {'causal' if causal else 'full'}"
                    ratio = ""
                    if ours:
                        best = min(ours, key=ours.get)
                        ratio = f"  best {best}"
                        if "flash" in peers:
                            ratio += f": {peers['flash'] / ours[best]:.2f}x flash"
                        if "mma" in ours:
                            ratio += f", {ours['mma'] / ours[best]:.2f}x mma"
                    say(f"{case:26s} " + " ".join(f"{c:>15s}" for c in cells) + ratio)
                    del q, k, v, dout, out, lse
                    torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="wgmma,mma",
                        help="ours to check and time, of wgmma_ws,wgmma,mma [wgmma,mma]")
    parser.add_argument("--configs", default="", help="comma-separated names of mma.GPU_CANDIDATES to time too")
    parser.add_argument("--wgmma-configs", default="", help="names of wgmma.GPU_CANDIDATES to time too")
    parser.add_argument("--ws-configs", default="", help="names of wgmma_ws.GPU_CANDIDATES to time too")
    parser.add_argument("--wgmma-default", default="", help="a name of wgmma.GPU_CANDIDATES to run as backend "
                        "'wgmma' itself (correctness included) instead of the default tiles")
    parser.add_argument("--ws-default", default="", help="a name of wgmma_ws.GPU_CANDIDATES to run as backend "
                        "'wgmma_ws' itself (correctness included) instead of its default tiles")
    parser.add_argument("--seqlens", default="1k,2k,4k,8k,16k", help="timing sequence lengths [1k,2k,4k,8k,16k]")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtypes", default="float16", help="timing dtypes, of float16,bfloat16 [float16]")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                        help="processes that precompile the kernels first (0: none)")
    parser.add_argument("--budget", type=float, default=225.0, help="seconds for the whole run [225]")
    parser.add_argument("--quick", action="store_true", help="correctness: only the cases of head dims 64 / 128")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU: compile every specialisation for sm_90 and run ptxas -v (NUMBA_ENABLE_CUDASIM=0)")
    args = parser.parse_args()
    args.deadline = time.time() + args.budget
    args.seqlens = [parse_size(s) for s in args.seqlens.split(",") if s.strip()]
    args.dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    backends = [x.strip() for x in args.backends.split(",") if x.strip()]
    start = time.time()

    from numba_attn.backward import mma, wgmma, wgmma_ws

    if args.wgmma_default:
        if args.wgmma_default not in wgmma.GPU_CANDIDATES:
            say(f"ERROR --wgmma-default: unknown {args.wgmma_default}; choose from {', '.join(wgmma.GPU_CANDIDATES)}")
            return 2
        chosen = wgmma.GPU_CANDIDATES[args.wgmma_default]
        wgmma.GPU_CONFIG_64 = wgmma.GPU_CONFIG_128 = chosen  # (default_config reads them; spawned workers too)
        os.environ["CHECK_BACKWARD_WGMMA_DEFAULT"] = args.wgmma_default
        say(f"INFO backend wgmma runs {args.wgmma_default}: {chosen}")
    if args.ws_default:
        if args.ws_default not in wgmma_ws.GPU_CANDIDATES:
            say(f"ERROR --ws-default: unknown {args.ws_default}; choose from {', '.join(wgmma_ws.GPU_CANDIDATES)}")
            return 2
        wgmma_ws.DEFAULT_CONFIG = wgmma_ws.GPU_CANDIDATES[args.ws_default]  # (default_config reads it)
        os.environ["CHECK_BACKWARD_WS_DEFAULT"] = args.ws_default
        say(f"INFO backend wgmma_ws runs {args.ws_default}: {wgmma_ws.DEFAULT_CONFIG}")
    columns = []
    for backend, module, extra in (("wgmma_ws", wgmma_ws, args.ws_configs), ("wgmma", wgmma, args.wgmma_configs),
                                   ("mma", mma, args.configs)):
        if backend not in backends:
            continue
        unknown = [n for n in extra.split(",") if n.strip() and n.strip() not in module.GPU_CANDIDATES]
        if unknown:
            say(f"ERROR --configs of {backend}: unknown {unknown}; choose from {', '.join(module.GPU_CANDIDATES)}")
            return 2
        columns.append((backend, backend, module, None))
        columns += [(f"{backend}:{n.strip()}", backend, module, module.GPU_CANDIDATES[n.strip()])
                    for n in extra.split(",") if n.strip()]
    if args.compile_only:
        return compile_only([(n, c) for n, b, m, c in columns if b == "mma"],
                            [(n, c) for n, b, m, c in columns if b == "wgmma"],
                            [(n, c) for n, b, m, c in columns if b == "wgmma_ws"])

    import torch

    if not torch.cuda.is_available():
        say("ERROR needs a CUDA GPU and torch with CUDA")
        return 1
    say(f"INFO device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.jobs > 0:
        precompile(args, backends, columns)
    failed = 0
    if not args.skip_correctness:
        checked, failed = correctness(args, torch, backends)
        say(f"INFO correctness: {checked - failed} of {checked} passed ({time.time() - start:.0f} s)")
    if not args.skip_timing:
        timing(args, torch, columns)
    say(f"total {time.time() - start:.0f} s; {'ALL PASSED' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
