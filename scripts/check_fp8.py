"""GPU self-check and timing of the float8 e4m3 forward on an H100: the warp-specialised kernel
(numba_attn/forward/wgmma_ws_fp8.py, ``backend="wgmma_ws"``) and the single-warpgroup one (forward/wgmma_fp8.py,
``backend="wgmma"``).

    python3 scripts/check_fp8.py                      # precompile, correctness, timing (< 4 minutes)
    python3 scripts/check_fp8.py --part timing --lengths 4096,16384 --reps 10
    python3 scripts/check_fp8.py --config stages=3 --config block_n=64,stages=4    # more WsConfig tiles timed

precompile   every kernel the correctness and timing parts launch, compiled first by --jobs processes at once (tiny
             calls) into the on-disk kernel cache.
correctness  ``flash_forward`` on torch float8_e4m3fn tensors (per-tensor and per-head descales, bfloat16 and
             float16 output, causal or not, GQA, Lq != Lk, a tail), on each kernel, against
             ``reference.attention_fp8`` (float64 of the dequantised inputs) on every row, and against
             ``reference.flash_fp8_model``
             (the same with P rounded to e4m3 as the kernel does): PASS when the error is below the model's plus
             8e-3 (the 16-bit output's rounding), the lse within 1e-4 + 2^-11 sm_scale max_j sum_d |q_id k_jd|
             per row (the e4m3 MMAs accumulate with about 14 bits: a score's error follows its terms' size).
timing       median of --reps runs (CUDA events, after warm-up) at B = 4, (D = 128, H = 32) and (D = 64, H = 48),
             N = --lengths, causal or not: ``fp8ws`` (flash_forward on fp8, backend "wgmma_ws"; each --config
             launched directly), ``fp8wg`` (backend "wgmma"), ``bf16`` (flash_forward's default on bfloat16:
             wgmma_ws at D 128, wgmma at D 64) and torch SDPA's cuDNN backend on bfloat16. TFLOP/s count 4 B H N^2 D,
             halved when causal; "ws/bf16" is our bf16 time over our fp8-ws time (the issue's target: >= 1.4 at N >=
             4k, D = 128), "ws/cudnn" likewise against cuDNN.
probe        (only when asked) D 128, H 32, B 4, --lengths, causal or not: the WS fp8 kernel launched directly with
             its default tiles, the same without its softmax (``probe="no_softmax"``: no max, exp or sums) and
             without P's conversion (``"no_pack"``) -- timing probes with wrong results --, the V^T pre-pass alone,
             and our bf16 default: where the WS fp8 kernel's time goes.
share        (only when asked) per shape: flash_forward's event time, the kernel's (launched directly), the
             kernel's without its in-kernel V transpose (a timing probe with wrong results), our bf16 kernel's, the
             kernel with ``v_transpose="ldmatrix"`` (V in the TMA's swizzle; PASS when its output has the same bits
             as the default's); and the host time of one call (tiny problem, no synchronisation) of both paths.

Every case prints one line starting with PASS, FAIL, ERROR, SKIP or INFO; exit status 0 when nothing failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _fields import parse_fields as parse_config  # noqa: E402
from _timing import median_ms as _median_ms  # noqa: E402

MODEL_SLACK = 8e-3
#: the lse bound per row: 1e-4 + LSE_ACCUMULATION * sm_scale * max_j sum_d |q_id k_jd| -- the e4m3 tensor cores add
#: their products with about 14 bits kept (measured 2^-13-ish here; DeepSeek-V3 reports ~14 bits on the H800), so a
#: score's error follows the size of its terms, not of the score
LSE_ACCUMULATION = 2.0 ** -11


def say(*args):
    print(*args, flush=True)


def quantize(torch, x, per_head: bool, kv_heads: int):
    """(e4m3 tensor, descale) of a bfloat16 ``(batch, heads, seqlen, d)`` tensor: amax scaling to 448, per tensor or
    per (batch, head) (FlashAttention-3's (batch, kv_heads) when ``kv_heads`` groups the heads)."""
    if per_head:
        batch, heads = x.shape[:2]
        amax = x.float().abs().reshape(batch, kv_heads, -1).amax(dim=-1).clamp(min=1e-6)
        scale = amax / 448.0
        per_q_head = scale.repeat_interleave(heads // kv_heads, dim=1)
        return (x.float() / per_q_head[:, :, None, None]).to(torch.float8_e4m3fn), scale.contiguous()
    scale = x.float().abs().amax().clamp(min=1e-6) / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), float(scale)


#: (batch, heads, kv_heads, seqlen_q, seqlen_k, d, causal, per_head, out_dtype)
CASES = [
    (2, 8, 2, 1000, 1200, 128, True, True, "bfloat16"),
    (2, 8, 8, 1024, 1024, 128, False, False, "bfloat16"),
    (1, 6, 3, 777, 2049, 64, True, True, "float16"),
    (1, 4, 4, 2048, 2048, 64, False, False, "bfloat16"),
    (1, 4, 1, 300, 100, 128, True, False, "bfloat16"),  # Lq > Lk: rows without keys
]
BACKENDS = ("wgmma_ws", "wgmma")


def _warm(job) -> str:
    """Tiny calls that compile what a job's kernel needs, in a process of its own: ``("fp8", backend, d, per_head,
    out_dtype[, WsConfig fields])`` or ``("bf16", backend, d)``."""
    start = time.time()
    try:
        import torch

        import numba_attn
        from numba_attn.forward import wgmma_ws_fp8

        if job[0] == "fp8":
            _, backend, d, per_head, out_dtype, *config = job
            if config:  # a --config: this process's default (the kernel cache keys it by its tiles)
                wgmma_ws_fp8.DEFAULT_CONFIG = dataclasses.replace(wgmma_ws_fp8.DEFAULT_CONFIG, **dict(config[0]))
            x = torch.randn(1, 2, 200, d, device="cuda").to(torch.float8_e4m3fn)
            scale = torch.ones(1, 2, device="cuda") if per_head else 1.0
            numba_attn.flash_forward(x, x, x, causal=True, backend=backend, descale_q=scale, descale_k=scale,
                                     descale_v=scale, out_dtype=out_dtype)
        else:
            _, backend, d = job
            x = torch.randn(1, 2, 200, d, device="cuda", dtype=torch.bfloat16)
            numba_attn.flash_forward(x, x, x, causal=True, backend=backend)
        torch.cuda.synchronize()
        return f"{job}: {time.time() - start:.0f} s"
    except Exception as exc:  # noqa: BLE001
        return f"{job}: {type(exc).__name__}: {str(exc)[:300]}"


def precompile(args) -> int:
    import concurrent.futures as futures
    import multiprocessing

    jobs = {("fp8", backend, d, per_head, out_dtype) for _, _, _, _, _, d, _, per_head, out_dtype in CASES
            for backend in args.backends}
    jobs |= {("fp8", backend, d, False, "bfloat16") for d in (64, 128) for backend in BACKENDS}  # timing
    jobs |= {("bf16", "wgmma_ws", 128)}  # the bfloat16 default at D 128 (no tuned table: its default tiles)
    jobs |= {("fp8", "wgmma_ws", d, False, "bfloat16", tuple(sorted(parse_config(c).items()))) for c in args.config
             for d in (64, 128)}
    start = time.time()
    with futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_warm, sorted(jobs)))
    errors = [line for line in results if "Error" in line or "Exception" in line]
    say(f"INFO precompiled {len(jobs)} kernels in {time.time() - start:.0f} s with {args.jobs} processes")
    for line in errors:
        say(f"ERROR precompile {line}")
    return len(errors)


def correctness(args, torch, numba_attn, reference, np) -> int:
    failures = 0
    for batch, heads, kv_heads, lq, lk, d, causal, per_head, out_dtype in CASES:
        name = f"B{batch} H{heads}/{kv_heads} Lq{lq} Lk{lk} D{d} {'causal' if causal else 'full'} " \
               f"{'per-head' if per_head else 'per-tensor'} {out_dtype}"
        try:
            gen = torch.Generator(device="cuda").manual_seed(lq + lk + d)
            q, k, v = (torch.randn(batch, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16) * s
                       for h, n, s in ((heads, lq, 1.5), (kv_heads, lk, 1.5), (kv_heads, lk, 1.0)))
            (q8, dq), (k8, dk), (v8, dv) = (quantize(torch, x, per_head, kv_heads) for x in (q, k, v))
            codes = [x.view(torch.uint8).cpu().numpy() for x in (q8, k8, v8)]
            factors = [x.cpu().numpy() if hasattr(x, "cpu") else x for x in (dq, dk, dv)]
            ref, ref_lse = reference.attention_fp8(*codes, *factors, causal=causal, return_lse=True)
            qf, kf, vf = reference.dequantize(*codes, *factors)
            model = reference.flash_fp8_model(qf, kf, vf, causal=causal)
        except Exception:
            failures += 1
            say(f"ERROR correctness {name}:\n{traceback.format_exc()}")
            continue
        for backend in args.backends:
            try:
                out, lse = numba_attn.flash_forward(q8, k8, v8, causal=causal, return_lse=True, descale_q=dq,
                                                    descale_k=dk, descale_v=dv, out_dtype=out_dtype, backend=backend)
                torch.cuda.synchronize()
                failures += _compare(np, f"{backend:8s} {name}", out, lse, ref, ref_lse, model, qf, kf, heads,
                                     kv_heads, batch, d)
            except Exception:
                failures += 1
                say(f"ERROR correctness {backend} {name}:\n{traceback.format_exc()}")
    return failures


def _compare(np, name, out, lse, ref, ref_lse, model, qf, kf, heads, kv_heads, batch, d) -> int:
    """One PASS / FAIL line: a kernel's output and lse against the reference and the model; returns 1 on FAIL."""
    got = out.double().cpu().numpy()
    norm = np.linalg.norm(ref)
    err = np.linalg.norm(got - ref) / norm
    model_err = np.linalg.norm(model - ref) / norm
    vs_model = np.linalg.norm(got - model) / norm
    finite = np.isfinite(ref_lse)
    group = heads // kv_heads
    terms = np.stack([(np.abs(qf[b, h]) @ np.abs(kf[b, h // group]).T).max(axis=1)
                      for b in range(batch) for h in range(heads)]).reshape(ref_lse.shape)
    lse_tol = 1e-4 + LSE_ACCUMULATION * terms / math.sqrt(d)
    lse_dev = np.abs(lse.cpu().numpy() - ref_lse)
    lse_err = float(np.max(lse_dev[finite])) if finite.any() else 0.0
    lse_ok = bool(np.all(lse_dev[finite] <= lse_tol[finite]))
    empty_ok = bool(np.all(got[~finite] == 0) and np.all(np.isneginf(lse.cpu().numpy()[~finite])))
    ok = err < model_err + MODEL_SLACK and lse_ok and empty_ok and np.isfinite(got).all()
    say(f"{'PASS' if ok else 'FAIL'} correctness {name}: err {err:.2e} (model {model_err:.2e}, kernel vs "
        f"model {vs_model:.2e}), lse {lse_err:.1e} (bound {float(np.min(lse_tol)):.1e}.."
        f"{float(np.max(lse_tol)):.1e}){'' if empty_ok else ', EMPTY ROWS WRONG'}")
    return int(not ok)


def timing(args, torch, numba_attn, np) -> int:
    from numba_attn.forward import fp8_vt, wgmma_ws_fp8

    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    configs = [parse_config(c) for c in args.config]
    failures = 0

    def median_ms(fn):
        return _median_ms(fn, args.reps)

    say("INFO timing: TFLOP/s (ms); B4; fp8 inputs float8_e4m3fn with per-tensor descales, bf16 out")
    for d, heads in ((128, 32), (64, 48)):
        for n in args.lengths:
            for causal in (False, True):
                try:
                    q, k, v = (torch.randn(4, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                    (q8, dq), (k8, dk), (v8, dv) = (quantize(torch, x, False, heads) for x in (q, k, v))
                    flops = 4.0 * 4 * heads * n * n * d * (0.5 if causal else 1.0)
                    results = {}
                    for label, backend in (("fp8ws", "wgmma_ws"), ("fp8wg", "wgmma")):
                        results[label] = median_ms(lambda: numba_attn.flash_forward(  # noqa: B023
                            q8, k8, v8, causal=causal, descale_q=dq, descale_k=dk, descale_v=dv, backend=backend))
                    for config in configs:
                        label = "fp8ws[" + ",".join(f"{a}={b}" for a, b in config.items()) + "]"
                        ws_config = dataclasses.replace(wgmma_ws_fp8.DEFAULT_CONFIG, **config)
                        results[label] = median_ms(_direct_launch(torch, wgmma_ws_fp8, ws_config, q8, k8, v8, dq, dk,
                                                                  dv, causal))
                    vt = torch.empty(4, heads, d, fp8_vt.padded_keys(n), dtype=torch.uint8, device="cuda")
                    stream = torch.cuda.current_stream().cuda_stream
                    v_bits = v8.view(torch.uint8)
                    vt_ms = median_ms(lambda: fp8_vt.transpose(v_bits, vt, stream))  # noqa: B023
                    results["bf16"] = median_ms(lambda: numba_attn.flash_forward(q, k, v, causal=causal))  # noqa
                    try:
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            results["cudnn"] = median_ms(lambda: sdpa(q, k, v, is_causal=causal))  # noqa: B023
                    except Exception as exc:  # a backend that does not take the shape
                        say(f"SKIP cudnn D{d} N{n}: {type(exc).__name__}")
                    parts = " ".join(f"{label} {flops / ms / 1e9:.0f} ({ms:.3f})" for label, ms in results.items())
                    say(f"INFO D{d} H{heads} N{n:5d} {'causal' if causal else 'full  '}: {parts} | V^T pre-pass "
                        f"{vt_ms:.3f} ms ({vt_ms / results['fp8ws']:.0%}) | ws/bf16 "
                        f"{results['bf16'] / results['fp8ws']:.2f}x, ws/wg {results['fp8wg'] / results['fp8ws']:.2f}x, "
                        f"ws/cudnn {results.get('cudnn', float('nan')) / results['fp8ws']:.2f}x")
                except Exception:
                    failures += 1
                    say(f"ERROR timing D{d} N{n} causal={causal}:\n{traceback.format_exc()}")
    return failures


def probe(args, torch, numba_attn, np) -> int:
    from numba_attn.forward import fp8_vt, wgmma_ws_fp8

    def event_ms(fn):
        return _median_ms(fn, args.reps)

    config = wgmma_ws_fp8.DEFAULT_CONFIG
    d, heads = 128, 32
    for n in args.lengths:
        for causal in (False, True):
            q, k, v = (torch.randn(4, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            (q8, dq), (k8, dk), (v8, dv) = (quantize(torch, x, False, heads) for x in (q, k, v))
            flops = 4.0 * 4 * heads * n * n * d * (0.5 if causal else 1.0)
            times = {}
            for name in (None, "no_softmax", "no_pack"):
                times[name or "kernel"] = event_ms(_direct_launch(torch, wgmma_ws_fp8, config, q8, k8, v8, dq, dk, dv,
                                                                  causal, probe=name))
            vt = torch.empty(4, heads, d, fp8_vt.padded_keys(n), dtype=torch.uint8, device="cuda")
            stream = torch.cuda.current_stream().cuda_stream
            v_bits = v8.view(torch.uint8)
            times["V^T pre-pass"] = event_ms(lambda: fp8_vt.transpose(v_bits, vt, stream))  # noqa: B023
            times["bf16"] = event_ms(lambda: numba_attn.flash_forward(q, k, v, causal=causal))  # noqa: B023
            parts = ", ".join(f"{name} {ms:.3f} ms ({flops / ms / 1e9:.0f})" for name, ms in times.items())
            say(f"INFO probe D{d} H{heads} N{n:5d} {'causal' if causal else 'full  '} (pre-pass + kernel, "
                f"TFLOP/s): {parts}")
    return 0


def share(args, torch, numba_attn, np) -> int:
    """Where the time of a call goes: event time of flash_forward, of the kernel launched directly, of the kernel
    without its V transpose (a timing probe, wrong results), and the host time of a call (tiny problem, no sync)."""
    from numba_attn.forward import wgmma_fp8

    failures = 0

    def event_ms(fn, reps):
        return _median_ms(fn, reps)

    def host_us(fn, reps=200):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
        return 1e6 * elapsed / reps

    tiny = [torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    (t_q, t_dq), (t_k, t_dk), (t_v, t_dv) = (quantize(torch, x, False, 1) for x in tiny)

    def fp8_tiny():
        numba_attn.flash_forward(t_q, t_k, t_v, descale_q=t_dq, descale_k=t_dk, descale_v=t_dv)

    say(f"INFO host time per call (B1 H1 N64 D64, no sync): fp8 flash_forward {host_us(fp8_tiny):.0f} us, "
        f"bf16 flash_forward {host_us(lambda: numba_attn.flash_forward(*tiny, backend='wgmma')):.0f} us")
    config = wgmma_fp8.DEFAULT_CONFIG
    for d, heads in ((64, 48), (128, 32)):
        for n in args.lengths:
            for causal in (False, True):
                q, k, v = (torch.randn(4, heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                (q8, dq), (k8, dk), (v8, dv) = (quantize(torch, x, False, heads) for x in (q, k, v))
                api = event_ms(lambda: numba_attn.flash_forward(q8, k8, v8, causal=causal, descale_q=dq,  # noqa
                                                                descale_k=dk, descale_v=dv), args.reps)
                direct = event_ms(_direct_launch(torch, wgmma_fp8, config, q8, k8, v8, dq, dk, dv,
                                                 causal), args.reps)
                probe = event_ms(_direct_launch(torch, wgmma_fp8, config, q8, k8, v8, dq, dk, dv,
                                                causal, transpose=False), args.reps)
                staged = _direct_launch(torch, wgmma_fp8, config, q8, k8, v8, dq, dk, dv, causal)
                swizzled = _direct_launch(torch, wgmma_fp8, wgmma_fp8.Fp8Config(v_transpose="ldmatrix"),
                                          q8, k8, v8, dq, dk, dv, causal)
                ldsm = event_ms(swizzled, args.reps)
                staged()
                swizzled()
                torch.cuda.synchronize()
                same = torch.equal(staged.out, swizzled.out)
                failures += not same
                bf16 = event_ms(lambda: numba_attn.flash_forward(q, k, v, causal=causal, backend="wgmma"),  # noqa
                                args.reps)
                flops = 4.0 * 4 * heads * n * n * d * (0.5 if causal else 1.0)
                say(f"INFO share D{d} H{heads} N{n} {'causal' if causal else 'full  '}: flash_forward {api:.3f} ms, "
                    f"kernel {direct:.3f} ms ({flops / direct / 1e9:.0f} TFLOP/s), without the V transpose "
                    f"{probe:.3f} ms (transpose share {(direct - probe) / direct:.0%}), bf16 {bf16:.3f} ms; "
                    f"V^T by ldmatrix from the TMA layout {ldsm:.3f} ms, {'PASS' if same else 'FAIL'} same bits")
    return failures


def _direct_launch(torch, module, config, q8, k8, v8, dq, dk, dv, causal, transpose=True, probe=None):
    """A launch of ``module``'s fp8 kernel (``wgmma_fp8`` or ``wgmma_ws_fp8``) with ``config`` on torch tensors (what
    flash_forward does with its defaults); ``transpose=False``: ``wgmma_fp8``'s timing probe."""
    from numba_attn.runtime.device import DeviceView
    import numpy as np

    def view(t, dtype):
        size = t.element_size()
        return DeviceView(t.data_ptr(), tuple(t.shape), tuple(s * size for s in t.stride()), np.dtype(dtype), t)

    out = torch.empty(q8.shape, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(q8.shape[:3], dtype=torch.float32, device="cuda")
    views = [view(x.view(torch.uint8), np.uint8) for x in (q8, k8, v8)]
    o, l = view(out.view(torch.int16), np.uint16), view(lse, np.float32)
    stream = torch.cuda.current_stream().cuda_stream
    sm_scale = 1.0 / math.sqrt(q8.shape[-1])

    extra = {} if transpose else {"_transpose": False}
    if probe is not None:
        extra["_probe"] = probe
    if module.__name__.endswith("wgmma_ws_fp8"):  # V^T's scratch made once, as a pool would hand it out
        from numba_attn.forward import fp8_vt

        batch, kv_heads, seqlen_k, d = k8.shape
        vt = view(torch.empty(batch, kv_heads, d, fp8_vt.padded_keys(seqlen_k), dtype=torch.uint8, device="cuda"),
                  np.uint8)
        extra["scratch"] = lambda shape, dtype: vt

    def run():
        module.launch(*views, o, l, False, sm_scale, causal, stream, descale=(dq, dk, dv), config=config, **extra)

    run.out = out
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "correctness", "timing", "share", "probe"), default="all")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--config", action="append", default=[],
                        help="KEY=VALUE[,KEY=VALUE] of WsConfig (over wgmma_ws_fp8.DEFAULT_CONFIG), timed too")
    parser.add_argument("--jobs", type=int, default=8, help="processes that precompile the kernels first (0: none)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="the fp8 backends the correctness part checks")
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.backends = [x for x in args.backends.split(",") if x]
    import numpy as np
    import torch

    import numba_attn
    import reference
    from numba_attn.runtime.device import compute_capability

    if numba_attn.SIMULATOR or compute_capability() < (9, 0):
        say("SKIP needs an sm_90 GPU")
        return 0
    say(f"INFO {torch.cuda.get_device_name()} torch {torch.__version__}")
    t0 = time.time()
    failures = 0
    if args.jobs and args.part in ("all", "correctness", "timing"):
        failures += precompile(args)
    if args.part in ("all", "correctness"):
        failures += correctness(args, torch, numba_attn, reference, np)
        say(f"INFO correctness took {time.time() - t0:.0f}s")
    if args.part in ("all", "timing"):
        failures += timing(args, torch, numba_attn, np)
    if args.part == "share":
        failures += share(args, torch, numba_attn, np)
    if args.part == "probe":
        failures += probe(args, torch, numba_attn, np)
    say(f"INFO done in {time.time() - t0:.0f}s, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
