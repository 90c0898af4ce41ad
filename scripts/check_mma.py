"""GPU self-check of the tensor-core flash kernel (numba_attn/forward/mma.py) and its PTX intrinsics.

    python scripts/check_mma.py                      # all three parts, about 2-3 minutes with compiles
    python scripts/check_mma.py --part unit          # one part only, in this process
    python scripts/check_mma.py --budget 170         # seconds for everything (later work is skipped, not run late)

Parts (each runs in its own child process, so that a fatal CUDA error in one is reported and the others still run):

unit         each intrinsic of ``ptx`` against NumPy on one warp: the f16 and bf16 MMA with the documented fragment
             layouts, the P-in-registers chain (C fragments of S re-used as the A operand of P V), cvt packing,
             ex2.approx, the butterfly shuffle, 16-byte loads/stores and the half-word interleaves.
correctness  the flash kernel against a float64 NumPy reference on poisoned outputs (NaN bits everywhere, also in
             the columns after headdim of a wider buffer, which must stay untouched), float16 and bfloat16, head
             dims 16..256, causal or not, Lq != Lk both ways, GQA / MQA, lengths 1, 63, 65, 1000, strided views;
             rel. error bound 2e-3 (float16) / 1e-2 (bfloat16), lse within 1e-4, -inf exactly where expected.
timing       median of 20 (CUDA events, after warm-up) against torch SDPA's flash backend when torch is installed;
             B=4, H=32, D=128 and B=4, H=48, D=64, N = 2k, 4k, 8k, causal or not, float16; TFLOP/s counts
             4 B H N^2 D (halved when causal).

Every case prints one line starting with PASS, FAIL, ERROR, SKIP or INFO; a summary closes the run. Exit status 0
when nothing failed. Runs under NUMBA_ENABLE_CUDASIM=1 too (unit part only in practice: the simulator is slow).
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PARTS = ("unit", "correctness", "timing")
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
LSE_TOLERANCE = 1e-4


def say(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# helpers shared by the parts (imported lazily: the parent process never touches CUDA)
# ---------------------------------------------------------------------------------------------------------------------
# Bound by _setup(). Module globals, not closure variables, so that kernels defined below see them as globals (the
# simulator swaps the global ``cuda`` inside kernels; Numba resolves global modules and types at compile time).
cuda = None  # numba.cuda
ptx = None  # numba_attn.core.ptx
float32 = uint32 = None  # Numba types


def _setup():
    global cuda, ptx, float32, uint32
    import numpy as np

    import numba_attn  # noqa: F401  (GPU or simulator decision before numba.cuda)
    from numba import float32 as f32
    from numba import uint32 as u32

    from numba_attn.runtime.device import SIMULATOR
    from numba_attn.runtime.device import cuda as numba_cuda
    from numba_attn.forward import mma as flash_mma
    from numba_attn.core import ptx as ptx_module

    cuda, ptx, float32, uint32 = numba_cuda, ptx_module, f32, u32
    return np, SIMULATOR, flash_mma, ptx_module


class _CompiledOnly(Exception):
    """--compile-only: the kernel was compiled (and assembled), not run."""


def _offline_compile(pyfunc, argtypes, name, launch_bounds=None):
    """PTX for sm_90 without a GPU (NUMBA_ENABLE_CUDASIM=0), then ``ptxas -v`` when it is on the PATH."""
    import shutil
    import tempfile

    import numba.cuda.dispatcher as dispatcher

    class _Sm90:  # device functions ask the current device for its compute capability; there is none
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    ptx_src, _ = cuda.compile_ptx(pyfunc, argtypes, cc=(9, 0), launch_bounds=launch_bounds)
    info = f"{ptx_src.count('mma.sync')} mma, {ptx_src.count('call.uni')} calls"
    ptxas = shutil.which("ptxas")
    if ptxas:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx_src)
            res = subprocess.run([ptxas, "-arch=sm_90", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"ptxas failed for {name}:\n{res.stderr}")
            info += " | " + " | ".join(l.split("info    :")[-1].strip() for l in res.stderr.splitlines()
                                      if "Used" in l or "spill" in l)
    say(f"INFO compiled {name}: {info}")
    return ptx_src


def _describe_device(cuda, simulator):
    if simulator:
        return "CUDA simulator (no GPU)"
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    return f"{name}, compute capability {dev.compute_capability}, {dev.MULTIPROCESSOR_COUNT} SMs"


def _to_device(cuda, simulator, host):
    return cuda.to_device(host)  # under the simulator a FakeCUDAArray: views of it reach kernels uncopied


def _to_host(simulator, arr):
    return arr.copy_to_host()


def _sync(cuda, simulator):
    if not simulator:
        cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------------
# part 1: intrinsics
# ---------------------------------------------------------------------------------------------------------------------
def part_unit(args):
    np, simulator, flash_mma, _ = _setup()
    if not args.compile_only:
        say(f"INFO device: {_describe_device(cuda, simulator)}")
    rng = np.random.default_rng(0)
    results = []

    def check(name, ok, detail):
        results.append(ok)
        say(f"{'PASS' if ok else 'FAIL'} unit {name}: {detail}")

    def guarded(name, fn):
        try:
            fn()
        except _CompiledOnly:
            results.append(True)
            say(f"PASS unit {name}: compiled for sm_90 (not run)")
        except Exception as exc:  # noqa: BLE001  (report and go on)
            results.append(False)
            say(f"ERROR unit {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stdout)

    def run1(kernel, *arrays):
        if args.compile_only:
            from numba import typeof

            _offline_compile(kernel.py_func, tuple(typeof(a) for a in arrays), kernel.py_func.__name__)
            raise _CompiledOnly
        dev = [_to_device(cuda, simulator, a) for a in arrays]
        kernel[1, 32](*dev)
        _sync(cuda, simulator)
        return [_to_host(simulator, d) for d in dev]

    # -- fragments of A (16x16), B (16x8) and C (16x8) per the PTX ISA tables, built lane by lane ------------------
    def make_mma_kernel(mma):
        @cuda.jit
        def kernel(a_bits, b_bits, c, d):
            lane = cuda.threadIdx.x
            g = lane // 4
            t = lane % 4
            a0 = ptx.pack_u16x2(a_bits[g, 2 * t], a_bits[g, 2 * t + 1])
            a1 = ptx.pack_u16x2(a_bits[g + 8, 2 * t], a_bits[g + 8, 2 * t + 1])
            a2 = ptx.pack_u16x2(a_bits[g, 2 * t + 8], a_bits[g, 2 * t + 9])
            a3 = ptx.pack_u16x2(a_bits[g + 8, 2 * t + 8], a_bits[g + 8, 2 * t + 9])
            b0 = ptx.pack_u16x2(b_bits[2 * t, g], b_bits[2 * t + 1, g])
            b1 = ptx.pack_u16x2(b_bits[2 * t + 8, g], b_bits[2 * t + 9, g])
            r0, r1, r2, r3 = mma(a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t],
                                 c[g + 8, 2 * t + 1])
            d[g, 2 * t] = r0
            d[g, 2 * t + 1] = r1
            d[g + 8, 2 * t] = r2
            d[g + 8, 2 * t + 1] = r3

        return kernel

    def to_bits(x, dtype):
        if dtype == "float16":
            h = x.astype(np.float16)
            return h.view(np.uint16), h.astype(np.float64)
        bits = ptx.float32_to_bf16_bits(x)
        return bits, ptx.bf16_bits_to_float32(bits).astype(np.float64)

    for dtype, mma in (("float16", ptx.mma_m16n8k16_f16), ("bfloat16", ptx.mma_m16n8k16_bf16)):
        def mma_case(dtype=dtype, mma=mma):
            a_bits, a = to_bits(rng.standard_normal((16, 16)).astype(np.float32), dtype)
            b_bits, b = to_bits(rng.standard_normal((16, 8)).astype(np.float32), dtype)
            c = rng.standard_normal((16, 8)).astype(np.float32)
            d = np.full((16, 8), np.nan, np.float32)
            _, _, _, d = run1(make_mma_kernel(mma), a_bits, b_bits, c, d)
            ref = a @ b + c
            err = float(np.max(np.abs(d - ref)) / np.max(np.abs(ref)))
            check(f"mma m16n8k16 {dtype}", err < 1e-5, f"max rel err {err:.2e} (layout: a0..a3 / b0 b1 / c0..c3)")

        guarded(f"mma {dtype}", mma_case)

    # -- the FlashAttention-2 register trick: C fragments of S = A K^T (two n8 blocks) ARE the A operand of P V ------
    def chain_case():
        @cuda.jit
        def kernel(a_bits, kt_bits, v_bits, o):
            lane = cuda.threadIdx.x
            g = lane // 4
            t = lane % 4
            a0 = ptx.pack_u16x2(a_bits[g, 2 * t], a_bits[g, 2 * t + 1])
            a1 = ptx.pack_u16x2(a_bits[g + 8, 2 * t], a_bits[g + 8, 2 * t + 1])
            a2 = ptx.pack_u16x2(a_bits[g, 2 * t + 8], a_bits[g, 2 * t + 9])
            a3 = ptx.pack_u16x2(a_bits[g + 8, 2 * t + 8], a_bits[g + 8, 2 * t + 9])
            # S block 0 = keys 0..7, block 1 = keys 8..15; B[k = d][n = key] = kt[d, key]
            s00, s01, s02, s03 = ptx.mma_m16n8k16_f16(
                a0, a1, a2, a3, ptx.pack_u16x2(kt_bits[2 * t, g], kt_bits[2 * t + 1, g]),
                ptx.pack_u16x2(kt_bits[2 * t + 8, g], kt_bits[2 * t + 9, g]), 0.0, 0.0, 0.0, 0.0)
            s10, s11, s12, s13 = ptx.mma_m16n8k16_f16(
                a0, a1, a2, a3, ptx.pack_u16x2(kt_bits[2 * t, g + 8], kt_bits[2 * t + 1, g + 8]),
                ptx.pack_u16x2(kt_bits[2 * t + 8, g + 8], kt_bits[2 * t + 9, g + 8]), 0.0, 0.0, 0.0, 0.0)
            p0 = ptx.pack_half2(s00, s01)
            p1 = ptx.pack_half2(s02, s03)
            p2 = ptx.pack_half2(s10, s11)
            p3 = ptx.pack_half2(s12, s13)
            # O = P V, B[k = key][n = d] = v[key, d]
            r0, r1, r2, r3 = ptx.mma_m16n8k16_f16(
                p0, p1, p2, p3, ptx.pack_u16x2(v_bits[2 * t, g], v_bits[2 * t + 1, g]),
                ptx.pack_u16x2(v_bits[2 * t + 8, g], v_bits[2 * t + 9, g]), 0.0, 0.0, 0.0, 0.0)
            o[g, 2 * t] = r0
            o[g, 2 * t + 1] = r1
            o[g + 8, 2 * t] = r2
            o[g + 8, 2 * t + 1] = r3

        a_bits, a = to_bits(rng.standard_normal((16, 16)).astype(np.float32), "float16")
        kt_bits, kt = to_bits(rng.standard_normal((16, 16)).astype(np.float32), "float16")
        v_bits, v = to_bits(rng.standard_normal((16, 8)).astype(np.float32), "float16")
        o = np.full((16, 8), np.nan, np.float32)
        *_, o = run1(kernel, a_bits, kt_bits, v_bits, o)
        p = (a @ kt).astype(np.float32).astype(np.float16).astype(np.float64)
        ref = p @ v
        err = float(np.max(np.abs(o - ref)) / np.max(np.abs(ref)))
        check("P-in-registers chain", err < 1e-3, f"max rel err {err:.2e} (S fragments re-used as the A of P V)")

    guarded("chain", chain_case)

    def pack_case():
        @cuda.jit
        def kernel(x, out):
            i = cuda.threadIdx.x
            out[i, 0] = ptx.pack_half2(x[i, 0], x[i, 1])
            out[i, 1] = ptx.pack_bf16x2(x[i, 0], x[i, 1])
            w = ptx.pack_u16x2(ptx.low_u16(out[i, 0]), ptx.high_u16(out[i, 1]))
            out[i, 2] = w

        x = (rng.standard_normal((32, 2)) * np.array([1.0, 1000.0])).astype(np.float32)
        x[0] = [1.0 + 2.0 ** -11, -(1.0 + 3 * 2.0 ** -11)]  # float16 ties: round to nearest even
        x[1] = [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]  # bfloat16 ties
        out = np.zeros((32, 3), np.uint32)
        _, out = run1(kernel, x, out)
        h = x.astype(np.float16).view(np.uint16).astype(np.uint32)
        want_h = h[:, 0] | (h[:, 1] << 16)
        bf = ptx.float32_to_bf16_bits(x).astype(np.uint32)
        want_b = bf[:, 0] | (bf[:, 1] << 16)
        want_mix = (want_h & 0xFFFF) | (want_b & 0xFFFF0000)
        check("cvt.rn.f16x2.f32 (pack_half2)", np.array_equal(out[:, 0], want_h),
              f"{int(np.sum(out[:, 0] != want_h))} of 32 words differ (lo = first argument)")
        check("cvt.rn.bf16x2.f32 (pack_bf16x2)", np.array_equal(out[:, 1], want_b),
              f"{int(np.sum(out[:, 1] != want_b))} of 32 words differ")
        check("pack_u16x2 / low_u16 / high_u16", np.array_equal(out[:, 2], want_mix),
              f"{int(np.sum(out[:, 2] != want_mix))} of 32 words differ")

    guarded("pack", pack_case)

    def exp2_shfl_case():
        @cuda.jit
        def kernel(x, y, z):
            i = cuda.threadIdx.x
            y[i] = ptx.exp2_approx(x[i])
            v = float32(i)
            z[i, 0] = ptx.shfl_xor_f32(v, 1)
            z[i, 1] = ptx.shfl_xor_f32(v, 2)
            z[i, 2] = ptx.shfl_xor_f32(v, 16)

        x = np.linspace(-60.0, 60.0, 32).astype(np.float32)
        x[0] = -np.inf
        x[1] = -200.0  # underflows (flushed) to 0
        y = np.full(32, np.nan, np.float32)
        z = np.full((32, 3), np.nan, np.float32)
        _, y, z = run1(kernel, x, y, z)
        ref = np.exp2(x.astype(np.float64))
        err = float(np.max(np.abs(y[2:] - ref[2:]) / ref[2:]))
        check("ex2.approx.ftz.f32", err < 4e-6 and y[0] == 0.0 and y[1] == 0.0,
              f"max rel err {err:.2e}, exp2(-inf) = {y[0]}, exp2(-200) = {y[1]}")
        lanes = np.arange(32)
        want = np.stack([lanes ^ 1, lanes ^ 2, lanes ^ 16], axis=1).astype(np.float32)
        check("shfl.sync.bfly.b32", np.array_equal(z, want), "lane ^ 1, ^ 2, ^ 16")

    guarded("exp2/shfl", exp2_shfl_case)

    def vector_case():
        SMEM_ALIGN = None if simulator else 16  # the simulator refuses an alignment

        @cuda.jit
        def kernel(src, words, inter):
            i = cuda.threadIdx.x
            tile = cuda.shared.array((32, 8), uint32, alignment=SMEM_ALIGN)  # 16-byte stores
            w0, w1, w2, w3 = ptx.load_u16x8(src, i, 8)  # elements 8..15 of row i: 16-byte aligned
            ptx.store_u32x4(tile, i, 4, w0, w1, w2, w3)
            ptx.store2(tile, i, 0, ptx.load2(src, i, 0))
            cuda.syncthreads()
            for j in range(8):
                words[i, j] = tile[i, j]
            nxt = (i + 1) % 32
            inter[i, 0] = ptx.interleave_low(tile[i, 4], tile[nxt, 4])
            inter[i, 1] = ptx.interleave_high(tile[i, 4], tile[nxt, 4])

        src = rng.integers(0, 2 ** 16, size=(32, 24), dtype=np.uint16)
        words = np.zeros((32, 8), np.uint32)
        inter = np.zeros((32, 2), np.uint32)
        _, words, inter = run1(kernel, src, words, inter)
        s32 = src.astype(np.uint32)
        want = (s32[:, 8:16:2] | (s32[:, 9:16:2] << 16))
        ok = np.array_equal(words[:, 4:8], want) and np.array_equal(words[:, 0], s32[:, 0])
        check("load_u16x8 / store_u32x4 / load2 / store2", ok, "16-byte global load -> 16-byte shared store")
        nxt = np.roll(np.arange(32), -1)
        want_lo = s32[:, 8] | (s32[nxt, 8] << 16)
        want_hi = s32[:, 9] | (s32[nxt, 9] << 16)
        check("interleave_low / interleave_high", np.array_equal(inter[:, 0], want_lo)
              and np.array_equal(inter[:, 1], want_hi), "(row r, row r + 1) pairs of one column")

    guarded("vector", vector_case)
    return 0 if all(results) else 1


# ---------------------------------------------------------------------------------------------------------------------
# part 2: flash kernel correctness
# ---------------------------------------------------------------------------------------------------------------------
def correctness_cases(tiny: bool = False):
    """(name, dict) pairs. ``layout``: 'contig', 'blhd' (memory (B, L, H, D), a transposed view) or 'pad3' (rows of
    headdim + 3 elements: no 16-byte alignment, element loads)."""
    def case(dtype, b, h, hk, lq, lk, d, causal, layout="contig", scale=1.0, sm_scale=None, warps=4):
        return dict(dtype=dtype, b=b, h=h, hk=hk, lq=lq, lk=lk, d=d, causal=causal, layout=layout, scale=scale,
                    sm_scale=sm_scale, warps=warps)

    if tiny:  # for a smoke test of this script under the simulator
        return [case("float16", 1, 2, 1, 20, 17, 16, True), case("bfloat16", 1, 1, 1, 5, 9, 8, False, "pad3")]
    f, bf = "float16", "bfloat16"
    return [
        case(f, 2, 4, 4, 128, 128, 64, False),
        case(f, 2, 4, 4, 128, 128, 64, True),
        case(f, 1, 4, 2, 1000, 1000, 128, True),  # GQA
        case(f, 1, 4, 1, 1000, 1000, 128, False),  # MQA
        case(f, 1, 2, 2, 65, 63, 16, True),  # Lq > Lk: the first rows see no key
        case(f, 1, 2, 2, 63, 65, 16, False),
        case(f, 1, 2, 1, 1, 1000, 59, True),  # one query row (decode-like), odd headdim
        case(f, 1, 2, 2, 1000, 1, 59, True),  # one key: rows 0..998 see nothing
        case(f, 1, 3, 3, 200, 333, 80, True),
        case(f, 1, 2, 2, 257, 190, 111, False),
        case(f, 1, 2, 2, 257, 190, 111, True),
        case(f, 1, 2, 1, 300, 300, 256, True),
        case(f, 1, 2, 2, 129, 70, 256, False),
        case(f, 2, 4, 2, 300, 300, 128, True, "blhd"),  # strided (transposed) views
        case(f, 1, 2, 2, 100, 100, 64, False, "pad3"),  # rows not 16-byte aligned: element loads
        case(f, 1, 1, 1, 1, 1, 64, False),
        case(f, 1, 2, 2, 1000, 1000, 64, True, scale=3.0, sm_scale=0.3),  # peaky softmax, explicit scale
        case(f, 1, 4, 2, 1000, 1000, 128, True, warps=8),  # the 8-warp variant the timing part compares
        case(f, 1, 4, 4, 700, 700, 64, False, warps=8),
        case(bf, 2, 4, 4, 128, 128, 64, True),
        case(bf, 1, 4, 2, 1000, 1000, 128, False),
        case(bf, 1, 2, 2, 65, 63, 128, True),
        case(bf, 1, 2, 1, 300, 300, 256, False),
        case(bf, 1, 2, 2, 63, 65, 59, True),
        case(bf, 2, 4, 2, 300, 300, 128, True, "blhd"),
    ]


def _make_inputs(np, cuda, simulator, ptx, c, rng):
    """Device q, k, v (bit views) in the requested layout, and their exact float64 values."""
    DeviceNDArray = None
    if not simulator:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray

    def one(heads, length, scale):
        x = (rng.standard_normal((c["b"], heads, length, c["d"])) * scale).astype(np.float32)
        if c["dtype"] == "float16":
            bits = x.astype(np.float16).view(np.uint16)
            exact = bits.view(np.float16).astype(np.float64)
        else:
            bits = ptx.float32_to_bf16_bits(x)
            exact = ptx.bf16_bits_to_float32(bits).astype(np.float64)
        return _place(np, cuda, simulator, DeviceNDArray, bits, c["layout"]), exact

    q, qf = one(c["h"], c["lq"], c["scale"])
    k, kf = one(c["hk"], c["lk"], c["scale"])
    v, vf = one(c["hk"], c["lk"], 1.0)
    return (q, k, v), (qf, kf, vf)


def _place(np, cuda, simulator, DeviceNDArray, bits, layout):
    """bits (B, H, L, D) uint16 -> a device view with that logical shape in the given memory layout."""
    b, h, length, d = bits.shape
    if layout == "contig":
        return _to_device(cuda, simulator, np.ascontiguousarray(bits))
    if layout == "blhd":
        mem = np.ascontiguousarray(bits.transpose(0, 2, 1, 3))  # (B, L, H, D) in memory
        dev = _to_device(cuda, simulator, mem)
        strides = (mem.strides[0], mem.strides[2], mem.strides[1], mem.strides[3])
    elif layout == "pad3":
        mem = np.zeros((b, h, length, d + 3), np.uint16)
        mem[..., :d] = bits
        dev = _to_device(cuda, simulator, mem)
        strides = mem.strides
    else:
        raise ValueError(layout)
    if simulator:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(np.lib.stride_tricks.as_strided(dev.copy_to_host(), (b, h, length, d), strides))
    return DeviceNDArray(shape=(b, h, length, d), strides=strides, dtype=np.uint16, gpu_data=dev.gpu_data)


def _case_spec(flash_mma, c):
    """(padded head dim, dtype, vector loads) that a case runs with on a GPU (device buffers are 256-byte aligned)."""
    return flash_mma.padded_head_dim(c["d"]), c["dtype"], c["d"] % 8 == 0 and c["layout"] != "pad3", c["warps"]


def part_correctness(args):
    np, simulator, flash_mma, _ = _setup()
    import reference

    if args.compile_only:
        specs = sorted({_case_spec(flash_mma, c) for c in correctness_cases(args.tiny)})
        failed = 0
        for d_pad, dtype, vector, warps in specs:
            name = f"flash kernel D_pad={d_pad} {dtype} vector_loads={vector} warps={warps}"
            try:
                config = flash_mma.MmaConfig(warps=warps)
                fn = flash_mma._kernel_source(flash_mma.tiles_for(config, d_pad), dtype == "bfloat16", vector)
                _offline_compile(fn, flash_mma.SIGNATURE.args, name, config.launch_bounds())
                say(f"PASS correct {name}: compiled for sm_90 (not run)")
            except Exception as exc:  # noqa: BLE001
                failed += 1
                say(f"ERROR correct {name}: {type(exc).__name__}: {exc}")
        return 1 if failed else 0

    say(f"INFO device: {_describe_device(cuda, simulator)}")
    rng = np.random.default_rng(1)
    poison = {"float16": 0x7E00, "bfloat16": 0x7FC0}  # quiet NaN bit patterns
    results = []
    seen_kernels = set()
    for c in correctness_cases(args.tiny):
        name = (f"{c['dtype']:8s} B{c['b']} H{c['h']}/{c['hk']} Lq{c['lq']} Lk{c['lk']} D{c['d']} "
                f"causal={int(c['causal'])} {c['layout']}" + (f" scale{c['scale']}" if c["scale"] != 1.0 else "")
                + (f" warps={c['warps']}" if c["warps"] != 4 else ""))
        config = flash_mma.MmaConfig(warps=c["warps"])
        if time.time() > args.deadline:
            say(f"SKIP correct {name}: time budget used up")
            continue
        try:
            (q, k, v), (qf, kf, vf) = _make_inputs(np, cuda, simulator, ptx, c, rng)
            b, h, lq, d = c["b"], c["h"], c["lq"], c["d"]
            # out: a poisoned (B, H, Lq, D + 5) buffer; the kernel writes [..., :D] and must leave the rest alone
            out_mem = np.full((b, h, lq, d + 5), poison[c["dtype"]], np.uint16)
            out_dev = _to_device(cuda, simulator, out_mem)
            out = out_dev[:, :, :, :d]
            lse_dev = _to_device(cuda, simulator, np.full((b, h, lq), np.nan, np.float32))
            sm_scale = c["sm_scale"] if c["sm_scale"] is not None else 1.0 / math.sqrt(d)
            t0 = time.time()
            stream = 0 if simulator else cuda.default_stream()
            flash_mma.launch(q, k, v, out, lse_dev, True, sm_scale, c["causal"], stream, config=config,
                             dtype=c["dtype"])
            _sync(cuda, simulator)
            elapsed = time.time() - t0
            key = (flash_mma.padded_head_dim(d), c["dtype"], flash_mma.vector_loads_ok(q, k, v), c["warps"])
            if key not in seen_kernels and not simulator:
                seen_kernels.add(key)
                kern = flash_mma.flash_mma_kernel(config, key[0], key[1] == "bfloat16", key[2])
                say(f"INFO kernel D_pad={key[0]} {key[1]} vector_loads={key[2]} warps={key[3]}: first call "
                    f"{elapsed:.1f}s "
                    f"(with compile), {kern.get_regs_per_thread()} registers, "
                    f"{kern.get_local_mem_per_thread()} B local memory, {kern.get_shared_mem_per_block()} B shared")
            got_mem = _to_host(simulator, out_dev)
            lse = _to_host(simulator, lse_dev).astype(np.float64)
            got_bits = got_mem[..., :d]
            if c["dtype"] == "float16":
                got = got_bits.view(np.float16).astype(np.float64)
            else:
                got = ptx.bf16_bits_to_float32(got_bits).astype(np.float64)
            ref, ref_lse = reference.attention(qf, kf, vf, causal=c["causal"], sm_scale=sm_scale, return_lse=True)
            denom = np.linalg.norm(ref)
            err = float(np.linalg.norm(got - ref) / denom) if denom > 0 else float(np.linalg.norm(got))
            if np.isnan(got).any():
                err = float("inf")
            untouched = bool(np.all(got_mem[..., d:] == poison[c["dtype"]]))
            inf_ref = np.isneginf(ref_lse)
            inf_ok = bool(np.array_equal(np.isneginf(lse), inf_ref)) and not np.isnan(lse).any()
            fin = ~inf_ref
            lse_err = float(np.max(np.abs(lse[fin] - ref_lse[fin]) / np.maximum(1.0, np.abs(ref_lse[fin])))) \
                if fin.any() else 0.0
            zero_rows_ok = bool(np.all(got[np.broadcast_to(inf_ref[..., None], got.shape)] == 0.0))
            ok = (err <= TOLERANCE[c["dtype"]] and untouched and inf_ok and lse_err <= LSE_TOLERANCE
                  and zero_rows_ok)
            results.append(ok)
            say(f"{'PASS' if ok else 'FAIL'} correct {name}: rel err {err:.2e} (bound {TOLERANCE[c['dtype']]:.0e}), "
                f"lse err {lse_err:.1e}, -inf rows ok {inf_ok}, empty rows zero {zero_rows_ok}, "
                f"padding untouched {untouched}")
        except Exception as exc:  # noqa: BLE001
            results.append(False)
            say(f"ERROR correct {name}: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stdout)
            if "CUDA_ERROR" in str(exc) or "cudaError" in str(exc):
                say("ERROR correct: CUDA error: the context is probably unusable, stopping this part")
                return 1
    return 0 if all(results) else 1


# ---------------------------------------------------------------------------------------------------------------------
# part 3: timing
# ---------------------------------------------------------------------------------------------------------------------
def part_timing(args):
    np, simulator, flash_mma, _ = _setup()
    if simulator or args.compile_only:
        say("SKIP timing: needs a GPU")
        return 0
    say(f"INFO device: {_describe_device(cuda, simulator)}")
    try:
        import torch
        import torch.nn.functional as F

        have_torch = torch.cuda.is_available()
    except Exception as exc:  # noqa: BLE001
        have_torch = False
        say(f"INFO torch not usable ({type(exc).__name__}: {exc}): timing numba_attn only")
    reps = args.reps
    stream = cuda.default_stream()

    def median_ms(fn, use_torch):
        """Median milliseconds of ``fn`` over ``reps`` runs, each between two CUDA events on the default stream."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if use_torch:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
            else:
                start, end = cuda.event(), cuda.event()
                start.record(stream)
                fn()
                end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return float(np.median(times))

    @cuda.jit
    def fill(bits, seed):  # pseudo-random float16 values in [-2, 2] without a host round trip
        i = cuda.grid(1)
        if i < bits.size:
            z = (i * 2654435761 + seed * 40503) & 0xFFFFFFFF
            z = (((z >> 16) ^ z) * 0x45D9F3B) & 0xFFFFFFFF
            z = ((z >> 16) ^ z) & 0xFFFF
            bits[i] = ptx.low_u16(ptx.pack_half2(z * (4.0 / 65535.0) - 2.0, 0.0))

    def sdpa_context():
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        except ImportError:
            return torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False, enable_mem_efficient=False)

    configs = [(4, 32, 128), (4, 48, 64)]
    lengths = (2048, 4096, 8192)
    for b, h, d in configs:
        for n in lengths:
            for causal in (False, True):
                name = f"B{b} H{h} N{n} D{d} causal={int(causal)} float16"
                if time.time() > args.deadline:
                    say(f"SKIP timing {name}: time budget used up")
                    continue
                try:
                    flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
                    shape = (b, h, n, d)
                    if have_torch:
                        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
                        out = torch.empty_like(q)
                        qd, kd, vd, od = (cuda.as_cuda_array(x) for x in (q, k, v, out))
                    else:
                        qd, kd, vd = (cuda.device_array(shape, np.float16) for _ in range(3))
                        for i, x in enumerate((qd, kd, vd)):
                            flat = x.reshape(x.size).view(np.uint16)
                            fill[(x.size + 255) // 256, 256](flat, i + 1)
                        od = cuda.device_array(shape, np.float16)
                    lse = cuda.device_array((b, h, n), np.float32)
                    sm_scale = 1.0 / math.sqrt(d)

                    line = f"INFO timing {name}:"
                    t_ours = None
                    for warps in (4, 8):
                        config = flash_mma.MmaConfig(warps=warps)

                        def ours():
                            flash_mma.launch(qd, kd, vd, od, lse, False, sm_scale, causal, stream, config=config)

                        t = median_ms(ours, False)
                        t_ours = t if t_ours is None else min(t_ours, t)
                        line += f" mma {warps} warps {t:8.3f} ms {flops / t / 1e9:6.1f} TFLOP/s |"
                    if have_torch:
                        def theirs():
                            with sdpa_context():
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        t_torch = median_ms(theirs, True)
                        ref = theirs()
                        torch.cuda.synchronize()
                        diff = (out.float() - ref.float()).norm() / ref.float().norm()
                        line += (f" torch SDPA flash {t_torch:8.3f} ms {flops / t_torch / 1e9:6.1f} TFLOP/s"
                                 f" | best ours/torch time {t_ours / t_torch:5.2f}x | rel diff {float(diff):.1e}")
                    say(line)
                    del qd, kd, vd, od, lse
                    if have_torch:
                        del q, k, v, out
                        torch.cuda.empty_cache()
                except Exception as exc:  # noqa: BLE001
                    say(f"ERROR timing {name}: {type(exc).__name__}: {exc}")
                    traceback.print_exc(file=sys.stdout)
                    if "CUDA_ERROR" in str(exc):
                        return 1
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------------
def _run_child(part, deadline, extra):
    """Run one part in a child process, echo its output, return (exit code, output lines)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--deadline", str(deadline)] + extra
    lines = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    killed = []

    def watchdog():
        # the child skips work past the deadline itself; this only catches a hang
        if proc.poll() is None:
            killed.append(True)
            proc.kill()

    timer = threading.Timer(max(5.0, deadline - time.time() + 30.0), watchdog)
    timer.start()
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
        proc.wait()
    finally:
        timer.cancel()
    if killed:
        lines.append(f"ERROR {part}: killed after running past the time budget")
        say(lines[-1])
    return proc.returncode, lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, help="run one part in this process")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds for the whole run (default 170)")
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per timing case (median)")
    parser.add_argument("--tiny", action="store_true", help="two tiny correctness cases (simulator smoke test)")
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU needed: compile every kernel for sm_90 (set NUMBA_ENABLE_CUDASIM=0) and run "
                             "ptxas -v on it instead of running it")
    args = parser.parse_args()
    start = time.time()
    if args.deadline is None:
        args.deadline = start + args.budget
    if args.part:
        try:
            code = {"unit": part_unit, "correctness": part_correctness, "timing": part_timing}[args.part](args)
        except Exception as exc:  # noqa: BLE001
            say(f"ERROR {args.part}: {type(exc).__name__}: {exc}")
            traceback.print_exc(file=sys.stdout)
            code = 1
        sys.exit(code)

    extra = ["--reps", str(args.reps)] + (["--tiny"] if args.tiny else []) + \
        (["--compile-only"] if args.compile_only else [])
    summary = {}
    failures = []
    # time shares: the correctness part compiles most kernels; timing reuses them from Numba's disk cache
    shares = {"unit": 0.15, "correctness": 0.75, "timing": 1.0}
    for part in PARTS:
        part_deadline = start + shares[part] * (args.deadline - start)
        say(f"==== {part} ====")
        code, lines = _run_child(part, part_deadline, extra)
        counts = {tag: sum(1 for l in lines if l.startswith(tag + " ")) for tag in ("PASS", "FAIL", "ERROR", "SKIP")}
        summary[part] = (code, counts)
        failures += [l for l in lines if l.startswith(("FAIL ", "ERROR "))]
        if code not in (0, 1):
            failures.append(f"ERROR {part}: child exited with status {code} (crash?)")
    say("==== summary ====")
    for part, (code, counts) in summary.items():
        say(f"{part:12s} exit {code}: " + ", ".join(f"{n} {tag}" for tag, n in counts.items()))
    for line in failures:
        say(f"  {line}")
    say(f"total {time.time() - start:.0f} s; {'ALL PASSED' if not failures else f'{len(failures)} problem(s)'}")
    sys.exit(0 if not failures else 1)


if __name__ == "__main__":
    main()
