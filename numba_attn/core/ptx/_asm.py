"""Shared machinery of the ``ptx`` intrinsics: the GPU-or-simulator switch and the code-generation helpers.

``simulated_by`` is the one place that decides what a public name of the package is bound to: on a GPU the Numba
``@intrinsic`` that emits the instruction, under Numba's CUDA simulator (where inline PTX cannot run) its pure-Python
twin, defined beside it in the same module. The rest are small LLVM-IR builders the intrinsics' ``codegen`` functions
share (casts to 32-bit registers, inline-asm calls, element pointers without wraparound); they only ever run on a GPU.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types

from ...runtime.device import SIMULATOR

if not SIMULATOR:  # the simulator generates no code: Numba's CUDA lowering is left unimported there
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic


def simulated_by(twin, *, factory: bool = False):
    """Decorator: bind the public name to ``twin`` under the simulator, else to the decorated GPU version.

    The decorated function is an intrinsic's typer ``(typingctx, *args) -> (sig, codegen)`` and becomes a Numba
    ``@intrinsic``; with ``factory=True`` it is a plain function that builds intrinsics itself (with
    ``make_intrinsic``) and is kept as it is."""

    def bind(gpu_version):
        if SIMULATOR:
            return twin
        return gpu_version if factory else intrinsic(gpu_version)

    return bind


def make_intrinsic(typer):
    """``@intrinsic`` for a typer made at run time by a factory (GPU only)."""
    return intrinsic(typer)


_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _i32(context, builder, value, ty):
    return context.cast(builder, value, ty, types.uint32)


def _f32(context, builder, value, ty):
    return context.cast(builder, value, ty, types.float32)


def _c(value):
    return ir.Constant(_I32, value)


def _asm(builder, ret, arg_types, text, constraints, args, convergent=False):
    """Call an inline-asm block. Warp-synchronous instructions are marked ``convergent`` so that LLVM never
    moves them across control flow."""
    asm = ir.InlineAsm(ir.FunctionType(ret, arg_types), text, constraints)
    return builder.call(asm, args, attrs=("convergent",) if convergent else ())


def _void_asm(text):
    """Typer of a no-operand instruction with side effects (a ``~{memory}`` clobber: no memory access moves across
    it)."""
    def typer():
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    return typer


def _is_number(*tys):
    return all(isinstance(ty, (types.Integer, types.Float)) for ty in tys)


def _is_int(*tys):
    return all(isinstance(ty, types.Integer) for ty in tys)


def _is_1d(arr):
    return isinstance(arr, types.Array) and arr.ndim == 1


def _is_2d(arr):
    return isinstance(arr, types.Array) and arr.ndim == 2


def _pointer(context, builder, aryty, ary, i_ty, i, j_ty, j):
    """Element pointer of ``ary[i, j]`` WITHOUT negative-index wraparound (Numba adds a compare and select per
    signed index otherwise, which keeps the fully unrolled fragment addresses from folding into base + offset)."""
    array = context.make_array(aryty)(context, builder, value=ary)
    inds = [context.cast(builder, i, i_ty, types.intp), context.cast(builder, j, j_ty, types.intp)]
    return cgutils.get_item_pointer(context, builder, aryty, array, inds, wraparound=False)


def _pointer1(context, builder, aryty, ary, i_ty, i):
    """Element pointer of ``ary[i]`` of a 1-D array, without wraparound (as ``_pointer``)."""
    array = context.make_array(aryty)(context, builder, value=ary)
    idx = context.cast(builder, i, i_ty, types.intp)
    return cgutils.get_item_pointer(context, builder, aryty, array, [idx], wraparound=False)


def _shared_address(builder, ptr):
    """The 32-bit shared-window address of a generic pointer into shared memory (LLVM folds the cast into the
    shared array's own address space, so the address arithmetic stays 32-bit)."""
    return builder.ptrtoint(builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3)), _I32)


def _vector_store(builder, ptr, elem_ty, values, align):
    """One vector store of ``values`` (``len(values)`` elements of ``elem_ty``) at ``ptr``."""
    vec_ty = ir.VectorType(elem_ty, len(values))
    vec = ir.Constant(vec_ty, ir.Undefined)
    for n, value in enumerate(values):
        vec = builder.insert_element(vec, value, ir.Constant(_I32, n))
    builder.store(vec, builder.bitcast(ptr, vec_ty.as_pointer()), align=align)
