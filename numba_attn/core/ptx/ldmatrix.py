"""``ldmatrix``: a warp loads four 8x8 matrices of 16-bit elements from shared memory straight into MMA fragments.

How the matrices of a ``[row][d]`` tile line up with the A and B fragments of ``mma.sync.m16n8k16`` is set out in the
``ptx`` package docstring.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types

from ._asm import _I32, _is_1d, _is_int, _pointer1, _shared_address, simulated_by
from ._sim import _sim_lane, _sim_warp_gather


def _ldmatrix(trans, short=False):
    def typer(arr, i):
        if not (_is_1d(arr) and arr.dtype == types.uint16 and _is_int(i)):
            return None
        sig = types.UniTuple(types.uint32, 4)(arr, i)
        text = (f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
                "{$0, $1, $2, $3}, [$4];")

        def codegen(context, builder, sig, args):
            if short:  # the array's 32-bit shared-window address plus 2 i, in 32-bit arithmetic
                array = context.make_array(sig.args[0])(context, builder, value=args[0])
                window = builder.addrspacecast(array.data, ir.PointerType(array.data.type.pointee, 3))
                offset = builder.shl(context.cast(builder, args[1], sig.args[1], types.uint32), ir.Constant(_I32, 1))
                addr = builder.add(builder.ptrtoint(window, _I32), offset)
            else:
                addr = _shared_address(builder, _pointer1(context, builder, sig.args[0], args[0], sig.args[1],
                                                          args[1]))
            # side effects: never hoisted or merged across the barrier that publishes the tile
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32]), text,
                               "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            res = builder.call(asm, [addr], attrs=("convergent",))
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, n) for n in range(4)])

        return sig, codegen

    return typer


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


def _sim_ldmatrix_x4(arr, i):
    """Simulator emulation of ``ldmatrix.x4`` (see the GPU version)."""
    return _sim_ldmatrix(arr, i, False)


@simulated_by(_sim_ldmatrix_x4)
def ldmatrix_x4(typingctx, arr, i):
    """(arr, i) -> (w0, w1, w2, w3): four 8x8 matrices of 16-bit elements from a 1-D uint16 SHARED array, one per
    register. Lane ``8 m + r`` gives in ``i`` the start of row ``r`` of matrix ``m`` (8 consecutive elements,
    16-byte aligned); lane ``l`` receives in ``w_m`` row ``l // 4``, elements ``2 (l % 4)`` (low) and ``+ 1``::

        ldmatrix.sync.aligned.m8n8.x4.shared.b16 {w0, w1, w2, w3}, [addr];

    With the 8 rows = 8 keys of a ``[key][d]`` K tile this is the B fragment of ``Q K^T`` (``b0``: columns
    ``0..7`` of the k-slice, ``b1``: ``8..15``)."""
    return _ldmatrix(False)(arr, i)


def _sim_ldmatrix_x4_trans(arr, i):
    """Simulator emulation of ``ldmatrix.x4.trans`` (see the GPU version)."""
    return _sim_ldmatrix(arr, i, True)


@simulated_by(_sim_ldmatrix_x4_trans)
def ldmatrix_x4_trans(typingctx, arr, i):
    """(arr, i) -> (w0, w1, w2, w3): as ``ldmatrix_x4`` but each matrix transposed: lane ``l`` receives column
    ``l // 4``, rows ``2 (l % 4)`` (low) and ``+ 1``. With the rows = keys of a ``[key][d]`` V tile this is the B
    fragment of ``P V`` without a transposed copy of V."""
    return _ldmatrix(True)(arr, i)


@simulated_by(_sim_ldmatrix_x4)
def ldmatrix_x4_short(typingctx, arr, i):
    """As ``ldmatrix_x4``, with the address computed in 32 bits (the array's shared-window address plus ``2 i``,
    ``0 <= i < 2**31``): the many constant offsets of fully unrolled fragment loops then cost one register each
    where they are hoisted, not two (the backward's key-block kernel spilled without it)."""
    return _ldmatrix(False, short=True)(arr, i)


@simulated_by(_sim_ldmatrix_x4_trans)
def ldmatrix_x4_trans_short(typingctx, arr, i):
    """As ``ldmatrix_x4_trans``, with the address computed in 32 bits (``ldmatrix_x4_short``)."""
    return _ldmatrix(True, short=True)(arr, i)
