"""``cp.async``: copies from global to shared memory that run while the thread computes, in commit groups.

A thread starts copies (``cp_async_16``), closes them into a group (``cp_async_commit``) and later waits for its
groups (``cp_async_wait_all`` / ``cp_async_wait_group``); other threads see the data after a barrier that follows
the wait. Under the simulator the copies are synchronous, so committing and waiting do nothing.
"""
from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import types

from ._asm import _I32, _i32, _is_1d, _is_int, _pointer1, _shared_address, _void_asm, make_intrinsic, simulated_by


def _cp_async_16(typingctx, dst, i, src, offset, nbytes, instruction):
    if not (_is_1d(dst) and dst.dtype in (types.uint16, types.float32) and isinstance(src, types.Array)
            and _is_int(i, offset, nbytes)):
        return None
    sig = types.void(dst, i, src, offset, nbytes)

    def codegen(context, builder, sig, args):
        addr = _shared_address(builder, _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
        data = context.make_array(sig.args[2])(context, builder, value=args[2]).data
        gptr = builder.add(builder.ptrtoint(data, ir.IntType(64)),
                           context.cast(builder, args[3], sig.args[3], types.int64))
        size = _i32(context, builder, args[4], sig.args[4])
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, ir.IntType(64), _I32]),
                           instruction + " [$0], [$1], 16, $2;", "r,l,r,~{memory}", side_effect=True)
        builder.call(asm, [addr, gptr, size])
        return context.get_dummy_value()

    return sig, codegen


def _sim_cp_async_16(dst, i, src, offset, nbytes):
    """Simulator emulation of ``cp.async``: a synchronous copy (or zero fill)."""
    raw = np.zeros(16, np.uint8)
    if nbytes:
        data = np.asarray(src).__array_interface__["data"][0]
        raw[:] = np.ctypeslib.as_array((ctypes.c_uint8 * 16).from_address(data + int(offset)))
    words = raw.view(dst.dtype)
    for n in range(len(words)):
        dst[i + n] = words[n]


@simulated_by(_sim_cp_async_16)
def cp_async_16(typingctx, dst, i, src, offset, nbytes):
    """(dst, i, src, offset, nbytes): start an asynchronous copy of the 16 bytes ``offset`` bytes past the first
    element of ``src`` (any array in global memory; the caller computes the offset from its strides) to
    ``dst[i : i + 16 / itemsize]`` (a 1-D uint16 or float32 shared array); both 16-byte aligned. ``nbytes`` (0 or
    16) bytes are read and the rest of the 16 filled with zeros, so ``0`` zero-fills without reading (the address
    must still be valid)::

        cp.async.cg.shared.global [dst], [src + offset], 16, nbytes;

    Completes at ``cp_async_wait_all`` (for the groups committed before it)."""
    return _cp_async_16(typingctx, dst, i, src, offset, nbytes, "cp.async.cg.shared.global")


@simulated_by(_sim_cp_async_16)  # the L2 hint changes nothing the simulator could show
def cp_async_16_prefetch(typingctx, dst, i, src, offset, nbytes):
    """As ``cp_async_16``, also asking L2 to fetch the whole 256-byte sector group around the address
    (``cp.async.cg.shared.global.L2::256B``): for long runs of contiguous rows streamed once, as a KV cache is
    when decoding (H100, split-KV decode of 256 MB: 2-3 % less time)."""
    return _cp_async_16(typingctx, dst, i, src, offset, nbytes, "cp.async.cg.shared.global.L2::256B")


def _sim_cp_async_commit():
    pass


@simulated_by(_sim_cp_async_commit)
def cp_async_commit(typingctx):
    """``cp.async.commit_group``: the copies this thread started since the last commit form one group."""
    return _void_asm("cp.async.commit_group;")()


def _sim_cp_async_wait_all():
    pass


@simulated_by(_sim_cp_async_wait_all)
def cp_async_wait_all(typingctx):
    """``cp.async.wait_group 0``: this thread's committed copies have landed (other threads' copies are visible
    after a barrier that follows)."""
    return _void_asm("cp.async.wait_group 0;")()


def _sim_cp_async_wait_group(pending: int):
    """Simulator twin of ``cp_async_wait_group``: the copies are synchronous already."""
    return cp_async_wait_all


_wait_groups: dict = {}


@simulated_by(_sim_cp_async_wait_group, factory=True)
def cp_async_wait_group(pending: int):
    """The intrinsic ``()`` -> ``cp.async.wait_group pending``: all but this thread's ``pending`` most recent
    commit groups have landed (groups complete in order). Made once per count (an immediate operand)."""
    pending = int(pending)
    if not 0 <= pending <= 7:
        raise ValueError(f"pending: expected 0..7 commit groups, got {pending}")
    if pending not in _wait_groups:
        text = f"cp.async.wait_group {pending};"

        def wait_group(typingctx):
            return _void_asm(text)()

        wait_group.__name__ = wait_group.__qualname__ = f"cp_async_wait_group_{pending}"
        _wait_groups[pending] = make_intrinsic(wait_group)
    return _wait_groups[pending]
