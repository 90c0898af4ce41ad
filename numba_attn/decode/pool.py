"""The atomic counters of pooled decoding launches (``decode.plan``: a row tile's blocks take its pool's tiles one
by one through a counter, and its last block to arrive merges the parts)."""
from __future__ import annotations

import threading

import numpy as np

from ..runtime import launch as _launch
from ..runtime.cache import BoundedCache
from ..runtime.device import SIMULATOR, DeviceView, cuda


class PoolCounters:
    """The counters of pooled launches: ``2 * row tiles`` uint32s per launch (tiles handed out, blocks arrived),
    zero when a launch starts and left at zero by it (its last block resets them). A launch that fails part-way
    (the simulator stops a kernel at a Python exception) leaves them as it got them: the launcher calls ``reset``.

    Launches that may run at the same time must not share counters. Plain launches on one stream run one after
    the other, so they share one buffer per (device, stream), and per thread on the per-thread default stream. A
    launch captured into a CUDA graph runs whenever the graph is replayed, on any stream, so it gets counters of its
    own: a slice of an arena zeroed before the capture (zeroing them inside the graph would add a memset node to
    every replay). ``get`` returns None when a capture finds no arena space, or when
    ``MAX_STREAMS`` streams already have counters (a program that makes a stream per request would otherwise keep
    a buffer for each); the caller then zeroes counters in its scratch with a memset on the stream."""

    ARENA_WORDS = 1 << 16  # 1024 captured launches of 32 row tiles; a new arena once half of it is taken
    PER_THREAD_STREAM = 2  # CU_STREAM_PER_THREAD: one handle, a stream per thread
    MAX_STREAMS = 1024  # buffers of at least 1 KB each

    def __init__(self):
        self._lock = threading.Lock()
        # (device, stream, thread) -> counters of plain launches; never full enough to evict (see get)
        self._streams = BoundedCache("decode pool counters per stream", self.MAX_STREAMS)
        self._arenas = {}  # device -> [zeroed words, words taken]: the arenas' state, not a cache
        self._kept = []  # every buffer ever made: launches and graphs may still use the ones replaced
        self._unused = DeviceView(0, (0,), (4,), np.uint32, None) if not SIMULATOR else None

    def unused(self):
        """The argument of a plan without a pool (the kernel never reads it)."""
        if self._unused is None:
            self._unused = cuda.to_device(np.zeros(1, np.uint32))
        return self._unused

    def reset(self, counters, words: int, stream: int) -> None:
        """Zero the first ``words`` of ``counters`` after a launch on ``stream`` (a driver handle) failed: it may have
        drawn tiles or counted arrivals without its last block zeroing them. In stream order on a GPU (where a
        launch that fails has not run); a capture's counters are its own and go with the failed capture."""
        if SIMULATOR:
            counters[:words] = 0
        elif not _launch.stream_capturing(stream):
            _launch.zero_words_async(DeviceView.of(counters).ptr, words, stream)

    def get(self, words: int, stream: int, device_id: int, capturing: bool | None = None):
        """``words`` zeroed counters for a launch on ``stream`` (a driver handle) of device ``device_id``, or None.
        ``capturing``: whether the stream is being captured, where the caller asked already."""
        if capturing is None:
            capturing = _launch.stream_capturing(stream)
        if capturing:
            with self._lock:
                arena = self._arenas.get(device_id)
                if arena is None or arena[1] + words > arena[0].shape[0]:
                    return None
                start = arena[1]
                arena[1] += words
            return _slice_words(arena[0], start, words)
        arena = self._arenas.get(device_id)
        if arena is None or 2 * arena[1] > arena[0].shape[0]:  # (made outside captures, for the next ones)
            with self._lock:
                self._arenas[device_id] = [_launch.zeroed_words(self.ARENA_WORDS), 0]
                self._kept.append(self._arenas[device_id][0])
        thread = threading.get_ident() if stream == self.PER_THREAD_STREAM else 0
        key = (device_id, stream, thread)
        counters = self._streams.get(key)
        if counters is None or counters.shape[0] < words:
            if counters is None and len(self._streams) >= self.MAX_STREAMS:
                return None
            with self._lock:
                counters = _launch.zeroed_words(max(words, 256))
                self._kept.append(counters)
                self._streams.put(key, counters)
        return counters



def _slice_words(words, start: int, count: int):
    if SIMULATOR:
        return words[start:start + count]
    return DeviceView(words.ptr + 4 * start, (count,), (4,), np.uint32, None)


#: the counters of every pooled launch in this process
POOL_COUNTERS = PoolCounters()
