"""How the simulator twins of warp-collective instructions see the other lanes.

Numba's CUDA simulator runs every thread of a block as a Python thread. A twin that needs its warp's (or
warpgroup's) operands publishes its own in a slot of the block and meets the others at the block's barrier, so every
thread of a group must call such twins the same number of times in the same order.

Those meetings (and the mbarrier polls of ``tma``) are rounds of the simulator's one block-wide barrier, which a
kernel's ``cuda.syncthreads()`` also waits at: a warp at a kernel barrier would leave it at the first round that
another warp spends inside a shuffle, before that warp reaches the barrier, and read shared memory not yet written
(a rare CI failure of a decode test, 2026-11-27). So, under the simulator, ``cuda.syncthreads()`` is counted
(``_kernel_syncthreads``): a thread's n-th call returns only once every live thread of its block has made its n-th
call -- the hardware's meaning, exited threads counting as arrived.
"""
from __future__ import annotations

import threading

from ...runtime.device import SIMULATOR

_LOCK = threading.Lock()


def _kernel_syncthreads(_module=None):
    """``cuda.syncthreads()`` of a simulated kernel: block-wide barrier rounds until every live thread of the block
    has called it as often as this thread (the rounds other threads spend in collectives and polls pass by)."""
    thread = threading.current_thread()
    manager = thread._manager
    calls = getattr(thread, "_kernel_barriers", 0) + 1
    thread._kernel_barriers = calls
    with _LOCK:
        arrived = manager.__dict__.setdefault("_sim_arrived", {})
        arrived[calls] = arrived.get(calls, 0) + 1
    while True:
        thread.syncthreads()
        with _LOCK:
            # (after a round every thread of the block exists: the manager releases none before it has started all)
            members = manager.__dict__.get("_sim_members")
            if members is None:
                members = manager._sim_members = [t for t in threading.enumerate()
                                                  if getattr(t, "_manager", None) is manager]
            if arrived[calls] >= len(members):
                return
        if all(getattr(t, "_kernel_barriers", 0) >= calls or not t.is_alive() for t in members):
            return  # (some threads have exited)


if SIMULATOR:
    from numba.cuda.simulator import kernelapi as _kernelapi

    _kernelapi.FakeCUDAModule.syncthreads = _kernel_syncthreads


def _sim_warp_gather(value):
    """All 32 lanes' ``value`` of the calling thread's warp (simulator only; a block-wide barrier inside)."""
    return _sim_group_gather(value, 32)


def _sim_group_gather(value, size: int):
    """``value`` of every thread of the calling thread's group of ``size`` consecutive threads (a warp, a
    warpgroup; simulator only; block-wide barriers inside).

    Each thread posts its value with the number of its earlier gathers over groups of this size, then meets the
    others at the block's barrier until its whole group has posted that call: a member may still be blocked at
    another barrier (a warp-specialised kernel's threads wait on mbarriers and named barriers by polling the
    block's barrier, ``tma``), which the simulator does not tell apart."""
    thread = threading.current_thread()
    slots = thread._manager.__dict__.setdefault(f"_ptx_exchange_{size}", ({}, {}))
    counter = f"_ptx_calls_{size}"
    calls = getattr(thread, counter, 0)
    setattr(thread, counter, calls + 1)
    # Two slots used alternately: a thread only comes back to a slot after every member of its group has posted
    # the next call, i.e. after each has read this one.
    slot = slots[calls % 2]
    tid = thread.thread_id
    slot[tid] = (calls, value)
    base = tid - tid % size
    for _ in range(_MAX_ROUNDS):
        thread.syncthreads()
        posted = [slot.get(base + i) for i in range(size)]
        if all(entry is not None and entry[0] == calls for entry in posted):
            return [entry[1] for entry in posted]
    raise RuntimeError(f"simulator: a group of {size} threads never met (deadlock)")


#: block barriers a simulated collective waits for its group before giving up
_MAX_ROUNDS = 200_000


def _sim_lane() -> int:
    return threading.current_thread().thread_id % 32
