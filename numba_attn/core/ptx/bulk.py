"""Bulk copies of contiguous bytes from global to shared memory (``cp.async.bulk``, sm_90), completing on an mbarrier
of ``tma`` -- for small row-major tiles that need no tensor map (the backward's per-row statistics) -- and bulk
reductions back (``bulk_reduce_add_f32``: the backward's float32 ``dQ`` tiles, ``core.dq_tile``), and TMA stores of
swizzled tiles through a tensor map (``tma_store_4d``: the forward's output, ``core.epilogue.stage_rows``).

``bulk_load_f32(smem, dst, arr, i, nbytes, bar)``: copy ``nbytes`` (a multiple of 16) starting at ``arr[i, 0]`` of
a 2-D float32 array (rows contiguous with each other over the copied span; 16-byte aligned) to ``smem[dst:]`` (a
1-D uint16 shared array, 16-byte aligned), and complete ``nbytes`` transaction bytes on the mbarrier at
``smem[bar]`` (``tma.mbarrier_arrive_expect_tx`` announced them)::

    cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], nbytes, [bar];

The simulator twin copies at once and completes the bytes on the simulated barrier. The twins of the bulk
reductions and of the TMA store keep each thread's groups and carry a group out only at the wait that covers it (the latest moment the
hardware may read its source), so a source written again too early, or a group never waited for, shows.
"""
from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import types

from ._asm import (_I32, _i32, _is_1d, _is_2d, _is_int, _pointer, _pointer1, _shared_address, _void_asm,
                   simulated_by)
from .tma import _sim_complete_tx, sim_tma_store_now

_I64 = ir.IntType(64)


def _sim_bulk_load_f32(smem, dst, arr, i, nbytes, bar):
    n = int(nbytes) // 4
    src = np.ascontiguousarray(np.asarray(arr)[int(i):]).reshape(-1)[:n].astype(np.float32)
    words = np.asarray(smem).view(np.uint16)
    words[int(dst):int(dst) + 2 * n] = src.view(np.uint16)
    _sim_complete_tx(smem, bar, int(nbytes))


@simulated_by(_sim_bulk_load_f32)
def bulk_load_f32(typingctx, smem, dst, arr, i, nbytes, bar):
    """(smem, dst, arr, i, nbytes, bar): the module docstring's copy."""
    if not (_is_1d(smem) and smem.dtype == types.uint16 and _is_2d(arr) and arr.dtype == types.float32
            and _is_int(dst, i, nbytes, bar)):
        return None
    sig = types.void(smem, dst, arr, i, nbytes, bar)
    text = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];"

    def codegen(context, builder, sig, args):
        smem_ty, dst_ty, arr_ty, i_ty, n_ty, bar_ty = sig.args
        dst_addr = _shared_address(builder, _pointer1(context, builder, smem_ty, args[0], dst_ty, args[1]))
        zero = context.get_constant(types.intp, 0)
        src = _pointer(context, builder, arr_ty, args[2], i_ty, args[3], types.intp, zero)
        src = builder.ptrtoint(builder.addrspacecast(src, ir.PointerType(src.type.pointee, 1)), _I64)
        bar_addr = _shared_address(builder, _pointer1(context, builder, smem_ty, args[0], bar_ty, args[5]))
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32, _I32]), text, "r,l,r,r,~{memory}",
                           side_effect=True)
        builder.call(asm, [dst_addr, src, _i32(context, builder, args[4], n_ty), bar_addr])
        return context.get_dummy_value()

    return sig, codegen


def _sim_bulk_group():
    """The calling thread's bulk reductions issued since its last commit, and its committed groups (oldest first)."""
    thread = threading.current_thread()
    if not hasattr(thread, "_ptx_bulk_groups"):
        thread._ptx_bulk_groups = ([], [])
    return thread._ptx_bulk_groups


def _sim_bulk_reduce_add_f32(arr, i, smem, src, nbytes):
    # deferred to the latest moment the hardware may read the source (the wait that covers its group): a staging
    # tile written again too early, or a group never waited for, shows in the result
    _sim_bulk_group()[0].append((_sim_bulk_reduce_now, (arr, i, smem, src, nbytes)))


def _sim_bulk_reduce_now(arr, i, smem, src, nbytes):
    n = int(nbytes) // 4
    values = np.asarray(smem).view(np.uint16)[int(src):int(src) + 2 * n].copy().view(np.float32)
    rows = np.asarray(arr)[int(i):]
    if n > rows.shape[1]:  # a span over several rows: they must follow one another in memory
        if not rows.flags.c_contiguous or rows.size < n:
            raise ValueError("bulk_reduce_add_f32: a span over several rows needs contiguous rows inside the array")
        span = rows.reshape(-1)[:n]
    else:
        span = rows[0, :n]
    span[:] = (span.astype(np.float32) + values).astype(np.float32)


def _bulk_reduce_typer(text: str):
    """Typer of ``(arr, i, smem, src, nbytes)`` for a bulk reduction whose PTX is ``text`` ($0 the global address,
    $1 the shared one, $2 the bytes)."""
    def typer(typingctx, arr, i, smem, src, nbytes):
        if not (_is_2d(arr) and arr.dtype == types.float32 and _is_1d(smem) and smem.dtype == types.uint16
                and _is_int(i, src, nbytes)):
            return None
        sig = types.void(arr, i, smem, src, nbytes)

        def codegen(context, builder, sig, args):
            arr_ty, i_ty, smem_ty, src_ty, n_ty = sig.args
            zero = context.get_constant(types.intp, 0)
            dst = _pointer(context, builder, arr_ty, args[0], i_ty, args[1], types.intp, zero)
            dst = builder.ptrtoint(builder.addrspacecast(dst, ir.PointerType(dst.type.pointee, 1)), _I64)
            src = _shared_address(builder, _pointer1(context, builder, smem_ty, args[2], src_ty, args[3]))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64, _I32, _I32]), text, "l,r,r,~{memory}",
                               side_effect=True)
            builder.call(asm, [dst, src, _i32(context, builder, args[4], n_ty)])
            return context.get_dummy_value()

        return sig, codegen

    return typer


@simulated_by(_sim_bulk_reduce_add_f32)
def bulk_reduce_add_f32(typingctx, arr, i, smem, src, nbytes):
    """(arr, i, smem, src, nbytes): add the ``nbytes / 4`` float32 values at ``smem[src:]`` (a uint16 shared array,
    16-byte aligned) to ``arr[i, 0:]`` of a 2-D float32 array in global memory (onward over the following rows
    where ``nbytes`` exceeds a row: rows contiguous), elementwise, by the TMA unit (each element atomically);
    ``nbytes`` a multiple of 16. The copy joins this thread's current bulk group (``bulk_commit``,
    ``bulk_wait_read``)::

        cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [dst], [src], nbytes;"""
    return _bulk_reduce_typer("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;")(
        typingctx, arr, i, smem, src, nbytes)


@simulated_by(_sim_bulk_reduce_add_f32)
def bulk_reduce_add_f32_evict_last(typingctx, arr, i, smem, src, nbytes):
    """``bulk_reduce_add_f32`` with the L2 policy "evict last" for the destination lines (other blocks add to
    the same tile soon)::

        createpolicy.fractional.L2::evict_last.b64 policy, 1.0;
        cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [dst], [src], nbytes, policy;"""
    return _bulk_reduce_typer(
        "{ .reg .b64 policy; createpolicy.fractional.L2::evict_last.b64 policy, 1.0; "
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [$0], [$1], $2, policy; }")(
        typingctx, arr, i, smem, src, nbytes)


def _sim_tma_store(smem, src, tensor_map, *coords):
    _sim_bulk_group()[0].append((sim_tma_store_now, (smem, src, tensor_map) + coords))


@simulated_by(_sim_tma_store)
def tma_store_4d(typingctx, smem, src, tensor_map, c0, c1, c2, c3):
    """(smem, src, tensor_map, c0, c1, c2, c3): the TMA unit stores the box at ``smem[src:]`` (laid out as
    ``tma.tma_load_4d`` leaves one: 128-byte swizzled, ``src`` 1024-byte aligned) to the box of the rank-4 tensor
    map at ``(c0, c1, c2, c3)``; elements outside the tensor are not written. Before it, the writers of the box
    ``fence_proxy_async`` and meet at a barrier; the copy joins this thread's bulk group (``bulk_commit``;
    ``bulk_wait_read`` before the box is written again or the block exits)::

        cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [tensor_map, {c0, c1, c2, c3}], [src];"""
    if not (_is_1d(smem) and smem.dtype == types.uint16 and _is_int(src, tensor_map, c0, c1, c2, c3)):
        return None
    sig = types.void(smem, src, tensor_map, c0, c1, c2, c3)
    text = "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [$0, {$2, $3, $4, $5}], [$1];"

    def codegen(context, builder, sig, args):
        src_addr = _shared_address(builder, _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
        tmap = context.cast(builder, args[2], sig.args[2], types.uint64)
        coords = [_i32(context, builder, a, t) for a, t in zip(args[3:], sig.args[3:])]
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64, _I32] + [_I32] * 4), text,
                           "l,r,r,r,r,r,~{memory}", side_effect=True)
        builder.call(asm, [tmap, src_addr] + coords)
        return context.get_dummy_value()

    return sig, codegen


def _sim_commit():
    issued, groups = _sim_bulk_group()
    groups.append(list(issued))
    issued.clear()


def _sim_wait_read(pending: int):
    groups = _sim_bulk_group()[1]
    while len(groups) > pending:
        for op, args in groups.pop(0):
            op(*args)


def _sim_wait_read0():
    _sim_wait_read(0)


def _sim_wait_read1():
    _sim_wait_read(1)


@simulated_by(_sim_commit)
def bulk_commit(typingctx):
    """``cp.async.bulk.commit_group``: this thread's bulk copies issued since the last commit form one group."""
    return _void_asm("cp.async.bulk.commit_group;")()


@simulated_by(_sim_wait_read0)
def bulk_wait_read(typingctx):
    """``cp.async.bulk.wait_group.read 0``: this thread's committed bulk groups have read their shared-memory
    sources (which may then be written again)."""
    return _void_asm("cp.async.bulk.wait_group.read 0;")()


@simulated_by(_sim_wait_read0)
def bulk_wait_all(typingctx):
    """``cp.async.bulk.wait_group 0``: this thread's committed bulk groups are complete."""
    return _void_asm("cp.async.bulk.wait_group 0;")()


@simulated_by(_sim_wait_read1)
def bulk_wait_read1(typingctx):
    """``cp.async.bulk.wait_group.read 1``: all but this thread's most recent committed bulk group have read their
    shared-memory sources."""
    return _void_asm("cp.async.bulk.wait_group.read 1;")()
