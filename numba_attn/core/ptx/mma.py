"""Warp-level tensor-core MMAs (``mma.sync``) and the tf32 rounding of their operands.

The fragment layouts of both shapes, and how the C fragment of one MMA becomes the A fragment of the next,
are in the ``ptx`` package docstring. Under the simulator the MMAs are computed in float64 from the whole
warp's fragments, gathered through the block's barrier (``_sim``), and rounded to float32 once.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types

from ._asm import _F32, _I32, _asm, _f32, _i32, _is_int, _is_number, simulated_by
from ._sim import _sim_lane, _sim_warp_gather
from .convert import _halves


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


# ---------------------------------------------------------------------------------------------------------------------
# m16n8k16 with float16 / bfloat16 operands
# ---------------------------------------------------------------------------------------------------------------------
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


def _sim_mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """Simulator emulation of the float16 MMA (see the GPU version)."""
    return _sim_mma(False, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))


@simulated_by(_sim_mma_m16n8k16_f16)
def mma_m16n8k16_f16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3): one warp-wide ``D = A B + C``, A 16x16
    and B 16x8 float16, C and D 16x8 float32::

        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0,d1,d2,d3}, {a0,a1,a2,a3}, {b0,b1}, {c0,c1,c2,c3};

    a and b are 32-bit integers holding two float16 each (low half = lower index), c and d float32, laid out
    as in the ``ptx`` package docstring. All 32 lanes must call it together (converged)."""
    return _mma("f16", (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3))


def _sim_mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """Simulator emulation of the bfloat16 MMA (see the GPU version)."""
    return _sim_mma(True, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))


@simulated_by(_sim_mma_m16n8k16_bf16)
def mma_m16n8k16_bf16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """As ``mma_m16n8k16_f16`` with bfloat16 A and B::

    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d0,d1,d2,d3}, {a0,a1,a2,a3}, {b0,b1}, {c0,c1,c2,c3};
    """
    return _mma("bf16", (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3))


# ---------------------------------------------------------------------------------------------------------------------
# m16n8k8 with tf32 operands
# ---------------------------------------------------------------------------------------------------------------------
def _tf32_value(bits):
    return float(np.uint32(int(bits) & 0xFFFFE000).view(np.float32))


def _sim_mma_m16n8k8_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
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


@simulated_by(_sim_mma_m16n8k8_tf32)
def mma_m16n8k8_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3): one warp-wide ``D = A B + C``, A 16x8 and
    B 8x8 tf32 (float32 bit patterns, e.g. from ``to_tf32``), C and D 16x8 float32::

        mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {d0,d1,d2,d3}, {a0,a1,a2,a3}, {b0,b1}, {c0,c1,c2,c3};
    """
    return _mma("tf32", (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3), shape="m16n8k8")


def _tf32_block(lanes, at, rows, cols, a_layout):
    """The 16x8 A (``a_layout``) or 8x8 B matrix held in registers ``at ..`` of every lane's tuple."""
    m = np.zeros((rows, cols))
    for lane, r in enumerate(lanes):
        g, t = lane // 4, lane % 4
        if a_layout:
            m[g, t], m[g + 8, t], m[g, t + 4], m[g + 8, t + 4] = (_tf32_value(x) for x in r[at:at + 4])
        else:
            m[t, g], m[t + 4, g] = _tf32_value(r[at]), _tf32_value(r[at + 1])
    return m


def _sim_mma_m16n8k8_tf32x3(ah0, ah1, ah2, ah3, al0, al1, al2, al3, bh0, bh1, bl0, bl1, c0, c1, c2, c3):
    """Simulator emulation of ``mma_m16n8k8_tf32x3``: the three products in float64, rounded to float32 once, from
    one exchange of the warp's registers (a third of the simulator's barriers)."""
    lanes = _sim_warp_gather((ah0, ah1, ah2, ah3, al0, al1, al2, al3, bh0, bh1, bl0, bl1, c0, c1, c2, c3))
    a_hi, a_lo = _tf32_block(lanes, 0, 16, 8, True), _tf32_block(lanes, 4, 16, 8, True)
    b_hi, b_lo = _tf32_block(lanes, 8, 8, 8, False), _tf32_block(lanes, 10, 8, 8, False)
    c = np.zeros((16, 8))
    for lane, r in enumerate(lanes):
        g, t = lane // 4, lane % 4
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1] = (float(x) for x in r[12:])
    with np.errstate(over="ignore", invalid="ignore"):
        d = (a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi + c).astype(np.float32)
    g, t = _sim_lane() // 4, _sim_lane() % 4
    return d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1]


@simulated_by(_sim_mma_m16n8k8_tf32x3)
def mma_m16n8k8_tf32x3(typingctx, ah0, ah1, ah2, ah3, al0, al1, al2, al3, bh0, bh1, bl0, bl1, c0, c1, c2, c3):
    """3xTF32: ``D = A_lo B_hi + A_hi B_lo + A_hi B_hi + C`` as three ``mma_m16n8k8_tf32`` in that order (the small
    terms first), each feeding the next as C: the same three inline-asm MMAs as three calls of that intrinsic. A
    operands ``(ah*, al*)``, B ``(bh*, bl*)`` tf32 bit patterns in its layout, C and D float32. (Under the simulator
    one exchange of the warp's registers for the three.)"""
    regs = (ah0, ah1, ah2, ah3, al0, al1, al2, al3, bh0, bh1, bl0, bl1)
    accs = (c0, c1, c2, c3)
    if not (_is_int(*regs) and _is_number(*accs)):
        return None
    text = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
    sig = types.UniTuple(types.float32, 4)(*regs, *accs)

    def codegen(context, builder, sig, args):
        a_hi, a_lo = [[_i32(context, builder, v, ty) for v, ty in zip(args[i:i + 4], sig.args[i:i + 4])]
                      for i in (0, 4)]
        b_hi, b_lo = [[_i32(context, builder, v, ty) for v, ty in zip(args[i:i + 2], sig.args[i:i + 2])]
                      for i in (8, 10)]
        acc = [_f32(context, builder, v, ty) for v, ty in zip(args[12:], sig.args[12:])]
        for a, b in ((a_lo, b_hi), (a_hi, b_lo), (a_hi, b_hi)):
            res = _asm(builder, ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4, text,
                       "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", a + b + acc, convergent=True)
            acc = [builder.extract_value(res, i) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, acc)

    return sig, codegen


def _sim_to_tf32(x):
    bits = int(np.float32(x).view(np.uint32))
    if (bits & 0x7F800000) == 0x7F800000:  # inf and NaN pass unchanged
        return np.uint32(bits)
    return np.uint32(((bits + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF)


@simulated_by(_sim_to_tf32)
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


# ---------------------------------------------------------------------------------------------------------------------
# tf32 rounding by integer arithmetic (plain LLVM, no asm)
# ---------------------------------------------------------------------------------------------------------------------
#: |x| from which rounding to tf32 overflows: the finite float32 values >= (2 - 2^-11) 2^127 round to +-inf
TF32_HUGE = float(np.uint32(0x7F7FF000).view(np.float32))
_ROUND = 0x1000  # half a tf32 unit in the last place: 13 dropped bits
_KEEP = 0xFFFFE000  # the 19 bits a tf32 operand keeps
_SIGN_ONE = 0xBF800000  # (x + _ROUND) & this: +-1.0 for +-inf and for the finite values that round to +-inf


def _sim_round_tf32(x):
    return np.uint32(((int(np.float32(x).view(np.uint32)) + _ROUND) & _KEEP) & 0xFFFFFFFF)


def _sim_round_tf32_keep_inf(x):
    mask = _SIGN_ONE if abs(float(x)) >= TF32_HUGE else _KEEP
    return np.uint32(((int(np.float32(x).view(np.uint32)) + _ROUND) & mask) & 0xFFFFFFFF)


def _rounding(keep_inf: bool):
    def typer(x):
        if not _is_number(x):
            return None
        sig = types.uint32(x)

        def codegen(context, builder, sig, args):
            value = _f32(context, builder, args[0], sig.args[0])
            if keep_inf:  # NVVM has no llvm.fabs: PTX, where ptxas folds the abs into the compare
                return _asm(builder, _I32, [_F32, _I32], (
                    "{ .reg .pred p; .reg .b32 m; .reg .f32 a; abs.f32 a, $1; "
                    f"setp.ge.f32 p, a, 0f{0x7F7FF000:08X}; selp.b32 m, {_SIGN_ONE}, {_KEEP}, p; "
                    f"add.u32 $0, $2, {_ROUND}; and.b32 $0, $0, m; }}"), "=r,f,r", [value, builder.bitcast(value, _I32)])
            rounded = builder.add(builder.bitcast(value, _I32), ir.Constant(_I32, _ROUND))
            return builder.and_(rounded, ir.Constant(_I32, _KEEP))

        return sig, codegen

    return typer


@simulated_by(_sim_round_tf32)
def round_tf32(typingctx, x):
    """x -> uint32: float32 ``x`` rounded to tf32 as ``cvt.rna`` rounds finite values (nearest, ties away), by
    integer arithmetic: ``(bits(x) + 0x1000) & 0xFFFFE000``. Two instructions where ``cvt.rna.tf32.f32`` takes four
    on sm_90 (it also tests for NaN and inf and passes them unchanged). +-inf stay +-inf; a NaN may come out as
    -0.0 or inf, so a split ``hi = round_tf32(x), lo = x - hi`` keeps NaN in ``lo`` only. Plain LLVM, no asm."""
    return _rounding(False)(x)


@simulated_by(_sim_round_tf32_keep_inf)
def round_tf32_keep_inf(typingctx, x):
    """x -> uint32: as ``round_tf32``, but ``|x| >= TF32_HUGE`` (+-inf, and the finite values that round to +-inf)
    gives +-1.0 (the mask ``0xBF800000`` instead of ``0xFFFFE000``; a compare and a select more). Then
    ``lo = x - hi`` is +-inf for +-inf (where ``hi = inf`` gave ``lo = inf - inf = NaN``): in the 3xTF32 product
    ``a_lo b_hi + a_hi b_lo + a_hi b_hi`` an infinite ``a`` meets ``b`` through ``a_lo b_hi`` (+-inf, or NaN for
    ``b = 0``, as IEEE says) while ``a_hi = +-1`` keeps the other two terms finite."""
    return _rounding(True)(x)
