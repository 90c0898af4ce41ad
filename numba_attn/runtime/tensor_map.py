"""Tensor maps for the TMA copies of the Hopper kernels (``core.ptx.tma``): encoded on the host by the driver,
kept in device memory, one per (tensor, box).

A 4-d ``(batch, heads, seqlen, headdim)`` array of 2-byte elements becomes a rank-4 map with coordinates (column,
row, head, batch), innermost first, the byte strides of its rows, heads and batches, a box of 64 columns (128
bytes, the 128-byte swizzle's row: one atom column of ``core.warpgroup``'s tile layout) by ``rows`` rows by one
head by one batch entry, and zeros for every element outside the array (tails of the sequence, columns past
headdim). An array of 1-byte elements (float8 e4m3 bit patterns, uint8) gets 128-column boxes: again 128 bytes,
one atom column of an 8-bit tile. ``tma_layout_ok`` tells whether the TMA can read an array at all (16-byte aligned base, contiguous last
axis, the other strides multiples of 16 bytes); the kernels fall back to ``cp.async`` otherwise.

Device residence. Numba cannot pass a ``__grid_constant__`` map, so a map lives in global memory: 128-byte slots of
slabs allocated for the life of the process, and the kernel reads it through its address (a uint64 argument),
after ``tma.tensormap_acquire``. ``TensorMaps.address(x, rows, stream)`` returns that address; a cache keyed by
(device, pointer, shape, strides, dtype, box) -- everything the map's bytes depend on -- makes repeated calls on the
same tensors free. A new map is written by a one-thread kernel whose 16 parameters are its 128 bytes, launched on the
caller's stream: stream ordered, nothing on the host to keep alive until it runs (a copy from pinned memory would
need its source unchanged until the stream reaches it, and forever once captured), and a kernel node inside a CUDA
graph capture. A slot is written again for another map only on the stream of its last use (whose earlier kernels
have then finished reading it) and never once a capture used it (a graph replays with the address it captured);
while a stream is captured no memory is allocated (the call falls back when the slots run out).

Plans (``runtime.replay``) note which array each map describes (``replay.note_map``) and, replayed on new arrays,
ask ``address_of`` for theirs: a new pointer costs one encoding and one writer launch, a known one a dict lookup.

Under the simulator a map is a ``core.ptx.tma.SimTensorMap`` and its "address" the handle the simulated copies
look it up by.
"""
from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import numpy as np

from ..core.ptx import tma
from . import launch as _launch
from . import replay as _replay
from .device import SIMULATOR, DeviceView, _cuda_library, cuda, current_device_id

#: 16-bit elements per box row: 128 bytes, the 128-byte swizzle's span (1-byte elements: twice as many)
BOX_COLUMNS = 64
MAP_BYTES = 128
_SLAB_SLOTS = 256
#: maps cached per device before the least recently used is dropped
CAPACITY = 1024
_MAX_STRIDE = 1 << 40

# CUtensorMap enums (cuda.h)
_DATA_TYPE_UINT8 = 0
_DATA_TYPE_UINT16 = 1
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: elements outside the tensor read as zeros


def _layout(x):
    """(address, shape, byte strides, item size) of a device, simulator or host array."""
    if isinstance(x, DeviceView):
        return x.ptr, x.shape, x.strides, x.dtype.itemsize
    if isinstance(x, np.ndarray):
        return int(x.__array_interface__["data"][0]), x.shape, x.strides, x.dtype.itemsize
    if SIMULATOR:
        return _layout(_host_array(x))
    view = DeviceView.of(x)  # (Numba's arrays report no strides when contiguous: the view works them out)
    return view.ptr, view.shape, view.strides, view.dtype.itemsize


def tma_layout_ok(x) -> bool:
    """The TMA can read the 4-d array ``x`` of 2-byte (or 1-byte) elements: 16-byte aligned base, unit-stride last
    axis, the other strides multiples of 16 bytes below 2^40 (an axis of length 1 may have any stride)."""
    ptr, shape, strides, itemsize = _layout(x)
    if itemsize not in (1, 2) or len(shape) != 4 or ptr % 16 or 0 in shape or strides[3] != itemsize:
        return False
    return all(n == 1 or (s % 16 == 0 and 0 < s < _MAX_STRIDE) for n, s in zip(shape[:3], strides[:3]))


def _map_geometry(shape, strides, rows: int, itemsize: int = 2):
    """(dims, byte strides of dims 1.., box) of a ``(batch, heads, seqlen, headdim)`` array of ``itemsize``-byte
    elements, innermost first (a box row is 128 bytes either way)."""
    batch, heads, seqlen, head_dim = shape
    dims = (head_dim, seqlen, heads, batch)
    # an axis of length 1 is never stepped over: any multiple of 16 stands in for its stride
    byte_strides = tuple(s if n > 1 else 16 for n, s in ((seqlen, strides[2]), (heads, strides[1]), (batch, strides[0])))
    return dims, byte_strides, (BOX_COLUMNS * 2 // itemsize, rows, 1, 1)


def encode_tiled(ptr: int, dims: tuple, byte_strides: tuple, box: tuple, itemsize: int = 2) -> bytes:
    """The 128 bytes of a tiled, 128-byte-swizzled, zero-filling map of 16-bit (``itemsize`` 1: 8-bit) elements
    (``cuTensorMapEncodeTiled``); RuntimeError with the driver's code where it refuses."""
    lib = _cuda_library()
    fn = lib.cuTensorMapEncodeTiled
    rank = len(dims)
    raw = (ctypes.c_uint64 * 16)()
    data_type = _DATA_TYPE_UINT8 if itemsize == 1 else _DATA_TYPE_UINT16
    code = fn(raw, ctypes.c_int(data_type), ctypes.c_uint32(rank), ctypes.c_void_p(ptr),
              (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*byte_strides),
              (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
              ctypes.c_int(_INTERLEAVE_NONE), ctypes.c_int(_SWIZZLE_128B), ctypes.c_int(_L2_PROMOTION_256B),
              ctypes.c_int(_OOB_FILL_ZEROS))
    if code:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {code} (dims {dims}, strides "
                           f"{byte_strides}, box {box})")
    return bytes(raw)


def _host_array(x):
    """The NumPy array under a simulator or host array."""
    inner = getattr(x, "_ary", None)
    return inner if inner is not None else np.asarray(x)


_writer = None


def _map_writer():
    """The one-thread kernel ``(slab, slot, w0 .. w15)``: ``slab[16 slot + i] = w_i``."""
    global _writer
    if _writer is None:
        from numba import types

        from .device import kernel_jit

        words = types.Array(types.uint64, 1, "A")

        @kernel_jit((32, 1), types.void(words, types.int64, *([types.uint64] * 16)))
        def write_map(slab, slot, w0, w1, w2, w3, w4, w5, w6, w7, w8, w9, w10, w11, w12, w13, w14, w15):
            if cuda.threadIdx.x == 0:
                at = 16 * slot
                slab[at] = w0
                slab[at + 1] = w1
                slab[at + 2] = w2
                slab[at + 3] = w3
                slab[at + 4] = w4
                slab[at + 5] = w5
                slab[at + 6] = w6
                slab[at + 7] = w7
                slab[at + 8] = w8
                slab[at + 9] = w9
                slab[at + 10] = w10
                slab[at + 11] = w11
                slab[at + 12] = w12
                slab[at + 13] = w13
                slab[at + 14] = w14
                slab[at + 15] = w15

        _writer = write_map
    return _writer


class _Entry:
    __slots__ = ("slab", "slot", "stream", "permanent")

    def __init__(self, slab, slot, stream, permanent):
        self.slab, self.slot, self.stream, self.permanent = slab, slot, stream, permanent


class TensorMaps:
    """The device-resident maps of one device (``maps_for``); thread safe."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self._lock = threading.Lock()
        self._entries: OrderedDict = OrderedDict()
        self._fresh: list = []  # (slab, slot) never written
        self._free: list = []  # (slab, slot, stream of its last use) of dropped maps
        self._slabs: list = []
        self.uploads = 0  # maps written so far (tests read it)

    def _grow(self) -> None:
        lib = _cuda_library()
        ptr = ctypes.c_uint64(0)
        if lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(MAP_BYTES * _SLAB_SLOTS)):
            raise MemoryError("cuMemAlloc of a tensor-map slab failed")
        slab = DeviceView(ptr.value, (16 * _SLAB_SLOTS,), (8,), np.uint64, None)
        _replay.keep(ptr.value, MAP_BYTES * _SLAB_SLOTS)
        self._slabs.append(slab)
        self._fresh.extend((slab, i) for i in range(_SLAB_SLOTS - 1, -1, -1))

    def _slot(self, stream: int, capturing: bool):
        for n in range(len(self._free) - 1, -1, -1):
            slab, slot, last = self._free[n]
            if last == stream:
                del self._free[n]
                return slab, slot
        if not self._fresh:
            if capturing:
                return None
            self._grow()
        return self._fresh.pop()

    def address(self, x, rows: int, stream) -> int | None:
        """The device address of the map of ``x`` (``tma_layout_ok``) with ``rows``-row boxes, written on ``stream``
        (a Numba stream or a driver handle) when new; None when it cannot be had now (no slot while the stream is
        being captured, or the driver refuses the map): the caller falls back."""
        ptr, shape, strides, itemsize = _layout(x)
        return self.address_of(ptr, shape, strides, rows, stream, itemsize)

    def address_of(self, ptr: int, shape: tuple, strides: tuple, rows: int, stream, itemsize: int = 2,
                   capturing: bool | None = None) -> int | None:
        """``address`` of the array at ``ptr`` with ``shape``, byte ``strides`` and ``itemsize``-byte elements (what a
        replayed plan knows); ``capturing``: whether ``stream`` is being captured, where the caller asked already (a
        plan asks once for all its maps)."""
        key = (ptr, shape, strides, itemsize, rows)
        # (the launch module's functions through the module, once imported: an import statement per call, or per
        # map of a replayed call, cost more host time than the lookup it serves)
        handle = _launch.stream_handle(stream)
        if capturing is None:
            capturing = _launch.stream_capture_status(handle)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.stream = handle
                entry.permanent = entry.permanent or capturing
                address = entry.slab.ptr + MAP_BYTES * entry.slot
                _replay.note_map(address, ptr, shape, strides, rows, itemsize)
                return address
            try:
                words = np.frombuffer(encode_tiled(ptr, *_map_geometry(shape, strides, rows, itemsize), itemsize),
                                      np.uint64)
            except (RuntimeError, AttributeError):
                return None
            place = self._slot(handle, capturing)
            if place is None:
                return None
            slab, slot = place
            with _replay.paused():  # (a plan writes the maps of its own arrays)
                _launch.launch(_map_writer(), 1, 32, stream, 0, slab, slot, *(int(w) for w in words))
            self.uploads += 1
            self._entries[key] = _Entry(slab, slot, handle, capturing)
            while len(self._entries) > CAPACITY:
                _, old = self._entries.popitem(last=False)
                if not old.permanent:
                    self._free.append((old.slab, old.slot, old.stream))
            address = slab.ptr + MAP_BYTES * slot
            _replay.note_map(address, ptr, shape, strides, rows, itemsize)
            return address


class _SimulatedMaps:
    """Simulator stand-in: handles of ``tma.SimTensorMap`` s, one per (array, box)."""

    def __init__(self):
        self._handles: dict = {}
        self._lock = threading.Lock()
        self.uploads = 0

    def address(self, x, rows: int, stream) -> int:
        # (1-byte elements as uint16 pairs: a 128-byte box row is 64 of them either way)
        itemsize = _host_array(x).dtype.itemsize
        array = _host_array(x).view(np.uint16)
        ptr, shape, strides, _ = _layout(array)
        key = (ptr, shape, strides, itemsize, rows)
        with self._lock:
            # (the registry keeps each array alive: one address, shape and strides is one memory)
            handle = self._handles.get(key)
            if handle is None:
                handle = tma.sim_register_map(tma.SimTensorMap(array, (BOX_COLUMNS, rows, 1, 1), 128, itemsize))
                self._handles[key] = handle
                self.uploads += 1
            return handle


_MAPS: dict = {}
_MAPS_LOCK = threading.Lock()


def maps_for(device_id: int | None = None):
    """The map cache of ``device_id`` (default: the current device; the simulator has one)."""
    key = -1 if SIMULATOR else (current_device_id() if device_id is None else device_id)
    maps = _MAPS.get(key)
    if maps is None:
        with _MAPS_LOCK:
            maps = _MAPS.get(key)
            if maps is None:
                maps = _SimulatedMaps() if SIMULATOR else TensorMaps(key)
                _MAPS[key] = maps
    return maps


def tensor_map_address(x, rows: int, stream) -> int | None:
    """``maps_for().address(x, rows, stream)``: the device address (simulator: handle) of the map of the 4-d array
    ``x`` with ``rows``-row boxes, or None where it cannot be had now (the caller falls back)."""
    return maps_for().address(x, rows, stream)
