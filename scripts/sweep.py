#!/usr/bin/env python
"""Benchmark sweep of numba_attn against the peers that are installed, on the same inputs.

Sweeps (``--sweeps``):

* ``flash``  -- ``numba_attn.flash_forward`` vs torch SDPA (flash / cuDNN / memory-efficient backends forced one at a
  time, the math backend only where its score matrix fits the memory budget), our Triton FlashAttention-2 forward
  (``peers/triton_flash.py``) and a naive CuPy attention, over sequence length, causal and not, per (headdim, heads)
  configuration. Metric: TFLOP/s with FLOPs = 4 * B * H * Lq * Lk * D (two matrix products), **halved for causal**
  (the masked half is not counted, whatever a kernel actually computes).
* ``decode`` -- ``numba_attn.flash_decode`` (one query row against a long KV cache) vs torch SDPA and the Triton
  kernel, plain multi-head and grouped-query. Metric: GB/s = bytes of K and V read plus q read and out written, per
  second, and its percentage of the device-to-device copy bandwidth measured in the same run (read + written
  bytes of a 1 GiB buffer copy).
* ``linear`` -- ``numba_attn.causal_dot_product`` vs flash-linear-attention's chunked and fused-recurrent kernels
  (``scale=1``, ``normalize=False``: the same unnormalised causal sum). Metric: ms only.

How each (case, provider) pair is measured:

1. Correctness first: the provider runs once on input set 0 and a slice of its output (batch 0, the first and last
   heads, the last ``--check-rows`` query rows) is compared with the float64 ``reference`` package computed on the
   same slice of the inputs (bottom-right causal alignment makes the last rows against all keys an exact
   sub-problem). ``rel_err = ||out - ref|| / ||ref||``. Above the dtype's bound (``--tol``; providers that compute
   float32 with TF32 tensor cores get the ``tf32`` bound) the provider is marked FAIL and not timed. A provider
   that raises (unsupported dtype or shape, out of memory, missing kernel) is recorded as skipped with the error
   text; nothing a provider does stops the sweep.
2. Timing: ``--warmup`` calls, then up to ``--reps`` calls (fewer if they would exceed ``--budget`` seconds, at
   least 3), rotating over a few freshly drawn normal random input sets (``--rotate``) so that no call finds its
   inputs in L2. On a GPU every call is bracketed by CUDA events on one stream, the stream all providers run on
   (torch's current stream, which CuPy and numba_attn are pointed at too); calls are queued back to back and the
   host synchronises every few calls, so host launch overhead is only visible when it exceeds the GPU work (as it
   would be in an application). The reported time is the median. Under the simulator, ``time.perf_counter``.
3. Decode steps are also timed in CUDA graphs (``--graph-sweeps``, torch arrays only): ``--graph-steps`` calls over
   the rotated input sets captured in one ``torch.cuda.CUDAGraph``, replayed ``--graph-replays`` times between
   CUDA events; the median replay over the number of steps is the GPU time of one call without host time or
   launch gaps, the way a serving loop runs a decoding step (queued, a short step measures the lease's CPU too:
   a planned GQA call took 59 and 117 us of host time on two H100 leases of one day, and 16k-key steps queued at
   228 us each on a third against 103 us in graphs). Tables and plots show both; providers that launch on a
   stream of their own (the CuPy naive peer) are not captured.

Without a GPU (``numba_attn.SIMULATOR``) the same pipeline runs a tiny grid under Numba's CUDA simulator against a
NumPy naive peer: it checks that the sweep and the kernels work, not how fast anything is.

Outputs in ``--out``: ``results.csv``, ``results.json`` (device, date, versions, command line, copy bandwidth, every
row), ``results.md`` (markdown tables), one ``<sweep>.png`` per sweep; progress lines and a table per sweep on
stdout. Providers are kept in a registry (``build_registry``): one dict per sweep, name -> ``Provider``; new
numba_attn backends appear automatically when the public functions grow a ``backend=`` keyword.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import importlib.metadata
import inspect
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (HERE, ROOT):  # bench/peers/ lives next to this script; numba_attn and reference at the repo root
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numba_attn  # noqa: E402  (first: decides GPU vs simulator before numba.cuda is imported)
import reference  # noqa: E402

from bench import peers  # noqa: E402

SWEEPS = ("flash", "decode", "linear")
OURS = "numba_attn"

# --------------------------------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------------------------------
_DTYPE_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}
_SHORT = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}

#: ||out - ref|| / ||ref|| bounds by input dtype; "tf32" applies to float32 inputs of providers that use TF32.
DEFAULT_TOLERANCES = {"fp32": 1e-5, "tf32": 5e-3, "fp16": 2e-3, "bf16": 1e-2}

#: Grids by mode. Values given on the command line override them.
_GRIDS = {
    "full": dict(
        seqlens=[1024, 2048, 4096, 8192, 16384], flash_configs=[(64, 48), (128, 32)], flash_batch=4,
        flash_dtypes=["float16"], decode_batch=8, decode_heads=32, decode_kv_heads=[32, 4], decode_headdim=128,
        decode_lengths=[4096, 8192, 16384, 32768, 65536], decode_dtypes=["float16"], linear_batch=4,
        linear_heads=8, linear_dim=64, linear_dtypes=["float16", "float32"], reps=30, warmup=3, budget=2.0,
        rotate=3, min_reps=3,
    ),
    "quick": dict(
        seqlens=[1024, 4096], flash_configs=[(128, 32)], flash_batch=4, flash_dtypes=["float16"], decode_batch=8,
        decode_heads=32, decode_kv_heads=[32, 4], decode_headdim=128, decode_lengths=[4096, 16384],
        decode_dtypes=["float16"], linear_batch=4, linear_heads=8, linear_dim=64, linear_dtypes=["float16"],
        reps=10, warmup=2, budget=0.5, rotate=2, min_reps=3,
    ),
    "simulator": dict(
        seqlens=[16, 32], flash_configs=[(16, 1)], flash_batch=1, flash_dtypes=["float32"], decode_batch=1,
        decode_heads=2, decode_kv_heads=[2, 1], decode_headdim=16, decode_lengths=[32, 64],
        decode_dtypes=["float32"], linear_batch=1, linear_heads=1, linear_dim=16, linear_dtypes=["float32"],
        reps=2, warmup=0, budget=1.0, rotate=2, min_reps=1,
    ),
}


def parse_size(text: str) -> int:
    """``"4k"`` -> 4096, ``"512"`` -> 512."""
    text = text.strip().lower()
    if text.endswith("k"):
        return int(float(text[:-1]) * 1024)
    return int(text)


def size_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _list(convert):
    def parse(text: str):
        items = [t for t in text.split(",") if t.strip()]
        try:
            return [convert(t.strip()) for t in items]
        except (KeyError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"cannot parse {text!r}: {exc}") from None

    return parse


def _dtype(text: str) -> str:
    try:
        return _DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r} (fp16, fp32, bf16)") from None


def _flash_config(text: str) -> tuple[int, int]:
    d, h = text.lower().replace("x", ":").split(":")
    return int(d), int(h)


def _tolerances(text: str) -> dict:
    out = {}
    for item in text.split(","):
        if item.strip():
            key, value = item.split("=")
            key = _SHORT.get(_DTYPE_ALIASES.get(key.strip().lower(), ""), key.strip().lower())
            if key not in DEFAULT_TOLERANCES:
                raise argparse.ArgumentTypeError(f"--tol: unknown key {key!r} (fp32, tf32, fp16, bf16)")
            out[key] = float(value)
    return out


_EPILOG = """\
modes (defaults in [brackets] are the full grid's):
  full       the grid above: roughly 10-20 minutes on an H100 (an estimate), much of it compiling
  --quick    flash D=128 H=32 N=1k,4k; decode Lk=4k,16k; linear fp16 N=1k,4k; 10 reps, 0.5 s per case
  simulator  no GPU: flash D=16 H=1 B=1 N=16,32 fp32; decode H=2 Hkv=2,1 D=16 Lk=32,64; linear E=M=16
             N=16,32; numba_attn vs a NumPy naive peer, perf_counter timing (checks the pipeline, not speed)

examples:
  python scripts/sweep.py                              # everything installed, full grid
  python scripts/sweep.py --quick                      # < 2 minutes smoke test
  python scripts/sweep.py --sweeps flash --dtypes fp16,bf16 --seqlens 2k,8k --providers numba,triton,flash
  python scripts/sweep.py --sweeps decode --decode-kv-heads 8 --decode-lengths 16k,128k
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sweep.py",
        description="Benchmark numba_attn against the installed peers (torch SDPA, Triton, CuPy, fla) on the same\n"
        "inputs, after checking every provider against the float64 reference. Without a GPU a tiny grid runs\n"
        "under Numba's CUDA simulator. Sizes accept a k suffix (4k = 4096); lists are comma-separated.\n"
        "Options left unset take the defaults of the mode (full, --quick or simulator; see the end).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    add = p.add_argument
    add("--sweeps", type=_list(str), default=list(SWEEPS), help="sweeps to run [flash,decode,linear]")
    add("--quick", action="store_true",
        help="smoke-test grid: flash N=1k,4k with D=128 H=32; decode Lk=4k,16k; linear N=1k,4k fp16; 10 reps")
    add("--seqlens", type=_list(parse_size), help="flash and linear sequence lengths [1k,2k,4k,8k,16k]")
    add("--dtypes", type=_list(_dtype),
        help="dtypes for every sweep: fp16, fp32, bf16 [flash, decode: fp16; linear: fp16,fp32]")
    add("--providers", type=_list(str),
        help="keep only providers whose name contains one of these substrings (e.g. numba,triton); =name keeps "
             "exactly that provider (e.g. =numba_attn for the default dispatch alone)")
    add("--batch", type=int, help="batch size for every sweep [flash 4, decode 8, linear 4]")
    add("--flash-configs", type=_list(_flash_config),
        help="flash (headdim:heads) configurations [64:48,128:32]")
    add("--headdims", type=_list(int), help="flash head dims, paired with --heads (alternative to --flash-configs)")
    add("--heads", type=_list(int), help="flash head counts, paired with --headdims")
    add("--causal", choices=("both", "causal", "noncausal"), default="both", help="flash masking [both]")
    add("--decode-lengths", type=_list(parse_size), help="decode KV-cache lengths [4k,8k,16k,32k,64k]")
    add("--decode-heads", type=int, help="decode query heads [32]")
    add("--decode-kv-heads", type=_list(int), help="decode KV head counts, one case each [32,4]")
    add("--decode-headdim", type=int, help="decode head dim [128]")
    add("--linear-heads", type=int, help="linear heads [8]")
    add("--linear-dim", type=int, help="linear feature and value dim E = M [64]")
    add("--reps", type=int, help="timed calls per case and provider, at most [30]")
    add("--warmup", type=int, help="untimed calls before timing [3]")
    add("--budget", type=float, help="seconds of timed calls per case and provider; cuts --reps down [2.0]")
    add("--rotate", type=int, help="fresh random input sets rotated between calls [3]")
    add("--graph-sweeps", type=_list(str), default=["decode"],
        help="sweeps whose calls are also timed as CUDA graph replays (torch arrays; 'none': no graphs) [decode]")
    add("--graph-steps", type=int, default=20, help="calls captured in one CUDA graph [20]")
    add("--graph-replays", type=int, default=15, help="timed replays of the graph; the median counts [15]")
    add("--check-rows", type=int, default=128,
        help="query rows (the last ones) of batch 0, first and last head, compared with the reference [128]")
    add("--tol", type=_tolerances, default={},
        help="rel. error bounds by dtype; tf32 is for float32 inputs of TF32 providers "
        "[fp32=1e-5,tf32=5e-3,fp16=2e-3,bf16=1e-2]")
    add("--naive-mem-gb", type=float, default=8.0,
        help="skip providers that materialise the scores (CuPy naive, SDPA math) above this many GB [8]")
    add("--input-mem-gb", type=float, default=12.0,
        help="memory for the rotated input sets of one case; fewer sets when they do not fit [12]")
    add("--out", default="bench_out",
        help="output folder: results.csv, results.json, results.md, <sweep>.png [bench_out]")
    add("--no-plot", action="store_true", help="do not write the PNG plots")
    add("--list-providers", action="store_true", help="print the providers of each sweep and exit")
    return p


@dataclass
class Options:
    """The resolved settings of one run (mode defaults with the command line's values on top)."""

    mode: str
    sweeps: list
    seqlens: list
    flash_configs: list
    flash_causal: list
    flash_batch: int
    flash_dtypes: list
    decode_batch: int
    decode_heads: int
    decode_kv_heads: list
    decode_headdim: int
    decode_lengths: list
    decode_dtypes: list
    linear_batch: int
    linear_heads: int
    linear_dim: int
    linear_dtypes: list
    reps: int
    warmup: int
    budget: float
    rotate: int
    min_reps: int
    check_rows: int
    graph_sweeps: list
    graph_steps: int
    graph_replays: int
    tolerances: dict
    naive_mem_bytes: float
    input_mem_bytes: float
    providers: list | None
    out: str
    plot: bool


def resolve_options(args: argparse.Namespace, simulator: bool) -> Options:
    mode = "simulator" if simulator else ("quick" if args.quick else "full")
    g = dict(_GRIDS[mode])
    unknown = [s for s in args.sweeps if s not in SWEEPS]
    if unknown:
        raise SystemExit(f"--sweeps: unknown {unknown}; choose from {','.join(SWEEPS)}")
    configs = g["flash_configs"]
    if args.flash_configs:
        configs = args.flash_configs
    elif args.headdims or args.heads:
        dims = args.headdims or [d for d, _ in configs]
        heads = args.heads or [h for _, h in configs]
        if len(dims) == 1:
            dims = dims * len(heads)
        if len(heads) == 1:
            heads = heads * len(dims)
        if len(dims) != len(heads):
            raise SystemExit("--headdims and --heads must have the same length (or one value)")
        configs = list(zip(dims, heads))
    pick = lambda name, key: getattr(args, name) if getattr(args, name) is not None else g[key]  # noqa: E731
    tolerances = dict(DEFAULT_TOLERANCES, **args.tol)
    return Options(
        mode=mode,
        sweeps=[s for s in SWEEPS if s in args.sweeps],
        seqlens=pick("seqlens", "seqlens"),
        flash_configs=configs,
        flash_causal={"both": [False, True], "causal": [True], "noncausal": [False]}[args.causal],
        flash_batch=pick("batch", "flash_batch"),
        flash_dtypes=pick("dtypes", "flash_dtypes"),
        decode_batch=pick("batch", "decode_batch"),
        decode_heads=pick("decode_heads", "decode_heads"),
        decode_kv_heads=pick("decode_kv_heads", "decode_kv_heads"),
        decode_headdim=pick("decode_headdim", "decode_headdim"),
        decode_lengths=pick("decode_lengths", "decode_lengths"),
        decode_dtypes=pick("dtypes", "decode_dtypes"),
        linear_batch=pick("batch", "linear_batch"),
        linear_heads=pick("linear_heads", "linear_heads"),
        linear_dim=pick("linear_dim", "linear_dim"),
        linear_dtypes=pick("dtypes", "linear_dtypes"),
        reps=max(1, pick("reps", "reps")),
        warmup=max(0, pick("warmup", "warmup")),
        budget=pick("budget", "budget"),
        rotate=max(1, pick("rotate", "rotate")),
        min_reps=min(g["min_reps"], max(1, pick("reps", "reps"))),
        check_rows=max(1, args.check_rows),
        graph_sweeps=[] if simulator else [s for s in SWEEPS if s in args.graph_sweeps],
        graph_steps=max(1, args.graph_steps),
        graph_replays=max(1, args.graph_replays),
        tolerances=tolerances,
        naive_mem_bytes=args.naive_mem_gb * 1e9,
        input_mem_bytes=args.input_mem_gb * 1e9,
        providers=args.providers,
        out=args.out,
        plot=not args.no_plot,
    )


# --------------------------------------------------------------------------------------------------------------------
# Environment: where arrays live, the stream, and the timer
# --------------------------------------------------------------------------------------------------------------------
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

    def active(self):
        """Context in which every provider runs (the shared stream on a GPU)."""
        return contextlib.nullcontext()

    def sync(self):
        pass

    def free(self):
        pass

    def time_calls(self, fns: list, count: int) -> list:
        times = []
        for i in range(count):
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

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
        times = []
        for first in range(0, count, chunk):
            pairs = []
            for i in range(first, min(count, first + chunk)):
                start, end = self._event(), self._event()
                start.record()
                fns[i % len(fns)]()
                end.record()
                pairs.append((start, end))
            pairs[-1][1].synchronize()
            times.extend(self._elapsed(s, e) for s, e in pairs)
        return times

    def copy_bandwidth(self, nbytes: int = 1 << 30) -> float | None:
        """GB/s of a device-to-device copy of ``nbytes`` (read + written bytes), median of 20."""
        fn = self._copy_fn(nbytes)
        for _ in range(3):
            fn()
        ms = float(np.median(self.time_calls([fn], 20)))
        del fn
        self.free()
        return 2 * nbytes / (ms * 1e-3) / 1e9


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
        torch = self.torch
        side = torch.cuda.Stream(self.device)
        side.wait_stream(self.stream)
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch asks before a capture
            for fn in fns:
                fn()
        self.stream.wait_stream(side)
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(steps):
                fns[i % len(fns)]()
        times = []
        for _ in range(1 + replays):  # the first replay uploads the graph
            start, end = self._event(), self._event()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(self._elapsed(start, end) / steps)
        del graph
        return float(np.median(times[1:]))


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


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    reps: int


def measure(env: Env, fns: list, opts: Options) -> Timing:
    """Warm up, estimate one call, then time up to ``opts.reps`` calls within ``opts.budget`` seconds."""
    for i in range(opts.warmup):
        fns[i % len(fns)]()
    times = env.time_calls(fns[:1], 1)  # the first timed call also sizes the run
    count = int(opts.budget * 1e3 / max(times[0], 1e-3))
    count = max(opts.min_reps, min(opts.reps, count))
    if count > 1:
        times += env.time_calls(fns[1:] + fns[:1], count - 1)
    return Timing(float(np.median(times)), float(np.min(times)), len(times))


# --------------------------------------------------------------------------------------------------------------------
# Cases and their inputs
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One point of a sweep: shapes, dtype and the work it represents."""

    sweep: str
    config: str  # the table / subplot the case belongs to
    dtype: str
    size: int  # x axis: seqlen (flash, linear) or KV length (decode)
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int  # q/k feature dim (E for linear)
    value_dim: int  # v / out feature dim (M for linear)
    causal: bool = False
    flops: float = 0.0  # counted FLOPs for TFLOP/s (0: not reported)
    nbytes: float = 0.0  # counted bytes for GB/s (0: not reported)

    @property
    def label(self) -> str:
        return f"{self.sweep} {_SHORT[self.dtype]} {self.config} {size_label(self.size)}"

    def shapes(self) -> dict:
        b, h, hk = self.batch, self.heads, self.kv_heads
        return {
            "q": (b, h, self.seqlen_q, self.head_dim),
            "k": (b, hk, self.seqlen_k, self.head_dim),
            "v": (b, hk, self.seqlen_k, self.value_dim),
        }

    def out_shape(self) -> tuple:
        return (self.batch, self.heads, self.seqlen_q, self.value_dim)

    def input_bytes(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return itemsize * sum(math.prod(s) for s in self.shapes().values())


def flash_cases(o: Options):
    for dtype in o.flash_dtypes:
        for d, h in o.flash_configs:
            for causal in o.flash_causal:
                config = f"D={d} H={h} {'causal' if causal else 'non-causal'}"
                for n in o.seqlens:
                    flops = 4.0 * o.flash_batch * h * n * n * d * (0.5 if causal else 1.0)
                    yield Case("flash", config, dtype, n, o.flash_batch, h, h, n, n, d, d, causal, flops=flops)


def decode_cases(o: Options):
    h, d = o.decode_heads, o.decode_headdim
    for dtype in o.decode_dtypes:
        itemsize = 4 if dtype == "float32" else 2
        for hk in o.decode_kv_heads:
            if hk < 1 or h % hk:
                print(f"decode: kv heads {hk} do not divide heads {h}; skipped", flush=True)
                continue
            config = f"H={h} Hkv={hk} D={d}" + (f" (GQA {h // hk})" if hk != h else "")
            for lk in o.decode_lengths:
                b = o.decode_batch
                nbytes = itemsize * (2 * b * hk * lk * d + 2 * b * h * 1 * d)  # K, V read; q read, out written
                yield Case("decode", config, dtype, lk, b, h, hk, 1, lk, d, d, False, nbytes=nbytes)


def linear_cases(o: Options):
    h, e = o.linear_heads, o.linear_dim
    for dtype in o.linear_dtypes:
        config = f"H={h} E=M={e}"
        for n in o.seqlens:
            yield Case("linear", config, dtype, n, o.linear_batch, h, h, n, n, e, e, True)


CASES = {"flash": flash_cases, "decode": decode_cases, "linear": linear_cases}


def make_inputs(env: Env, case: Case, seed: int) -> dict:
    """Normal random q, k, v (never zeros) in the environment's array library."""
    return {name: env.randn(shape, case.dtype, seed * 3 + i) for i, (name, shape) in enumerate(case.shapes().items())}


# --------------------------------------------------------------------------------------------------------------------
# Correctness: a slice of the output against the float64 reference
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class CheckSlice:
    """Batch 0, ``heads`` (first and last), the last ``rows`` query rows, all keys."""

    heads: list
    rows: int

    def of(self, x):
        """The slice of a ``(batch, heads, seqlen_q, dim)`` array, in its own library."""
        return x[0][self.heads][:, x.shape[2] - self.rows:]


def check_slice(case: Case, rows: int) -> CheckSlice:
    heads = sorted({0, case.heads - 1})
    return CheckSlice(heads, min(rows, case.seqlen_q))


def reference_output(case: Case, inputs: dict, sl: CheckSlice) -> np.ndarray:
    """float64 reference for the slice: ``reference.attention`` / ``reference.causal_dot_product``."""
    group = case.heads // case.kv_heads
    kv_heads = [h // group for h in sl.heads]
    q = to_numpy(inputs["q"][0][sl.heads])
    k = to_numpy(inputs["k"][0][kv_heads])
    v = to_numpy(inputs["v"][0][kv_heads])
    if case.sweep == "linear":
        out = reference.causal_dot_product(q, k, v, method="chunked", chunk_size=256)
        return out[:, case.seqlen_q - sl.rows:]
    # The last rows of a bottom-right-aligned causal problem against all keys are themselves a bottom-right-aligned
    # causal problem: the reference on the slice is exact.
    q = q[:, case.seqlen_q - sl.rows:]
    return reference.attention(q[None], k[None], v[None], causal=case.causal)[0]


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """``||out - ref|| / ||ref||`` in float64; any NaN or inf in ``out`` gives inf."""
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = float(np.linalg.norm(ref))
    diff = float(np.linalg.norm(out - ref))
    return diff / denom if denom > 0 else diff


def tolerance_for(case: Case, provider: "Provider", tolerances: dict) -> tuple[str, float]:
    key = _SHORT[case.dtype]
    if case.dtype == "float32" and case.dtype in provider.tf32_dtypes:
        key = "tf32"
    return key, tolerances[key]


# --------------------------------------------------------------------------------------------------------------------
# Providers and the registry
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """A provider bound to one input set: ``fn()`` is the timed call.

    ``post`` maps fn's result to ``(batch, heads, seqlen_q, dim)`` (outside the timed region); ``context`` is entered
    around the correctness call and around the whole timing loop (e.g. a forced SDPA backend).
    """

    fn: Callable[[], Any]
    post: Callable[[Any], Any] = lambda out: out
    context: Callable[[], Any] = contextlib.nullcontext


@dataclass
class Provider:
    """One implementation in the registry.

    ``prepare(case, inputs, env)`` turns an input set (q, k, v in the environment's library and numba_attn's layout)
    into a ``Prepared`` call; it runs outside the timed region, so layout changes made there are not timed.
    ``check(case, env)`` returns a reason to skip the case before anything is allocated (or None).
    ``tf32_dtypes``: input dtypes the provider computes with TF32 tensor cores (they get the ``tf32`` bound).
    """

    prepare: Callable[[Case, dict, Env], Prepared]
    ours: bool = False
    check: Callable[[Case, Env], str | None] = lambda case, env: None
    tf32_dtypes: tuple = ()
    note: str = ""
    graphs: bool = True  # its calls launch on the current torch stream, so a CUDA graph capture takes them


def _backend_variants(fn, names) -> list:
    """``[None]`` plus the backend names when ``fn`` takes ``backend=``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return [None]
    if "backend" not in params:
        return [None]
    return [None] + [str(n) for n in names]


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _float32_only(case: Case, env: Env) -> str | None:
    return None if case.dtype == "float32" else "tf32 applies to float32 inputs only"


def numba_attn_providers(sweep: str) -> dict:
    """``numba_attn`` (default dispatch), ``numba_attn[<backend>]`` for each backend the function offers, and
    ``numba_attn[tf32]`` (float32 inputs in one tf32 term) where it offers ``allow_tf32``."""
    fn = {"flash": numba_attn.flash_forward, "decode": numba_attn.flash_decode,
          "linear": numba_attn.causal_dot_product}[sweep]
    names = {"flash": getattr(numba_attn, "BACKENDS", ("simt", "mma")),
             "linear": getattr(numba_attn, "LINEAR_BACKENDS", ())}.get(sweep, ())
    variants = [(backend, {} if backend is None else {"backend": backend}) for backend in _backend_variants(fn, names)]
    if _takes(fn, "allow_tf32"):
        variants.append(("tf32", {"allow_tf32": True}))
    providers = {}
    for variant, kwargs in variants:

        def prepare(case, x, env, kwargs=kwargs):
            if sweep == "flash":
                return Prepared(lambda: fn(x["q"], x["k"], x["v"], causal=case.causal, **kwargs))
            return Prepared(lambda: fn(x["q"], x["k"], x["v"], **kwargs))

        name = OURS if variant is None else f"{OURS}[{variant}]"
        if variant == "tf32":
            providers[name] = Provider(prepare, ours=True, check=_float32_only, tf32_dtypes=("float32",),
                                       note=f"numba_attn.{fn.__name__}(allow_tf32=True)")
        else:
            providers[name] = Provider(prepare, ours=True, note=f"numba_attn.{fn.__name__}")
    return providers


def _torch_only(case: Case, env: Env) -> str | None:
    return None if env.kind == "torch" else f"needs torch tensors (arrays are {env.kind})"


def _naive_check(budget: float):
    def check(case: Case, env: Env) -> str | None:
        from bench.peers.naive import score_bytes

        need = score_bytes(case.batch, case.heads, case.seqlen_q, case.seqlen_k)
        if need > budget:
            return f"materialised scores need {need / 1e9:.1f} GB > --naive-mem-gb {budget / 1e9:.1f}"
        return None

    return check


def _all_checks(*checks):
    def check(case, env):
        for c in checks:
            reason = c(case, env)
            if reason:
                return reason
        return None

    return check


def _sdpa_providers(mod, opts: Options) -> dict:
    flash, decode = {}, {}
    for backend in mod.BACKENDS:
        context = mod.backend_context(backend)

        def prep_flash(case, x, env, context=context):
            return Prepared(lambda: mod.attention(x["q"], x["k"], x["v"], case.causal), context=context)

        def prep_decode(case, x, env, context=context):
            return Prepared(lambda: mod.decode(x["q"], x["k"], x["v"]), context=context)

        check = _torch_only
        if backend == "math":
            check = _all_checks(_torch_only, _naive_check(opts.naive_mem_bytes))
        flash[f"torch-sdpa-{backend}"] = Provider(prep_flash, check=check, note=f"SDPA, {backend} backend forced")
        if backend != "math":
            decode[f"torch-sdpa-{backend}"] = Provider(
                prep_decode, check=_torch_only, note=f"SDPA, {backend} backend forced, GQA heads packed as rows")
    return {"flash": flash, "decode": decode}


def _triton_providers(mod) -> dict:
    def check(case, env):
        if env.kind != "torch":
            return _torch_only(case, env)
        if case.head_dim not in mod.HEAD_DIMS:
            return f"headdim {case.head_dim} not in {mod.HEAD_DIMS}"
        return None

    def prep_flash(case, x, env):
        return Prepared(lambda: mod.flash_forward(x["q"], x["k"], x["v"], causal=case.causal))

    def prep_decode(case, x, env):
        return Prepared(lambda: mod.flash_forward(x["q"], x["k"], x["v"], causal=False))

    tf32 = ("float32",)
    note = "peers/triton_flash.py: FA2 forward, autotuned, no split-KV"
    return {
        "flash": {"triton-fa2": Provider(prep_flash, check=check, tf32_dtypes=tf32, note=note)},
        "decode": {"triton-fa2": Provider(prep_decode, check=check, tf32_dtypes=tf32, note=note)},
    }


def _cupy_naive_providers(naive, opts: Options) -> dict:
    import cupy

    def as_cupy(x):
        if type(x).__module__.startswith("torch"):
            if "bfloat16" in str(x.dtype):
                raise TypeError("CuPy has no bfloat16")
            return cupy.asarray(x.detach())
        return x

    def prep(case, x, env):
        q, k, v = (as_cupy(x[n]) for n in ("q", "k", "v"))
        bias = naive.causal_bias(cupy, case.seqlen_q, case.seqlen_k) if case.causal else None
        return Prepared(lambda: naive.attention(cupy, q, k, v, bias=bias))

    note = "materialised scores: cuBLAS in the input dtype, float32 softmax, P in the input dtype"
    provider = Provider(prep, check=_naive_check(opts.naive_mem_bytes), note=note, graphs=False)
    return {"flash": {"cupy-naive": provider}, "decode": {"cupy-naive": provider}}


def _fla_providers(mod) -> dict:
    linear = {}
    for name, kernel in mod.KERNELS.items():

        def prep(case, x, env, kernel=kernel):
            import torch

            q, k, v = (mod.to_fla_layout(x[n]) for n in ("q", "k", "v"))  # not timed: see fla_linear.py

            @contextlib.contextmanager
            def no_grad():
                with torch.no_grad():
                    yield

            return Prepared(lambda: kernel(q, k, v), post=mod.from_fla_layout, context=no_grad)

        tf32 = ("float32",) if name == "chunk" else ()
        note = f"fla {name}_linear_attn(scale=1, normalize=False), (B,T,H,D) inputs prepared outside timing"
        if mod.EINOPS_STUBBED:
            note += "; einops missing, stubbed for fla's import"
        linear[f"fla-{name}"] = Provider(prep, check=_torch_only, tf32_dtypes=tf32, note=note)
    return {"linear": linear}


def _numpy_naive_providers() -> dict:
    from bench.peers import naive

    def prep_attention(case, x, env):
        bias = naive.causal_bias(np, case.seqlen_q, case.seqlen_k) if case.causal else None
        return Prepared(lambda: naive.attention(np, x["q"], x["k"], x["v"], bias=bias))

    def prep_linear(case, x, env):
        return Prepared(lambda: naive.causal_dot_product(np, x["q"], x["k"], x["v"]))

    note = "NumPy on the host, materialised float32 scores"
    attention = Provider(prep_attention, note=note)
    return {"flash": {"numpy-naive": attention}, "decode": {"numpy-naive": attention},
            "linear": {"numpy-naive": Provider(prep_linear, note=note)}}


def build_registry(env: Env, opts: Options) -> tuple[dict, dict]:
    """``({sweep: {name: Provider}}, {peer: reason unavailable})`` for this environment; numba_attn first."""
    registry = {s: numba_attn_providers(s) for s in SWEEPS}
    unavailable = {}

    def merge(groups: dict):
        for sweep, providers in groups.items():
            registry[sweep].update(providers)

    if env.kind == "numpy":
        merge(_numpy_naive_providers())
        return registry, unavailable
    loaders = {
        "torch-sdpa": ("torch_sdpa", lambda m: _sdpa_providers(m, opts)),
        "triton-fa2": ("triton_flash", _triton_providers),
        "cupy-naive": ("naive", lambda m: _cupy_naive_providers(m, opts)),
        "fla": ("fla_linear", _fla_providers),
    }
    for label, (module, make) in loaders.items():
        mod, reason = peers.load(module)
        if mod is not None:
            try:
                merge(make(mod))
            except Exception as exc:  # noqa: BLE001
                reason = f"{type(exc).__name__}: {exc}"
        if reason:
            unavailable[label] = reason
    return registry, unavailable


def filter_registry(registry: dict, patterns: list | None) -> dict:
    if not patterns:
        return registry
    def keep(name: str) -> bool:
        return any(name == pat[1:] if pat.startswith("=") else pat in name for pat in patterns)

    return {s: {n: p for n, p in provs.items() if keep(n)} for s, provs in registry.items()}


# --------------------------------------------------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------------------------------------------------
def _error_text(exc: BaseException, caught=()) -> str:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
    hints = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    if hints:
        text += " | " + " | ".join(dict.fromkeys(hints))[:400]
    return text


def _row(case: Case, name: str, provider: Provider, **fields) -> dict:
    row = {
        "sweep": case.sweep, "config": case.config, "dtype": case.dtype, "size": case.size, "provider": name,
        "ours": provider.ours, "status": "skip", "reason": "", "rel_err": None, "tol_key": "", "tol": None,
        "ms": None, "ms_min": None, "reps": 0, "tflops": None, "gbs": None, "pct_copy_bw": None,
        "vs_best_peer": None, "best_peer": "", "graph_ms": None, "graph_gbs": None, "graph_pct_copy_bw": None,
        "graph_vs_best_peer": None, "graph_best_peer": "", "batch": case.batch, "heads": case.heads,
        "kv_heads": case.kv_heads, "seqlen_q": case.seqlen_q, "seqlen_k": case.seqlen_k,
        "head_dim": case.head_dim, "value_dim": case.value_dim, "causal": case.causal, "flops": case.flops,
        "bytes": case.nbytes,
    }
    row.update(fields)
    return row


def _progress(case: Case, name: str, row: dict):
    head = f"[{case.label}] {name:<22}"
    if row["status"] == "ok":
        text = f"ok    err {row['rel_err']:.1e}  {row['ms']:9.3f} ms"
        if row["tflops"] is not None:
            text += f"  {_num(row['tflops']):>7} TFLOP/s"
        if row["gbs"] is not None:
            text += f"  {_num(row['gbs']):>7} GB/s"
        text += f"  ({row['reps']} reps)"
        if row["graph_ms"] is not None:
            text += f"  graph {row['graph_ms']:.4f} ms"
            if row["graph_gbs"] is not None:
                text += f" {_num(row['graph_gbs'])} GB/s"
    elif row["status"] == "FAIL":
        text = f"FAIL  err {row['rel_err']:.1e} > {row['tol']:.0e} ({row['tol_key']})  {row['reason']}".rstrip()
    else:
        text = f"skip  {row['reason']}"
    print(f"{head} {text}", flush=True)


def run_provider(case: Case, name: str, provider: Provider, input_sets: list, ref: np.ndarray, sl: CheckSlice,
                 env: Env, opts: Options) -> dict:
    """Check one provider on one case and, if it is correct, time it. Never raises (except KeyboardInterrupt)."""
    tol_key, tol = tolerance_for(case, provider, opts.tolerances)
    base = dict(tol_key=tol_key, tol=tol)
    try:
        reason = provider.check(case, env)
    except Exception as exc:  # noqa: BLE001
        reason = _error_text(exc)
    if reason:
        return _row(case, name, provider, reason=reason, **base)

    prepared = []
    try:
        # 1. correctness on input set 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                first = provider.prepare(case, input_sets[0], env)
                prepared.append(first)
                with first.context():
                    out = first.post(first.fn())
                env.sync()
                if tuple(out.shape) != case.out_shape():
                    raise ValueError(f"output shape {tuple(out.shape)}, expected {case.out_shape()}")
                got = to_numpy(sl.of(out))
                del out
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001
                return _row(case, name, provider, reason=_error_text(exc, caught), **base)
        err = rel_error(got, ref)
        if not err <= tol:
            return _row(case, name, provider, status="FAIL", rel_err=err, reason="not timed", **base)

        # 2. timing over the rotated input sets
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                prepared += [provider.prepare(case, x, env) for x in input_sets[1:]]
                with first.context():
                    timing = measure(env, [p.fn for p in prepared], opts)
                env.sync()
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # noqa: BLE001
                return _row(case, name, provider, rel_err=err, reason="timing: " + _error_text(exc), **base)
            graph = {}
            if case.sweep in opts.graph_sweeps and provider.graphs:
                try:
                    with first.context():
                        graph_ms = env.graph_call_ms([p.fn for p in prepared], opts.graph_steps,
                                                     opts.graph_replays)
                    if graph_ms is not None:
                        graph = dict(graph_ms=graph_ms,
                                     graph_gbs=case.nbytes / (graph_ms * 1e-3) / 1e9 if case.nbytes else None)
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # noqa: BLE001
                    graph = dict(reason="graph: " + _error_text(exc))
                    with contextlib.suppress(Exception):
                        env.sync()
        seconds = timing.median_ms * 1e-3
        return _row(
            case, name, provider, status="ok", rel_err=err, ms=timing.median_ms, ms_min=timing.min_ms,
            reps=timing.reps, tflops=case.flops / seconds / 1e12 if case.flops else None,
            gbs=case.nbytes / seconds / 1e9 if case.nbytes else None, **base, **graph,
        )
    finally:
        prepared.clear()
        with contextlib.suppress(Exception):
            env.free()


def run_case(case: Case, providers: dict, env: Env, opts: Options) -> list:
    """All providers on one case: inputs and reference made once, shared by every provider."""
    rows = []
    try:
        per_set = case.input_bytes()
        count = max(1, min(opts.rotate, int(opts.input_mem_bytes // max(per_set, 1))))
        input_sets = [make_inputs(env, case, seed) for seed in range(count)]
        env.sync()
        sl = check_slice(case, opts.check_rows)
        ref = reference_output(case, input_sets[0], sl)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001
        reason = "inputs: " + _error_text(exc)
        for name, provider in providers.items():
            rows.append(_row(case, name, provider, reason=reason))
            _progress(case, name, rows[-1])
        with contextlib.suppress(Exception):
            env.free()
        return rows
    for name, provider in providers.items():
        row = run_provider(case, name, provider, input_sets, ref, sl, env, opts)
        rows.append(row)
        _progress(case, name, row)
    del input_sets
    with contextlib.suppress(Exception):
        env.free()
    return rows


def add_comparisons(rows: list, copy_gbs: float | None):
    """Fill ``best_peer`` / ``vs_best_peer`` (time / best peer's time) and ``pct_copy_bw`` for every row."""
    groups = {}
    for r in rows:
        groups.setdefault((r["sweep"], r["config"], r["dtype"], r["size"]), []).append(r)
    for group in groups.values():
        for prefix in ("", "graph_"):
            ms = prefix + "ms" if prefix else "ms"
            peers_ok = [r for r in group if not r["ours"] and r["status"] == "ok" and r[ms] is not None]
            best = min(peers_ok, key=lambda r: r[ms]) if peers_ok else None
            for r in group:
                if best is not None:
                    r[prefix + "best_peer"] = best["provider"]
                    if r["status"] == "ok" and r[ms] is not None:
                        r[prefix + "vs_best_peer"] = r[ms] / best[ms]
                if copy_gbs and r[prefix + "gbs"] is not None:
                    r[prefix + "pct_copy_bw"] = 100.0 * r[prefix + "gbs"] / copy_gbs


# --------------------------------------------------------------------------------------------------------------------
# Reporting: tables, CSV, JSON, markdown, plots
# --------------------------------------------------------------------------------------------------------------------
METRIC_TEXT = {
    "flash": "cell = median ms / TFLOP/s (FLOPs = 4*B*H*N*N*D, halved for causal)",
    "decode": "cell = median ms / GB/s (K, V, q read + out written) (% of device copy bandwidth); tables marked "
              "(CUDA graph replays): the same calls captured in a CUDA graph, ms per call",
    "linear": "cell = median ms",
}


def _num(x: float) -> str:
    """Short number: one decimal from 10 up, three significant digits below (simulator rates are tiny)."""
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def _cell(r: dict, prefix: str = "") -> str:
    if r["status"] == "FAIL":
        return f"FAIL {r['rel_err']:.0e}"
    if r["status"] != "ok":
        return "skip"
    ms = r[prefix + "ms"]
    if ms is None:
        return "-"
    if r["sweep"] == "flash" and r["tflops"] is not None and not prefix:
        return f"{ms:.3f} / {_num(r['tflops'])}"
    if r["sweep"] == "decode" and r[prefix + "gbs"] is not None:
        pct = f" ({r[prefix + 'pct_copy_bw']:.0f}%)" if r[prefix + "pct_copy_bw"] is not None else ""
        return f"{ms:.3f} / {_num(r[prefix + 'gbs'])}{pct}"
    return f"{ms:.3f}"


def pivot_tables(rows: list, sweep: str) -> list:
    """``[(title, header, body)]``, one per (config, dtype) and timer (queued calls; CUDA graph replays where
    measured): a row per size, a column per provider, and numba_attn's time over the best peer's for each
    numba_attn provider."""
    sweep_rows = [r for r in rows if r["sweep"] == sweep]
    tables = []
    groups = {}
    for r in sweep_rows:
        groups.setdefault((r["config"], r["dtype"]), []).append(r)
    for (config, dtype), group in groups.items():
        providers = list(dict.fromkeys(r["provider"] for r in group))
        ours = [p for p in providers if any(r["ours"] for r in group if r["provider"] == p)]
        header = ["size"] + providers + [f"{p} / best peer" for p in ours] + ["best peer"]
        for prefix, timer in (("", ""), ("graph_", " (CUDA graph replays)")):
            if prefix and not any(r["graph_ms"] is not None for r in group):
                continue
            body = []
            for size in sorted({r["size"] for r in group}):
                by_provider = {r["provider"]: r for r in group if r["size"] == size}
                line = [size_label(size)] + [_cell(by_provider[p], prefix) if p in by_provider else ""
                                             for p in providers]
                for p in ours:
                    ratio = by_provider.get(p, {}).get(prefix + "vs_best_peer")
                    line.append(f"{ratio:.2f}x" if ratio is not None else "-")
                best = next((r[prefix + "best_peer"] for r in by_provider.values() if r[prefix + "best_peer"]), "")
                line.append(best or "-")
                body.append(line)
            tables.append((f"{sweep}: {config}, {dtype}{timer}", header, body))
    return tables


def sweep_notes(rows: list, sweep: str) -> list:
    """Skip reasons, failures and the worst error of each provider, as text lines."""
    lines = []
    sweep_rows = [r for r in rows if r["sweep"] == sweep]
    for name in dict.fromkeys(r["provider"] for r in sweep_rows):
        mine = [r for r in sweep_rows if r["provider"] == name]
        errs = [r["rel_err"] for r in mine if r["rel_err"] is not None]
        ok = sum(r["status"] == "ok" for r in mine)
        fail = sum(r["status"] == "FAIL" for r in mine)
        skip = sum(r["status"] == "skip" for r in mine)
        worst = f", max rel err {max(errs):.1e}" if errs else ""
        lines.append(f"{name}: {ok} ok, {fail} FAIL, {skip} skipped{worst}")
        for reason in dict.fromkeys(r["reason"] for r in mine if r["status"] == "skip" and r["reason"]):
            sizes = ",".join(size_label(r["size"]) for r in mine if r["reason"] == reason)
            lines.append(f"    skipped ({sizes}): {reason}")
        for r in mine:
            if r["status"] == "ok" and r["reason"].startswith("graph:"):
                lines.append(f"    no CUDA graph time for {r['config']} {r['dtype']} {size_label(r['size'])}: "
                             f"{r['reason']}")
            if r["status"] == "FAIL":
                lines.append(f"    FAIL {r['config']} {r['dtype']} {size_label(r['size'])}: rel err "
                             f"{r['rel_err']:.2e} > {r['tol']:.0e} ({r['tol_key']} bound); not timed")
    return lines


def format_text_table(header: list, body: list) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    fmt = lambda line: "  ".join(  # noqa: E731
        str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(line) for line in body])


def format_markdown_table(header: list, body: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(str(x) for x in line) + " |" for line in body]
    return "\n".join(lines)


def print_report(rows: list, meta: dict):
    for sweep in meta["options"]["sweeps"]:
        if not any(r["sweep"] == sweep for r in rows):
            continue
        print(f"\n=== {sweep} === {METRIC_TEXT[sweep]}; '<ours> / best peer' = time ratio (< 1: numba_attn faster)")
        for title, header, body in pivot_tables(rows, sweep):
            print(f"\n{title}")
            print(format_text_table(header, body))
        print()
        for line in sweep_notes(rows, sweep):
            print(line)
    print(flush=True)


def write_markdown(path: str, rows: list, meta: dict):
    out = [f"# numba_attn benchmark sweep ({meta['device']})", ""]
    out.append(f"{meta['date']}; {meta['mode']} grid; timing: {meta['timer']}; median of up to "
               f"{meta['options']['reps']} calls over {meta['options']['rotate']} rotated input sets.")
    if meta["simulator"]:
        out.append("")
        out.append("**Simulator run** (no GPU): the timings measure Numba's CUDA simulator on the CPU, not a kernel.")
    if meta.get("copy_bandwidth_gbs"):
        out.append("")
        out.append(f"Device-to-device copy bandwidth: {meta['copy_bandwidth_gbs']:.0f} GB/s (read + written bytes).")
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    out += ["", f"Versions: {versions}.", "", f"Command: `{meta['command']}`"]
    for sweep in meta["options"]["sweeps"]:
        if not any(r["sweep"] == sweep for r in rows):
            continue
        out += ["", f"## {sweep}", "", METRIC_TEXT[sweep] + "; `<ours> / best peer` is the time ratio "
                "(< 1: numba_attn faster). FAIL: error above the bound, not timed."]
        for title, header, body in pivot_tables(rows, sweep):
            out += ["", f"### {title}", "", format_markdown_table(header, body)]
        out += ["", "Notes:", ""] + [f"- {line.strip()}" for line in sweep_notes(rows, sweep)]
    if meta.get("notes"):
        out += [""] + [f"Note: {n}" for n in meta["notes"]]
    if meta["unavailable_peers"]:
        out += ["", "Peers not available: " + "; ".join(f"{k} ({v})" for k, v in meta["unavailable_peers"].items())]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def write_csv(path: str, rows: list):
    if not rows:
        with open(path, "w") as f:
            f.write("")
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in r.items()})


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str, rows: list, meta: dict):
    with open(path, "w") as f:
        json.dump(_json_safe({"meta": meta, "results": rows}), f, indent=1)


def write_plot(path: str, rows: list, sweep: str, meta: dict) -> str | None:
    """One PNG per sweep: metric vs size, a line per provider, a subplot per (config, dtype). None if written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"no plot ({type(exc).__name__}: {exc})"
    metric, ylabel = {"flash": ("tflops", "TFLOP/s"), "decode": ("gbs", "GB/s"), "linear": ("ms", "ms")}[sweep]
    sweep_rows = [r for r in rows if r["sweep"] == sweep]
    panels = list(dict.fromkeys((r["config"], r["dtype"]) for r in sweep_rows))
    if not panels:
        return "no rows"
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax, (config, dtype) in zip(axes.flat, panels):
        panel = [r for r in sweep_rows if r["config"] == config and r["dtype"] == dtype]
        for name in dict.fromkeys(r["provider"] for r in panel):
            pts = sorted((r["size"], r[metric]) for r in panel
                         if r["provider"] == name and r["status"] == "ok" and r[metric] is not None)
            if not pts:
                continue
            ours = any(r["ours"] for r in panel if r["provider"] == name)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                            linewidth=2.5 if ours else 1.2, linestyle="-" if ours else "--")
            graph_pts = sorted((r["size"], r["graph_" + metric]) for r in panel if r["provider"] == name
                               and r["status"] == "ok" and r.get("graph_" + metric) is not None)
            if graph_pts:
                ax.plot([p[0] for p in graph_pts], [p[1] for p in graph_pts], marker="x", color=line.get_color(),
                        label=f"{name} (graph)", linewidth=1.0 if ours else 0.8, linestyle=":")
        if sweep == "decode" and meta.get("copy_bandwidth_gbs"):
            ax.axhline(meta["copy_bandwidth_gbs"], color="gray", linestyle=":", label="device copy")
        ax.set_xscale("log", base=2)
        if sweep == "linear":
            ax.set_yscale("log")
        sizes = sorted({r["size"] for r in panel})
        ax.set_xticks(sizes)
        ax.set_xticklabels([size_label(s) for s in sizes])
        ax.set_title(f"{config}, {dtype}", fontsize=10)
        ax.set_xlabel("KV length" if sweep == "decode" else "sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{sweep} on {meta['device']}" + (" (simulator: not a performance number)" if meta["simulator"]
                                                     else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


#: every file this script may write in --out (at most 8, as promised)
OUTPUT_FILES = ("results.csv", "results.json", "results.md") + tuple(f"{s}.png" for s in SWEEPS)


def write_outputs(rows: list, meta: dict, opts: Options) -> list:
    """Write the result files; remove this script's own files that this run did not rewrite (stale plots)."""
    os.makedirs(opts.out, exist_ok=True)
    written = []
    for sweep in opts.sweeps if opts.plot else ():
        path = os.path.join(opts.out, f"{sweep}.png")
        problem = write_plot(path, rows, sweep, meta)
        if problem is None:
            written.append(path)
        else:
            note = f"{sweep}.png not written: {problem}"
            meta.setdefault("notes", []).append(note)
            print(note, flush=True)
    for name, writer in (("results.csv", lambda p: write_csv(p, rows)),
                         ("results.json", lambda p: write_json(p, rows, meta)),
                         ("results.md", lambda p: write_markdown(p, rows, meta))):
        path = os.path.join(opts.out, name)
        writer(path)
        written.append(path)
    for name in OUTPUT_FILES:
        path = os.path.join(opts.out, name)
        if path not in written and os.path.exists(path):
            os.remove(path)
    return written


# --------------------------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------------------------
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


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


# --------------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------------
def main(argv: list | None = None, *, extra_providers: dict | None = None) -> dict:
    """Run the sweep; returns ``{"rows", "meta", "files"}``.

    ``extra_providers``: ``{sweep: {name: Provider}}`` added to the registry (after the built-in providers), e.g.
    a provider under development or a deliberately wrong one in the tests.
    """
    args = build_parser().parse_args(argv)
    env = make_env()
    opts = resolve_options(args, env.simulator)
    registry, unavailable = build_registry(env, opts)
    for sweep, providers in (extra_providers or {}).items():
        registry.setdefault(sweep, {}).update(providers)
    registry = filter_registry(registry, opts.providers)

    if args.list_providers:
        for sweep in opts.sweeps:
            print(f"{sweep}: " + ", ".join(registry.get(sweep, {})))
        for label, reason in unavailable.items():
            print(f"unavailable: {label}: {reason}")
        return {"rows": [], "meta": {}, "files": []}

    print(f"numba_attn sweep on {env.device_name} ({opts.mode} grid, arrays: {env.kind})", flush=True)
    if env.simulator:
        print("No GPU: running a tiny grid under Numba's CUDA simulator against a NumPy naive peer. "
              "Times measure the simulator, not the kernels.", flush=True)
    for label, reason in unavailable.items():
        print(f"peer {label} unavailable: {reason}", flush=True)

    meta = {
        "device": env.device_name, "simulator": env.simulator, "mode": opts.mode, "arrays": env.kind,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.argv[0] if argv is None else "sweep.py"]
                            + (sys.argv[1:] if argv is None else list(argv))),
        "git_commit": _git_commit(), "versions": versions(), "timer": env.timer, "options": asdict(opts),
        "copy_bandwidth_gbs": None, "unavailable_peers": unavailable,
        "providers": {s: {n: p.note for n, p in registry.get(s, {}).items()} for s in opts.sweeps},
        "flops": "flash: 4*B*H*Lq*Lk*D, halved for causal",
        "bytes": "decode: K and V read + q read + out written",
        "correctness": f"batch 0, heads first and last, last {opts.check_rows} query rows vs float64 reference",
    }
    rows: list = []
    files: list = []
    try:
        with env.active():
            if "decode" in opts.sweeps and not env.simulator:
                try:
                    meta["copy_bandwidth_gbs"] = env.copy_bandwidth()
                except Exception as exc:  # noqa: BLE001
                    print(f"copy bandwidth not measured: {_error_text(exc)}", flush=True)
                if meta["copy_bandwidth_gbs"]:
                    print(f"device-to-device copy bandwidth: {meta['copy_bandwidth_gbs']:.0f} GB/s "
                          "(1 GiB buffer, read + written bytes)", flush=True)
            for sweep in opts.sweeps:
                providers = registry.get(sweep, {})
                if not providers:
                    print(f"{sweep}: no provider left after --providers; skipped", flush=True)
                    continue
                for case in CASES[sweep](opts):
                    rows.extend(run_case(case, providers, env, opts))
    finally:
        add_comparisons(rows, meta["copy_bandwidth_gbs"])
        print_report(rows, meta)
        files = write_outputs(rows, meta, opts)
        print("wrote " + ", ".join(files), flush=True)
    return {"rows": rows, "meta": meta, "files": files}


if __name__ == "__main__":
    main()
