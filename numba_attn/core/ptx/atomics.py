"""Atomic read-modify-writes on global memory: a counter with memory-ordering semantics, and float32 reductions
(``red``: additions whose old value nobody waits for, as the backward's ``dq`` accumulator takes them)."""
from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import types

from ._asm import _F32, _I32, _f32, _i32, _is_1d, _is_2d, _is_int, _is_number, _pointer, _pointer1, simulated_by

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


def _sim_red_add_f32(arr, i, j, value):
    with _sim_atomics:
        arr[i, j] = np.float32(arr[i, j]) + np.float32(value)


def _red_pointer(context, builder, sig, args):
    """The element pointer of ``arr[i, j]`` (no wraparound), in the global address space."""
    ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2])
    return builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 1))


@simulated_by(_sim_red_add_f32)
def red_add_f32(typingctx, arr, i, j, value):
    """(arr, i, j, value): ``arr[i, j] += value`` for a 2-D float32 array in global memory, atomically, without
    returning the old value (a reduction: the SM does not wait for it), ``0 <= i, j`` only::

        red.relaxed.gpu.global.add.f32 [address], value;

    Many blocks may add into one element at once; the order of their additions (and so the last bits of the
    sum) depends on timing."""
    if not (_is_2d(arr) and arr.dtype == types.float32 and _is_int(i, j) and _is_number(value)):
        return None
    sig = types.void(arr, i, j, value)

    def codegen(context, builder, sig, args):
        ptr = _red_pointer(context, builder, sig, args)
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type, _F32]),
                           "red.relaxed.gpu.global.add.f32 [$0], $1;", "l,f", side_effect=True)
        builder.call(asm, [ptr, _f32(context, builder, args[3], sig.args[3])])
        return context.get_dummy_value()

    return sig, codegen


def _sim_red_add_f32x2(arr, i, j, a, b):
    with _sim_atomics:
        arr[i, j] = np.float32(arr[i, j]) + np.float32(a)
        arr[i, j + 1] = np.float32(arr[i, j + 1]) + np.float32(b)


@simulated_by(_sim_red_add_f32x2)
def red_add_f32x2(typingctx, arr, i, j, a, b):
    """(arr, i, j, a, b): ``arr[i, j] += a`` and ``arr[i, j + 1] += b`` in ONE vector reduction (each element
    atomically, as ``red_add_f32``): compute capability 9.0 or newer only; ``arr[i, j]`` 8-byte aligned (``j``
    even, the rows a whole number of 8-byte pairs)::

        red.relaxed.gpu.global.add.v2.f32 [address], {a, b};"""
    if not (_is_2d(arr) and arr.dtype == types.float32 and _is_int(i, j) and _is_number(a, b)):
        return None
    sig = types.void(arr, i, j, a, b)

    def codegen(context, builder, sig, args):
        ptr = _red_pointer(context, builder, sig, args)
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type, _F32, _F32]),
                           "red.relaxed.gpu.global.add.v2.f32 [$0], {$1, $2};", "l,f,f", side_effect=True)
        builder.call(asm, [ptr] + [_f32(context, builder, v, ty) for v, ty in zip(args[3:], sig.args[3:])])
        return context.get_dummy_value()

    return sig, codegen


def _sim_red_add_f32x4(arr, i, j, a, b, c, d):
    with _sim_atomics:
        for k, x in enumerate((a, b, c, d)):
            arr[i, j + k] = np.float32(arr[i, j + k]) + np.float32(x)


@simulated_by(_sim_red_add_f32x4)
def red_add_f32x4(typingctx, arr, i, j, a, b, c, d):
    """(arr, i, j, a, b, c, d): ``arr[i, j + k] += (a, b, c, d)[k]`` in ONE vector reduction (each element
    atomically, as ``red_add_f32``): compute capability 9.0 or newer only; ``arr[i, j]`` 16-byte aligned::

        red.relaxed.gpu.global.add.v4.f32 [address], {a, b, c, d};"""
    if not (_is_2d(arr) and arr.dtype == types.float32 and _is_int(i, j) and _is_number(a, b, c, d)):
        return None
    sig = types.void(arr, i, j, a, b, c, d)

    def codegen(context, builder, sig, args):
        ptr = _red_pointer(context, builder, sig, args)
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ptr.type] + [_F32] * 4),
                           "red.relaxed.gpu.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f",
                           side_effect=True)
        builder.call(asm, [ptr] + [_f32(context, builder, v, ty) for v, ty in zip(args[3:], sig.args[3:])])
        return context.get_dummy_value()

    return sig, codegen
