"""Pick a kernel's tile configuration per key: a choice the user tuned, the shipped table of the GPU family, or
the kernel's default; time the candidates only when asked to.

A key (``Key``) is the GPU family (``"sm90"``) and SM count, fields matched exactly (dtype, padded head dim,
causal; a windowed or capped call's variant) and size classes (powers of 4, ``size_class``). ``Autotuner.choose``
takes, in order:

1. the choice tuned on this machine for the exact key, SM count included: in memory, or in the JSON file per tuner
   under ``$NUMBA_ATTN_CACHE_DIR`` (default ``~/.cache/numba_attn``), so it holds for later processes too;
2. in tuning mode only, for a key with no such choice: like ``triton.autotune``, time every candidate on the call's
   own inputs (into a scratch output; ``time_on_stream``: warm-up calls, then the median of ``REPS`` samples of
   back-to-back calls between CUDA events, queued behind a short wait so that host latency stays out), keep the
   fastest and store it as in 1. Never while the call's stream is being captured into a CUDA graph (timing
   synchronises): such a call goes on to 3 and the key stays untuned;
3. the shipped table of the family (``numba_attn/forward/tuned/sm90.json``, written by ``scripts/tune_defaults.py``),
   keyed without the SM count so that it holds for every GPU of the family: the exact key, else the entry with the
   nearest size classes (the least sum of |log4 ratio| over the size fields; ties go to the larger sizes) among
   those with the same other fields;
4. the tuner's default configuration.

Modes (``mode()``): ``NUMBA_ATTN_AUTOTUNE`` unset: 1, 3, 4 (no timing in any call); ``=1``: 1-4 in every call;
``=0``: 3, 4 only (the user's file is not read: every machine of a family runs the same configurations). Inside
``with numba_attn.autotune():`` (this thread only, re-entrant) calls tune as with ``=1``, unless the variable is
``0``. Under the CUDA simulator nothing is worth timing: the callers take the simulator's own configuration.

A stored entry records the candidate's fields, not its position in the list, so editing the candidates never maps
an old key to the wrong configuration: an entry whose configuration is no longer a candidate is ignored (and, when
tuning, tuned again).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
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

#: modes: shipped table and defaults only / also the user's tuned choices / also tune new keys
OFF, CACHED, TUNE = "off", "cached", "tune"
_OFF_WORDS = ("0", "false", "no", "off")
_ON_WORDS = ("1", "true", "yes", "on")
_thread = threading.local()


#: CPython's dict behind ``os.environ`` and the variable's key in it: every public call reads the variable, and
#: ``os.environ.get`` of an unset one (the usual case) raises and catches a KeyError inside, some microseconds
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENABLE_KEY = os.environ.encodekey(ENABLE_ENV) if hasattr(os.environ, "encodekey") else None


def _setting() -> str:
    """The value of ``ENABLE_ENV`` ('' when unset), read as ``os.environ`` holds it."""
    if type(_ENVIRON_DATA) is dict and _ENABLE_KEY is not None:
        raw = _ENVIRON_DATA.get(_ENABLE_KEY)
        return "" if raw is None else os.environ.decodevalue(raw)
    return os.environ.get(ENABLE_ENV, "")


def mode() -> str:
    """``OFF``, ``CACHED`` or ``TUNE`` for a call made now on this thread (module docstring)."""
    if SIMULATOR:
        return OFF
    value = _setting().strip().lower()
    if value in _OFF_WORDS:
        return OFF
    if value in _ON_WORDS or getattr(_thread, "depth", 0):
        return TUNE
    if value:
        raise ValueError(f"{ENABLE_ENV}: expected 0, 1 or unset, got {os.environ[ENABLE_ENV]!r}")
    return CACHED


@contextlib.contextmanager
def autotune():
    """Tune new keys in the calls made inside ``with numba_attn.autotune():`` on this thread (re-entrant; other
    threads keep their mode): each key without a tuned choice is timed once on its call's inputs and the fastest
    configuration is kept, in memory and on disk. ``NUMBA_ATTN_AUTOTUNE=0`` wins: no tuning then."""
    _thread.depth = getattr(_thread, "depth", 0) + 1
    try:
        yield
    finally:
        _thread.depth -= 1


def cache_dir() -> str:
    return os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "numba_attn")


def size_class(n: int) -> int:
    """Powers of 4 (1, 4, 16, ...): sizes within a factor of 4 share a tuning result."""
    return 4 ** max(0, math.ceil(math.log(max(1, n), 4)))


#: each timed sample runs back-to-back calls for at least this long (ms): short kernels are averaged over a batch
BATCH_MS = 1.0
#: before the samples, back-to-back calls for about this long (ms) bring the clocks up for this kernel
WARM_MS = 5.0
#: microseconds the GPU waits before each sample, plus per call of its batch: longer than the host takes to enqueue
HOLD_US, HOLD_US_PER_CALL = 200, 60


@functools.cache
def _hold_kernel():
    @cuda.jit
    def hold(microseconds):
        for _ in range(microseconds):
            cuda.nanosleep(1000)

    return hold


def _hold(stream, microseconds: int) -> None:
    """Keep ``stream`` busy for about ``microseconds`` so that the host enqueues a sample's calls before the GPU
    reaches its start event: the time between the events is then the kernels' alone, not the host's launch latency
    (which, for calls of 0.1 ms, is of the same size and varies)."""
    _hold_kernel()[1, 1, stream](microseconds)


def _sample(fn, stream, calls: int) -> float:
    start, end = cuda.event(), cuda.event()
    _hold(stream, HOLD_US + HOLD_US_PER_CALL * calls)
    start.record(stream)
    for _ in range(calls):
        fn()
    end.record(stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / calls


def time_on_stream(fn: Callable[[], None], stream, reps: int | None = None) -> float:
    """Median milliseconds per call of ``fn()`` on ``stream``: one untimed call (it compiles), about ``WARM_MS`` of
    untimed back-to-back calls, then ``reps`` samples (default ``REPS``) between CUDA events, each of enough
    back-to-back calls to last ``BATCH_MS`` and queued behind a short wait kernel (``_hold``). Single calls between
    events, each started by the host, varied from run to run by more than the candidates differ (clocks, host
    latency)."""
    fn()
    once = max(_sample(fn, stream, 1), 1e-3)
    calls = max(1, min(64, math.ceil(BATCH_MS / once)))
    for _ in range(max(0, min(200, math.ceil(WARM_MS / once)) - 1)):
        fn()
    return float(np.median([_sample(fn, stream, calls) for _ in range(REPS if reps is None else reps)]))


@dataclasses.dataclass(frozen=True)
class Key:
    """What a choice is made for. ``family`` names the shipped table (``"sm90"``); ``sms``: the SM count (a tuned
    choice holds for the GPU model it was timed on); ``fields`` are matched exactly; ``sizes`` are size classes."""

    family: str
    sms: int
    fields: tuple
    sizes: tuple

    @functools.cached_property
    def text(self) -> str:
        """The key in the user's file, e.g. ``sm90|132|float16|64|True|262144|1024``."""
        return "|".join(str(part) for part in (self.family, self.sms) + tuple(self.fields) + tuple(self.sizes))

    @functools.cached_property
    def table_text(self) -> str:
        """The key in the shipped table: without family (one file per family) and SM count."""
        return "|".join(str(part) for part in tuple(self.fields) + tuple(self.sizes))


def _log4(n: int) -> float:
    return math.log(max(1, n)) / math.log(4)


def _defaults(cls) -> dict:
    """A configuration dataclass's field defaults (fields without one are left out)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


class TunedTable:
    """One tuner's entries of a family's shipped file: configurations by ``Key.table_text``."""

    def __init__(self, entries: dict | None = None):
        self.entries = dict(entries or {})
        self._parts = [(text.split("|"), config) for text, config in self.entries.items()]

    def lookup(self, key: Key):
        """The exact entry, else the nearest in size classes with the same other fields, else None."""
        config = self.entries.get(key.table_text)
        if config is not None or not key.sizes:
            return config
        fields, count = [str(part) for part in key.fields], len(key.sizes)
        best_rank, best = None, None
        for parts, config in self._parts:
            if len(parts) != len(fields) + count or parts[:len(fields)] != fields:
                continue
            try:
                sizes = [int(part) for part in parts[len(fields):]]
            except ValueError:
                continue
            distance = sum(abs(_log4(a) - _log4(b)) for a, b in zip(sizes, key.sizes))
            rank = (round(distance, 6), -round(sum(_log4(s) for s in sizes), 6))
            if best_rank is None or rank < best_rank:
                best_rank, best = rank, config
        return best

    @classmethod
    def read(cls, path: str, tuner: "Autotuner") -> tuple["TunedTable", list[str]]:
        """The entries of ``tuner`` in the family file at ``path`` (none if there is no file) and the problems found
        (an unreadable file, an entry whose configuration is not one of the tuner's candidates: left out)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return cls(), []
        except (OSError, ValueError) as e:
            return cls(), [f"{path}: {e}"]
        tuners = data.get("tuners") if isinstance(data, dict) else None
        section = tuners.get(tuner.name) if isinstance(tuners, dict) else None
        found = section.get("entries") if isinstance(section, dict) else None
        if not isinstance(tuners, dict) or (section is not None and not isinstance(found, dict)):
            return cls(), [f"{path}: expected {{'tuners': {{name: {{'entries': {{key: entry}}}}}}}}"]
        entries, problems = {}, []
        for text, entry in (found or {}).items():
            fields = entry.get("config") if isinstance(entry, dict) else None
            config = tuner.from_fields(fields) if isinstance(fields, dict) else None
            if config is None:
                problems.append(f"{path}: {tuner.name} {text}: {fields!r} is not a candidate")
            else:
                entries[text] = config
        return cls(entries), problems


class Autotuner:
    """Chooses among ``candidates`` (frozen dataclass instances of one type) per ``Key``.

    ``choose(key, bench, capturing)``: ``bench(config)`` returns the time of one run of that configuration in any
    unit (called only when tuning a new key); ``capturing()`` says whether the call's stream is being captured
    (asked only before tuning). ``table_dir`` holds the shipped tables, ``<family>.json``.
    """

    def __init__(self, name: str, candidates: Sequence[Any], default: Any, table_dir: str | None = None):
        if not candidates or default not in candidates:
            raise ValueError("candidates: must be non-empty and contain the default")
        self.name = name
        self.candidates = tuple(candidates)
        self.default = default
        self.table_dir = table_dir
        #: the timings of the keys tuned by this process, by ``Key.text`` (what ``scripts/tune_defaults.py`` reads)
        self.timings: dict[str, dict] = {}
        self._chosen: dict[str, Any] = {}
        self._loaded_from: str | None = None
        self._tables: dict[str, TunedTable] = {}
        self._shipped: dict[Key, Any] = {}
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        return os.path.join(cache_dir(), f"autotune-{self.name}.json")

    def table_path(self, family: str) -> str | None:
        return None if self.table_dir is None else os.path.join(self.table_dir, f"{family}.json")

    def from_fields(self, fields: dict):
        """The candidate with these fields, or None (not a candidate any more). A field the entry does not name takes
        its default: a table written before the field existed keeps its meaning."""
        for config in self.candidates:
            full = dataclasses.asdict(config)
            if set(fields) <= set(full) and full == {**_defaults(type(config)), **fields}:
                return config
        return None

    # -- the user's choices ----------------------------------------------------------------------------------------
    def _read_file(self) -> dict:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}  # no file yet, or a damaged one: tune again (and rewrite it)

    def _load(self) -> None:
        """Read the user's file once per cache directory (with the lock held)."""
        path = self.path
        if self._loaded_from == path:
            return
        self._loaded_from = path
        for text, entry in self._read_file().items():
            config = self.from_fields(entry.get("config", {})) if isinstance(entry, dict) else None
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

    def tuned(self, key: Key):
        """The user's choice for ``key`` (memory or file), or None."""
        if self._loaded_from != self.path:
            with self._lock:
                self._load()
        return self._chosen.get(key.text)

    def _tune(self, key: Key, bench: Callable[[Any], float]):
        with self._lock:  # one key at a time; a thread that waited here finds the key tuned
            self._load()
            config = self._chosen.get(key.text)
            if config is not None:
                return config
            _replay.refuse("tuning")  # (the timed launches are not the call's own)
            timings = {repr(candidate): float(bench(candidate)) for candidate in self.candidates}
            best = min(self.candidates, key=lambda c: timings[repr(c)])
            self._chosen[key.text] = best
            self.timings[key.text] = timings
            self._store(key.text, best, timings)
            _replay.clear()  # plans recorded with the configuration used before would keep it
            return best

    # -- the shipped table -----------------------------------------------------------------------------------------
    def table(self, family: str) -> TunedTable:
        table = self._tables.get(family)
        if table is None:
            path = self.table_path(family)
            table = TunedTable.read(path, self)[0] if path else TunedTable()
            self._tables[family] = table
        return table

    def shipped(self, key: Key):
        """The shipped table's configuration for ``key``, else the default (remembered per key)."""
        config = self._shipped.get(key)
        if config is None:
            config = self.table(key.family).lookup(key) or self.default
            self._shipped[key] = config
        return config

    # -- the choice ------------------------------------------------------------------------------------------------
    def choose(self, key: Key, bench: Callable[[Any], float], capturing: Callable[[], bool] | None = None,
               fallback_key: Key | None = None, adjust: Callable[[Any], Any] | None = None):
        """The configuration for ``key`` (steps 1-4 above). ``fallback_key``: where ``key`` has no choice of the
        user's and is not tuned now, the choice for that key (the user's, else the shipped table's) stands in,
        passed through ``adjust`` -- for keys the shipped tables do not hold (windowed calls: ``forward.dispatch``)."""
        current = mode()
        if current != OFF:
            config = self.tuned(key)
            if config is not None:
                return config
            if current == TUNE and not (capturing is not None and capturing()):
                return self._tune(key, bench)
        if fallback_key is None:
            return self.shipped(key)
        config = (self.tuned(fallback_key) if current != OFF else None) or self.shipped(fallback_key)
        return config if adjust is None else adjust(config)

    def forget(self) -> None:
        """Drop what is held in memory (the files stay): the next ``choose`` reads the user's file and the shipped
        table again."""
        with self._lock:
            self._chosen.clear()
            self._loaded_from = None
            self._tables.clear()
            self._shipped.clear()
            self.timings.clear()
