"""Hopper's asynchronous machinery (sm_90): mbarriers, the Tensor Memory Accelerator, named barriers, register
budgets; Numba intrinsics with simulator twins.

mbarrier (PTX "Parallel Synchronization and Communication Instructions: mbarrier")
    A 64-bit object in shared memory (8-byte aligned), here named by ``(smem, i)``: element ``i`` of a 1-D uint16
    shared array. It counts *arrivals* and *transaction bytes* of its current phase; the phase completes when the
    pending arrivals reach 0 and the transaction count is 0 again, then the next phase starts with the arrival count
    given at ``mbarrier_init``. ``mbarrier_arrive_expect_tx(smem, i, n)`` raises the transaction count by ``n`` bytes
    and arrives; a TMA copy that names the barrier lowers it by the bytes it writes when they have landed
    (``complete_tx``: the whole box, zero-filled parts included). ``mbarrier_wait(smem, i, parity)`` returns once
    the phase of parity ``parity`` has completed -- i.e. while the barrier's current phase has the other parity
    (before the first completion, ``parity = 1`` passes at once: the usual start of a producer waiting on "empty"
    barriers). A ring of ``S`` stages waits on tile ``j`` with parity ``(j // S) & 1``.
    After ``mbarrier_init`` (one thread), ``fence_mbarrier_init`` and a barrier of the block publish the barriers.

Tensor Memory Accelerator (``cp.async.bulk.tensor``)
    ``tma_load_4d(smem, dst, tensor_map, c0, c1, c2, c3, smem_bar)``: one thread asks the TMA unit to copy the box
    of the tensor map whose first element has coordinates ``(c0, c1, c2, c3)`` (innermost first) to ``smem[dst:]``
    (128-byte aligned; 1024-byte aligned for the 128-byte swizzle, whose pattern the unit takes from the address),
    completing ``tx`` bytes on the mbarrier at ``smem[smem_bar]``. Elements outside the tensor are written as zeros
    (``runtime.tensor_map`` encodes maps that way). ``tensor_map`` is the 64-bit generic address of a 128-byte,
    64-byte aligned ``CUtensorMap`` in GLOBAL memory (Numba cannot pass a ``__grid_constant__`` parameter; PTX takes a
    map in ``.global``). A map written by a generic-proxy store (``runtime.tensor_map`` writes them with a kernel)
    must be acquired by the tensor-map proxy before its first use in a kernel: ``tensormap_acquire`` (one fence per
    thread that issues copies). With the 128-byte swizzle the box's inner extent is 128 bytes (64 16-bit elements):
    box row ``r`` lands at byte ``128 r`` with its 16-byte pieces permuted as ``core.warpgroup.swizzle`` says -- one
    "atom column" of ``core.warpgroup``'s tile layout per box. ``tma_load_2d`` / ``tma_load_3d`` are the same for
    lower ranks.

Named barriers (``bar.sync`` / ``bar.arrive``)
    ``named_barrier_sync(id, count)``: wait until ``count`` threads (a multiple of 32, whole warps) have reached
    barrier ``id`` (1..15; 0 is ``cuda.syncthreads``) by ``named_barrier_sync`` or ``named_barrier_arrive``; the
    latter counts without waiting. Two warpgroups take turns this way (ping-pong).

Register budgets (``setmaxnreg``)
    ``setmaxnreg_inc(n)`` / ``setmaxnreg_dec(n)``: the intrinsic that moves the calling warpgroup's per-thread
    register budget to ``n`` (a multiple of 8 in 24..256; every thread of the warpgroup calls it). ptxas honours it
    only when it knows the count at the kernel's entry (launch bounds with one block per SM); otherwise warning C7508.

``elect_one()``: 1 in exactly one active lane of the warp (``elect.sync``), 0 in the others.

Simulator twins: the barriers' state lives beside the shared array (keyed by its address and the index), a waiting
thread polls at the block's barrier (so it takes part in the warp-collective twins' exchanges of the other threads,
``_sim``), ``tma_load_*`` copies synchronously from the array a simulated tensor map names (``SimTensorMap``) and
completes the bytes at once, ``setmaxnreg_*`` does nothing and ``elect_one`` is lane 0.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import types

from ...runtime.device import SIMULATOR
from ._asm import _I32, _i32, _is_1d, _is_int, _pointer1, _shared_address, _void_asm, make_intrinsic, simulated_by

_I64 = ir.IntType(64)

# ---------------------------------------------------------------------------------------------------------------------
# Simulator state
# ---------------------------------------------------------------------------------------------------------------------
_SIM_LOCK = threading.Lock()
_SIM_BARRIERS: dict = {}  # (shared array address, index) -> [pending arrivals, arrival count, tx bytes, phase]
#: block manager -> {barrier id: [threads arrived, generation, their count]}; weak keys: a finished block's states
#: go with its manager (keyed by ``id()``, a later block whose manager got a dead one's id met its states)
_SIM_NAMED = weakref.WeakKeyDictionary()
_SIM_MAPS: dict = {}  # simulated tensor-map handle -> SimTensorMap
#: polls of the block's barrier before a simulated wait gives up (a deadlock under the simulator)
_SIM_MAX_POLLS = 200_000


@dataclass(frozen=True)
class SimTensorMap:
    """What a simulated tensor map describes: ``array`` (any dtype of 2-byte elements, viewed as uint16), read with
    coordinates innermost first (the reverse of its axes), ``box`` elements per coordinate (innermost first), and
    ``swizzle`` (0 or 128 bytes). ``element_bytes`` 1: the map's elements are bytes (an 8-bit array seen as uint16
    pairs): its innermost coordinate counts bytes, the box's uint16 pairs."""

    array: object
    box: tuple
    swizzle: int
    element_bytes: int = 2


def sim_register_map(desc: SimTensorMap) -> int:
    """A handle for ``desc`` that simulated kernels take in place of a tensor map's address."""
    with _SIM_LOCK:
        handle = 0x1000 + 128 * len(_SIM_MAPS)
        _SIM_MAPS[handle] = desc
    return handle


def _sim_key(smem, i):
    return np.asarray(smem).__array_interface__["data"][0], int(i)


def _sim_thread():
    return threading.current_thread()


def _sim_poll(done, what: str):
    """Wait until ``done()`` holds, meeting the other threads at the block's barrier between looks."""
    thread = _sim_thread()
    for _ in range(_SIM_MAX_POLLS):
        with _SIM_LOCK:
            if done():
                return
        thread.syncthreads()
    raise RuntimeError(f"simulator: {what} never completed (deadlock)")


def _sim_complete(state):
    """Close the phase when nothing is pending (lock held)."""
    if state[0] == 0 and state[2] == 0:
        state[0] = state[1]
        state[3] ^= 1


def _sim_mbarrier_init(smem, i, count):
    with _SIM_LOCK:
        _SIM_BARRIERS[_sim_key(smem, i)] = [int(count), int(count), 0, 0]


def _sim_mbarrier_arrive(smem, i):
    with _SIM_LOCK:
        state = _SIM_BARRIERS[_sim_key(smem, i)]
        state[0] -= 1
        _sim_complete(state)


def _sim_mbarrier_arrive_expect_tx(smem, i, nbytes):
    with _SIM_LOCK:
        state = _SIM_BARRIERS[_sim_key(smem, i)]
        state[2] += int(nbytes)
        state[0] -= 1
        _sim_complete(state)


def _sim_complete_tx(smem, i, nbytes):
    with _SIM_LOCK:
        state = _SIM_BARRIERS[_sim_key(smem, i)]
        state[2] -= int(nbytes)
        _sim_complete(state)


def _sim_mbarrier_wait(smem, i, parity):
    state = _SIM_BARRIERS[_sim_key(smem, i)]
    _sim_poll(lambda: state[3] != (int(parity) & 1), "an mbarrier wait")


def _sim_nothing(*args):
    pass


def _sim_box(tensor_map, coords):
    """(array as uint16, box slices into it, slices of the box that lie inside, the box's shape outermost first,
    its words' offsets in shared memory from the box's start) of the box at ``coords`` (innermost first)."""
    desc = _SIM_MAPS[int(tensor_map)]
    array = np.asarray(desc.array).view(np.uint16)
    rank = len(desc.box)
    if array.ndim != rank or len(coords) != rank:
        raise ValueError(f"simulator: a rank-{rank} tensor map used with {len(coords)} coordinates")
    src, put = [], []
    for axis in range(rank):
        c, n, size = int(coords[rank - 1 - axis]), desc.box[rank - 1 - axis], array.shape[axis]
        if axis == rank - 1 and desc.element_bytes == 1:
            if c % 2:
                raise ValueError("simulator: an 8-bit map's innermost coordinate must be even here")
            c //= 2
        lo, hi = max(c, 0), min(c + n, size)
        src.append(slice(lo, max(lo, hi)))
        put.append(slice(lo - c, lo - c + max(0, hi - lo)))
    shape = tuple(reversed(desc.box))
    offsets = np.arange(int(np.prod(shape)))
    if desc.swizzle == 128:
        if desc.box[0] != 64:
            raise ValueError("simulator: the 128-byte swizzle needs boxes 64 16-bit elements wide")
        offsets = (offsets * 2 ^ (((offsets * 2 >> 7) & 7) << 4)) // 2
    return array, tuple(src), tuple(put), shape, offsets


def _sim_tma_load(smem, dst, tensor_map, *coords_and_bar):
    """Copy the box at ``coords`` (innermost first) into ``smem[dst:]`` (zeros outside the tensor; swizzled), then
    complete its bytes on the barrier."""
    *coords, bar = coords_and_bar
    array, src, put, shape, offsets = _sim_box(tensor_map, coords)
    box = np.zeros(shape, np.uint16)  # outermost first, as the array's axes
    box[put] = array[src]
    np.asarray(smem).view(np.uint16)[int(dst) + offsets] = box.reshape(-1)
    _sim_complete_tx(smem, bar, 2 * box.size)


def sim_tma_store_now(smem, src, tensor_map, *coords):
    """The simulated store of ``smem[src:]`` (swizzled) to the box at ``coords``: only its part inside the tensor
    (``core.ptx.bulk.tma_store_4d``'s twin carries it out at the wait that covers it)."""
    array, dst, put, shape, offsets = _sim_box(tensor_map, coords)
    box = np.asarray(smem).view(np.uint16)[int(src) + offsets].reshape(shape)
    array[dst] = box[put]


def _sim_named_count(barrier_id, count):
    """Count this thread's arrival at a named barrier; returns ``(state, generation)``: the barrier's state
    ``[arrived, generation, count]`` and the round this arrival joined. Arrivals of one round must name the same
    thread count (PTX leaves anything else undefined: on an H100 two uses of one id with different counts raised an
    illegal instruction now and then, when their rounds overlapped). The simulator's threads seldom make them
    overlap, so it is stricter: one id, one count, for the whole block."""
    manager = _sim_thread()._manager
    with _SIM_LOCK:
        state = _SIM_NAMED.setdefault(manager, {}).setdefault(int(barrier_id), [0, 0, int(count)])
        if state[2] != int(count):
            raise RuntimeError(f"simulator: named barrier {int(barrier_id)} used with {state[2]} and {int(count)} "
                               f"threads (give each use its own id)")
        generation = state[1]
        state[0] += 1
        if state[0] == int(count):
            state[0] = 0
            state[1] += 1
        return state, generation


def _sim_named_sync(barrier_id, count):
    state, generation = _sim_named_count(barrier_id, count)
    _sim_poll(lambda: state[1] != generation, f"named barrier {int(barrier_id)}")


def _sim_named_arrive(barrier_id, count):
    _sim_named_count(barrier_id, count)


def _sim_elect_one():
    return np.uint32(_sim_thread().thread_id % 32 == 0)


# ---------------------------------------------------------------------------------------------------------------------
# Intrinsics
# ---------------------------------------------------------------------------------------------------------------------
def _shared_index_typer(extra: int, text: str, constraints: str):
    """Typer of ``(smem, i, *extra 32-bit ints)`` -> void: ``$0`` the shared address of ``smem[i]``."""
    def typer(typingctx, smem, i, *rest):
        if not (_is_1d(smem) and smem.dtype == types.uint16 and _is_int(i, *rest)) or len(rest) != extra:
            return None
        sig = types.void(smem, i, *rest)

        def codegen(context, builder, sig, args):
            addr = _shared_address(builder, _pointer1(context, builder, sig.args[0], args[0], sig.args[1], args[1]))
            values = [addr] + [_i32(context, builder, a, t) for a, t in zip(args[2:], sig.args[2:])]
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32] * len(values)), text, constraints,
                               side_effect=True)
            builder.call(asm, values, attrs=("convergent",))
            return context.get_dummy_value()

        return sig, codegen

    return typer


@simulated_by(_sim_mbarrier_init)
def mbarrier_init(typingctx, smem, i, count):
    """(smem, i, count): make the mbarrier at ``smem[i]`` (8-byte aligned) expect ``count`` arrivals per phase::

        mbarrier.init.shared::cta.b64 [addr], count;"""
    return _shared_index_typer(1, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r,~{memory}")(
        typingctx, smem, i, count)


@simulated_by(_sim_mbarrier_arrive)
def mbarrier_arrive(typingctx, smem, i):
    """(smem, i): arrive once on the mbarrier at ``smem[i]`` (release semantics: this thread's earlier memory
    accesses happen before the phase completes)::

        mbarrier.arrive.shared::cta.b64 state, [addr];"""
    return _shared_index_typer(0, "{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0]; }", "r,~{memory}")(
        typingctx, smem, i)


@simulated_by(_sim_mbarrier_arrive_expect_tx)
def mbarrier_arrive_expect_tx(typingctx, smem, i, nbytes):
    """(smem, i, nbytes): expect ``nbytes`` more transaction bytes in this phase of the mbarrier at ``smem[i]``,
    and arrive once::

        mbarrier.arrive.expect_tx.shared::cta.b64 state, [addr], nbytes;"""
    return _shared_index_typer(
        1, "{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }", "r,r,~{memory}")(
        typingctx, smem, i, nbytes)


@simulated_by(_sim_mbarrier_wait)
def mbarrier_wait(typingctx, smem, i, parity):
    """(smem, i, parity): spin until the phase of parity ``parity & 1`` of the mbarrier at ``smem[i]`` has completed
    (acquire semantics: what the arrivals and the copies released is visible after it)::

        WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [addr], parity;  @!p bra WAIT;

    (the label is local to the asm's braces, so the block may be inlined any number of times)."""
    text = "{ .reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; @!p bra WAIT; }"
    return _shared_index_typer(1, text, "r,r,~{memory}")(typingctx, smem, i, parity)


def _tma_load_typer(rank: int):
    coords = ", ".join(f"${2 + x}" for x in range(rank))
    text = (f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
            f"[$0], [$1, {{{coords}}}], [${2 + rank}];")
    constraints = ",".join(["r", "l"] + ["r"] * rank + ["r", "~{memory}"])

    def typer(typingctx, smem, dst, tensor_map, *rest):
        if len(rest) != rank + 1 or not (_is_1d(smem) and smem.dtype == types.uint16 and _is_int(dst, tensor_map, *rest)):
            return None
        sig = types.void(smem, dst, tensor_map, *rest)

        def codegen(context, builder, sig, args):
            smem_ty = sig.args[0]
            dst_addr = _shared_address(builder, _pointer1(context, builder, smem_ty, args[0], sig.args[1], args[1]))
            tmap = context.cast(builder, args[2], sig.args[2], types.uint64)
            cs = [_i32(context, builder, a, t) for a, t in zip(args[3:3 + rank], sig.args[3:3 + rank])]
            bar = _shared_address(builder, _pointer1(context, builder, smem_ty, args[0], sig.args[-1], args[-1]))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I64] + [_I32] * rank + [_I32]), text,
                               constraints, side_effect=True)
            builder.call(asm, [dst_addr, tmap] + cs + [bar])
            return context.get_dummy_value()

        return sig, codegen

    return typer


@simulated_by(_sim_tma_load)
def tma_load_2d(typingctx, smem, dst, tensor_map, c0, c1, bar):
    """(smem, dst, tensor_map, c0, c1, bar): the box at ``(c0, c1)`` of a rank-2 tensor map to ``smem[dst:]``,
    completing its bytes on the mbarrier at ``smem[bar]`` (module docstring)."""
    return _tma_load_typer(2)(typingctx, smem, dst, tensor_map, c0, c1, bar)


@simulated_by(_sim_tma_load)
def tma_load_3d(typingctx, smem, dst, tensor_map, c0, c1, c2, bar):
    """As ``tma_load_2d`` for a rank-3 tensor map."""
    return _tma_load_typer(3)(typingctx, smem, dst, tensor_map, c0, c1, c2, bar)


@simulated_by(_sim_tma_load)
def tma_load_4d(typingctx, smem, dst, tensor_map, c0, c1, c2, c3, bar):
    """As ``tma_load_2d`` for a rank-4 tensor map: ``(c0, c1, c2, c3)`` = (head-dim column, row, head, batch) of a
    ``(batch, heads, seqlen, headdim)`` tensor (``runtime.tensor_map``)."""
    return _tma_load_typer(4)(typingctx, smem, dst, tensor_map, c0, c1, c2, c3, bar)


def _map_address_typer(text: str):
    def typer(typingctx, tensor_map):
        if not _is_int(tensor_map):
            return None
        sig = types.void(tensor_map)

        def codegen(context, builder, sig, args):
            addr = context.cast(builder, args[0], sig.args[0], types.uint64)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I64]), text, "l,~{memory}", side_effect=True)
            builder.call(asm, [addr])
            return context.get_dummy_value()

        return sig, codegen

    return typer


@simulated_by(_sim_nothing)
def tensormap_acquire(typingctx, tensor_map):
    """(tensor_map): make a tensor map that generic-proxy stores wrote on this GPU (an earlier kernel) visible to
    this thread's TMA copies::

        fence.proxy.tensormap::generic.acquire.gpu [tensor_map], 128;"""
    return _map_address_typer("fence.proxy.tensormap::generic.acquire.gpu [$0], 128;")(typingctx, tensor_map)


@simulated_by(_sim_nothing)
def prefetch_tensormap(typingctx, tensor_map):
    """(tensor_map): start fetching the tensor map into the TMA unit's cache (``prefetch.tensormap [a];``)."""
    return _map_address_typer("prefetch.tensormap [$0];")(typingctx, tensor_map)


@simulated_by(_sim_nothing)
def fence_mbarrier_init(typingctx):
    """``fence.mbarrier_init.release.cluster``: this thread's ``mbarrier_init`` s are visible to the async proxy (the
    TMA unit) and, after the next barrier of the block, to the other threads."""
    return _void_asm("fence.mbarrier_init.release.cluster;")()


def _named_typer(text: str):
    def typer(typingctx, barrier_id, count):
        if not _is_int(barrier_id, count):
            return None
        sig = types.void(barrier_id, count)

        def codegen(context, builder, sig, args):
            values = [_i32(context, builder, a, t) for a, t in zip(args, sig.args)]
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I32]), text, "r,r,~{memory}",
                               side_effect=True)
            builder.call(asm, values, attrs=("convergent",))
            return context.get_dummy_value()

        return sig, codegen

    return typer


@simulated_by(_sim_named_sync)
def named_barrier_sync(typingctx, barrier_id, count):
    """(id, count): wait at barrier ``id`` until ``count`` threads have come (``bar.sync id, count;``; whole warps,
    the same ``count`` in every participant)."""
    return _named_typer("bar.sync $0, $1;")(typingctx, barrier_id, count)


@simulated_by(_sim_named_arrive)
def named_barrier_arrive(typingctx, barrier_id, count):
    """(id, count): count this warp at barrier ``id`` without waiting (``bar.arrive id, count;``)."""
    return _named_typer("bar.arrive $0, $1;")(typingctx, barrier_id, count)


def _sim_setmaxnreg(count: int):
    _check_registers(count)
    return _sim_nothing


def _check_registers(count: int) -> int:
    if type(count) is not int or count % 8 or not 24 <= count <= 256:
        raise ValueError(f"setmaxnreg: expected a multiple of 8 in [24, 256], got {count!r}")
    return count


def _setmaxnreg(direction: str, count: int):
    text = f"setmaxnreg.{direction}.sync.aligned.u32 {_check_registers(count)};"

    def setmaxnreg(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
            builder.call(asm, [], attrs=("convergent",))
            return context.get_dummy_value()

        return types.void(), codegen

    setmaxnreg.__name__ = setmaxnreg.__qualname__ = f"setmaxnreg_{direction}_{count}"
    return make_intrinsic(setmaxnreg)


@simulated_by(_sim_setmaxnreg, factory=True)
@lru_cache(maxsize=None)
def setmaxnreg_inc(count: int):
    """The intrinsic ``()``: raise the calling warpgroup's register budget to ``count`` per thread (it waits until
    the SM's pool has them: other warpgroups released them with ``setmaxnreg_dec``)."""
    return _setmaxnreg("inc", count)


@simulated_by(_sim_setmaxnreg, factory=True)
@lru_cache(maxsize=None)
def setmaxnreg_dec(count: int):
    """The intrinsic ``()``: lower the calling warpgroup's register budget to ``count`` per thread, returning the
    rest to the SM's pool."""
    return _setmaxnreg("dec", count)


@simulated_by(_sim_elect_one)
def elect_one(typingctx):
    """() -> uint32: 1 in one active lane of the (converged) warp, 0 elsewhere::

        elect.sync _|p, 0xffffffff;"""
    sig = types.uint32()

    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_I32, []),
                           "{ .reg .pred p; elect.sync _|p, 0xffffffff; selp.u32 $0, 1, 0, p; }", "=r",
                           side_effect=True)
        return builder.call(asm, [], attrs=("convergent",))

    return sig, codegen


__all__ = ["mbarrier_init", "mbarrier_arrive", "mbarrier_arrive_expect_tx", "mbarrier_wait", "fence_mbarrier_init",
           "tma_load_2d", "tma_load_3d", "tma_load_4d", "tensormap_acquire", "prefetch_tensormap",
           "named_barrier_sync", "named_barrier_arrive", "setmaxnreg_inc", "setmaxnreg_dec", "elect_one",
           "SimTensorMap", "sim_register_map", "SIMULATOR"]
