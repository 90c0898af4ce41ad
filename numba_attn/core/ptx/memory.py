"""Loads and stores that Numba's indexing would not emit: no negative-index wraparound, vector widths, byte offsets.

All are plain LLVM (no asm). Indices must be ``>= 0``; a vector access needs its address aligned to its full width
(8 or 16 bytes), which the caller guarantees by its layout.
"""
from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import types

from ._asm import (_F32, _I32, _f32, _i32, _is_1d, _is_2d, _is_int, _is_number, _pointer, _pointer1, _vector_store,
                   simulated_by)


# ---------------------------------------------------------------------------------------------------------------------
# One element, without wraparound
# ---------------------------------------------------------------------------------------------------------------------
def _sim_load2(arr, i, j):
    return arr[i, j]


@simulated_by(_sim_load2)
def load2(typingctx, arr, i, j):
    """(arr, i, j) -> ``arr[i, j]`` of a 2-D array, for ``0 <= i, j`` only (no negative-index wraparound)."""
    if not (_is_2d(arr) and _is_int(i, j)):
        return None
    sig = arr.dtype(arr, i, j)

    def codegen(context, builder, sig, args):
        return builder.load(_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                                     sig.args[2], args[2]))

    return sig, codegen


def _sim_store2(arr, i, j, value):
    arr[i, j] = value


@simulated_by(_sim_store2)
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


def _sim_load1(arr, i):
    return arr[i]


@simulated_by(_sim_load1)
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


def _sim_store1(arr, i, value):
    arr[i] = value


@simulated_by(_sim_store1)
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


# ---------------------------------------------------------------------------------------------------------------------
# Vector loads and stores along the contiguous last axis of a 2-D array
# ---------------------------------------------------------------------------------------------------------------------
def _sim_load_u16x8(arr, i, j):
    words = [int(arr[i, j + 2 * n]) | (int(arr[i, j + 2 * n + 1]) << 16) for n in range(4)]
    return tuple(np.uint32(w) for w in words)


@simulated_by(_sim_load_u16x8)
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


def _sim_store_u32x4(arr, i, j, w0, w1, w2, w3):
    arr[i, j], arr[i, j + 1], arr[i, j + 2], arr[i, j + 3] = w0, w1, w2, w3


@simulated_by(_sim_store_u32x4)
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


def _sim_load_f32x4(arr, i, j):
    return arr[i, j], arr[i, j + 1], arr[i, j + 2], arr[i, j + 3]


@simulated_by(_sim_load_f32x4)
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


def _sim_load_u16x4(arr, i, j):
    return (np.uint32(int(arr[i, j]) | (int(arr[i, j + 1]) << 16)),
            np.uint32(int(arr[i, j + 2]) | (int(arr[i, j + 3]) << 16)))


@simulated_by(_sim_load_u16x4)
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


def _sim_store_pair(arr, i, j, a, b):
    arr[i, j], arr[i, j + 1] = a, b


@simulated_by(_sim_store_pair)
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


# ---------------------------------------------------------------------------------------------------------------------
# Vector loads and stores of 1-D (shared-memory) buffers
# ---------------------------------------------------------------------------------------------------------------------
def _sim_store_u32x4_1d(arr, i, w0, w1, w2, w3):
    for n, w in enumerate((w0, w1, w2, w3)):
        arr[i + 2 * n], arr[i + 2 * n + 1] = int(w) & 0xFFFF, (int(w) >> 16) & 0xFFFF


@simulated_by(_sim_store_u32x4_1d)
def store_u32x4_1d(typingctx, arr, i, w0, w1, w2, w3):
    """(arr, i, w0, w1, w2, w3): one 16-byte store of four 32-bit words at ``arr[i : i + 8]`` of a 1-D 16-bit
    array (a shared-memory buffer; word ``n`` covers elements ``i + 2n`` (low half) and ``i + 2n + 1``); ``i`` a
    multiple of 8, ``>= 0``, the buffer 16-byte aligned."""
    if not (_is_1d(arr) and arr.dtype.bitwidth == 16 and _is_int(i, w0, w1, w2, w3)):
        return None
    sig = types.void(arr, i, w0, w1, w2, w3)

    def codegen(context, builder, sig, args):
        ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        words = [_i32(context, builder, v, ty) for v, ty in zip(args[2:], sig.args[2:])]
        _vector_store(builder, ptr, _I32, words, 16)
        return context.get_dummy_value()

    return sig, codegen


def _sim_store_u32x2_1d(arr, i, w0, w1):
    for n, w in enumerate((w0, w1)):
        arr[i + 2 * n], arr[i + 2 * n + 1] = int(w) & 0xFFFF, (int(w) >> 16) & 0xFFFF


@simulated_by(_sim_store_u32x2_1d)
def store_u32x2_1d(typingctx, arr, i, w0, w1):
    """(arr, i, w0, w1): one 8-byte store of two 32-bit words at ``arr[i : i + 4]`` of a 1-D 16-bit array (word
    ``n`` covers elements ``i + 2n``, low half, and ``i + 2n + 1``); ``i >= 0``, the address 8-byte aligned."""
    if not (_is_1d(arr) and arr.dtype.bitwidth == 16 and _is_int(i, w0, w1)):
        return None
    sig = types.void(arr, i, w0, w1)

    def codegen(context, builder, sig, args):
        ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        words = [_i32(context, builder, v, ty) for v, ty in zip(args[2:], sig.args[2:])]
        _vector_store(builder, ptr, _I32, words, 8)
        return context.get_dummy_value()

    return sig, codegen


def _sim_load_f32x2(arr, i):
    return arr[i], arr[i + 1]


@simulated_by(_sim_load_f32x2)
def load_f32x2(typingctx, arr, i):
    """(arr, i) -> (arr[i], arr[i + 1]) of a 1-D float32 array (a shared-memory buffer) in ONE 8-byte load
    (``ld.v2.f32``): ``i`` must be even and ``>= 0`` (no negative-index wraparound) and the buffer 8-byte
    aligned. Two scalar loads would cost two instructions and two shared-memory wavefronts."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32 and _is_int(i)):
        return None
    sig = types.UniTuple(types.float32, 2)(arr, i)

    def codegen(context, builder, sig, args):
        ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        vec_ty = ir.VectorType(_F32, 2)
        vec = builder.load(builder.bitcast(ptr, vec_ty.as_pointer()), align=8)
        return context.make_tuple(builder, sig.return_type,
                                  [builder.extract_element(vec, ir.Constant(_I32, n)) for n in range(2)])

    return sig, codegen


def _sim_load_f32x4_1d(arr, i):
    return arr[i], arr[i + 1], arr[i + 2], arr[i + 3]


@simulated_by(_sim_load_f32x4_1d)
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


def _sim_load_u16x2(arr, i):
    return np.uint32(int(arr[i]) | (int(arr[i + 1]) << 16))


@simulated_by(_sim_load_u16x2)
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


def _sim_store_u16x2(arr, i, word):
    arr[i], arr[i + 1] = int(word) & 0xFFFF, (int(word) >> 16) & 0xFFFF


@simulated_by(_sim_store_u16x2)
def store_u16x2(typingctx, arr, i, word):
    """(arr, i, word): one 4-byte store of the 32-bit ``word`` at ``arr[i : i + 2]`` of a 1-D 16-bit array (a
    shared-memory buffer; ``arr[i]`` gets the low half): ``i`` even and ``>= 0``."""
    if not (_is_1d(arr) and arr.dtype.bitwidth == 16 and _is_int(i, word)):
        return None
    sig = types.void(arr, i, word)

    def codegen(context, builder, sig, args):
        ptr = _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        builder.store(_i32(context, builder, args[2], sig.args[2]), builder.bitcast(ptr, _I32.as_pointer()), align=4)
        return context.get_dummy_value()

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


def _sim_store_f32x2(arr, i, a, b):
    arr[i], arr[i + 1] = a, b


@simulated_by(_sim_store_f32x2)
def store_f32x2(typingctx, arr, i, a, b):
    """(arr, i, a, b): ``arr[i], arr[i + 1] = a, b`` for a 1-D float32 array (shared memory) in one 8-byte store;
    ``i`` even, ``>= 0``."""
    return _store_f32_vector(2)(arr, i, a, b)


def _sim_store_f32x4(arr, i, a, b, c, d):
    arr[i], arr[i + 1], arr[i + 2], arr[i + 3] = a, b, c, d


@simulated_by(_sim_store_f32x4)
def store_f32x4(typingctx, arr, i, a, b, c, d):
    """(arr, i, a, b, c, d): ``arr[i : i + 4] = a, b, c, d`` for a 1-D float32 array (shared memory) in one
    16-byte store; ``i`` a multiple of 4, ``>= 0``."""
    return _store_f32_vector(4)(arr, i, a, b, c, d)


# ---------------------------------------------------------------------------------------------------------------------
# Accesses at a byte offset from an array's first element (the caller adds the strides once per row)
# ---------------------------------------------------------------------------------------------------------------------
def _sim_address(arr, offset):
    return np.asarray(arr).__array_interface__["data"][0] + int(offset)


def _sim_store_u32_at(arr, offset, value):
    ctypes.c_uint32.from_address(_sim_address(arr, offset)).value = int(value) & 0xFFFFFFFF


@simulated_by(_sim_store_u32_at)
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


def _sim_store_f32x2_at(arr, offset, a, b):
    (ctypes.c_float * 2).from_address(_sim_address(arr, offset))[:] = [float(np.float32(a)), float(np.float32(b))]


@simulated_by(_sim_store_f32x2_at)
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


def _sim_load_f32_at(arr, offset):
    return np.float32(ctypes.c_float.from_address(_sim_address(arr, offset)).value)


@simulated_by(_sim_load_f32_at)
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
