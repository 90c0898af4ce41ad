"""Conversions between float32 and 16-bit or 8-bit floats, and moves of raw bits between registers.

A 32-bit register that holds two 16-bit values keeps the element with the smaller index in its LOW half (the MMA
fragment layouts' "elements low to high"); one that holds four 8-bit values (float8 e4m3) keeps element 0 in bits
0-7. Also the host (NumPy) bfloat16 and e4m3 helpers that the simulator twins, the tests and the scripts use.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types

from ._asm import _F32, _I16, _I32, _asm, _c, _f32, _i32, _is_int, _is_number, simulated_by


# ---------------------------------------------------------------------------------------------------------------------
# Host helpers (NumPy)
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


def _e4m3_table() -> np.ndarray:
    """The float32 values of the 256 float8 e4m3 (``e4m3fn``: no inf, NaN at 0x7F / 0xFF) bit patterns."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6, (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = np.where((bits & 0x7F) == 0x7F, np.nan, sign * value)
    return value.astype(np.float32)


E4M3_VALUES = _e4m3_table()
#: the largest finite e4m3 value (``satfinite`` conversions clamp to it)
E4M3_MAX = 448.0


def e4m3_bits_to_float32(bits) -> np.ndarray:
    """float32 values of float8 e4m3 bit patterns (uint8; exact)."""
    return E4M3_VALUES[np.asarray(bits).astype(np.uint8)]


def float32_to_e4m3_bits(x) -> np.ndarray:
    """e4m3 bit patterns (uint8) of ``x``, as ``cvt.rn.satfinite.e4m3x2.f32`` makes them: round to nearest even,
    finite values beyond +-448 (and +-inf) clamped to +-448, NaN to 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    finite = E4M3_VALUES[:0x7F].astype(np.float64)  # 0 .. 448, increasing
    mag = np.minimum(np.abs(np.nan_to_num(x.astype(np.float64), posinf=E4M3_MAX, neginf=-E4M3_MAX)), E4M3_MAX)
    upper = np.clip(np.searchsorted(finite, mag, side="left"), 0, 0x7E)  # first value >= mag
    lower = np.maximum(upper - 1, 0)
    d_low, d_up = mag - finite[lower], finite[upper] - mag
    # ties to the even pattern (even mantissa: even bits)
    pick_up = (d_up < d_low) | ((d_up == d_low) & (upper % 2 == 0))
    code = np.where(pick_up, upper, lower).astype(np.uint8)
    code = np.where(np.signbit(x), code | 0x80, code).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), code).astype(np.uint8)


def _f16_bits(x) -> int:
    with np.errstate(over="ignore"):
        return int(np.array(x, dtype=np.float32).astype(np.float16).view(np.uint16))


def _bf16_bits(x) -> int:
    return int(float32_to_bf16_bits(np.array([x], dtype=np.float32))[0])


def _halves(word, bf16: bool):
    """The two 16-bit floats of a 32-bit word as Python floats, low half first."""
    lo, hi = int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF
    if bf16:
        return float(bf16_bits_to_float32(lo)), float(bf16_bits_to_float32(hi))
    return float(np.uint16(lo).view(np.float16)), float(np.uint16(hi).view(np.float16))


# ---------------------------------------------------------------------------------------------------------------------
# float32 pairs -> packed 16-bit floats (cvt)
# ---------------------------------------------------------------------------------------------------------------------
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


def _sim_pack_half2(lo, hi):
    return np.uint32(_f16_bits(lo) | (_f16_bits(hi) << 16))


@simulated_by(_sim_pack_half2)
def pack_half2(typingctx, lo, hi):
    """(lo, hi) -> uint32: two float32 rounded to nearest float16, ``lo`` in bits 0-15, ``hi`` in 16-31 (an
    A/B operand register)::

        cvt.rn.f16x2.f32 d, hi, lo;     // cvt puts its first source in the upper half"""
    return _pack("cvt.rn.f16x2.f32", lo, hi)


def _sim_pack_bf16x2(lo, hi):
    return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))


@simulated_by(_sim_pack_bf16x2)
def pack_bf16x2(typingctx, lo, hi):
    """(lo, hi) -> uint32: as ``pack_half2``, to bfloat16::

        cvt.rn.bf16x2.f32 d, hi, lo;"""
    return _pack("cvt.rn.bf16x2.f32", lo, hi)


def _sim_pack_e4m3x4(x0, x1, x2, x3):
    codes = float32_to_e4m3_bits(np.array([x0, x1, x2, x3], dtype=np.float32)).astype(np.uint32)
    return np.uint32(codes[0] | (codes[1] << 8) | (codes[2] << 16) | (codes[3] << 24))


@simulated_by(_sim_pack_e4m3x4)
def pack_e4m3x4(typingctx, x0, x1, x2, x3):
    """(x0, x1, x2, x3) -> uint32: four float32 rounded to float8 e4m3 (nearest even, saturated to +-448), ``x0``
    in bits 0-7 ... ``x3`` in bits 24-31 (an 8-bit MMA operand register, sm_89+)::

        cvt.rn.satfinite.e4m3x2.f32 lo, x1, x0;   // the first source goes to the upper byte
        cvt.rn.satfinite.e4m3x2.f32 hi, x3, x2;
        mov.b32 d, {lo, hi};"""
    if not _is_number(x0, x1, x2, x3):
        return None
    sig = types.uint32(x0, x1, x2, x3)
    text = ("{ .reg .b16 lo, hi;\n"
            "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
            "mov.b32 $0, {lo, hi}; }")

    def codegen(context, builder, sig, args):
        values = [_f32(context, builder, v, ty) for v, ty in zip(args, sig.args)]
        return _asm(builder, _I32, [_F32] * 4, text, "=r,f,f,f,f", values)

    return sig, codegen


def _sim_byte_perm(a, b, selector):
    data = int(a) & 0xFFFFFFFF | (int(b) & 0xFFFFFFFF) << 32
    out = 0
    for n in range(4):
        out |= ((data >> (8 * ((int(selector) >> (4 * n)) & 7))) & 0xFF) << (8 * n)
    return np.uint32(out)


@simulated_by(_sim_byte_perm)
def byte_perm(typingctx, a, b, selector):
    """(a, b, selector) -> uint32 ``prmt.b32 d, a, b, selector``: byte ``n`` of the result is byte ``s_n`` (the
    ``n``-th 4-bit nibble of ``selector``, 0..7) of the 8 bytes ``b:a`` (``a`` bytes 0-3, ``b`` bytes 4-7); CUDA's
    ``__byte_perm``. A constant selector becomes the instruction's immediate."""
    if not _is_int(a, b, selector):
        return None
    sig = types.uint32(a, b, selector)

    def codegen(context, builder, sig, args):
        values = [_i32(context, builder, v, ty) for v, ty in zip(args, sig.args)]
        return _asm(builder, _I32, [_I32] * 3, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", values)

    return sig, codegen


# ---------------------------------------------------------------------------------------------------------------------
# 16-bit floats -> float32
# ---------------------------------------------------------------------------------------------------------------------
def _sim_half_to_float(bits):
    return np.float32(np.uint16(int(bits) & 0xFFFF).view(np.float16))


@simulated_by(_sim_half_to_float)
def half_to_float(typingctx, bits):
    """16-bit float16 pattern (low half of any integer) -> its float32 value (exact)."""
    if not _is_int(bits):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        low = builder.trunc(_i32(context, builder, args[0], sig.args[0]), _I16)
        return builder.fpext(builder.bitcast(low, ir.HalfType()), _F32)

    return sig, codegen


def _sim_bf16_to_float(bits):
    return np.uint32((int(bits) & 0xFFFF) << 16).view(np.float32)


@simulated_by(_sim_bf16_to_float)
def bf16_to_float(typingctx, bits):
    """16-bit bfloat16 pattern (low half of any integer) -> its float32 value (exact: a shift)."""
    if not _is_int(bits):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        word = builder.and_(_i32(context, builder, args[0], sig.args[0]), _c(0xFFFF))
        return builder.bitcast(builder.shl(word, _c(16)), _F32)

    return sig, codegen


# ---------------------------------------------------------------------------------------------------------------------
# Raw bits: 16-bit halves of 32-bit words, float32 <-> uint32 (plain LLVM, no asm)
# ---------------------------------------------------------------------------------------------------------------------
def _bits_op(sig, body):
    def codegen(context, builder, sig, args):
        return body(builder, *[_i32(context, builder, v, ty) for v, ty in zip(args, sig.args)])

    return sig, codegen


def _sim_pack_u16x2(lo, hi):
    return np.uint32((int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16))


@simulated_by(_sim_pack_u16x2)
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


def _sim_interleave_high(a, b):
    return np.uint32(((int(a) >> 16) & 0xFFFF) | (int(b) & 0xFFFF0000))


@simulated_by(_sim_interleave_high)
def interleave_high(typingctx, a, b):
    """(a, b) -> uint32 ``(a >> 16) | (b & 0xFFFF0000)``: the high halves of two words (element 2i + 1)."""
    if not _is_int(a, b):
        return None
    return _bits_op(types.uint32(a, b),
                    lambda bl, x, y: bl.or_(bl.lshr(x, _c(16)), bl.and_(y, _c(0xFFFF0000))))


def _sim_low_u16(word):
    return np.uint16(int(word) & 0xFFFF)


@simulated_by(_sim_low_u16)
def low_u16(typingctx, word):
    """word -> uint16: bits 0-15 (the element with the lower index)."""
    if not _is_int(word):
        return None
    return _bits_op(types.uint16(word), lambda b, x: b.trunc(x, _I16))


def _sim_high_u16(word):
    return np.uint16((int(word) >> 16) & 0xFFFF)


@simulated_by(_sim_high_u16)
def high_u16(typingctx, word):
    """word -> uint16: bits 16-31."""
    if not _is_int(word):
        return None
    return _bits_op(types.uint16(word), lambda b, x: b.trunc(b.lshr(x, _c(16)), _I16))


def _sim_float_bits(x):
    return np.float32(x).view(np.uint32)


@simulated_by(_sim_float_bits)
def float_bits(typingctx, x):
    """float32 x -> uint32: its bit pattern (no conversion)."""
    if not _is_number(x):
        return None
    sig = types.uint32(x)

    def codegen(context, builder, sig, args):
        return builder.bitcast(_f32(context, builder, args[0], sig.args[0]), _I32)

    return sig, codegen


def _sim_bits_float(bits):
    return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)


@simulated_by(_sim_bits_float)
def bits_float(typingctx, bits):
    """uint32 bits -> float32 with that bit pattern (no conversion)."""
    if not _is_int(bits):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        return builder.bitcast(_i32(context, builder, args[0], sig.args[0]), _F32)

    return sig, codegen
