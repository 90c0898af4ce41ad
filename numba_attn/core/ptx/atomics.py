"""Atomic read-modify-writes on global memory with memory-ordering semantics."""
from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import types

from ._asm import _I32, _i32, _is_1d, _is_int, _pointer1, simulated_by

_sim_atomics = threading.Lock()


def _sim_atomic_inc_acq_rel(arr, i, limit):
    with _sim_atomics:
        old = np.uint32(arr[i])
        arr[i] = 0 if old >= limit else old + 1
        return old


@simulated_by(_sim_atomic_inc_acq_rel)
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
