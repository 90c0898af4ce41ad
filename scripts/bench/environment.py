"""Where arrays live and what runs them: the NumPy/simulator, torch and CuPy environments (arrays, the shared stream,
device name), array conversion to NumPy, and the software versions and git commit recorded with the results."""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import warnings
from typing import Any

import numpy as np

import numba_attn

from . import timing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def to_numpy(x) -> np.ndarray:
    """Any array (NumPy, CuPy, torch incl. bfloat16, Numba device array) as a float64 NumPy array."""
    module = type(x).__module__
    if module.startswith("torch"):
        return x.detach().float().cpu().numpy().astype(np.float64)
    if module.startswith("cupy"):
        return x.get().astype(np.float64)
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


class Env:
    """Host arrays (NumPy) and wall-clock timing: the simulator's environment, and the base of the GPU ones."""

    kind = "numpy"
    timer = "time.perf_counter (the simulator runs synchronously)"

    def __init__(self, simulator: bool):
        self.simulator = simulator
        self.device_name = "Numba CUDA simulator (CPU)" if simulator else platform.processor() or "host"

    def randn(self, shape, dtype: str, seed: int):
        if dtype == "bfloat16":
            raise TypeError("NumPy has no bfloat16")
        return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32).astype(dtype)

    def from_numpy(self, array: np.ndarray):
        """A host array (offsets, page tables) where the inputs live: on the device for the GPU environments."""
        return array

    def active(self):
        """Context in which every provider runs (the shared stream on a GPU)."""
        return contextlib.nullcontext()

    def sync(self):
        pass

    def free(self):
        pass

    def time_calls(self, fns: list, count: int) -> list:
        return timing.host_calls(self, fns, count)

    def copy_bandwidth(self) -> float | None:
        return None

    def graph_call_ms(self, fns: list, steps: int, replays: int) -> float | None:
        """ms per call from CUDA graph replays of ``steps`` calls rotating over ``fns``; None where the
        environment cannot capture graphs."""
        return None


class GpuEnv(Env):
    """What the GPU environments share: one dedicated stream, CUDA-event timing, the copy-bandwidth probe."""

    stream: Any = None

    def sync(self):
        self.stream.synchronize()

    def _event(self):
        raise NotImplementedError

    def _elapsed(self, start, end) -> float:
        raise NotImplementedError

    def _copy_fn(self, nbytes: int):
        raise NotImplementedError

    def time_calls(self, fns: list, count: int, chunk: int = 10) -> list:
        """Per-call ms from event pairs; ``chunk`` calls are queued back to back between host synchronisations."""
        return timing.event_calls(self, fns, count, chunk)

    def copy_bandwidth(self, nbytes: int = 1 << 30) -> float | None:
        """GB/s of a device-to-device copy of ``nbytes`` (read + written bytes), median of 20."""
        return timing.copy_bandwidth(self, nbytes)


class TorchEnv(GpuEnv):
    """torch CUDA tensors on one dedicated stream that torch, Triton, fla, CuPy and numba_attn all launch on."""

    kind = "torch"
    timer = "torch.cuda.Event pairs around each call on the shared stream"

    def __init__(self):
        import torch

        super().__init__(simulator=False)
        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_name = torch.cuda.get_device_name(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.cupy = self.cupy_stream = None
        try:
            import cupy

            # CuPy work (the CuPy naive peer) goes to the same stream. ExternalStream never destroys the stream it
            # wraps; it is deprecated in CuPy 14, but its replacement, Stream.from_external, returns a Stream whose
            # finaliser may destroy the stream it wraps, here torch's.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.cupy_stream = cupy.cuda.ExternalStream(self.stream.cuda_stream, self.device.index)
            self.cupy = cupy
        except Exception:  # noqa: BLE001
            pass

    def randn(self, shape, dtype: str, seed: int):
        gen = self.torch.Generator(device=self.device).manual_seed(seed)
        return self.torch.randn(shape, dtype=getattr(self.torch, dtype), device=self.device, generator=gen)

    def from_numpy(self, array: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    @contextlib.contextmanager
    def active(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.torch.cuda.stream(self.stream))
            if self.cupy_stream is not None:
                stack.enter_context(self.cupy_stream)
            yield

    def free(self):
        self.sync()
        if self.cupy is not None:
            self.cupy.get_default_memory_pool().free_all_blocks()
        self.torch.cuda.empty_cache()

    def _event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def _elapsed(self, start, end) -> float:
        return start.elapsed_time(end)

    def _copy_fn(self, nbytes: int):
        src = self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device).random_(0, 255)
        dst = self.torch.empty_like(src)
        return lambda: dst.copy_(src)

    def graph_call_ms(self, fns: list, steps: int, replays: int) -> float | None:
        return timing.torch_graph_call_ms(self, fns, steps, replays)


class CupyEnv(GpuEnv):
    """CuPy arrays on one dedicated stream (when torch is missing: no torch, Triton or fla peers then)."""

    kind = "cupy"
    timer = "cupy.cuda.Event pairs around each call on the shared stream"

    def __init__(self):
        import cupy

        super().__init__(simulator=False)
        self.cupy = cupy
        dev = cupy.cuda.Device()
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def randn(self, shape, dtype: str, seed: int):
        if dtype == "bfloat16":
            raise TypeError("CuPy has no bfloat16 (install torch to sweep bf16)")
        rs = self.cupy.random.RandomState(seed)
        return rs.standard_normal(shape, dtype=self.cupy.float32).astype(dtype)

    def from_numpy(self, array: np.ndarray):
        return self.cupy.asarray(array)

    def active(self):
        return self.stream

    def free(self):
        self.sync()
        self.cupy.get_default_memory_pool().free_all_blocks()

    def _event(self):
        return self.cupy.cuda.Event()

    def _elapsed(self, start, end) -> float:
        return self.cupy.cuda.get_elapsed_time(start, end)

    def _copy_fn(self, nbytes: int):
        src = self.cupy.ones(nbytes, dtype=self.cupy.uint8)
        dst = self.cupy.empty_like(src)
        return lambda: self.cupy.copyto(dst, src)


def make_env() -> Env:
    if numba_attn.SIMULATOR:
        return Env(simulator=True)
    errors = []
    try:
        import torch

        if torch.cuda.is_available():
            return TorchEnv()
        errors.append("torch sees no CUDA device")
    except Exception as exc:  # noqa: BLE001
        errors.append(f"torch: {exc}")
    try:
        return CupyEnv()
    except Exception as exc:  # noqa: BLE001
        errors.append(f"cupy: {exc}")
    raise SystemExit("a GPU run needs torch or CuPy to allocate arrays and time them: " + "; ".join(errors))


def _version(dist: str, module: str | None = None) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except Exception:  # noqa: BLE001
        pass
    if module and module in sys.modules:
        return getattr(sys.modules[module], "__version__", None)
    return None


def versions() -> dict:
    out = {"python": platform.python_version(), "numba_attn": numba_attn.__version__}
    for dist, module in (("numpy", "numpy"), ("numba", "numba"), ("numba-cuda", None), ("torch", "torch"),
                         ("triton", "triton"), ("cupy-cuda13x", "cupy"), ("cupy-cuda12x", "cupy"), ("cupy", "cupy"),
                         ("fla-core", "fla"), ("matplotlib", "matplotlib")):
        v = _version(dist, module)
        if v and not (dist.startswith("cupy") and "cupy" in out):
            out["cupy" if dist.startswith("cupy") else dist] = v
    with contextlib.suppress(Exception):
        import torch

        out["cuda (torch)"] = torch.version.cuda
    return out


def package_hash() -> str | None:
    """The first 16 hex digits of ``runtime.kernel_cache.package_hash``: which package sources ran."""
    try:
        from numba_attn.runtime import kernel_cache

        return kernel_cache.package_hash()[:16]
    except OSError:
        return None


def git_commit() -> str | None:
    """The checkout's commit, ``-dirty`` where its tracked files differ from it (a copied tree may carry a stale
    ``.git``: the results' ``package_hash`` says which sources ran)."""
    try:
        return subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None
