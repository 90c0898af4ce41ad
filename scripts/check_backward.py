"""GPU check of the tensor-core backward (``flash_backward(..., backend="mma")``): correctness, then speed.

    python scripts/check_backward.py                              # PASS/FAIL lines, then the timing table (< 3 min)
    python scripts/check_backward.py --configs w8m64,w8m128,w4m64 # also time these tiles (mma.GPU_CANDIDATES)
    python scripts/check_backward.py --skip-correctness --seqlens 2k,4k,8k
    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/check_backward.py --compile-only

correctness  torch CUDA tensors, float16 and bfloat16: gradients against the float64 reference
             (``reference.attention_backward``) with the bound twice the error of torch's own SDPA backward in the
             same dtype on the same inputs (fp16 2e-3 / bf16 1e-2 where torch's cannot run); causal or not, GQA,
             Lq != Lk both ways, lengths 1..2048 that no tile divides, head dims 16..256, strided inputs,
             deterministic (two calls bitwise equal) or not.
timing       B=4, (D=64, H=48) and (D=128, H=32), N = --seqlens, causal or not, --dtype: median of --reps calls
             (CUDA events) of ``flash_backward`` (the dispatch default, then each of --configs) against torch SDPA's
             flash and cuDNN backends' backward (``torch.autograd.grad`` of one recorded forward); TFLOP/s count
             2.5 x the forward's 4 B H N^2 D (halved when causal). ``vs flash``: our time / theirs inverted (> 1:
             faster than FlashAttention-2).
--compile-only  no GPU: every kernel specialisation (float16 / bfloat16, head dims 64 / 128 / 256, atomic dQ or
             not, vector loads or not, the sm_90 vector reductions or not, the query-block kernel) compiled for sm_90
             and assembled by ``ptxas -v`` (registers, spills). Causality is a run-time flag (no specialisation).
             With ``--variants``: instead, the default tiles' specialisations of the issue #29 variants (a sliding
             window, soft-capping, packed sequences, and all three), vector loads, atomic dQ with the sm_90 vector
             reductions and the query-block kernel, float16 / bfloat16, head dims 64 / 128 / 256.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def say(*args):
    print(*args, flush=True)


def parse_size(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


# ---------------------------------------------------------------------------------------------------------------------
# --compile-only
# ---------------------------------------------------------------------------------------------------------------------
def _variant_jobs(mma, mma_kernels, config, d_pad: int, bf16: bool, dtype: str) -> list:
    """``--variants``: (label, source, signature, bounds) of the variant specialisations at one head dim and dtype
    (``config`` None: the tiles the dispatch picks, ``mma.default_config(d_pad, packed)``)."""
    from numba_attn.forward.common import Variant

    variants = {"window": Variant(window=(256, 0)), "window2": Variant(window=(100, 37)),
                "softcap": Variant(softcap=30.0), "packed": Variant(packed=True),
                "all": Variant(window=(256, 0), softcap=30.0, packed=True)}
    jobs = []
    for name, variant in variants.items():
        cfg = config or mma.default_config(d_pad, variant.packed)
        for want_dv, want_dk in mma.key_block_passes(cfg, d_pad):
            label = f"key {name} d{d_pad} {dtype} dv={int(want_dv)} dk={int(want_dk)} atomic={int(want_dk)}"
            jobs.append((label, mma_kernels.key_block_source(cfg, d_pad, bf16, True, want_dv, want_dk, want_dk,
                                                             want_dk, variant),
                         mma.signature(mma.KEY_SIGNATURE, variant), cfg.key_launch_bounds()))
        jobs.append((f"query {name} d{d_pad} {dtype}", mma_kernels.query_block_source(cfg, d_pad, bf16, True, variant),
                     mma.signature(mma.QUERY_SIGNATURE, variant), cfg.query_launch_bounds()))
    return jobs


def compile_only(configs, variants: bool = False) -> int:
    import numba_attn  # noqa: F401  (decides simulator or not before numba.cuda is imported)
    from numba_attn.runtime.device import SIMULATOR, cuda

    if SIMULATOR:
        say("ERROR --compile-only needs NUMBA_ENABLE_CUDASIM=0 (Numba's compiler, no GPU needed)")
        return 1
    import numba.cuda.dispatcher as dispatcher

    from numba_attn.backward import mma, mma_kernels

    class _Sm90:  # device functions ask the current device for its compute capability; there is none
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    ptxas = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")

    def assemble(ptx_src):
        if not os.path.exists(ptxas):
            return "ptxas not found"
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
            cfg = mma.default_config(d_pad) if name == "default" else config
            if cfg.shared_bytes(d_pad) > 227 * 1024:
                say(f"SKIP compile {name} d{d_pad}: {cfg.shared_bytes(d_pad)} bytes of shared memory (sm_90: 227 KB)")
                continue
            for dtype in ("float16", "bfloat16"):
                bf16 = dtype == "bfloat16"
                jobs = _variant_jobs(mma, mma_kernels, config, d_pad, bf16, dtype) if variants else []
                for want_dv, want_dk in () if variants else mma.key_block_passes(cfg, d_pad):
                    for atomic in ((True, False) if want_dk else (False,)):
                        for vred in ((True, False) if atomic else (False,)):
                            for vector in (True, False):
                                if not vector and (vred or not atomic):
                                    continue  # the element loaders: once per dQ mode is enough to type-check
                                label = (f"key d{d_pad} {dtype} dv={int(want_dv)} dk={int(want_dk)} atomic={int(atomic)}"
                                         f" v2red={int(vred)} vector={int(vector)}")
                                jobs.append((label, mma_kernels.key_block_source(
                                    cfg, d_pad, bf16, vector, want_dv, want_dk, atomic, vred),
                                    mma.KEY_SIGNATURE, cfg.key_launch_bounds()))
                for vector in () if variants else (True, False):
                    jobs.append((f"query d{d_pad} {dtype} vector={int(vector)}",
                                 mma_kernels.query_block_source(cfg, d_pad, bf16, vector), mma.QUERY_SIGNATURE,
                                 cfg.query_launch_bounds()))
                for label, source, signature, bounds in jobs:
                    try:
                        ptx_src, _ = cuda.compile_ptx(source, signature.args, cc=(9, 0), launch_bounds=bounds)
                        info = f"{ptx_src.count('mma.sync')} mma | {assemble(ptx_src)}"
                        say(f"PASS compile {name} {label}: {info}")
                    except Exception as exc:  # noqa: BLE001
                        failed += 1
                        say(f"ERROR compile {name} {label}: {type(exc).__name__}: {str(exc)[:1500]}")
    say(f"{'ALL COMPILED' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------------
# correctness
# ---------------------------------------------------------------------------------------------------------------------
#: (dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic, layout)
CASES = [
    ("float16", 2, 4, 2, 1000, 777, 64, False, False, "contig"),
    ("float16", 2, 4, 2, 1000, 777, 64, True, True, "contig"),
    ("float16", 2, 4, 4, 777, 1000, 128, True, False, "contig"),
    ("float16", 1, 8, 1, 2048, 2048, 128, False, True, "contig"),
    ("bfloat16", 2, 4, 2, 1000, 777, 128, True, False, "contig"),
    ("bfloat16", 2, 4, 2, 777, 1000, 64, False, True, "contig"),
    ("float16", 1, 2, 1, 1, 300, 128, False, False, "contig"),
    # (3 keys: with one, the visible rows' dq and dk are exactly 0 and only rounding is left to compare)
    ("float16", 1, 2, 2, 129, 3, 64, True, False, "contig"),
    ("float16", 1, 4, 2, 333, 555, 36, True, False, "blhd"),  # 72-byte rows: the element-wise loaders
    ("bfloat16", 1, 2, 1, 300, 513, 96, True, True, "contig"),
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


def correctness(args, torch) -> int:
    import numpy as np
    import torch.nn.functional as F

    import numba_attn
    import reference

    failed = 0
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}
    for dtype, b, h, hk, lq, lk, d, causal, det, layout in CASES:
        name = f"{dtype:8s} B{b} H{h}/{hk} Lq{lq} Lk{lk} D{d} causal={int(causal)} det={int(det)} {layout}"
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
            first = numba_attn.flash_backward(*ins, lse, causal=causal, deterministic=det, backend="mma")
            torch.cuda.synchronize()
            refs = reference.attention_backward(*exact, causal=causal)
            ours = _errors(first, refs)
            repeat = ""
            if det:
                second = numba_attn.flash_backward(*ins, lse, causal=causal, deterministic=True, backend="mma")
                same = all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(first, second))
                repeat = " repeat " + ("bitwise equal" if same else "DIFFERS")
                if not same:
                    ours = [float("inf")] * 3
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
            ok = all(e <= bnd for e, bnd in zip(ours, bounds))
            detail = "errors dq/dk/dv " + " ".join(f"{e:.1e}" for e in ours) + (
                "  torch " + " ".join(f"{t:.1e}" for t in theirs) if theirs else f"  bound {TOLERANCE[dtype]:.0e}")
            say(f"{'PASS' if ok else 'FAIL'} correct {name}: {detail}{repeat}")
            failed += not ok
            del q, k, v, dout, out, lse, ins, first
        except Exception as exc:  # noqa: BLE001
            failed += 1
            say(f"ERROR correct {name}: {type(exc).__name__}: {str(exc)[:500]}")
        if time.time() > args.deadline:
            say("SKIP correct: time budget used up")
            break
    torch.cuda.empty_cache()
    return failed


# ---------------------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------------------
def _median_ms(torch, fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def timing(args, torch, configs) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_attn
    from numba_attn.backward import mma

    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    names = [name for name, _ in configs]
    head = f"{'case':34s} " + " ".join(f"{n:>16s}" for n in names) + f" {'sdpa-flash':>16s} {'sdpa-cudnn':>16s}"
    say(f"INFO timing: TFLOP/s (ms), {args.dtype}, B={args.batch}; ours / flash as x")
    say(head)
    default_config = mma.default_config
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
                for name, config in configs:
                    try:
                        if config is not None:
                            mma.default_config = lambda head_dim=128, packed=False, _c=config: _c
                        ms = _median_ms(torch, lambda: numba_attn.flash_backward(
                            dout, q, k, v, out, lse, causal=causal, backend="mma"), args.reps)
                        ours[name] = ms
                        cells.append(f"{flops / ms / 1e9:7.0f} ({ms:6.2f})")
                    except Exception as exc:  # noqa: BLE001
                        cells.append(f"{'error':>16s}")
                        say(f"ERROR timing {name} D{d} N{n}: {type(exc).__name__}: {str(exc)[:300]}")
                    finally:
                        mma.default_config = default_config
                peers = {}
                for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                    try:
                        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
                        with sdpa_kernel(backend):
                            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                            peers[label] = _median_ms(torch, lambda: torch.autograd.grad(
                                o, (qq, kk, vv), dout, retain_graph=True), args.reps)
                        cells.append(f"{flops / peers[label] / 1e9:7.0f} ({peers[label]:6.2f})")
                        del o, qq, kk, vv
                    except Exception as exc:  # noqa: BLE001
                        cells.append(f"{'n/a':>16s}")
                        say(f"INFO timing sdpa-{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                case = f"D{d} H{h} N{n} {'causal' if causal else 'full'}"
                ratio = ""
                if "flash" in peers and ours:
                    best = min(ours, key=ours.get)
                    ratio = f"  best {best}: {peers['flash'] / ours[best]:.2f}x flash"
                say(f"{case:34s} " + " ".join(f"{c:>16s}" for c in cells) + ratio)
                del q, k, v, dout, out, lse
                torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="", help="comma-separated names of mma.GPU_CANDIDATES to time too")
    parser.add_argument("--seqlens", default="2k,4k", help="timing sequence lengths [2k,4k]")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget", type=float, default=170.0, help="seconds for the whole run [170]")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU: compile every specialisation for sm_90 and run ptxas -v (NUMBA_ENABLE_CUDASIM=0)")
    parser.add_argument("--variants", action="store_true",
                        help="--compile-only: the window / softcap / packed specialisations instead")
    args = parser.parse_args()
    args.deadline = time.time() + args.budget
    args.seqlens = [parse_size(s) for s in args.seqlens.split(",") if s.strip()]
    start = time.time()

    from numba_attn.backward import mma

    unknown = [n for n in args.configs.split(",") if n.strip() and n.strip() not in mma.GPU_CANDIDATES]
    if unknown:
        say(f"ERROR --configs: unknown {unknown}; choose from {', '.join(mma.GPU_CANDIDATES)}")
        return 2
    configs = [("default", None)] + [(n.strip(), mma.GPU_CANDIDATES[n.strip()])
                                     for n in args.configs.split(",") if n.strip()]
    if args.compile_only:
        return compile_only(configs, args.variants)

    import torch

    if not torch.cuda.is_available():
        say("ERROR needs a CUDA GPU and torch with CUDA")
        return 1
    say(f"INFO device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failed = 0
    if not args.skip_correctness:
        failed = correctness(args, torch)
        say(f"INFO correctness: {len(CASES) - failed} of {len(CASES)} passed ({time.time() - start:.0f} s)")
    if not args.skip_timing:
        timing(args, torch, configs)
    say(f"total {time.time() - start:.0f} s; {'ALL PASSED' if not failed else f'{failed} FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
