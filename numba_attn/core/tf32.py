"""3xTF32 building blocks shared by the float32 tensor-core kernels (``forward.tf32``, ``backward.tf32``): the MMA of
a split operand pair (three ``m16n8k8`` tf32 products, or one with ``allow_tf32``), the split of a finite float32
value, and the bank swizzle of float32 tiles that warps read both as row pairs and as column pairs.

Split (``split_finite``): ``hi = round_tf32(x)`` (nearest, ties away, by integer arithmetic: two instructions),
``lo = x - hi`` exact in float32 and passed unrounded (the tensor cores read its top 19 bits). ``a b`` is then
``a_lo b_hi + a_hi b_lo + a_hi b_hi`` (``mma3``: small terms first, one float32 accumulator), an error of about
2^-21 relative. +-inf gives ``lo = NaN`` (``forward.tf32_split`` keeps +-inf for the forward's inputs; the backward
takes NaN there, as the float64 reference does for infinite scores).

Accumulation: the tensor cores add C and the products exactly and round the float32 result toward zero, so every
MMA chained through the C operand shrinks the running sum by up to an ulp of IT. Over ``n`` chained MMAs that is a
bias of about ``n 2^-24`` relative to the sum (3xTF32 chains three MMAs per k-step: 96 for a head dim of 256; a
NumPy model of this rounding gives 2.3e-6 for such a dot product, 1.4e-7 with fresh accumulators per k-step, the
backward's measured gradient errors grew with the head dim the same way). Long sums therefore take ``mma3_add``
(fresh accumulators, float32 adds, which round to nearest) or chain a few k-steps into fresh accumulators.

Fragment swizzle (``fragment_swizzle``, ``swizzled``; ``staging.tile_loader(swizzle="fragments")``)
    A float32 tile stored in rows of ``row`` words (a multiple of 32: ``swizzled_row_words``) has its word ``c`` of
    row ``r`` at ``r * row + (c ^ s(r))``, ``s(r) = 8 ((r mod 4) xor ((r / 4) mod 2))``: the 8-word groups of a row
    are permuted, pairs and 16-byte pieces stay whole. Two fragment reads then hit 32 different banks:

    * row pairs (A fragments of ``[row][k]`` tiles, B fragments of ``[n][k]`` tiles): lane ``(g, t)`` reads words
      ``2t, 2t + 1`` of row ``g`` (an 8-byte load; its two phases, rows 0..3 and 4..7, see s = 0, 8, 16, 24 and
      8, 0, 24, 16);
    * column pairs (B fragments of ``[k][n]`` tiles, A fragments of a transposed tile): lane ``(g, t)`` reads word
      ``g`` of rows ``2t`` and ``2t + 1`` (4-byte loads: rows 0, 2, 4, 6 see s = 0, 16, 8, 24; rows 1, 3, 5, 7 see
      8, 24, 0, 16).

    Row blocks start at multiples of 8 and column blocks at multiples of 8, so a lane's ``s`` is one of three
    constants: ``s(g)`` for row pairs (rows ``g`` and ``g + 8``), ``s(2t)`` and ``s(2t + 1)`` for column pairs.
"""
from __future__ import annotations

import numpy as np

from . import ptx
from .staging import device_function, inlined_function

_ZERO = np.float32(0.0)


def swizzled_row_words(width: int) -> int:
    """Words per row of a fragment-swizzled float32 tile ``width`` words wide: a whole number of 32-word lines."""
    return -(-width // 32) * 32


@inlined_function
def fragment_swizzle(r):
    """The word XOR ``s(r)`` of row ``r`` (module docstring)."""
    return 8 * ((r & 3) ^ ((r >> 2) & 1))


@inlined_function
def swizzled(col, s):
    """Where word ``col`` (a multiple of 8; a lane adds its ``2t`` or ``g`` after) of a row with XOR ``s`` lies: for a
    constant ``col`` one of four values per lane plus a constant, which the compiler keeps in registers."""
    return 32 * (col // 32) + ((col % 32) ^ s)


def split_finite(x):
    """``x -> (hi, lo)`` tf32 bit patterns, ``hi + lo = x`` (module docstring); P, dS and the backward's operands."""
    hi = ptx.round_tf32(x)
    return hi, ptx.float_bits(x - ptx.bits_float(hi))


def split_hi(x):
    """``x -> (hi, 0)``: one tf32 term (``allow_tf32``), rounded to nearest."""
    return ptx.round_tf32(x), 0


def mma3(c, mt, n, a_hi, a_lo, i, bh0, bh1, bl0, bl1):
    """``c[mt, n, :] += A B`` with A the fragment ``a_hi[mt, i]`` + ``a_lo[mt, i]`` (register arrays) and B ``(bh0,
    bh1) + (bl0, bl1)``: three MMAs, lo * hi, hi * lo, hi * hi (the small terms first; ``ptx.mma_m16n8k8_tf32x3``)."""
    c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3] = ptx.mma_m16n8k8_tf32x3(
        a_hi[mt, i, 0], a_hi[mt, i, 1], a_hi[mt, i, 2], a_hi[mt, i, 3],
        a_lo[mt, i, 0], a_lo[mt, i, 1], a_lo[mt, i, 2], a_lo[mt, i, 3], bh0, bh1, bl0, bl1,
        c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3])


def mma3_add(c, mt, n, a_hi, a_lo, i, bh0, bh1, bl0, bl1):
    """``mma3`` into fresh zero accumulators, the result added to ``c[mt, n, :]`` with float32 adds: the tensor cores'
    float32 accumulation rounds toward zero, so a long chain through the C operand shrinks a sum (module docstring);
    each MMA's truncation is then relative to one k-step's products."""
    d0, d1, d2, d3 = ptx.mma_m16n8k8_tf32x3(
        a_hi[mt, i, 0], a_hi[mt, i, 1], a_hi[mt, i, 2], a_hi[mt, i, 3],
        a_lo[mt, i, 0], a_lo[mt, i, 1], a_lo[mt, i, 2], a_lo[mt, i, 3], bh0, bh1, bl0, bl1,
        _ZERO, _ZERO, _ZERO, _ZERO)
    c[mt, n, 0] += d0
    c[mt, n, 1] += d1
    c[mt, n, 2] += d2
    c[mt, n, 3] += d3


def mma1(c, mt, n, a_hi, a_lo, i, bh0, bh1, bl0, bl1):
    """``mma3`` with the hi * hi product alone (``allow_tf32``; ``a_lo``, ``bl0``, ``bl1`` unused)."""
    c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3] = ptx.mma_m16n8k8_tf32(
        a_hi[mt, i, 0], a_hi[mt, i, 1], a_hi[mt, i, 2], a_hi[mt, i, 3], bh0, bh1,
        c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3])


def tf32_products(tf32_only: bool):
    """``(split, mma_into, mma_add)``: ``split_finite``, ``mma3`` and ``mma3_add``, or (``tf32_only``, whose error of
    about 1e-3 a chain's truncations do not change) ``split_hi`` and ``mma1`` twice, as device functions."""
    if tf32_only:
        one = device_function(mma1)
        return device_function(split_hi), one, one
    return device_function(split_finite), device_function(mma3), device_function(mma3_add)
