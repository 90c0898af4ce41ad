"""Inline-PTX (and small LLVM-IR) intrinsics for the tensor-core kernels, via Numba ``@intrinsic``.

Every intrinsic is a plain function call inside a ``@cuda.jit`` kernel. A 32-bit operand that holds two 16-bit
values is passed as one integer (any Numba integer type; it is truncated to 32 bits); the element with the smaller
index sits in the LOW half, as the PTX fragment layouts require ("elements low to high").

Warp-level MMA ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32``. For lane ``l`` of the warp let
``g = l // 4`` (PTX "groupID") and ``t = l % 4`` ("threadID_in_group"), and let ``X[r][c0, c1]`` be one 32-bit
register holding ``X[r][c0]`` (low half) and ``X[r][c1]`` (high half). From the PTX ISA, "Matrix Fragments for
mma.m16n8k16 with floating point type"::

    A (16 x 16, row major), four registers      a0 = A[g    ][2t    , 2t + 1]
                                                a1 = A[g + 8][2t    , 2t + 1]
                                                a2 = A[g    ][2t + 8, 2t + 9]
                                                a3 = A[g + 8][2t + 8, 2t + 9]
    B (16 x 8, "col": columns contiguous),      b0 = B[2t    , 2t + 1][g]      (two consecutive k of column g)
      two registers                             b1 = B[2t + 8, 2t + 9][g]
    C, D (16 x 8, float32), four registers      c0 = C[g    ][2t]   c1 = C[g    ][2t + 1]
                                                c2 = C[g + 8][2t]   c3 = C[g + 8][2t + 1]

Consequences the attention kernel relies on:

* ``S = Q K^T`` with K stored ``[key][d]``: B = K^T, so ``b0`` is the 32-bit word of K row ``g`` holding columns
  ``2t, 2t + 1`` of the 16-column k-slice and ``b1`` the word 4 further on.
* ``O += P V``: the C fragments of two neighbouring n8 blocks ``2j`` and ``2j + 1`` of ``S`` (keys ``16j .. 16j + 15``),
  packed pairwise, ARE the A fragment of k-step ``j``: ``a0 = (c0, c1)`` and ``a1 = (c2, c3)`` of block ``2j`` (key
  columns ``16j + 2t, +1`` of rows ``g``, ``g + 8``), ``a2 = (c0, c1)`` and ``a3 = (c2, c3)`` of block ``2j + 1`` (key
  columns ``16j + 8 + 2t, +1``). No shuffles and no shared memory between the two GEMMs.
* For V as B (``B[k = key][n = d]``) a register needs two consecutive KEYS of one column ``d``: from a ``[key][d]``
  tile ``ldmatrix_x4_trans`` delivers exactly that (or V is stored transposed ``[d][key]``).
* ``ldmatrix_x4`` on a ``[row][d]`` tile: matrices (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8) are the A
  fragment ``a0..a3`` of a 16x16 block; matrices (rows +0, cols +0), (+0, +8), (+8, +0), (+8, +8) of a K tile are the
  B fragments ``(b0, b1)`` of two n8 blocks.

Warp-level MMA ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` (PTX "Matrix Fragments for mma.m16n8k8" with
``.tf32``), one 32-bit register per element (float32 bits; the hardware reads the top 19)::

    A (16 x 8), four registers     a0 = A[g][t]   a1 = A[g + 8][t]   a2 = A[g][t + 4]   a3 = A[g + 8][t + 4]
    B (8 x 8), two registers       b0 = B[t][g]   b1 = B[t + 4][g]
    C, D                           as for m16n8k16

The k index of one MMA may be permuted freely as long as A and B use the same permutation. With ``A col t <-> k 2t``
and ``A col t + 4 <-> k 2t + 1`` the C fragment of one n8 block of a product IS the A fragment of a k8 step of the
next product: ``(a0, a1, a2, a3) = (c0, c2, c1, c3)``, and the matching B registers are rows ``2t`` and ``2t + 1``.

Under Numba's CUDA simulator (``numba_attn.runtime.device.SIMULATOR``) inline PTX cannot run: the same names are then
pure-Python emulations with the same semantics. The warp-collective ones (``mma_*``, ``shfl_xor_f32``) exchange
operands through the thread block's barrier, so under the simulator every thread of the block must call them the
same number of times in the same order (the kernels of this package do); that lets the tensor-core kernel's index
arithmetic be tested without a GPU.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from ..runtime.device import SIMULATOR

__all__ = [
    "mma_m16n8k16_f16",
    "mma_m16n8k16_bf16",
    "pack_half2",
    "pack_bf16x2",
    "pack_u16x2",
    "interleave_low",
    "interleave_high",
    "low_u16",
    "high_u16",
    "exp2_approx",
    "shfl_xor_f32",
    "load2",
    "store2",
    "load_u16x8",
    "store_u32x4",
    "float32_to_bf16_bits",
    "bf16_bits_to_float32",
    "mma_m16n8k8_tf32",
    "to_tf32",
    "float_bits",
    "bits_float",
    "load_f32x2",
    "load_f32x4_1d",
    "load_u16x2",
    "store_u32_at",
    "store_f32x2_at",
    "load_f32_at",
    "load1",
    "store1",
    "load_f32x4",
    "load_u16x4",
    "store_f32x2",
    "store_f32x4",
    "store_pair",
    "half_to_float",
    "bf16_to_float",
    "ldmatrix_x4",
    "ldmatrix_x4_trans",
    "cp_async_16",
    "cp_async_16_prefetch",
    "cp_async_commit",
    "cp_async_wait_all",
    "cp_async_wait_group",
    "atomic_inc_acq_rel",
    "warp_sync",
    "all_lanes",
]


# ---------------------------------------------------------------------------------------------------------------------
# Host helpers (NumPy): the simulator emulation, the tests and scripts/check_mma.py use them
# ---------------------------------------------------------------------------------------------------------------------
def float32_to_bf16_bits(x) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of ``x``, rounded to nearest even like ``cvt.rn.bf16.f32`` (NaN stays NaN)."""
    x32 = np.asarray(x, dtype=np.float32)
    bits = np.ascontiguousarray(x32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = np.where(np.isnan(x32), (bits >> 16) | 0x40, rounded)
    return rounded.astype(np.uint16)


def bf16_bits_to_float32(bits) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact)."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f16_bits(x) -> int:
    with np.errstate(over="ignore"):
        return int(np.array(x, dtype=np.float32).astype(np.float16).view(np.uint16))


def _bf16_bits(x) -> int:
    return int(float32_to_bf16_bits(np.array([x], dtype=np.float32))[0])


def _halves(word, bf16: bool):
    lo, hi = int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF
    if bf16:
        return float(bf16_bits_to_float32(lo)), float(bf16_bits_to_float32(hi))
    return float(np.uint16(lo).view(np.float16)), float(np.uint16(hi).view(np.float16))


# ---------------------------------------------------------------------------------------------------------------------
# Simulator emulation
# ---------------------------------------------------------------------------------------------------------------------
def _sim_warp_gather(value):
    """All 32 lanes' ``value`` of the calling thread's warp (simulator only; a block-wide barrier inside)."""
    return _sim_group_gather(value, 32)


def _sim_group_gather(value, size: int):
    """``value`` of every thread of the calling thread's group of ``size`` consecutive threads (a warp, a
    warpgroup; simulator only; a block-wide barrier inside)."""
    thread = threading.current_thread()
    slots = thread._manager.__dict__.setdefault("_ptx_exchange", ({}, {}))
    calls = getattr(thread, "_ptx_calls", 0)
    thread._ptx_calls = calls + 1
    # Two slots used alternately: a thread only comes back to a slot after every thread has passed the next
    # barrier, i.e. after every thread has read it.
    slot = slots[calls % 2]
    tid = thread.thread_id
    slot[tid] = value
    thread.syncthreads()
    base = tid - tid % size
    return [slot[base + i] for i in range(size)]


def _sim_lane() -> int:
    return threading.current_thread().thread_id % 32


def _sim_mma(bf16, regs):
    lanes = _sim_warp_gather(tuple(regs))
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    c = np.zeros((16, 8))
    for lane, r in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for reg, (row, col) in zip(r[:4], ((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            a[row, col], a[row, col + 1] = _halves(reg, bf16)
        for reg, row in zip(r[4:6], (2 * t, 2 * t + 8)):
            b[row, g], b[row + 1, g] = _halves(reg, bf16)
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = (float(x) for x in r[6:])
    d = (a @ b + c).astype(np.float32)
    g, t = _sim_lane() // 4, _sim_lane() % 4
    return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]


if SIMULATOR:

    def mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """Simulator emulation of the float16 MMA (see the GPU version)."""
        return _sim_mma(False, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

    def mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """Simulator emulation of the bfloat16 MMA (see the GPU version)."""
        return _sim_mma(True, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))

    def pack_half2(lo, hi):
        return np.uint32(_f16_bits(lo) | (_f16_bits(hi) << 16))

    def pack_bf16x2(lo, hi):
        return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))

    def pack_u16x2(lo, hi):
        return np.uint32((int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16))

    interleave_low = pack_u16x2  # the low halves of two words are packed exactly like two 16-bit values

    def interleave_high(a, b):
        return np.uint32(((int(a) >> 16) & 0xFFFF) | (int(b) & 0xFFFF0000))

    def low_u16(word):
        return np.uint16(int(word) & 0xFFFF)

    def high_u16(word):
        return np.uint16((int(word) >> 16) & 0xFFFF)

    def exp2_approx(x):
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            return np.float32(np.exp2(np.float32(x)))

    def shfl_xor_f32(x, lane_mask):
        return _sim_warp_gather(np.float32(x))[_sim_lane() ^ int(lane_mask)]

    def load2(arr, i, j):
        return arr[i, j]

    def store2(arr, i, j, value):
        arr[i, j] = value

    def load_u16x8(arr, i, j):
        words = [int(arr[i, j + 2 * n]) | (int(arr[i, j + 2 * n + 1]) << 16) for n in range(4)]
        return tuple(np.uint32(w) for w in words)

    def store_u32x4(arr, i, j, w0, w1, w2, w3):
        arr[i, j], arr[i, j + 1], arr[i, j + 2], arr[i, j + 3] = w0, w1, w2, w3

    def _tf32_value(bits):
        return float(np.uint32(int(bits) & 0xFFFFE000).view(np.float32))

    def mma_m16n8k8_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """Simulator emulation of the tf32 MMA (operands are float32 bit patterns; the low 13 bits are ignored)."""
        lanes = _sim_warp_gather((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
        a = np.zeros((16, 8))
        b = np.zeros((8, 8))
        c = np.zeros((16, 8))
        for lane, r in enumerate(lanes):
            g, t = lane // 4, lane % 4
            a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4] = (_tf32_value(x) for x in r[:4])
            b[t, g], b[t + 4, g] = _tf32_value(r[4]), _tf32_value(r[5])
            c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = (float(x) for x in r[6:])
        with np.errstate(over="ignore", invalid="ignore"):
            d = (a @ b + c).astype(np.float32)
        g, t = _sim_lane() // 4, _sim_lane() % 4
        return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]

    def to_tf32(x):
        bits = int(np.float32(x).view(np.uint32))
        if (bits & 0x7F800000) == 0x7F800000:  # inf and NaN pass unchanged
            return np.uint32(bits)
        return np.uint32(((bits + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF)

    def float_bits(x):
        return np.float32(x).view(np.uint32)

    def bits_float(bits):
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    def load_f32x2(arr, i):
        return arr[i], arr[i + 1]

    def load_f32x4_1d(arr, i):
        return arr[i], arr[i + 1], arr[i + 2], arr[i + 3]

    def load_u16x2(arr, i):
        return np.uint32(int(arr[i]) | (int(arr[i + 1]) << 16))

    def store_u32_at(arr, offset, value):
        data = np.asarray(arr).__array_interface__["data"][0]
        ctypes.c_uint32.from_address(data + int(offset)).value = int(value) & 0xFFFFFFFF

    def store_f32x2_at(arr, offset, a, b):
        data = np.asarray(arr).__array_interface__["data"][0]
        (ctypes.c_float * 2).from_address(data + int(offset))[:] = [float(np.float32(a)), float(np.float32(b))]

    def load_f32_at(arr, offset):
        data = np.asarray(arr).__array_interface__["data"][0]
        return np.float32(ctypes.c_float.from_address(data + int(offset)).value)

    def load1(arr, i):
        return arr[i]

    _sim_atomics = threading.Lock()

    def atomic_inc_acq_rel(arr, i, limit):
        with _sim_atomics:
            old = np.uint32(arr[i])
            arr[i] = 0 if old >= limit else old + 1
            return old

    def store1(arr, i, value):
        arr[i] = value

    def load_f32x4(arr, i, j):
        return arr[i, j], arr[i, j + 1], arr[i, j + 2], arr[i, j + 3]

    def load_u16x4(arr, i, j):
        return (np.uint32(int(arr[i, j]) | (int(arr[i, j + 1]) << 16)),
                np.uint32(int(arr[i, j + 2]) | (int(arr[i, j + 3]) << 16)))

    def store_f32x2(arr, i, a, b):
        arr[i], arr[i + 1] = a, b

    def store_f32x4(arr, i, a, b, c, d):
        arr[i], arr[i + 1], arr[i + 2], arr[i + 3] = a, b, c, d

    def store_pair(arr, i, j, a, b):
        arr[i, j], arr[i, j + 1] = a, b

    def half_to_float(bits):
        return np.float32(np.uint16(int(bits) & 0xFFFF).view(np.float16))

    def bf16_to_float(bits):
        return np.uint32((int(bits) & 0xFFFF) << 16).view(np.float32)

    def _sim_ldmatrix(arr, i, trans):
        rows = _sim_warp_gather(int(i))  # lane 8m + r gives the start of row r of matrix m
        g, t = _sim_lane() // 4, _sim_lane() % 4
        words = []
        for m in range(4):
            if trans:  # this lane gets column g, rows 2t and 2t + 1
                lo, hi = arr[rows[8 * m + 2 * t] + g], arr[rows[8 * m + 2 * t + 1] + g]
            else:  # row g, columns 2t and 2t + 1
                lo, hi = arr[rows[8 * m + g] + 2 * t], arr[rows[8 * m + g] + 2 * t + 1]
            words.append(np.uint32(int(lo) | (int(hi) << 16)))
        return tuple(words)

    def ldmatrix_x4(arr, i):
        """Simulator emulation of ``ldmatrix.x4`` (see the GPU version)."""
        return _sim_ldmatrix(arr, i, False)

    def ldmatrix_x4_trans(arr, i):
        """Simulator emulation of ``ldmatrix.x4.trans`` (see the GPU version)."""
        return _sim_ldmatrix(arr, i, True)

    def cp_async_16(dst, i, src, offset, nbytes):
        """Simulator emulation of ``cp.async``: a synchronous copy (or zero fill)."""
        raw = np.zeros(16, np.uint8)
        if nbytes:
            data = np.asarray(src).__array_interface__["data"][0]
            raw[:] = np.ctypeslib.as_array((ctypes.c_uint8 * 16).from_address(data + int(offset)))
        words = raw.view(dst.dtype)
        for n in range(len(words)):
            dst[i + n] = words[n]

    cp_async_16_prefetch = cp_async_16

    def cp_async_commit():
        pass

    def all_lanes(predicate):
        """Simulator emulation of ``vote.sync.all`` (see the GPU version)."""
        return np.uint32(all(_sim_warp_gather(bool(predicate))))

    def cp_async_wait_all():
        pass

    def warp_sync():
        """Simulator twin of ``bar.warp.sync``: a block-wide barrier (every thread must reach it)."""
        threading.current_thread().syncthreads()

    def cp_async_wait_group(pending: int):
        """Simulator twin of ``cp_async_wait_group``: the copies are synchronous already."""
        return cp_async_wait_all

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _I16 = ir.IntType(16)
    _I32 = ir.IntType(32)
    _F32 = ir.FloatType()

    def _i32(context, builder, value, ty):
        return context.cast(builder, value, ty, types.uint32)

    def _f32(context, builder, value, ty):
        return context.cast(builder, value, ty, types.float32)

    def _asm(builder, ret, arg_types, text, constraints, args, convergent=False):
        """Call an inline-asm block. Warp-synchronous instructions are marked ``convergent`` so that LLVM never
        moves them across control flow."""
        asm = ir.InlineAsm(ir.FunctionType(ret, arg_types), text, constraints)
        return builder.call(asm, args, attrs=("convergent",) if convergent else ())

    def _is_number(*tys):
        return all(isinstance(ty, (types.Integer, types.Float)) for ty in tys)

    def _is_int(*tys):
        return all(isinstance(ty, types.Integer) for ty in tys)

    def _mma(ab_type, regs, accs, shape="m16n8k16"):
        """Typing and codegen of one ``mma.sync`` with four A, two B and four float32 C/D registers (the register
        counts of both m16n8k16 with 16-bit operands and m16n8k8 with tf32)."""
        if not (_is_int(*regs) and _is_number(*accs)):
            return None
        text = (
            f"mma.sync.aligned.{shape}.row.col.f32.{ab_type}.{ab_type}.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
        )
        sig = types.UniTuple(types.float32, 4)(*regs, *accs)

        def codegen(context, builder, sig, args):
            ins = [_i32(context, builder, v, ty) for v, ty in zip(args[:6], sig.args[:6])]
            ins += [_f32(context, builder, v, ty) for v, ty in zip(args[6:], sig.args[6:])]
            res = _asm(builder, ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4, text,
                       "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", ins, convergent=True)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    @intrinsic
    def mma_m16n8k16_f16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3): one warp-wide ``D = A B + C``, A 16x16
        and B 16x8 float16, C and D 16x8 float32::

            mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0,d1,d2,d3}, {a0,a1,a2,a3}, {b0,b1}, {c0,c1,c2,c3};

        a and b are 32-bit integers holding two float16 each (low half = lower index), c and d float32, laid out
        as in the module docstring. All 32 lanes must call it together (converged)."""
        return _mma("f16", (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3))

    @intrinsic
    def mma_m16n8k16_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """As ``mma_m16n8k16_f16`` with bfloat16 A and B::

        mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0,d1,d2,d3}, {a0,a1,a2,a3}, {b0,b1}, {c0,c1,c2,c3};
        """
        return _mma("bf16", (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3))

    def _pack(cvt, lo, hi):
        if not _is_number(lo, hi):
            return None
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            a = _f32(context, builder, args[0], sig.args[0])
            b = _f32(context, builder, args[1], sig.args[1])
            # cvt puts its FIRST source in the UPPER half: pass (hi, lo)
            return _asm(builder, _I32, [_F32, _F32], f"{cvt} $0, $1, $2;", "=r,f,f", [b, a])

        return sig, codegen

    @intrinsic
    def pack_half2(typingctx, lo, hi):
        """(lo, hi) -> uint32: two float32 rounded to nearest float16, ``lo`` in bits 0-15, ``hi`` in 16-31 (an
        A/B operand register)::

            cvt.rn.f16x2.f32 d, hi, lo;     // cvt puts its first source in the upper half"""
        return _pack("cvt.rn.f16x2.f32", lo, hi)

    @intrinsic
    def pack_bf16x2(typingctx, lo, hi):
        """(lo, hi) -> uint32: as ``pack_half2``, to bfloat16::

            cvt.rn.bf16x2.f32 d, hi, lo;"""
        return _pack("cvt.rn.bf16x2.f32", lo, hi)

    def _bits_op(sig, body):
        def codegen(context, builder, sig, args):
            return body(builder, *[_i32(context, builder, v, ty) for v, ty in zip(args, sig.args)])

        return sig, codegen

    def _c(value):
        return ir.Constant(_I32, value)

    @intrinsic
    def pack_u16x2(typingctx, lo, hi):
        """(lo, hi) -> uint32 ``(lo & 0xFFFF) | (hi & 0xFFFF) << 16``: two raw 16-bit patterns (float16 or
        bfloat16 elements loaded as uint16) in one register. Plain LLVM, no asm."""
        if not _is_int(lo, hi):
            return None
        return _bits_op(types.uint32(lo, hi),
                        lambda b, x, y: b.or_(b.and_(x, _c(0xFFFF)), b.shl(y, _c(16))))

    #: (a, b) -> uint32 ``(a & 0xFFFF) | (b << 16)``: the low halves of two words (element 2i of two rows) — the
    #: same bit operation as ``pack_u16x2``.
    interleave_low = pack_u16x2

    @intrinsic
    def interleave_high(typingctx, a, b):
        """(a, b) -> uint32 ``(a >> 16) | (b & 0xFFFF0000)``: the high halves of two words (element 2i + 1)."""
        if not _is_int(a, b):
            return None
        return _bits_op(types.uint32(a, b),
                        lambda bl, x, y: bl.or_(bl.lshr(x, _c(16)), bl.and_(y, _c(0xFFFF0000))))

    @intrinsic
    def low_u16(typingctx, word):
        """word -> uint16: bits 0-15 (the element with the lower index)."""
        if not _is_int(word):
            return None
        return _bits_op(types.uint16(word), lambda b, x: b.trunc(x, _I16))

    @intrinsic
    def high_u16(typingctx, word):
        """word -> uint16: bits 16-31."""
        if not _is_int(word):
            return None
        return _bits_op(types.uint16(word), lambda b, x: b.trunc(b.lshr(x, _c(16)), _I16))

    @intrinsic
    def exp2_approx(typingctx, x):
        """x -> float32 ``2**x`` on the SFU, subnormals flushed (``exp2(-inf) = 0``)::

            ex2.approx.ftz.f32 d, x;"""
        if not _is_number(x):
            return None
        sig = types.float32(x)

        def codegen(context, builder, sig, args):
            return _asm(builder, _F32, [_F32], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
                        [_f32(context, builder, args[0], sig.args[0])])

        return sig, codegen

    @intrinsic
    def shfl_xor_f32(typingctx, x, lane_mask):
        """(x, lane_mask) -> float32: ``x`` of lane ``laneid ^ lane_mask``; all 32 lanes take part::

            shfl.sync.bfly.b32 d, x, lane_mask, 31, 0xffffffff;"""
        if not (_is_number(x) and _is_int(lane_mask)):
            return None
        sig = types.float32(x, lane_mask)

        def codegen(context, builder, sig, args):
            v = _f32(context, builder, args[0], sig.args[0])
            m = _i32(context, builder, args[1], sig.args[1])
            return _asm(builder, _F32, [_F32, _I32], "shfl.sync.bfly.b32 $0, $1, $2, 31, -1;", "=f,f,r", [v, m],
                        convergent=True)

        return sig, codegen

    def _pointer(context, builder, aryty, ary, i_ty, i, j_ty, j):
        """Element pointer of ``ary[i, j]`` WITHOUT negative-index wraparound (Numba adds a compare and select per
        signed index otherwise, which keeps the fully unrolled fragment addresses from folding into base + offset)."""
        array = context.make_array(aryty)(context, builder, value=ary)
        inds = [context.cast(builder, i, i_ty, types.intp), context.cast(builder, j, j_ty, types.intp)]
        return cgutils.get_item_pointer(context, builder, aryty, array, inds, wraparound=False)

    def _is_2d(arr):
        return isinstance(arr, types.Array) and arr.ndim == 2

    @intrinsic
    def load2(typingctx, arr, i, j):
        """(arr, i, j) -> ``arr[i, j]`` of a 2-D array, for ``0 <= i, j`` only (no negative-index wraparound)."""
        if not (_is_2d(arr) and _is_int(i, j)):
            return None
        sig = arr.dtype(arr, i, j)

        def codegen(context, builder, sig, args):
            return builder.load(_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                         sig.args[2], args[2]))

        return sig, codegen

    @intrinsic
    def store2(typingctx, arr, i, j, value):
        """(arr, i, j, value): ``arr[i, j] = value`` for a 2-D array, ``0 <= i, j`` only (no wraparound)."""
        if not (_is_2d(arr) and _is_int(i, j) and _is_number(value)):
            return None
        sig = types.void(arr, i, j, value)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2])
            builder.store(context.cast(builder, args[3], sig.args[3], sig.args[0].dtype), ptr)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def load_u16x8(typingctx, arr, i, j):
        """(arr, i, j) -> (w0, w1, w2, w3): one 16-byte load of ``arr[i, j : j + 8]`` of a 2-D uint16 array whose
        last axis is contiguous; word ``n`` holds elements ``j + 2n`` (low) and ``j + 2n + 1`` (high). The address
        must be 16-byte aligned. Emitted as an LLVM ``<4 x i32>`` load (PTX ``ld.v4.u32``)."""
        if not (_is_2d(arr) and arr.dtype == types.uint16 and _is_int(i, j)):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, i, j)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2])
            vec_ty = ir.VectorType(_I32, 4)
            vec = builder.load(builder.bitcast(ptr, vec_ty.as_pointer()), align=16)
            words = [builder.extract_element(vec, ir.Constant(_I32, n)) for n in range(4)]
            return context.make_tuple(builder, sig.return_type, words)

        return sig, codegen

    @intrinsic
    def store_u32x4(typingctx, arr, i, j, w0, w1, w2, w3):
        """(arr, i, j, w0, w1, w2, w3): one 16-byte store of four words to ``arr[i, j : j + 4]`` of a 2-D uint32
        array (a shared-memory tile) whose last axis is contiguous; the address must be 16-byte aligned."""
        if not (_is_2d(arr) and arr.dtype == types.uint32 and _is_int(i, j, w0, w1, w2, w3)):
            return None
        sig = types.void(arr, i, j, w0, w1, w2, w3)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2])
            vec_ty = ir.VectorType(_I32, 4)
            vec = ir.Constant(vec_ty, ir.Undefined)
            for n in range(4):
                word = _i32(context, builder, args[3 + n], sig.args[3 + n])
                vec = builder.insert_element(vec, word, ir.Constant(_I32, n))
            builder.store(vec, builder.bitcast(ptr, vec_ty.as_pointer()), align=16)
            return context.get_dummy_value()

        return sig, codegen


    @intrinsic
    def mma_m16n8k8_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3): one warp-wide ``D = A B + C``, A 16x8 and
        B 8x8 tf32 (float32 bit patterns, e.g. from ``to_tf32``), C and D 16x8 float32::

            mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {d0,d1,d2,d3}, {a0,a1,a2,a3}, {b0,b1}, {c0,c1,c2,c3};
        """
        return _mma("tf32", (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3), shape="m16n8k8")

    @intrinsic
    def to_tf32(typingctx, x):
        """x -> uint32: float32 ``x`` rounded to tf32 (10 mantissa bits, nearest, ties away), as float32 bits with
        the low 13 bits zero::

            cvt.rna.tf32.f32 d, x;"""
        if not _is_number(x):
            return None
        sig = types.uint32(x)

        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, [_F32], "cvt.rna.tf32.f32 $0, $1;", "=r,f",
                        [_f32(context, builder, args[0], sig.args[0])])

        return sig, codegen

    @intrinsic
    def float_bits(typingctx, x):
        """float32 x -> uint32: its bit pattern (no conversion)."""
        if not _is_number(x):
            return None
        sig = types.uint32(x)

        def codegen(context, builder, sig, args):
            return builder.bitcast(_f32(context, builder, args[0], sig.args[0]), _I32)

        return sig, codegen

    @intrinsic
    def bits_float(typingctx, bits):
        """uint32 bits -> float32 with that bit pattern (no conversion)."""
        if not _is_int(bits):
            return None
        sig = types.float32(bits)

        def codegen(context, builder, sig, args):
            return builder.bitcast(_i32(context, builder, args[0], sig.args[0]), _F32)

        return sig, codegen

    @intrinsic
    def load_f32x2(typingctx, arr, i):
        """(arr, i) -> (arr[i], arr[i + 1]) of a 1-D float32 array (a shared-memory buffer) in ONE 8-byte load
        (``ld.v2.f32``): ``i`` must be even and ``>= 0`` (no negative-index wraparound) and the buffer 8-byte
        aligned. Two scalar loads would cost two instructions and two shared-memory wavefronts."""
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32 and _is_int(i)):
            return None
        sig = types.UniTuple(types.float32, 2)(arr, i)

        def codegen(context, builder, sig, args):
            array = context.make_array(sig.args[0])(context, builder, value=args[0])
            idx = context.cast(builder, args[1], sig.args[1], types.intp)
            ptr = cgutils.get_item_pointer(context, builder, sig.args[0], array, [idx], wraparound=False)
            vec_ty = ir.VectorType(_F32, 2)
            vec = builder.load(builder.bitcast(ptr, vec_ty.as_pointer()), align=8)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(vec, ir.Constant(_I32, n)) for n in range(2)])

        return sig, codegen

    @intrinsic
    def half_to_float(typingctx, bits):
        """16-bit float16 pattern (low half of any integer) -> its float32 value (exact)."""
        if not _is_int(bits):
            return None
        sig = types.float32(bits)

        def codegen(context, builder, sig, args):
            low = builder.trunc(_i32(context, builder, args[0], sig.args[0]), _I16)
            return builder.fpext(builder.bitcast(low, ir.HalfType()), _F32)

        return sig, codegen

    @intrinsic
    def bf16_to_float(typingctx, bits):
        """16-bit bfloat16 pattern (low half of any integer) -> its float32 value (exact: a shift)."""
        if not _is_int(bits):
            return None
        sig = types.float32(bits)

        def codegen(context, builder, sig, args):
            word = builder.and_(_i32(context, builder, args[0], sig.args[0]), _c(0xFFFF))
            return builder.bitcast(builder.shl(word, _c(16)), _F32)

        return sig, codegen

    def _pointer1(context, builder, aryty, ary, i_ty, i):
        array = context.make_array(aryty)(context, builder, value=ary)
        idx = context.cast(builder, i, i_ty, types.intp)
        return cgutils.get_item_pointer(context, builder, aryty, array, [idx], wraparound=False)

    def _is_1d(arr):
        return isinstance(arr, types.Array) and arr.ndim == 1

    @intrinsic
    def load_f32x4_1d(typingctx, arr, i):
        """(arr, i) -> (arr[i], ..., arr[i + 3]) of a 1-D float32 array (a shared-memory buffer) in ONE 16-byte load
        (``ld.v4.f32``): ``i`` a multiple of 4 and ``>= 0``, the buffer 16-byte aligned."""
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32 and _is_int(i)):
            return None
        sig = types.UniTuple(types.float32, 4)(arr, i)

        def codegen(context, builder, sig, args):
            ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec_ty = ir.VectorType(_F32, 4)
            vec = builder.load(builder.bitcast(ptr, vec_ty.as_pointer()), align=16)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(vec, ir.Constant(_I32, n)) for n in range(4)])

        return sig, codegen

    @intrinsic
    def load_u16x2(typingctx, arr, i):
        """(arr, i) -> one uint32 word holding ``arr[i]`` (low half) and ``arr[i + 1]`` of a 1-D 16-bit array (a
        shared-memory buffer), in one 4-byte load: ``i`` even and ``>= 0``."""
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype.bitwidth == 16 and _is_int(i)):
            return None
        sig = types.uint32(arr, i)

        def codegen(context, builder, sig, args):
            ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return builder.load(builder.bitcast(ptr, _I32.as_pointer()), align=4)

        return sig, codegen

    @intrinsic
    def store_u32_at(typingctx, arr, offset, value):
        """(arr, offset, value): store the 32-bit ``value`` ``offset`` BYTES past ``arr``'s first element (any array;
        the caller adds the strides itself, once per row: indexing a multi-axis view of any layout rebuilds the
        whole 64-bit address at every store). The address must be 4-byte aligned and inside the array."""
        if not (isinstance(arr, types.Array) and _is_int(offset, value)):
            return None
        sig = types.void(arr, offset, value)

        def codegen(context, builder, sig, args):
            array = context.make_array(sig.args[0])(context, builder, value=args[0])
            base = builder.bitcast(array.data, ir.IntType(8).as_pointer())
            ptr = builder.gep(base, [context.cast(builder, args[1], sig.args[1], types.int64)])
            builder.store(_i32(context, builder, args[2], sig.args[2]), builder.bitcast(ptr, _I32.as_pointer()),
                          align=4)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def store_f32x2_at(typingctx, arr, offset, a, b):
        """(arr, offset, a, b): store float32 ``a, b`` in one 8-byte store ``offset`` BYTES past ``arr``'s first
        element (as ``store_u32_at``; 8-byte aligned, inside the array)."""
        if not (isinstance(arr, types.Array) and _is_int(offset) and _is_number(a, b)):
            return None
        sig = types.void(arr, offset, a, b)

        def codegen(context, builder, sig, args):
            array = context.make_array(sig.args[0])(context, builder, value=args[0])
            base = builder.bitcast(array.data, ir.IntType(8).as_pointer())
            ptr = builder.gep(base, [context.cast(builder, args[1], sig.args[1], types.int64)])
            values = [_f32(context, builder, v, ty) for v, ty in zip(args[2:], sig.args[2:])]
            _vector_store(builder, ptr, _F32, values, 8)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def load_f32_at(typingctx, arr, offset):
        """(arr, offset) -> the float32 ``offset`` BYTES past a float32 array's first element (as ``store_u32_at``:
        one 64-bit base per row or block, constant offsets fold into the load)."""
        if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and _is_int(offset)):
            return None
        sig = types.float32(arr, offset)

        def codegen(context, builder, sig, args):
            array = context.make_array(sig.args[0])(context, builder, value=args[0])
            base = builder.bitcast(array.data, ir.IntType(8).as_pointer())
            ptr = builder.gep(base, [context.cast(builder, args[1], sig.args[1], types.int64)])
            return builder.load(builder.bitcast(ptr, _F32.as_pointer()), align=4)

        return sig, codegen

    @intrinsic
    def atomic_inc_acq_rel(typingctx, arr, i, limit):
        """(arr, i, limit) -> the old ``arr[i]`` of a 1-D uint32 array, which becomes ``0 if old >= limit else
        old + 1``, with release and acquire semantics at GPU scope: the writes this thread saw (a barrier's, too)
        are visible to whoever sees the new count, and what the threads that counted before wrote is visible to
        this one::

            atom.acq_rel.gpu.inc.u32 old, [address], limit;"""
        if not (_is_1d(arr) and arr.dtype == types.uint32 and _is_int(i, limit)):
            return None
        sig = types.uint32(arr, i, limit)

        def codegen(context, builder, sig, args):
            ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            bound = _i32(context, builder, args[2], sig.args[2])
            asm = ir.InlineAsm(ir.FunctionType(_I32, [ptr.type, _I32]), "atom.acq_rel.gpu.inc.u32 $0, [$1], $2;",
                               "=r,l,r,~{memory}", side_effect=True)
            return builder.call(asm, [ptr, bound])

        return sig, codegen

    @intrinsic
    def load1(typingctx, arr, i):
        """(arr, i) -> ``arr[i]`` of a 1-D array, ``i >= 0`` only. The index stays a 64-bit integer with no
        negative-index wraparound, so ``arr[x + c]`` for a constant ``c`` folds into one address register plus an
        immediate offset (a 32-bit unsigned index would be zero-extended first, which blocks that folding)."""
        if not (_is_1d(arr) and _is_int(i)):
            return None
        sig = arr.dtype(arr, i)

        def codegen(context, builder, sig, args):
            return builder.load(_pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1]))

        return sig, codegen

    @intrinsic
    def store1(typingctx, arr, i, value):
        """(arr, i, value): ``arr[i] = value`` for a 1-D array, ``i >= 0`` only (see ``load1``)."""
        if not (_is_1d(arr) and _is_int(i) and _is_number(value)):
            return None
        sig = types.void(arr, i, value)

        def codegen(context, builder, sig, args):
            ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            builder.store(context.cast(builder, args[2], sig.args[2], sig.args[0].dtype), ptr)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def load_f32x4(typingctx, arr, i, j):
        """(arr, i, j) -> four float32 ``arr[i, j : j + 4]`` of a 2-D float32 array with a contiguous last axis, in
        one 16-byte load (``ld.v4.f32``); the address must be 16-byte aligned."""
        if not (_is_2d(arr) and arr.dtype == types.float32 and _is_int(i, j)):
            return None
        sig = types.UniTuple(types.float32, 4)(arr, i, j)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2])
            vec_ty = ir.VectorType(_F32, 4)
            vec = builder.load(builder.bitcast(ptr, vec_ty.as_pointer()), align=16)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(vec, ir.Constant(_I32, n)) for n in range(4)])

        return sig, codegen

    def _vector_store(builder, ptr, elem_ty, values, align):
        vec_ty = ir.VectorType(elem_ty, len(values))
        vec = ir.Constant(vec_ty, ir.Undefined)
        for n, value in enumerate(values):
            vec = builder.insert_element(vec, value, ir.Constant(_I32, n))
        builder.store(vec, builder.bitcast(ptr, vec_ty.as_pointer()), align=align)

    @intrinsic
    def load_u16x4(typingctx, arr, i, j):
        """(arr, i, j) -> (w0, w1): one 8-byte load of ``arr[i, j : j + 4]`` of a 2-D uint16 array with a contiguous
        last axis; ``w0`` holds elements ``j`` (low) and ``j + 1``, ``w1`` the next two. 8-byte aligned."""
        if not (_is_2d(arr) and arr.dtype == types.uint16 and _is_int(i, j)):
            return None
        sig = types.UniTuple(types.uint32, 2)(arr, i, j)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2])
            vec_ty = ir.VectorType(_I32, 2)
            vec = builder.load(builder.bitcast(ptr, vec_ty.as_pointer()), align=8)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(vec, ir.Constant(_I32, n)) for n in range(2)])

        return sig, codegen

    def _store_f32_vector(count):
        def typer(arr, i, *values):
            if not (_is_1d(arr) and arr.dtype == types.float32 and _is_int(i) and _is_number(*values)):
                return None
            sig = types.void(arr, i, *values)

            def codegen(context, builder, sig, args):
                ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                values = [_f32(context, builder, v, ty) for v, ty in zip(args[2:], sig.args[2:])]
                _vector_store(builder, ptr, _F32, values, 4 * count)
                return context.get_dummy_value()

            return sig, codegen

        return typer

    @intrinsic
    def store_f32x2(typingctx, arr, i, a, b):
        """(arr, i, a, b): ``arr[i], arr[i + 1] = a, b`` for a 1-D float32 array (shared memory) in one 8-byte store;
        ``i`` even, ``>= 0``."""
        return _store_f32_vector(2)(arr, i, a, b)

    @intrinsic
    def store_f32x4(typingctx, arr, i, a, b, c, d):
        """(arr, i, a, b, c, d): ``arr[i : i + 4] = a, b, c, d`` for a 1-D float32 array (shared memory) in one
        16-byte store; ``i`` a multiple of 4, ``>= 0``."""
        return _store_f32_vector(4)(arr, i, a, b, c, d)

    @intrinsic
    def store_pair(typingctx, arr, i, j, a, b):
        """(arr, i, j, a, b): ``arr[i, j], arr[i, j + 1] = a, b`` for a 2-D uint16 or float32 array with a contiguous
        last axis, in one store of twice the element size (the address must be aligned to it)."""
        if not (_is_2d(arr) and arr.dtype in (types.uint16, types.float32) and _is_int(i, j) and _is_number(a, b)):
            return None
        sig = types.void(arr, i, j, a, b)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2])
            dtype = sig.args[0].dtype
            elem_ty = context.get_value_type(dtype)
            values = [context.cast(builder, v, ty, dtype) for v, ty in zip(args[3:], sig.args[3:])]
            _vector_store(builder, ptr, elem_ty, values, 2 * dtype.bitwidth // 8)
            return context.get_dummy_value()

        return sig, codegen

    def _shared_address(builder, ptr):
        """The 32-bit shared-window address of a generic pointer into shared memory (LLVM folds the cast into the
        shared array's own address space, so the address arithmetic stays 32-bit)."""
        return builder.ptrtoint(builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3)), _I32)

    def _ldmatrix(trans):
        def typer(arr, i):
            if not (_is_1d(arr) and arr.dtype == types.uint16 and _is_int(i)):
                return None
            sig = types.UniTuple(types.uint32, 4)(arr, i)
            text = (f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
                    "{$0, $1, $2, $3}, [$4];")

            def codegen(context, builder, sig, args):
                addr = _shared_address(builder, _pointer1(context, builder, sig.args[0], args[0], sig.args[1],
                                                          args[1]))
                # side effects: never hoisted or merged across the barrier that publishes the tile
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32]), text,
                                   "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                res = builder.call(asm, [addr], attrs=("convergent",))
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, n) for n in range(4)])

            return sig, codegen

        return typer

    @intrinsic
    def ldmatrix_x4(typingctx, arr, i):
        """(arr, i) -> (w0, w1, w2, w3): four 8x8 matrices of 16-bit elements from a 1-D uint16 SHARED array, one per
        register. Lane ``8 m + r`` gives in ``i`` the start of row ``r`` of matrix ``m`` (8 consecutive elements,
        16-byte aligned); lane ``l`` receives in ``w_m`` row ``l // 4``, elements ``2 (l % 4)`` (low) and ``+ 1``::

            ldmatrix.sync.aligned.m8n8.x4.shared.b16 {w0, w1, w2, w3}, [addr];

        With the 8 rows = 8 keys of a ``[key][d]`` K tile this is the B fragment of ``Q K^T`` (``b0``: columns
        ``0..7`` of the k-slice, ``b1``: ``8..15``)."""
        return _ldmatrix(False)(arr, i)

    @intrinsic
    def ldmatrix_x4_trans(typingctx, arr, i):
        """(arr, i) -> (w0, w1, w2, w3): as ``ldmatrix_x4`` but each matrix transposed: lane ``l`` receives column
        ``l // 4``, rows ``2 (l % 4)`` (low) and ``+ 1``. With the rows = keys of a ``[key][d]`` V tile this is the B
        fragment of ``P V`` without a transposed copy of V."""
        return _ldmatrix(True)(arr, i)

    @intrinsic
    def cp_async_16(typingctx, dst, i, src, offset, nbytes):
        """(dst, i, src, offset, nbytes): start an asynchronous copy of the 16 bytes ``offset`` bytes past the first
        element of ``src`` (any array in global memory; the caller computes the offset from its strides) to
        ``dst[i : i + 16 / itemsize]`` (a 1-D uint16 or float32 shared array); both 16-byte aligned. ``nbytes`` (0 or 16) bytes are read and
        the rest of the 16 filled with zeros, so ``0`` zero-fills without reading (the address must still be
        valid)::

            cp.async.cg.shared.global [dst], [src + offset], 16, nbytes;

        Completes at ``cp_async_wait_all`` (for the groups committed before it)."""
        return _cp_async_16(typingctx, dst, i, src, offset, nbytes, "cp.async.cg.shared.global")

    @intrinsic
    def cp_async_16_prefetch(typingctx, dst, i, src, offset, nbytes):
        """As ``cp_async_16``, also asking L2 to fetch the whole 256-byte sector group around the address
        (``cp.async.cg.shared.global.L2::256B``): for long runs of contiguous rows streamed once, as a KV cache is
        when decoding (H100, split-KV decode of 256 MB: 2-3 % less time)."""
        return _cp_async_16(typingctx, dst, i, src, offset, nbytes, "cp.async.cg.shared.global.L2::256B")

    def _cp_async_16(typingctx, dst, i, src, offset, nbytes, instruction):
        if not (_is_1d(dst) and dst.dtype in (types.uint16, types.float32) and isinstance(src, types.Array)
                and _is_int(i, offset, nbytes)):
            return None
        sig = types.void(dst, i, src, offset, nbytes)

        def codegen(context, builder, sig, args):
            addr = _shared_address(builder, _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
            data = context.make_array(sig.args[2])(context, builder, value=args[2]).data
            gptr = builder.add(builder.ptrtoint(data, ir.IntType(64)),
                               context.cast(builder, args[3], sig.args[3], types.int64))
            size = _i32(context, builder, args[4], sig.args[4])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, ir.IntType(64), _I32]),
                               instruction + " [$0], [$1], 16, $2;", "r,l,r,~{memory}", side_effect=True)
            builder.call(asm, [addr, gptr, size])
            return context.get_dummy_value()

        return sig, codegen

    def _void_asm(text):
        def typer():
            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
                builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return typer

    @intrinsic
    def cp_async_commit(typingctx):
        """``cp.async.commit_group``: the copies this thread started since the last commit form one group."""
        return _void_asm("cp.async.commit_group;")()

    @intrinsic
    def cp_async_wait_all(typingctx):
        """``cp.async.wait_group 0``: this thread's committed copies have landed (other threads' copies are visible
        after a barrier that follows)."""
        return _void_asm("cp.async.wait_group 0;")()

    _wait_groups: dict = {}

    def cp_async_wait_group(pending: int):
        """The intrinsic ``()`` -> ``cp.async.wait_group pending``: all but this thread's ``pending`` most recent
        commit groups have landed (groups complete in order). Made once per count (an immediate operand)."""
        pending = int(pending)
        if not 0 <= pending <= 7:
            raise ValueError(f"pending: expected 0..7 commit groups, got {pending}")
        if pending not in _wait_groups:
            text = f"cp.async.wait_group {pending};"

            def wait_group(typingctx):
                return _void_asm(text)()

            wait_group.__name__ = wait_group.__qualname__ = f"cp_async_wait_group_{pending}"
            _wait_groups[pending] = intrinsic(wait_group)
        return _wait_groups[pending]

    @intrinsic
    def warp_sync(typingctx):
        """``bar.warp.sync 0xffffffff``: the warp's lanes meet, and their shared-memory accesses before it are
        ordered before those after it (e.g. ``ldmatrix`` reads of a buffer that the warp's ``cp.async`` overwrites
        next)."""
        return _void_asm("bar.warp.sync 0xffffffff;")()

    @intrinsic
    def all_lanes(typingctx, predicate):
        """(predicate) -> 1 when ``predicate`` holds on every lane of the (converged) warp, else 0: a warp-uniform
        value, so a branch on it does not diverge::

            vote.sync.all.pred q, p, 0xffffffff;"""
        if not isinstance(predicate, (types.Boolean, types.Integer)):
            return None
        sig = types.uint32(predicate)

        def codegen(context, builder, sig, args):
            value = context.cast(builder, args[0], sig.args[0], types.uint32)
            return _asm(builder, _I32, [_I32],
                        "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; vote.sync.all.pred q, p, 0xffffffff; "
                        "selp.u32 $0, 1, 0, q; }", "=r,r", [value], convergent=True)

        return sig, codegen
