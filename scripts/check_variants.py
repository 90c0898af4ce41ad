"""GPU check and timing of sliding windows, soft-capping and packed sequences on every forward kernel (issue #29).

    python3 scripts/check_variants.py                    # all parts, a minute or two after the kernels are compiled
    python3 scripts/check_variants.py --part window --reps 20

window   each kernel (wgmma fp16 on sm_90, mma fp16, tf32 = 3xTF32 fp32, simt fp16) at B = 1, H = 16, N = 16384,
         D = 128: full causal against causal with ``window=(512, 0)``; PASS when the window is at least ``--speedup``
         (8) times faster (the ideal is about N / (512 + block) ~ 25x) and its output matches the float64 reference
         on 24 sampled rows.
softcap  each kernel at B = 1, H = 8, N = 2048, D = 128, causal, ``softcap`` 30 (inputs x1) and 5 (inputs x3, the cap
         bends most scores): error against the reference (the dtype's bound; fp16 / bf16 kernels cap with
         ``tanh.approx.f32``), and the time of the capped call over the plain one.
varlen   ``flash_forward_varlen`` on each kernel: lengths [1, 17, 128, 1000, 3], 8 / 2 heads (GQA), D = 128, causal,
         host and device ``cu_seqlens``, against ``reference.attention_varlen`` on all rows; then 32 sequences of
         random lengths 64..4096 (causal) against the same batch padded to the longest (``flash_forward``, B = 32):
         INFO times and the ratio (the packed call does no padding work).

Every case prints one line starting with PASS, FAIL, ERROR, SKIP or INFO; exit status 0 when nothing failed.
Timings: median of ``--reps`` calls between CUDA events after one warm-up call (which also compiles).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _timing import median_ms  # noqa: E402

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
#: (name, backend, dtype); wgmma only on sm_90
KERNELS = [("wgmma", "wgmma", "float16"), ("mma", "mma", "float16"), ("mma_bf16", "mma", "bfloat16"),
           ("tf32", "mma", "float32"), ("simt", "simt", "float16")]
failures = []


def say(line: str) -> None:
    print(line, flush=True)
    if line.startswith(("FAIL", "ERROR")):
        failures.append(line)


def rel(got, ref) -> float:
    import numpy as np

    got = np.asarray(got, np.float64)
    if np.isnan(got).any():
        return float("inf")
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def kernels():
    import torch

    for name, backend, dtype in KERNELS:
        if backend == "wgmma" and torch.cuda.get_device_capability() < (9, 0):
            say(f"SKIP {name}: needs compute capability 9.0")
            continue
        yield name, backend, dtype


def tensors(shapes, dtype, seed, scale=1.0):
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    out = []
    for i, shape in enumerate(shapes):
        x = rng.standard_normal(shape).astype(np.float32) * (scale if i < 2 else 1.0)
        out.append(torch.from_numpy(x).to("cuda", getattr(torch, dtype)))
    return out


def host(t):
    import numpy as np

    return t.float().cpu().numpy().astype(np.float64)


def part_window(args):
    import numpy as np

    import numba_attn
    import reference

    n, heads, d, window = 16384, 16, 128, (512, 0)
    rows = np.r_[0:8, n // 2:n // 2 + 8, n - 8:n]
    for name, backend, dtype in kernels():
        try:
            q, k, v = tensors([(1, heads, n, d)] * 3, dtype, 1)
            full = median_ms(lambda: numba_attn.flash_forward(q, k, v, causal=True, backend=backend), args.reps)
            win = median_ms(lambda: numba_attn.flash_forward(q, k, v, causal=True, window=window, backend=backend),
                            args.reps)
            out = numba_attn.flash_forward(q, k, v, causal=True, window=window, backend=backend)
            ref = reference.attention(host(q[:, :2]), host(k[:, :2]), host(v[:, :2]), causal=True, window=window,
                                      rows=rows)
            err = rel(host(out[:, :2])[:, :, rows], ref)
            ok = full / win >= args.speedup and err < TOLERANCE[dtype]
            say(f"{'PASS' if ok else 'FAIL'} window {name} N={n} H={heads} D={d} causal: full {full:.2f} ms, "
                f"window{window} {win:.3f} ms, {full / win:.1f}x (need {args.speedup}x), err {err:.2e}")
        except Exception as exc:  # noqa: BLE001
            say(f"ERROR window {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()


def part_softcap(args):
    import numba_attn
    import reference

    n, heads, d = 2048, 8, 128
    for name, backend, dtype in kernels():
        for softcap, scale in ((30.0, 1.0), (5.0, 3.0)):
            try:
                q, k, v = tensors([(1, heads, n, d)] * 3, dtype, 2, scale)
                out, lse = numba_attn.flash_forward(q, k, v, causal=True, softcap=softcap, backend=backend,
                                                    return_lse=True)
                ref, ref_lse = reference.attention(host(q), host(k), host(v), causal=True, softcap=softcap,
                                                   return_lse=True)
                err = rel(host(out), ref)
                lse_err = float(abs(host(lse) - ref_lse).max())
                plain = median_ms(lambda: numba_attn.flash_forward(q, k, v, causal=True, backend=backend), args.reps)
                capped = median_ms(lambda: numba_attn.flash_forward(q, k, v, causal=True, softcap=softcap,
                                                                    backend=backend), args.reps)
                ok = err < TOLERANCE[dtype] and lse_err < 1e-3
                say(f"{'PASS' if ok else 'FAIL'} softcap {name} c={softcap} inputs x{scale}: err {err:.2e} "
                    f"(bound {TOLERANCE[dtype]:.0e}), lse err {lse_err:.1e}; {plain:.3f} -> {capped:.3f} ms "
                    f"({capped / plain:.2f}x)")
            except Exception as exc:  # noqa: BLE001
                say(f"ERROR softcap {name} c={softcap}: {type(exc).__name__}: {exc}")
                traceback.print_exc()


def part_varlen(args):
    import numpy as np
    import torch

    import numba_attn
    import reference

    lengths = [1, 17, 128, 1000, 3]
    cu = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    for name, backend, dtype in kernels():
        try:
            q, k, v = tensors([(cu[-1], 8, 128), (cu[-1], 2, 128), (cu[-1], 2, 128)], dtype, 3)
            ref, ref_lse = reference.attention_varlen(host(q), host(k), host(v), cu, cu, causal=True,
                                                      return_lse=True)
            for where, offsets in (("host", cu), ("device", torch.from_numpy(cu).cuda())):
                out, lse = numba_attn.flash_forward_varlen(q, k, v, offsets, offsets, causal=True, backend=backend,
                                                           return_lse=True)
                err = rel(host(out), ref)
                fin = np.isfinite(ref_lse)
                lse_ok = bool(np.array_equal(np.isfinite(host(lse)), fin)) and \
                    float(abs(host(lse)[fin] - ref_lse[fin]).max()) < 1e-3
                ok = err < TOLERANCE[dtype] and lse_ok
                say(f"{'PASS' if ok else 'FAIL'} varlen {name} lengths {lengths} GQA 8/2 D128 causal, {where} "
                    f"cu_seqlens: err {err:.2e}, lse {'ok' if lse_ok else 'WRONG'}")
        except Exception as exc:  # noqa: BLE001
            say(f"ERROR varlen {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    rng = np.random.default_rng(4)
    lengths = rng.integers(64, 4097, 32)
    cu = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    longest = int(lengths.max())
    for name, backend, dtype in kernels():
        try:
            q, k, v = tensors([(cu[-1], 16, 128)] * 3, dtype, 5)
            dense = [torch.zeros((32, 16, longest, 128), device="cuda", dtype=q.dtype) for _ in range(3)]
            for b in range(32):  # the same sequences, padded at the front (causal: the padding rows see keys too)
                for x, packed in zip(dense, (q, k, v)):
                    x[b, :, longest - lengths[b]:] = packed[cu[b]:cu[b + 1]].transpose(0, 1)
            device_cu = torch.from_numpy(cu).cuda()
            packed_ms = median_ms(lambda: numba_attn.flash_forward_varlen(q, k, v, device_cu, device_cu, causal=True,
                                                                          backend=backend, max_seqlen_q=longest),
                                  args.reps)
            padded_ms = median_ms(lambda: numba_attn.flash_forward(*dense, causal=True, backend=backend), args.reps)
            say(f"INFO varlen {name} 32 sequences of 64..4096 ({cu[-1]} tokens, longest {longest}), H16 D128 causal: "
                f"packed {packed_ms:.3f} ms, padded batch {padded_ms:.3f} ms ({padded_ms / packed_ms:.2f}x)")
        except Exception as exc:  # noqa: BLE001
            say(f"ERROR varlen timing {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("window", "softcap", "varlen", "all"), default="all")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--speedup", type=float, default=8.0, help="window: the least speed-up over full causal")
    args = parser.parse_args()
    import numba_attn

    if numba_attn.SIMULATOR:
        say("SKIP: no GPU (the simulator would take hours at these sizes)")
        return 0
    import torch

    say(f"INFO device: {torch.cuda.get_device_name()}, compute capability {torch.cuda.get_device_capability()}")
    for part in ("window", "softcap", "varlen"):
        if args.part in (part, "all"):
            globals()[f"part_{part}"](args)
    say(f"{'FAIL' if failures else 'PASS'} check_variants: {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
