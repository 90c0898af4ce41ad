"""Where kernels run: a real GPU when one is visible, otherwise Numba's CUDA simulator.

Numba decides between the CUDA driver and the simulator once, when `numba.cuda` is first imported, from the
environment variable ``NUMBA_ENABLE_CUDASIM``. This module is imported before anything else in the package so that
on a machine with no usable GPU the variable is set in time and every public call still runs (slowly, on the CPU).
Set ``NUMBA_ENABLE_CUDASIM`` yourself (to 0 or 1) to take the decision out of our hands.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys


def _driver_sees_a_gpu() -> bool:
    """Ask the CUDA driver directly (no Numba import) whether at least one device is usable."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        try:
            if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return False
        except AttributeError:
            return False
        return count.value > 0
    return False


if "NUMBA_ENABLE_CUDASIM" not in os.environ and "numba.cuda" not in sys.modules:
    if not _driver_sees_a_gpu():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as _np  # noqa: E402
from numba import cuda  # noqa: E402  (must come after the decision above)
from numba.cuda.core import config as _cuda_config  # noqa: E402

#: True when kernels run under Numba's CUDA simulator (on the CPU).
SIMULATOR: bool = bool(_cuda_config.ENABLE_CUDASIM)


def multiprocessor_count() -> int:
    """Number of SMs of the current device (a small fixed number under the simulator)."""
    if SIMULATOR:
        return 4
    return _device_properties(current_device_id())[0]


def compute_capability() -> tuple[int, int]:
    if SIMULATOR:
        return (0, 0)
    return _device_properties(current_device_id())[1]


def current_device_id() -> int:
    """The device of the calling thread's current CUDA context, asked of the driver directly (Numba's
    ``get_current_device`` walks its context stack: about 15 us, several times per public call)."""
    lib = _cuda_library()
    device = ctypes.c_int(-1)
    if lib.cuCtxGetDevice(ctypes.byref(device)) == 0:
        return device.value
    return cuda.get_current_device().id  # no context yet: Numba makes one


@functools.lru_cache(maxsize=None)
def _device_properties(device_id: int) -> tuple[int, tuple[int, int]]:
    # read once per device: every public call asks, and the driver queries cost microseconds each
    device = cuda.get_current_device()
    return device.MULTIPROCESSOR_COUNT, tuple(device.compute_capability)


@functools.lru_cache(maxsize=64)
def external_stream(ptr: int):
    """Numba's handle on a stream someone else created (CuPy's, torch's), made once per stream pointer."""
    return cuda.external_stream(ptr)


@functools.lru_cache(maxsize=64)
def default_stream(device_id: int):
    """Numba's default-stream object, made once per device (``cuda.default_stream()`` checks the context first,
    some microseconds on every call)."""
    return cuda.default_stream()


def kernel_jit(launch_bounds=None, signature=None, **options):
    """``cuda.jit`` for the package's kernels: cached on disk on a GPU; GPU-only options are dropped under the
    simulator (which accepts neither caching nor launch bounds). With a ``signature`` the kernel is compiled for it
    alone, and ``launch`` then needs no per-call typing of the arguments."""
    if SIMULATOR:
        return cuda.jit
    if launch_bounds is not None:
        options["launch_bounds"] = launch_bounds
    if signature is not None:
        return cuda.jit(signature, cache=True, **options)
    return cuda.jit(cache=True, **options)


#: Dynamic shared memory a kernel may use without raising its attribute first.
DEFAULT_DYNAMIC_SHARED = 48 * 1024


class DeviceView:
    """A strided view of device memory, what the kernels take: pointer, shape, strides (bytes), NumPy dtype and
    the object that owns the memory (kept alive with the view).

    Making one costs no driver call, unlike a Numba device array made from ``__cuda_array_interface__``, and the
    launcher reads its kernel parameters (``params``) without typing it again. Numba still takes it wherever it
    takes a device array (it has ``__cuda_array_interface__``).
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "owner", "params")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, dtype, owner):
        self.ptr, self.shape, self.strides = int(ptr), tuple(shape), tuple(strides)
        self.dtype, self.owner = dtype if type(dtype) is _np.dtype else _np.dtype(dtype), owner
        size = 1
        for n in self.shape:
            size *= n
        # the launch ABI of a Numba array argument: meminfo, parent, nitems, itemsize, data, shape..., strides...
        self.params = (0, 0, size, self.dtype.itemsize, self.ptr) + self.shape + self.strides

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self.params[2]

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "strides": self.strides, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "stream": None}

    def view(self, dtype) -> "DeviceView":
        """The same memory read as another dtype of the same item size (float16 <-> uint16 bits)."""
        import numpy as np

        if np.dtype(dtype).itemsize != self.dtype.itemsize:
            raise TypeError(f"view: {self.dtype} cannot be viewed as {np.dtype(dtype)} (item sizes differ)")
        return DeviceView(self.ptr, self.shape, self.strides, dtype, self.owner)

    def with_axes(self, shape: tuple, strides: tuple) -> "DeviceView":
        return DeviceView(self.ptr, shape, strides, self.dtype, self.owner)

    def moved(self, ptr: int, owner) -> "DeviceView":
        """The same shape, strides and dtype over other memory (``owner``'s, at ``ptr``)."""
        view = DeviceView.__new__(DeviceView)  # (a planned decoding call moves five views: no checks again)
        view.ptr, view.shape, view.strides, view.dtype = int(ptr), self.shape, self.strides, self.dtype
        view.owner = owner
        params = self.params
        view.params = params[:4] + (view.ptr,) + params[5:]
        return view

    @classmethod
    def of(cls, x) -> "DeviceView":
        """The view of any object with ``__cuda_array_interface__`` (CuPy, Numba, torch float16 / float32 ...)."""
        if isinstance(x, DeviceView):
            return x
        import numpy as np

        cai = x.__cuda_array_interface__
        dtype = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        if strides is None:  # C-contiguous
            strides, step = [], dtype.itemsize
            for n in reversed(shape):
                strides.append(step)
                step *= n
            strides = tuple(reversed(strides))
        return cls(cai["data"][0] or 0, shape, tuple(strides), dtype, x)


# -- launching -------------------------------------------------------------------------------------------------------
# Numba's own launch types every argument, wraps each array in a device-array object and converts every parameter
# through ctypes on every call: about a hundred microseconds for a kernel with a few array arguments, more than the
# whole kernel takes at small sizes. The launcher below does that work once per (kernel, argument types) and then
# packs the parameters with one struct.pack_into and calls cuLaunchKernel directly.

#: Launch through the cached fast path (False: always through Numba's dispatcher, for comparison and debugging).
FAST_LAUNCH = True

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
        gx, gy, gz = grid
        bx, by, bz = block
        launch_kernel = _cuda_library().cuLaunchKernel
        code = launch_kernel(self.handle, gx, gy, gz, bx, by, bz, shared_bytes, stream or None, pointers, None)
        if code == 201:  # CUDA_ERROR_INVALID_CONTEXT: a thread that has not used Numba yet; make its context current
            cuda.current_context()
            code = launch_kernel(self.handle, gx, gy, gz, bx, by, bz, shared_bytes, stream or None, pointers, None)
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


_launchables: dict = {}
_libcuda = None


def _cuda_library():
    """The driver library, loaded once, with cuLaunchKernel's prototype set."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _libcuda = lib
    return _libcuda


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
    key = (id(kernel),) if specialized else (id(kernel),) + tuple(_arg_key(a) for a in args)
    entry = _launchables.get(key)
    if entry is None or (entry and entry.kernel is not kernel):
        if len(_launchables) > 4096:
            _launchables.clear()
        try:
            if specialized:
                compiled = next(iter(kernel.overloads.values()))
            else:
                compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
            entry = _Launchable(kernel, compiled, current_device_id(), specialized)
        except NotImplementedError:
            entry = False
        _launchables[key] = entry
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
        kernel[grid, block, stream, shared_bytes](*args)
        return
    entry = _launchable(kernel, args) if FAST_LAUNCH else None
    if entry is None:
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

    limit = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    if shared_bytes > limit:
        raise ValueError(f"kernel needs {shared_bytes} bytes of shared memory, the device allows {limit}")
    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, shared_bytes, cufunc_handle, device_id)


_raised_shared: dict = {}
_resident: dict = {}


def resident_blocks(kernel, threads: int, shared_bytes: int) -> int | None:
    """How many blocks of ``threads`` threads and ``shared_bytes`` of dynamic shared memory one SM holds at once
    (the driver's occupancy calculator), for a kernel compiled for one signature; None where unknown (simulator)."""
    if SIMULATOR or len(kernel.overloads) != 1:
        return None
    key = (id(kernel), threads, shared_bytes)
    if _resident.get(key, (None,))[0] is not kernel:
        handle = next(iter(kernel.overloads.values()))._codelibrary.get_cufunc().handle
        if shared_bytes > DEFAULT_DYNAMIC_SHARED:
            _raise_shared_limit(handle, shared_bytes, current_device_id())
        lib = _cuda_library()
        function, blocks = ctypes.c_void_p(), ctypes.c_int(0)
        # the handle is a CUkernel (library loading); the calculator wants the context's CUfunction
        ok = lib.cuKernelGetFunction(ctypes.byref(function), ctypes.c_void_p(int(handle))) == 0 and (
            lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(blocks), function, ctypes.c_int(threads), ctypes.c_size_t(shared_bytes)) == 0)
        _resident[key] = (kernel, blocks.value if ok and blocks.value > 0 else None)
    return _resident[key][1]


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
        _raised_shared[key] = (kernel, shared_bytes)  # the kernel held: its id stays its own


# -- device memory for counters ---------------------------------------------------------------------------------------
def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what} failed: {_launch_error(code)}")


def stream_capturing(stream: int) -> bool:
    """Whether work sent to this stream (a driver handle) is being captured into a CUDA graph. A query that fails
    (the legacy stream while another stream captures in global mode) counts as capturing: the caller then takes the
    path that is safe inside a capture."""
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
    return DeviceView(ptr.value, (count,), (4,), _np.uint32, None)


def zero_words_async(ptr: int, count: int, stream: int) -> None:
    """Zero ``count`` uint32s at ``ptr`` in stream order (a memset node when the stream is being captured)."""
    if count:
        _check(_cuda_library().cuMemsetD32Async(ctypes.c_uint64(ptr), ctypes.c_uint(0), ctypes.c_size_t(count),
                                                ctypes.c_void_p(stream or None)), "cuMemsetD32Async")
