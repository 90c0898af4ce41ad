"""Where kernels run: a real GPU when one is visible, otherwise Numba's CUDA simulator.

Numba decides between the CUDA driver and the simulator once, when `numba.cuda` is first imported, from the
environment variable ``NUMBA_ENABLE_CUDASIM``. This module is imported before anything else in the package so that
on a machine with no usable GPU the variable is set in time and every public call still runs (slowly, on the CPU).
Set ``NUMBA_ENABLE_CUDASIM`` yourself (to 0 or 1) to take the decision out of our hands.
"""
from __future__ import annotations

import ctypes
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
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


def compute_capability() -> tuple[int, int]:
    if SIMULATOR:
        return (0, 0)
    return tuple(cuda.get_current_device().compute_capability)


def kernel_jit(launch_bounds=None, **options):
    """``cuda.jit`` for the package's kernels: cached on disk on a GPU; GPU-only options are dropped under the
    simulator (which accepts neither caching nor launch bounds)."""
    if SIMULATOR:
        return cuda.jit
    if launch_bounds is not None:
        options["launch_bounds"] = launch_bounds
    return cuda.jit(cache=True, **options)
