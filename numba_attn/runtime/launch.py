"""Launching compiled kernels from Python with little host time: parameters packed once per kernel and argument
types, ``cuLaunchKernel`` called directly, shared-memory limits raised once, occupancy asked of the driver.

Numba's own launch types every argument, wraps each array in a device-array object and converts every parameter
through ctypes on every call: about a hundred microseconds for a kernel with a few array arguments, more than the
whole kernel takes at small sizes. ``launch`` does that work once per (kernel, argument types) and then packs the
parameters with one ``struct.pack_into``. ``NUMBA_ATTN_FAST_LAUNCH=0`` sends every launch through Numba instead.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as _np

from . import replay as _replay
from .cache import BoundedCache
from .device import (DEFAULT_DYNAMIC_SHARED, SIMULATOR, DeviceView, _cuda_library, cuda, current_device_id,
                     device_properties)


FAST_LAUNCH_ENV = "NUMBA_ATTN_FAST_LAUNCH"
#: Launch through the cached fast path (False: always through Numba's dispatcher, for comparison and debugging).
FAST_LAUNCH = os.environ.get(FAST_LAUNCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")

_SCALAR_FORMATS = {  # one 8-byte slot per scalar parameter; the kernel reads the leading bytes (little endian)
    "int8": "b7x", "int16": "h6x", "int32": "i4x", "int64": "q", "uint8": "B7x", "uint16": "H6x",
    "uint32": "I4x", "uint64": "Q", "bool": "?7x", "float32": "f4x", "float64": "d",
}


class _Launchable:
    """One compiled kernel ready to launch: its function handle, how its arguments become parameters, and a
    parameter buffer per thread."""

    def __init__(self, kernel, compiled, device_id: int, fixed_signature: bool):
        import struct
        import threading

        from numba.cuda import types
        from numba.cuda.np.numpy_support import as_dtype

        # the cache is keyed by id(kernel): holding the kernel keeps that id from going to another object
        self.kernel = kernel
        self.cufunc_handle = compiled._codelibrary.get_cufunc().handle
        self.handle = int(self.cufunc_handle)
        self.handle_arg = ctypes.c_void_p(self.handle)  # (made once: see ``device._cuda_library``)
        self.device_id = device_id
        self.arrays = []  # per argument: (dtype, ndim) for an array, None for a scalar
        fmt, slots = "<", 0
        for ty in compiled.argument_types:
            if isinstance(ty, types.Array):
                if ty.layout != "A" and fixed_signature:
                    # only the dtype and rank of an argument are checked per launch; a contiguous layout would
                    # also need its strides checked
                    raise NotImplementedError("fixed signatures with contiguous layouts are launched by Numba")
                self.arrays.append((as_dtype(ty.dtype), ty.ndim))
                fmt += "QQqqQ" + "q" * (2 * ty.ndim)
                slots += 5 + 2 * ty.ndim
            else:
                name = "bool" if ty == types.boolean else str(ty)
                if name not in _SCALAR_FORMATS:
                    raise NotImplementedError(f"argument type {ty}")
                self.arrays.append(None)
                fmt += _SCALAR_FORMATS[name]
                slots += 1
        self.packer = struct.Struct(fmt)
        self.slots = slots
        self.shared_raised = DEFAULT_DYNAMIC_SHARED
        self.fixed_signature = fixed_signature
        self._local = threading.local()

    def launch(self, grid: tuple, block: tuple, shared_bytes: int, stream: int, values) -> None:
        """Launch with the flat parameter ``values`` (an array argument contributes its ``DeviceView.params``, a
        scalar itself), ``grid`` and ``block`` as 3-tuples, on the stream with this handle (0: the default)."""
        if shared_bytes > self.shared_raised:
            _raise_shared_limit(self.cufunc_handle, shared_bytes, self.device_id)
            self.shared_raised = shared_bytes
        buffer, pointers = self.buffers()
        self.packer.pack_into(buffer, 0, *values)
        if _replay.ENABLED:
            _replay.note_launch(self, grid, block, shared_bytes, stream, values)
        gx, gy, gz = grid
        bx, by, bz = block
        launch_kernel = _cuda_library().cuLaunchKernel
        # (grid and block sizes and the shared bytes fit a C int: the driver's limits are below 2**31)
        stream_arg = _stream_arg(stream)
        code = launch_kernel(self.handle_arg, gx, gy, gz, bx, by, bz, shared_bytes, stream_arg, pointers, None)
        if code == 201:  # CUDA_ERROR_INVALID_CONTEXT: a thread that has not used Numba yet; make its context current
            cuda.current_context()
            code = launch_kernel(self.handle_arg, gx, gy, gz, bx, by, bz, shared_bytes, stream_arg, pointers, None)
        if code:
            raise RuntimeError(f"cuLaunchKernel failed: {_launch_error(code)} (grid {grid}, block {block}, "
                               f"{shared_bytes} bytes of dynamic shared memory)")

    def buffers(self):
        """This thread's parameter buffer and the array of pointers to its slots (cuLaunchKernel copies the
        parameters before it returns, so one buffer per thread is enough)."""
        local = self._local
        if not hasattr(local, "buffer"):
            local.buffer = ctypes.create_string_buffer(8 * max(1, self.slots))
            base = ctypes.addressof(local.buffer)
            local.pointers = (ctypes.c_void_p * max(1, self.slots))(*(base + 8 * i for i in range(self.slots)))
        return local.buffer, local.pointers


_STREAM_ARGS: dict = {0: None}


def _stream_arg(stream: int):
    """A stream handle as ``cuLaunchKernel``'s argument (None: the legacy default stream), made once per handle."""
    arg = _STREAM_ARGS.get(stream)
    if arg is None and stream:
        if len(_STREAM_ARGS) > 256:  # (a program that makes streams without end: start over)
            _STREAM_ARGS.clear()
            _STREAM_ARGS[0] = None
        arg = _STREAM_ARGS[stream] = ctypes.c_void_p(stream)
    return arg


_launchables = BoundedCache("launchables")
#: Held by every simulated launch and, under the simulator, by every public call (``api``): the simulator swaps the
#: ``cuda`` global of a kernel's module for its fake module while the kernel runs, so another thread building a
#: kernel in that module meanwhile would find no ``cuda.jit`` there. Reentrant: a call launches several kernels.
SIMULATOR_LOCK = threading.RLock()


def _launch_error(code: int) -> str:
    lib = _cuda_library()
    text = ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(text))
    return (text.value or b"unknown error").decode()


def _arg_key(a):
    if isinstance(a, DeviceView):
        return (a.dtype.str, a.shape, a.strides)
    if hasattr(a, "__cuda_array_interface__"):
        view = DeviceView.of(a)
        return (view.dtype.str, view.shape, view.strides)
    return type(a)


def _launchable(kernel, args) -> "_Launchable | None":
    """The cached launchable for ``kernel`` and these arguments; None when the fast path does not apply."""
    specialized = getattr(kernel, "specialized", False) and len(kernel.overloads) == 1
    # a fixed signature takes every argument of the right dtype and rank (layout "A"); a lazily compiled kernel
    # has one overload per Numba type, which the dtype, shape and strides of each array determine
    # per device: a kernel's module, its function handle and its raised shared-memory limit belong to one device
    device_id = current_device_id()
    key = (id(kernel), device_id) if specialized else (id(kernel), device_id) + tuple(_arg_key(a) for a in args)
    entry = _launchables.get(key)
    if entry is None or (entry and entry.kernel is not kernel):
        try:
            if specialized:
                compiled = next(iter(kernel.overloads.values()))
            else:
                compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
            entry = _Launchable(kernel, compiled, device_id, specialized)
        except NotImplementedError:
            entry = False
        _launchables.put(key, entry)
    return entry or None


def _grid3(g) -> tuple:
    if isinstance(g, tuple):
        return tuple(g) + (1,) * (3 - len(g))
    return (g, 1, 1)


def launch(kernel, grid, block, stream, shared_bytes: int, *args) -> None:
    """Launch ``kernel[grid, block, stream, shared_bytes](*args)``.

    On a GPU it goes through the cached fast path: arguments are packed into the kernel's parameter buffer and
    handed to ``cuLaunchKernel`` on ``stream``; arrays may be :class:`DeviceView` s, Numba device arrays or anything
    with ``__cuda_array_interface__``. Kernels needing more than 48 KB of dynamic shared memory get their
    max-dynamic-shared-memory attribute raised first (a plain launch with more fails). Under the simulator, with
    ``FAST_LAUNCH = False`` or for argument types the fast path does not pack, Numba launches it.
    """
    if SIMULATOR:
        _simulated_launch(kernel, grid, block, stream, shared_bytes, args)
        return
    entry = _launchable(kernel, args) if FAST_LAUNCH else None
    if entry is None:
        _replay.refuse("a launch through Numba's dispatcher")
        _raise_shared_limit_numba(kernel, shared_bytes, args)
        kernel[grid, block, stream, shared_bytes](*args)
        return
    if len(args) != len(entry.arrays):
        raise TypeError(f"kernel: expected {len(entry.arrays)} arguments, got {len(args)}")
    values = []
    for spec, a in zip(entry.arrays, args):
        if spec is None:
            values.append(a)
            continue
        view = a if isinstance(a, DeviceView) else DeviceView.of(a)
        if (view.dtype is not spec[0] and view.dtype != spec[0]) or len(view.shape) != spec[1]:
            raise TypeError(f"kernel argument: expected a {spec[1]}-d {spec[0]} array, got {view.ndim}-d {view.dtype}")
        values.extend(view.params)
    entry.launch(_grid3(grid), _grid3(block), shared_bytes, stream_handle(stream), values)


def _simulated_launch(kernel, grid, block, stream, shared_bytes: int, args) -> None:
    """A launch under the simulator, which runs like a GPU's: arguments are memory, never copies.

    NumPy arrays go in as the simulator's device arrays over the same memory: left to the simulator they would be
    copied in before the launch and copied back after it (which needs contiguous, writeable arrays, turns two views
    of one buffer into two buffers, and costs time). One simulated kernel runs at a time in the whole process
    (``SIMULATOR_LOCK``): the simulator swaps module globals for the duration of a launch and refuses concurrent
    ones.
    """
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    args = tuple(FakeCUDAArray(a) if isinstance(a, _np.ndarray) else a for a in args)
    with SIMULATOR_LOCK:
        kernel[grid, block, stream, shared_bytes](*args)


def stream_handle(stream) -> int:
    """The driver handle of a stream given as an int or a Numba stream (whose ``__int__`` gives an enum for the
    default stream, so its ``handle`` is read)."""
    return stream if isinstance(stream, int) else int(getattr(stream, "handle", stream))


def prepared(kernel) -> "_Launchable":
    """The launchable of a kernel compiled for one fixed signature, for callers that pack its parameters
    themselves (``_Launchable.launch``): a decoding step launches two kernels per call, and building views and
    checking them again on every call cost more host time than the kernels run at short caches."""
    if SIMULATOR or not FAST_LAUNCH:
        raise NotImplementedError("prepared launches need the fast launch path on a GPU")
    entry = _launchable(kernel, ())
    if entry is None or not entry.fixed_signature:
        raise NotImplementedError("prepared launches need a kernel compiled for one fixed signature")
    return entry


def _raise_shared_limit(cufunc_handle, shared_bytes: int, device_id: int) -> None:
    from numba.cuda.cudadrv.driver import binding, driver

    limit = device_properties(device_id).max_shared_per_block
    if shared_bytes > limit:
        raise ValueError(f"kernel needs {shared_bytes} bytes of shared memory, the device allows {limit}")
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, shared_bytes, cufunc_handle, device_id)


_raised_shared = BoundedCache("raised shared-memory limits")
_resident = BoundedCache("resident blocks")


def resident_blocks(kernel, threads: int, shared_bytes: int) -> int | None:
    """How many blocks of ``threads`` threads and ``shared_bytes`` of dynamic shared memory one SM holds at once
    (the driver's occupancy calculator), for a kernel compiled for one signature; None where unknown (simulator)."""
    if SIMULATOR or len(kernel.overloads) != 1:
        return None
    device_id = current_device_id()
    key = (id(kernel), device_id, threads, shared_bytes)
    held = _resident.get(key)
    if held is None or held[0] is not kernel:
        handle = next(iter(kernel.overloads.values()))._codelibrary.get_cufunc().handle
        if shared_bytes > DEFAULT_DYNAMIC_SHARED:
            _raise_shared_limit(handle, shared_bytes, device_id)
        lib = _cuda_library()
        function, blocks = ctypes.c_void_p(), ctypes.c_int(0)
        # the handle is a CUkernel (library loading); the calculator wants the context's CUfunction
        ok = lib.cuKernelGetFunction(ctypes.byref(function), ctypes.c_void_p(int(handle))) == 0 and (
            lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(blocks), function, ctypes.c_int(threads), ctypes.c_size_t(shared_bytes)) == 0)
        held = (kernel, blocks.value if ok and blocks.value > 0 else None)
        _resident.put(key, held)
    return held[1]


def _raise_shared_limit_numba(kernel, shared_bytes: int, args) -> None:
    """The attribute for a launch through Numba's dispatcher."""
    if shared_bytes <= DEFAULT_DYNAMIC_SHARED:
        return
    device_id = current_device_id()
    specialized = getattr(kernel, "specialized", False) and len(kernel.overloads) == 1
    argtypes = None if specialized else tuple(kernel.typeof_pyval(a) for a in args)
    key = (id(kernel), argtypes, device_id)
    held, raised = _raised_shared.get(key, (None, 0))
    if held is not kernel or raised < shared_bytes:
        compiled = next(iter(kernel.overloads.values())) if specialized else kernel.compile(argtypes)
        _raise_shared_limit(compiled._codelibrary.get_cufunc().handle, shared_bytes, device_id)
        _raised_shared.put(key, (kernel, shared_bytes))  # the kernel held: its id stays its own


# -- device memory for counters ---------------------------------------------------------------------------------------
def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed: {_launch_error(code)}")


def stream_capturing(stream: int) -> bool:
    """Whether work sent to this stream (a driver handle) is being captured into a CUDA graph. A query that fails
    (the legacy stream while another stream captures in global mode) counts as capturing: the caller then takes the
    path that is safe inside a capture."""
    _replay.refuse("a path that depends on stream capture")
    return stream_capture_status(stream)


def stream_capture_status(stream: int) -> bool:
    """``stream_capturing`` for callers whose recorded work does not depend on it (a plan asks again when it
    replays)."""
    if SIMULATOR:
        return False
    status = ctypes.c_int(0)
    code = _cuda_library().cuStreamIsCapturing(ctypes.c_void_p(stream or None), ctypes.byref(status))
    return code != 0 or status.value != 0


def zeroed_words(count: int):
    """``count`` zeroed uint32s of memory on the current device, allocated for the life of the process (a
    ``DeviceView``; a Numba array under the simulator). Synchronous: not to be called while a stream is captured."""
    if SIMULATOR:
        return cuda.to_device(_np.zeros(count, _np.uint32))
    lib = _cuda_library()
    ptr = ctypes.c_uint64(0)
    _check(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4 * count)), "cuMemAlloc")
    _check(lib.cuMemsetD32_v2(ctypes.c_uint64(ptr.value), ctypes.c_uint(0), ctypes.c_size_t(count)), "cuMemsetD32")
    # the memset runs on the legacy stream, which non-blocking streams (torch's, CuPy's) do not wait for
    _check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
    _replay.keep(ptr.value, 4 * count)
    return DeviceView(ptr.value, (count,), (4,), _np.uint32, None)


def zero_words_async(ptr: int, count: int, stream: int) -> None:
    """Zero ``count`` uint32s at ``ptr`` in stream order (a memset node when the stream is being captured)."""
    if count:
        _replay.note_memset(ptr, count, stream)
        _check(_cuda_library().cuMemsetD32Async(ctypes.c_uint64(ptr), ctypes.c_uint(0), ctypes.c_size_t(count),
                                                ctypes.c_void_p(stream or None)), "cuMemsetD32Async")
