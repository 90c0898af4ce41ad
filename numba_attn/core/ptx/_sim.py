"""How the simulator twins of warp-collective instructions see the other lanes.

Numba's CUDA simulator runs every thread of a block as a Python thread. A twin that needs its warp's (or
warpgroup's) operands publishes its own in a slot of the block and meets the others at the block's barrier, so every
thread of the block must call such twins the same number of times in the same order.
"""
from __future__ import annotations

import threading


def _sim_warp_gather(value):
    """All 32 lanes' ``value`` of the calling thread's warp (simulator only; a block-wide barrier inside)."""
    return _sim_group_gather(value, 32)


def _sim_group_gather(value, size: int):
    """``value`` of every thread of the calling thread's group of ``size`` consecutive threads (a warp, a
    warpgroup; simulator only; a block-wide barrier inside)."""
    thread = threading.current_thread()
    slots = thread._manager.__dict__.setdefault("_ptx_exchange", ({}, {}))
    calls = getattr(thread, "_ptx_calls", 0)
    thread._ptx_calls = calls + 1
    # Two slots used alternately: a thread only comes back to a slot after every thread of its group has written
    # the next one, i.e. after every one of them has read this one.
    slot = slots[calls % 2]
    tid = thread.thread_id
    base = tid - tid % size
    slot[tid] = (calls, value)
    # the block's barrier until the whole group has written: threads of the block that poll (a simulated mbarrier
    # wait) may release a barrier while some of the group have not come to this exchange yet
    while True:
        thread.syncthreads()
        if all(slot.get(base + i, (None,))[0] == calls for i in range(size)):
            return [slot[base + i][1] for i in range(size)]


def _sim_lane() -> int:
    return threading.current_thread().thread_id % 32
