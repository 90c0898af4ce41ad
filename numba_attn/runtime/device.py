"""Where kernels run: a real GPU when one is visible, otherwise Numba's CUDA simulator.

Numba decides between the CUDA driver and the simulator once, when `numba.cuda` is first imported, from the
environment variable ``NUMBA_ENABLE_CUDASIM``. This module is imported before anything else in the package so that
on a machine with no usable GPU the variable is set in time and every public call still runs (slowly, on the CPU).
Set ``NUMBA_ENABLE_CUDASIM`` yourself (to 0 or 1) to take the decision out of our hands.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
from dataclasses import dataclass


@functools.lru_cache(maxsize=None)
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

from .cache import BoundedCache  # noqa: E402

#: True when kernels run under Numba's CUDA simulator (on the CPU).
SIMULATOR: bool = bool(_cuda_config.ENABLE_CUDASIM)

if not SIMULATOR and "NUMBA_ENABLE_CUDASIM" not in os.environ and not _driver_sees_a_gpu():
    # numba.cuda was imported before us (its choice is made at its import): without a GPU every call would fail
    # later with CudaSupportError. Say now what to do instead.
    raise ImportError(
        "numba_attn: no CUDA GPU is visible and numba.cuda was imported before numba_attn, so the CUDA simulator "
        "fallback could not be switched on (Numba decides when numba.cuda is first imported). Either import "
        "numba_attn before numba.cuda, or set NUMBA_ENABLE_CUDASIM=1 in the environment before Python imports "
        "numba (kernels then run, slowly, on the CPU)."
    )


_libcuda = None


def _cuda_library():
    """The driver library, loaded once. No prototypes: ctypes converting arguments through ``argtypes`` costs about
    a microsecond per call of ``cuLaunchKernel``, so callers pass pointers as ``c_void_p`` and ints (C ``int``) that
    fit 31 bits themselves."""
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


@dataclass(frozen=True)
class DeviceProperties:
    """What kernels and planners need to know of a device, read once per device from the driver."""

    multiprocessor_count: int
    compute_capability: tuple
    max_shared_per_block: int  # dynamic shared memory one block may use once its attribute is raised (opt-in)
    max_grid: tuple  # blocks per grid axis (x, y, z)


#: What the simulator reports: a few SMs, no compute capability, CUDA's architectural grid and Hopper's shared memory.
SIMULATOR_PROPERTIES = DeviceProperties(4, (0, 0), 227 * 1024, (2**31 - 1, 65535, 65535))


def device_properties(device_id: int | None = None) -> DeviceProperties:
    """The properties of ``device_id`` (default: the current device)."""
    if SIMULATOR:
        return SIMULATOR_PROPERTIES
    return _device_properties(current_device_id() if device_id is None else device_id)


def multiprocessor_count() -> int:
    """Number of SMs of the current device (a small fixed number under the simulator)."""
    return device_properties().multiprocessor_count


def compute_capability() -> tuple[int, int]:
    return device_properties().compute_capability


def current_device_id() -> int:
    """The device of the calling thread's current CUDA context, asked of the driver directly (Numba's
    ``get_current_device`` walks its context stack: about 15 us, several times per public call)."""
    device = _driver_current_device()
    if device >= 0:
        return device
    return cuda.get_current_device().id  # no context yet: Numba makes one


_device_out = threading.local()  # a c_int per thread for the driver to write (made once: every public call asks)


def _driver_current_device() -> int:
    """The device of the thread's current context, -1 where the thread has none."""
    out = getattr(_device_out, "ref", None)
    if out is None:
        device = ctypes.c_int(-1)
        out = _device_out.ref = (device, ctypes.byref(device))
    if _cuda_library().cuCtxGetDevice(out[1]) == 0:
        return out[0].value
    return -1


_NOTHING = contextlib.nullcontext()


def on_device(device_id: int):
    """A context manager under which ``device_id``'s primary context is current: a public call runs on its arrays'
    device, whichever device the caller's thread has current (torch and CuPy run an operation on its tensors'
    device too). Its scratch, placeholders, counters, stream handles and launches then all belong to that device.
    Costs one driver query where the device is current already (the usual case); nothing for host arrays (-1) and
    under the simulator."""
    if SIMULATOR or device_id < 0 or _driver_current_device() == device_id:
        return _NOTHING
    return cuda.gpus[device_id]  # pushes the device's primary context, pops it on exit


def pointer_device(ptr: int) -> int:
    """The device that holds the device memory at ``ptr`` (-1 where the driver cannot tell: a null pointer)."""
    if SIMULATOR or not ptr:
        return -1
    device = ctypes.c_int(-1)
    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
    if _cuda_library().cuPointerGetAttribute(ctypes.byref(device), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                             ctypes.c_uint64(ptr)) == 0:
        return device.value
    return -1


@functools.lru_cache(maxsize=None)
def _device_properties(device_id: int) -> DeviceProperties:
    # read once per device: every public call asks, and the driver queries cost microseconds each; the device
    # asked for, not the current one (they differ when a limit is raised for another device)
    from numba.cuda.cudadrv.driver import driver

    device = driver.get_device(device_id)
    return DeviceProperties(
        device.MULTIPROCESSOR_COUNT, tuple(device.compute_capability), device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        (device.MAX_GRID_DIM_X, device.MAX_GRID_DIM_Y, device.MAX_GRID_DIM_Z),
    )


def max_grid(axis: int) -> int:
    """Blocks the current device allows along grid axis ``axis`` (0, 1, 2)."""
    return device_properties().max_grid[axis]


def max_shared_per_block() -> int:
    """Dynamic shared memory one block of the current device may use (after raising the kernel's attribute)."""
    return device_properties().max_shared_per_block


_EXTERNAL_STREAMS = BoundedCache("external streams", 64)
_DEFAULT_STREAMS = BoundedCache("default streams", 64)


def external_stream(ptr: int, device_id: int | None = None):
    """Numba's handle on a stream someone else created (CuPy's, torch's) on ``device_id`` (None: the current
    device), made once per device and stream pointer, in that device's context."""
    if device_id is None:
        device_id = current_device_id()

    def make():
        with on_device(device_id):
            return cuda.external_stream(ptr)

    return _EXTERNAL_STREAMS.get_or_make((device_id, ptr), make)


def default_stream(device_id: int):
    """Numba's default-stream object, made once per device (``cuda.default_stream()`` checks the context first,
    some microseconds on every call)."""
    def make():
        with on_device(device_id):
            return cuda.default_stream()

    return _DEFAULT_STREAMS.get_or_make(device_id, make)


def kernel_jit(launch_bounds=None, signature=None, **options):
    """``cuda.jit`` for the package's kernels. On a GPU a ``kernel_cache.CachedKernel``: used as Numba's dispatcher is,
    compiled on first use, and kept on disk under a key that every process computes alike (Numba's own cache never
    hits for closures, see ``runtime.kernel_cache``). Under the simulator ``cuda.jit`` itself (it accepts neither
    caching nor launch bounds). With a ``signature`` the kernel is compiled for it alone, and ``launch`` then needs
    no per-call typing of the arguments."""
    if SIMULATOR:
        return cuda.jit
    if launch_bounds is not None:
        options["launch_bounds"] = launch_bounds
    from .kernel_cache import CachedKernel

    def decorate(py_func):
        return CachedKernel(py_func, signature, options)

    return decorate


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
        if strides is None and hasattr(x, "strides"):
            # Numba's device arrays report strides None for layouts they call contiguous, a zero stride included
            strides = x.strides
        if strides is None:  # C-contiguous
            strides, step = [], dtype.itemsize
            for n in reversed(shape):
                strides.append(step)
                step *= n
            strides = tuple(reversed(strides))
        return cls(cai["data"][0] or 0, shape, tuple(strides), dtype, x)
