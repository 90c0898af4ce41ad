"""Warp-collective instructions: shuffles, a vote and the warp barrier.

Every lane of the warp must take part (converged). Under the simulator the twins exchange values through the
block's barrier (``_sim``): every thread of the block must call them the same number of times in the same order.
"""
from __future__ import annotations

import threading

import numpy as np
from numba import types

from ._asm import _F32, _I32, _asm, _f32, _i32, _is_int, _is_number, _void_asm, simulated_by
from ._sim import _sim_lane, _sim_warp_gather


def _sim_shfl_xor_f32(x, lane_mask):
    return _sim_warp_gather(np.float32(x))[_sim_lane() ^ int(lane_mask)]


@simulated_by(_sim_shfl_xor_f32)
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


def _sim_all_lanes(predicate):
    """Simulator emulation of ``vote.sync.all`` (see the GPU version)."""
    return np.uint32(all(_sim_warp_gather(bool(predicate))))


@simulated_by(_sim_all_lanes)
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


def _sim_warp_sync():
    """Simulator twin of ``bar.warp.sync``: a block-wide barrier (every thread must reach it)."""
    threading.current_thread().syncthreads()


@simulated_by(_sim_warp_sync)
def warp_sync(typingctx):
    """``bar.warp.sync 0xffffffff``: the warp's lanes meet, and their shared-memory accesses before it are
    ordered before those after it (e.g. ``ldmatrix`` reads of a buffer that the warp's ``cp.async`` overwrites
    next)."""
    return _void_asm("bar.warp.sync 0xffffffff;")()


def _sim_warp_uniform(x):
    """Simulator twin of ``warp_uniform``: the thread's own ``x`` (the same on every lane by contract)."""
    return np.int32(x)


@simulated_by(_sim_warp_uniform)
def warp_uniform(typingctx, x):
    """(x) -> int32: lane 0's ``x``, for a value the same on every lane (e.g. the warpgroup's index, ``tid //
    128``) that ptxas cannot prove so: what it reads from a shuffle of lane 0 it knows to be uniform, so addresses
    and wgmma descriptors made from it live in uniform registers (no per-k-step ``R2UR``; CUTLASS's
    ``canonical_warp_group_idx`` does the same)::

        shfl.sync.idx.b32 d, x, 0, 31, 0xffffffff;"""
    if not _is_int(x):
        return None
    sig = types.int32(x)

    def codegen(context, builder, sig, args):
        v = _i32(context, builder, args[0], sig.args[0])
        return _asm(builder, _I32, [_I32], "shfl.sync.idx.b32 $0, $1, 0, 31, -1;", "=r,r", [v], convergent=True)

    return sig, codegen
