"""Repeated calls of one kind without the checked path: the first call records its launches, later calls replay them.

A public call's host work -- argument checks, views, kernel choice, launch parameters -- depends on its arrays
only through their library, dtype, device, shapes, strides and pointer alignment, and on its options. The first
call with a new combination (the *key*) runs the checked path under a recorder that notes each allocation made
through the caller's library (``arrays.Call.output``), each kernel launch (``launch._Launchable.launch``) and each
memset. Where every pointer a launch takes lies in an input, in an allocation of the call or in a buffer kept for
the process (``keep``), and what the call returns is its own allocations, the recording becomes a plan. A later
call with the same key allocates again, moves each recorded pointer to the new arrays and launches: attribute
reads, argument packing and the driver calls only (the checked path costs ~100 us of host time per call, more than
many kernels run).

A tensor map (``runtime.tensor_map``) passed to a launch moves with its array: the plan makes (or finds) the map of
the new array before it launches anything. A small host array that the call copies to the device (``Call.upload``:
a varlen schedule made from host offsets, descale factors) is made from values that the key holds, so the plan keeps
its bytes and a device copy per stream (``note_upload``). Anything else a call does makes no plan (``refuse``): a
launch through Numba's dispatcher, tuning, a pointer of unknown origin. Calls with ``out=``, host arrays (other than
those whose values the key holds: ``host_values``) or Numba device arrays never use plans. Torch and CuPy arrays
only. ``NUMBA_ATTN_REPLAY=0`` turns plans off.
"""
from __future__ import annotations

import contextlib
import os
import threading

import numpy as np

from .cache import BoundedCache
from .device import SIMULATOR, _driver_current_device

REPLAY_ENV = "NUMBA_ATTN_REPLAY"
#: Serve repeated calls from recorded plans (False: every call takes the checked path).
ENABLED = not SIMULATOR and os.environ.get(REPLAY_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
#: A key holds each pointer's offset modulo this many bytes: every alignment rule of the kernels divides it.
ALIGNMENT = 256

_PLANS = BoundedCache("replay plans")
_local = threading.local()
_kept: dict = {}  # start -> end of device buffers kept for the life of the process (placeholders, counters)
_kept_lock = threading.Lock()
#: a plan keeps device copies of its uploads for this many streams; a replay on yet another stream uploads per call
UPLOAD_STREAMS = 16
_PER_THREAD_STREAM = 2  # CU_STREAM_PER_THREAD: one handle, a stream per thread
_captured: list = []  # uploads a captured replay read: a CUDA graph may launch with them for the life of the process


def clear() -> None:
    """Forget every plan (after changing a module-level knob the checked path reads)."""
    _PLANS.clear()


# -- what the checked path reports ------------------------------------------------------------------------------------
def keep(ptr: int, nbytes: int) -> None:
    """Declare ``nbytes`` at ``ptr`` a buffer that lives as long as the process: a launch may take it as is."""
    with _kept_lock:
        _kept[int(ptr)] = int(ptr) + max(1, int(nbytes))


def active():
    """The calling thread's recorder, None when its call is not being recorded."""
    return getattr(_local, "recorder", None)


def note_alloc(obj, ptr: int, shape: tuple, dtype: str, nbytes: int) -> None:
    recorder = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.allocs.append((obj, int(ptr), int(nbytes), tuple(shape), dtype))


def note_launch(launchable, grid: tuple, block: tuple, shared_bytes: int, stream: int, values) -> None:
    recorder = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.ops.append(("launch", launchable, grid, block, shared_bytes, stream, list(values)))


def note_map(address: int, ptr: int, shape: tuple, strides: tuple, rows: int, itemsize: int = 2) -> None:
    """A tensor map (``runtime.tensor_map``) at device ``address`` describes the array at ``ptr`` with ``shape``,
    byte ``strides``, ``itemsize``-byte elements and ``rows``-row boxes: a plan passes the map of the moved array in
    its place."""
    recorder = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.maps[int(address)] = (int(ptr), tuple(shape), tuple(strides), int(rows), int(itemsize))


@contextlib.contextmanager
def paused():
    """Launches made inside are not recorded (a tensor map's writer: a plan makes its own maps)."""
    recorder = getattr(_local, "recorder", None)
    _local.recorder = None
    try:
        yield
    finally:
        _local.recorder = recorder


def note_memset(ptr: int, count: int, stream: int) -> None:
    recorder = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.ops.append(("memset", int(ptr), int(count), stream))


def note_upload(obj, ptr: int, nbytes: int, host: np.ndarray) -> None:
    """``obj`` (``nbytes`` at ``ptr``) is a device copy of the host array ``host``, made on the call's stream, whose
    values follow from the call's key (a schedule of host offsets that the key holds): a plan keeps ``host`` and
    replays with a copy of its own on the replay's stream."""
    recorder = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.uploads.append((obj, int(ptr), max(1, int(nbytes)), np.array(host, copy=True)))


def host_values(x):
    """What a key holds of a host array whose values the checked path reads (varlen offsets, descale factors): its
    dtype, shape and bytes, so that equal values -- and only those -- find one plan. ``x`` a NumPy array, a torch
    CPU tensor, a list or a tuple; anything else (a device array, a number) None. Where the values cannot be read
    here, a list (unhashable: ``find`` then gives no key, and the checked path says what is wrong)."""
    if isinstance(x, np.ndarray):
        values = x
    elif isinstance(x, (list, tuple)) or (type(x).__module__.startswith("torch") and not x.is_cuda):
        try:
            values = np.asarray(x.numpy() if hasattr(x, "numpy") else x)
        except Exception:  # noqa: BLE001 (the checked path raises its own error for it)
            return []
    else:
        return None
    if values.dtype.hasobject:
        return []
    return values.dtype.str, values.shape, values.tobytes()


def refuse(reason: str) -> None:
    """The call being recorded does something a plan cannot repeat: it makes none."""
    recorder = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.refused = reason


_arrays = None


def _import_arrays():
    """The ``arrays`` module, imported on first use (it imports this one)."""
    global _arrays
    from . import arrays

    _arrays = arrays
    return arrays


_map_modules = None


def _import_map_modules():
    """``(launch, tensor_map)``, imported on first use (both import this one); a plan's replays then reach their
    functions through the modules, without an import statement per call."""
    global _map_modules
    from . import launch, tensor_map

    _map_modules = (launch, tensor_map)
    return _map_modules


# -- keys, recording, plans -------------------------------------------------------------------------------------------
def find(name: str, arrays: tuple, options: tuple):
    """``(key, plan, layouts)`` for a call of ``name`` on ``arrays`` (torch / CuPy arrays) with ``options``: the plan
    (None if there is none yet), the key to record one under (None where no plan can serve) and the arrays' fast
    layouts (``arrays.fast_layout``)."""
    if not ENABLED:
        return None, None, None
    fast_layout = (_arrays or _import_arrays()).fast_layout
    layouts = []
    key = [name]
    for x in arrays:
        layout = fast_layout(x)
        if layout is None:
            return None, None, None
        layouts.append(layout)
        key.append((type(x), layout[0], layout[1], layout[2], layout[3], layout[4] % ALIGNMENT))
    # the type with each option: True and 1 are equal and hash alike, but only one of them passes the checks
    key.append(tuple((type(o), o) for o in options))
    key = tuple(key)
    try:
        return key, _PLANS.get(key), layouts
    except TypeError:  # an unhashable option: the checked path says what is wrong with it
        return None, None, None


def record(key, arrays: tuple, layouts, run):
    """``run()`` (the checked path), recorded into a plan under ``key`` where it can be."""
    if key is None or getattr(_local, "recorder", None) is not None:
        return run()
    recorder = _Recorder()
    _local.recorder = recorder
    try:
        result = run()
    finally:
        _local.recorder = None
    plan = recorder.plan(arrays, layouts, result)
    _local.outcome = "planned" if plan is not None else recorder.refused or "no launch"
    if plan is not None:
        _PLANS.put(key, plan)
    return result


def last_outcome() -> str | None:
    """What this thread's last recorded call came to: "planned", or why it made no plan (for debugging a call that
    keeps taking the checked path)."""
    return getattr(_local, "outcome", None)


class _Recorder:
    def __init__(self):
        self.allocs: list = []
        self.ops: list = []
        self.maps: dict = {}  # device address of a tensor map -> (ptr, shape, strides, rows, itemsize) of its array
        self.uploads: list = []  # (device copy, its pointer, bytes, the host array) per ``note_upload``
        self.refused: str | None = None

    def _refuse(self, reason: str) -> None:
        self.refused = reason
        return None

    def _source(self, ptr: int, spans: list):
        """Where a recorded pointer comes from: (0, None, ptr) a constant, (1, i, offset) input i, (2, j, offset)
        allocation j, (4, u, offset) upload u; None where unknown."""
        if ptr == 0:
            return (0, None, 0)
        for kind, index, start, end in spans:
            if start <= ptr < end or ptr == start:
                return (kind, index, ptr - start)
        for start, end in list(_kept.items()):
            if start <= ptr < end:
                return (0, None, ptr)
        return None

    def plan(self, arrays: tuple, layouts, result) -> "Plan | None":
        if self.refused is not None or not self.ops:
            return None
        from .arrays import _library_of, fast_library

        spans = [(1, i, *_input_span(layout)) for i, layout in enumerate(layouts)]
        spans += [(2, j, ptr, ptr + nbytes) for j, (_, ptr, nbytes, _, _) in enumerate(self.allocs)]
        spans += [(4, u, ptr, ptr + nbytes) for u, (_, ptr, nbytes, _) in enumerate(self.uploads)]
        results = result if isinstance(result, tuple) else (result,)
        returned = []
        for r in results:
            index = next((j for j, alloc in enumerate(self.allocs) if alloc[0] is r), None)
            if index is None:
                return self._refuse("returns an array the call did not allocate")
            returned.append(index)
        stream = None
        ops, maps = [], []
        for op in self.ops:
            if stream is None:
                stream = op[-1] if op[0] == "memset" else op[5]
            if (op[-1] if op[0] == "memset" else op[5]) != stream:
                return self._refuse("launches on several streams")
            if op[0] == "memset":
                source = self._source(op[1], spans)
                if source is None:
                    return self._refuse("a memset of memory of unknown origin")
                ops.append(("memset", source, op[2]))
                continue
            _, launchable, grid, block, shared_bytes, _, values = op
            moves = []
            slot = 0
            for spec in launchable.arrays:
                if spec is None:  # a scalar: no pointer of this call may hide in it; a tensor map moves with its array
                    value = values[slot]
                    mapped = self.maps.get(int(value)) if self.maps and isinstance(value, (int, np.integer)) else None
                    if mapped is not None:
                        source = self._source(mapped[0], spans)
                        if source is None or not source[0]:
                            return self._refuse("a tensor map of memory of unknown origin")
                        moves.append((slot, 3, len(maps), 0))
                        maps.append(source + mapped[1:])
                    elif isinstance(value, int) and value > 4096 and any(s <= value < e for _, _, s, e in spans):
                        return self._refuse("a pointer passed as a scalar")
                    slot += 1
                    continue
                source = self._source(values[slot + 4], spans)  # (meminfo, parent, nitems, itemsize, data, ...)
                if source is None:
                    return self._refuse("a launch takes memory of unknown origin")
                if source[0]:
                    moves.append((slot + 4, source[0], source[1], source[2]))
                slot += 5 + 2 * spec[1]
            ops.append(("launch", launchable, grid, block, shared_bytes, values, tuple(moves)))
        library = _library_of(arrays[0])
        plan = Plan(fast_library(library), layouts[0][1], [(shape, dtype) for _, _, _, shape, dtype in self.allocs],
                    ops, tuple(returned), isinstance(result, tuple), maps,
                    tuple(host for _, _, _, host in self.uploads))
        if self.uploads:  # (the call's own copies, made on its stream: the first replay there needs none)
            plan.uploaded[_stream_key(stream)] = [tuple(obj for obj, _, _, _ in self.uploads),
                                                  [ptr for _, ptr, _, _ in self.uploads], False]
        return plan


_capture_status = None


def _import_capture_status():
    """``launch.stream_capture_status``, imported on first use (``launch`` imports this module; an import statement
    in ``_uploads_on`` would cost a microsecond per replay)."""
    global _capture_status
    from .launch import stream_capture_status

    _capture_status = stream_capture_status
    return stream_capture_status


def _stream_key(stream: int) -> tuple:
    """Which stream a handle names: the per-thread default stream is another stream in every thread."""
    return stream, threading.get_ident() if stream == _PER_THREAD_STREAM else 0


def _input_span(layout) -> tuple:
    """``(start, end)``: the bytes an input's elements lie in (start = its pointer for an empty one)."""
    _, _, shape, strides, ptr, storage = layout
    low = high = ptr
    for n, stride in zip(shape, strides):
        if n == 0:
            return ptr, ptr
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + storage.itemsize


class Plan:
    """A recorded call: the allocations to make, the launches and memsets with the pointers they move, what the
    call returns."""

    def __init__(self, library, device_id: int, allocs: list, ops: list, returned: tuple, as_tuple: bool,
                 maps: list = (), uploads: tuple = ()):
        self.library, self.device_id, self.allocs = library, device_id, allocs
        self.ops, self.returned, self.as_tuple = ops, returned, as_tuple
        # (kind, index, offset, shape, strides, rows, itemsize) of each tensor map the launches take
        self.maps = tuple(maps)
        # the host arrays of the call's uploads, and their device copies per stream: [arrays, pointers, captured].
        # A copy is made on the stream that reads it: freed with the plan, its memory goes back to the pool of that
        # stream, after whose queued launches any new owner runs
        self.uploads = uploads
        self.uploaded: dict = {}

    def _uploads_on(self, stream: int):
        """The pointers of this plan's uploads on ``stream``, copied there on its first replay; None inside a CUDA
        graph capture that finds no copy (copies from pageable memory cannot be captured: the checked path, which
        cannot either, says so)."""
        key = _stream_key(stream)
        held = self.uploaded.get(key)
        capturing = (_capture_status or _import_capture_status())(stream)
        if held is None:
            if capturing:
                return None
            library = self.library
            made = tuple(library.upload(host, self.device_id) for host in self.uploads)
            held = [made, [library.pointer(x) for x in made], False]
            if len(self.uploaded) < UPLOAD_STREAMS:
                self.uploaded[key] = held
            # (else this call's copies go with it: freed into the pool of the stream its launches are queued on)
        elif capturing and not held[2]:  # a graph launches with these copies whenever it is replayed
            _captured.append(held[0])
            held[2] = True
        return held[1]

    def run(self, layouts):
        """Replay on arrays whose key is the plan's; None where the checked path must take them (another device is
        current: it switches devices, replays do not)."""
        device_id = self.device_id
        if _driver_current_device() != device_id:
            return None
        library = self.library
        stream = library.stream(device_id)
        uploads = ()
        if self.uploads:
            uploads = self._uploads_on(stream)
            if uploads is None:
                return None
        made = [library.empty(shape, dtype, device_id) for shape, dtype in self.allocs]
        bases = ([layout[4] for layout in layouts], [library.pointer(x) for x in made], (), uploads)
        if self.maps:  # every map first: where one cannot be had now, nothing has been launched yet
            launch_module, tensor_map = _map_modules or _import_map_modules()
            tensor_maps = tensor_map.maps_for(device_id)
            capturing = launch_module.stream_capture_status(stream)  # (one driver query for all the maps)
            addresses = []
            for kind, index, offset, shape, strides, rows, itemsize in self.maps:
                address = tensor_maps.address_of(bases[kind - 1][index] + offset, shape, strides, rows, stream,
                                                 itemsize, capturing)
                if address is None:
                    return None
                addresses.append(address)
            bases = bases[:2] + (addresses, uploads)
        for op in self.ops:
            if op[0] == "launch":
                _, launchable, grid, block, shared_bytes, values, moves = op
                if moves:
                    values = list(values)
                    for slot, kind, index, offset in moves:
                        values[slot] = bases[kind - 1][index] + offset
                launchable.launch(grid, block, shared_bytes, stream, values)
            else:
                _, (kind, index, offset), count = op
                from .launch import zero_words_async

                zero_words_async(bases[kind - 1][index] + offset if kind else offset, count, stream)
        if self.as_tuple:
            return tuple(made[j] for j in self.returned)
        return made[self.returned[0]]
