"""The one host-side cache of the package: plans, launchables, placeholders and stream handles, each a
``BoundedCache`` with the same eviction rule.

Rule: once a cache holds ``NUMBA_ATTN_CACHE_ENTRIES`` entries (default 1024 per cache), the oldest entry goes. A
long-running server sees few kinds of call, so evictions are rare; a process that sweeps many shapes keeps its
memory bounded. Lookups take no lock (a dict read is atomic in CPython, and a planned decoding call makes several:
a lookup costs what ``dict.get`` costs); inserts and evictions take the cache's lock. ``clear_all()`` empties every
cache (after changing a module-level knob that a cached plan depends on, or in tests).

Compiled kernels are not kept here: ``functools.lru_cache`` on the kernel builders holds them, keyed by frozen
configurations from a finite set (and ``runtime.kernel_cache`` keeps them on disk for the next process).
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable

ENTRIES_ENV = "NUMBA_ATTN_CACHE_ENTRIES"


def _default_entries() -> int:
    try:
        return max(1, int(os.environ.get(ENTRIES_ENV, "1024")))
    except ValueError:
        raise ValueError(f"{ENTRIES_ENV}: expected a positive integer, got {os.environ[ENTRIES_ENV]!r}") from None


_ALL: "weakref.WeakSet[BoundedCache]" = weakref.WeakSet()


class BoundedCache:
    """A thread-safe mapping that drops its oldest entry past ``max_entries``."""

    def __init__(self, name: str, max_entries: int | None = None):
        self.name = name
        self.max_entries = max_entries if max_entries is not None else _default_entries()
        if self.max_entries < 1:
            raise ValueError(f"max_entries: expected >= 1, got {self.max_entries}")
        self._data: dict = {}
        self._lock = threading.Lock()
        _ALL.add(self)

    def get(self, key, default=None):
        return self._data.get(key, default)

    def put(self, key, value) -> None:
        with self._lock:
            self._data[key] = value
            while len(self._data) > self.max_entries:
                del self._data[next(iter(self._data))]

    def get_or_make(self, key, make: Callable[[], Any]):
        """The entry for ``key``, made by ``make()`` (outside the lock: it may compile or allocate) when missing;
        where two threads make one at once, the first stored wins and both get it."""
        value = self.get(key, _MISSING)
        if value is not _MISSING:
            return value
        value = make()
        with self._lock:
            if key in self._data:
                return self._data[key]
            self._data[key] = value
            while len(self._data) > self.max_entries:
                del self._data[next(iter(self._data))]
        return value

    def pop(self, key, default=None):
        with self._lock:
            return self._data.pop(key, default)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data


_MISSING = object()


def clear_all() -> None:
    """Empty every cache of the package."""
    for cache in list(_ALL):
        cache.clear()
