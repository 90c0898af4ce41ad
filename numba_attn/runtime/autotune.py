"""Pick a kernel's tile configuration by timing the candidates once per key, and remember the choice.

Like ``triton.autotune``: the first call with a new key (device, dtype, head dim, causal, a size class) runs every
candidate configuration on the call's own inputs, writing into a scratch output, times each with CUDA events and
keeps the fastest; later calls with that key use it at once. Choices are kept in memory and in a JSON file per tuner
under ``$NUMBA_ATTN_CACHE_DIR`` (default ``~/.cache/numba_attn``), so a later process skips the timing too (the
kernels themselves come from Numba's on-disk cache). ``NUMBA_ATTN_AUTOTUNE=0`` turns tuning off: every key then takes
the tuner's default configuration. Under the CUDA simulator there is nothing worth timing: the default is used.

A cache entry records the candidate's fields, not its position in the list, so editing the candidates never maps
an old key to the wrong configuration: an entry whose configuration is no longer a candidate is tuned again.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import threading
from typing import Any, Callable, Sequence

import numpy as np

from . import replay as _replay
from .device import SIMULATOR, cuda

CACHE_DIR_ENV = "NUMBA_ATTN_CACHE_DIR"
ENABLE_ENV = "NUMBA_ATTN_AUTOTUNE"
#: timed calls per candidate (after one untimed call that compiles and warms up); the median counts
REPS = 10


def enabled() -> bool:
    return not SIMULATOR and os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> str:
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "numba_attn")


def size_class(n: int) -> int:
    """Powers of 4 (1, 4, 16, ...): sizes within a factor of 4 share a tuning result."""
    return 4 ** max(0, math.ceil(math.log(max(1, n), 4)))


def time_on_stream(fn: Callable[[], None], stream, reps: int = REPS) -> float:
    """Median milliseconds of ``fn()`` between CUDA events on ``stream``, after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = cuda.event(), cuda.event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return float(np.median(times))


class Autotuner:
    """Chooses among ``candidates`` (frozen dataclass instances of one type) per key.

    ``choose(key, bench)``: ``key`` a tuple of str / int / bool; ``bench(config)`` returns the time of one run of
    that configuration in any unit (called only when the key is new). Returns the chosen configuration.
    """

    def __init__(self, name: str, candidates: Sequence[Any], default: Any):
        if not candidates or default not in candidates:
            raise ValueError("candidates: must be non-empty and contain the default")
        self.name = name
        self.candidates = tuple(candidates)
        self.default = default
        self._chosen: dict[str, Any] = {}
        self._loaded_from: str | None = None
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        return os.path.join(cache_dir(), f"autotune-{self.name}.json")

    @staticmethod
    def key_text(key: tuple) -> str:
        return "|".join(str(part) for part in key)

    def _from_fields(self, fields: dict):
        for config in self.candidates:
            if dataclasses.asdict(config) == fields:
                return config
        return None  # not a candidate any more: tune again

    def _read_file(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}  # no file yet, or a damaged one: tune again (and rewrite it)

    def _load(self) -> None:
        if self._loaded_from == self.path:
            return
        self._loaded_from = self.path
        for text, entry in self._read_file().items():
            config = self._from_fields(entry.get("config", {})) if isinstance(entry, dict) else None
            if config is not None:
                self._chosen.setdefault(text, config)

    def _store(self, text: str, config, timings: dict) -> None:
        data = self._read_file()  # keep what other processes wrote meanwhile
        data[text] = {"config": dataclasses.asdict(config), "timings": timings}
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)  # atomic: a reader sees the old file or the new one
        except OSError:
            pass  # a read-only home: the choice still holds for this process

    def choose(self, key: tuple, bench: Callable[[Any], float]):
        if not enabled():
            return self.default
        text = self.key_text(key)
        with self._lock:
            self._load()
            config = self._chosen.get(text)
            if config is not None:
                return config
            _replay.refuse("tuning")  # (the timed launches are not the call's own)
            timings = {}
            for candidate in self.candidates:
                timings[repr(candidate)] = float(bench(candidate))
            best = min(self.candidates, key=lambda c: timings[repr(c)])
            self._chosen[text] = best
            self._store(text, best, timings)
            return best

    def forget(self) -> None:
        """Drop the in-memory choices (the file stays): the next ``choose`` reads the file again."""
        with self._lock:
            self._chosen.clear()
            self._loaded_from = None
