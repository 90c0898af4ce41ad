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

from numba import cuda  # noqa: E402  (must come after the decision above)
from numba.cuda.core import config as _cuda_config  # noqa: E402

#: True when kernels run under Numba's CUDA simulator (on the CPU).
SIMULATOR: bool = bool(_cuda_config.ENABLE_CUDASIM)


def multiprocessor_count() -> int:
    """Number of SMs of the current device (a small fixed number under the simulator)."""
    if SIMULATOR:
        return 4
    return _device_properties(cuda.get_current_device().id)[0]


def compute_capability() -> tuple[int, int]:
    if SIMULATOR:
        return (0, 0)
    return _device_properties(cuda.get_current_device().id)[1]


@functools.lru_cache(maxsize=None)
def _device_properties(device_id: int) -> tuple[int, tuple[int, int]]:
    # read once per device: every public call asks, and the driver queries cost microseconds each
    device = cuda.get_current_device()
    return device.MULTIPROCESSOR_COUNT, tuple(device.compute_capability)


@functools.lru_cache(maxsize=64)
def external_stream(ptr: int):
    """Numba's handle on a stream someone else created (CuPy's, torch's), made once per stream pointer."""
    return cuda.external_stream(ptr)


def kernel_jit(launch_bounds=None, **options):
    """``cuda.jit`` for the package's kernels: cached on disk on a GPU; GPU-only options are dropped under the
    simulator (which accepts neither caching nor launch bounds)."""
    if SIMULATOR:
        return cuda.jit
    if launch_bounds is not None:
        options["launch_bounds"] = launch_bounds
    return cuda.jit(cache=True, **options)


#: Dynamic shared memory a kernel may use without raising its attribute first.
DEFAULT_DYNAMIC_SHARED = 48 * 1024
_raised_shared: dict = {}


def launch(kernel, grid, block, stream, shared_bytes: int, *args) -> None:
    """Launch ``kernel`` with ``shared_bytes`` of dynamic shared memory, raising the kernel's
    max-dynamic-shared-memory attribute first when it needs more than the default 48 KB (a plain launch with
    more fails)."""
    if not SIMULATOR and shared_bytes > DEFAULT_DYNAMIC_SHARED:
        device_id = cuda.get_current_device().id
        # A kernel compiled for one explicit signature has one overload: key on the kernel alone, so that a launch
        # does not type its arguments twice (Numba types them again to pick the overload otherwise).
        specialized = getattr(kernel, "specialized", False) and len(kernel.overloads) == 1
        argtypes = None if specialized else tuple(kernel.typeof_pyval(a) for a in args)
        key = (id(kernel), argtypes, device_id)
        if _raised_shared.get(key, 0) < shared_bytes:
            from numba.cuda.cudadrv.driver import binding, driver

            compiled = next(iter(kernel.overloads.values())) if specialized else kernel.compile(argtypes)
            cufunc = compiled._codelibrary.get_cufunc()
            limit = cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
            if shared_bytes > limit:
                raise ValueError(f"kernel needs {shared_bytes} bytes of shared memory, the device allows {limit}")
            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, shared_bytes, cufunc.handle, device_id)
            _raised_shared[key] = shared_bytes
    kernel[grid, block, stream, shared_bytes](*args)
