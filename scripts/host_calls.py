"""Python work per repeated call on the CPU, without a GPU: the planned path of ``flash_decode`` (``decode.cached``)
and the replayed paths of ``flash_forward`` (plain, and on the WS kernel with its four tensor maps) and of
``flash_forward_varlen`` with host ``cu_seqlens`` (``runtime.replay``:
the offsets' values in the key, the schedule's device copy kept by the plan), with the CUDA driver stubbed; beside
them what the checked varlen path does on the host for its offsets (checks and schedule, without the copy).

Host time can only be measured on a GPU (``scripts/host_overhead.py``); this counts what the Python side does per
call, which is most of it: function calls (cProfile) and microseconds per call on this CPU with the driver calls
(cuLaunchKernel, cuCtxGetDevice, ...) answered by stubs. Torch CPU tensors stand in for CUDA tensors
(``fast_layout`` takes them as device 0's, the torch allocator is the CPU one). The plans are made by hand as the
checked path would make them (the simulator would take minutes to run the kernels of these sizes).

    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=.:/tmp/torchlocal python scripts/host_calls.py [--calls 2000] [--profile NAME]

The same script runs on an older tree (``PYTHONPATH=/path/to/tree``) whose ``decode.cached`` has the earlier
interface, for a before / after comparison.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import inspect
import io
import os
import pstats
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


class _Driver:
    """The driver calls a planned call makes, answered at once."""

    @staticmethod
    def cuCtxGetDevice(ref):
        ref._obj.value = 0
        return 0

    @staticmethod
    def cuStreamIsCapturing(stream, ref):
        ref._obj.value = 0
        return 0

    @staticmethod
    def cuLaunchKernel(*args):
        return 0

    @staticmethod
    def cuMemsetD32Async(*args):
        return 0


def _setup():
    """Stub the driver, take torch CPU tensors for device 0's, allocate on the CPU."""
    import numpy as np
    import torch

    from numba_attn.runtime import arrays, device
    from numba_attn.runtime import launch as rt_launch

    device._cuda_library = rt_launch._cuda_library = lambda: _Driver
    dtypes = arrays._torch_dtypes()

    def fast_layout(x):  # arrays.fast_layout without the is_cuda test
        if arrays._library_of(x) != "torch":
            return None
        storage = dtypes.get(x.dtype)
        itemsize = storage.itemsize
        return (x.dtype, 0, tuple(x.shape), tuple(map(itemsize.__mul__, x.stride())), x.data_ptr(), storage)

    arrays.fast_layout = fast_layout

    class CpuOps(arrays._TorchOps):
        def empty(self, shape, dtype, device_id):
            torch_dtype = self.dtypes.get(dtype)
            if torch_dtype is None:
                torch_dtype = self.dtypes[dtype] = getattr(torch, dtype)
            return torch.empty(shape, dtype=torch_dtype)

        def stream(self, device_id):
            return 7

        def upload(self, host, device_id):
            return torch.from_numpy(np.array(host, copy=True))

    arrays._FAST_LIBRARIES["torch"] = CpuOps()
    # the pool's counters as on a GPU: device views (here of host memory), the capture query through the driver
    from numba_attn.decode import pool
    from numba_attn.runtime.device import DeviceView

    kept = []

    def zeroed_words(count):
        kept.append(np.zeros(count, np.uint32))
        return DeviceView(kept[-1].ctypes.data, (count,), (4,), np.uint32, None)

    rt_launch.zeroed_words = zeroed_words
    rt_launch.SIMULATOR = False  # (stream_capturing asks the driver)
    pool.POOL_COUNTERS._unused = DeviceView(0, (0,), (4,), np.uint32, None)
    return np, torch


def _launchable(argtypes):
    """A ``runtime.launch._Launchable`` for these argument types (its ``launch`` packs the parameters as on a GPU)."""
    import struct
    import threading

    from numba import types

    from numba_attn.runtime import launch as rt_launch

    entry = rt_launch._Launchable.__new__(rt_launch._Launchable)
    entry.kernel, entry.cufunc_handle, entry.handle, entry.device_id = None, 1, 1, 0
    entry.handle_arg = ctypes.c_void_p(1)
    entry.arrays, fmt, slots = [], "<", 0
    for ty in argtypes:
        if isinstance(ty, types.Array):
            entry.arrays.append((ty.dtype, ty.ndim))
            fmt += "QQqqQ" + "q" * (2 * ty.ndim)
            slots += 5 + 2 * ty.ndim
        else:
            entry.arrays.append(None)
            fmt += rt_launch._SCALAR_FORMATS["bool" if ty == types.boolean else str(ty)]
            slots += 1
    entry.packer, entry.slots = struct.Struct(fmt), slots
    entry.shared_raised, entry.fixed_signature, entry._local = 1 << 30, True, threading.local()
    return entry


def _decode_case(np, torch, batch, heads, kv_heads, seqlen_k, head_dim, num_splits, paged: bool):
    """A registered decode plan for torch float16 arrays of this size, and the call that takes it."""
    from numba import types

    from numba_attn.decode import cached, mma
    from numba_attn.decode import launch as dlaunch
    from numba_attn.runtime import arrays
    from numba_attn.runtime import launch as rt_launch
    from numba_attn.runtime.device import DeviceView

    old = "options" not in inspect.signature(cached.find).parameters
    if old:  # the earlier tree ran the prepared launches only off the simulator
        dlaunch.SIMULATOR = False
        from numba_attn.runtime import device

        device.current_device_id = lambda: 0
    q = torch.randn(batch, heads, 1, head_dim).half()
    out = torch.empty_like(q)
    kwargs = {}
    if paged:
        page = 256
        k = torch.randn(batch * seqlen_k // page, page, kv_heads, head_dim).half()
        v = torch.randn_like(k)
        lengths = torch.full((batch,), seqlen_k - 5, dtype=torch.int32)
        table = torch.arange(batch * seqlen_k // page, dtype=torch.int32).reshape(batch, -1)
        kwargs = dict(cache_seqlens=lengths, block_table=table)
    else:
        k = torch.randn(batch, kv_heads, seqlen_k, head_dim).half()
        v = torch.randn_like(k)
    view = arrays._device_view_of_torch
    lse = DeviceView(0, (1, 1, 1), (4, 4, 4), np.float32, None)
    q_rows, out_rows, lse_rows = dlaunch.grouped_views(view(q), view(out), lse, False, kv_heads, False)
    call = SimpleNamespace(library="torch", device_id=0, dtype="float16")
    scale = 1.0 / head_dim ** 0.5
    if paged:
        from numba_attn.decode import kvcache

        options = kvcache.KvOptions(ragged=True, paged=True)
        kv = kvcache.KvCache(options, view(lengths), view(table), table.shape[1] * page, None)
        launch = dlaunch.DecodeLaunch(q_rows, out_rows, False, scale, num_splits, 132, dtype="float16", device_id=0,
                                      kv=kv)
        kv_args = (kv.seqlens, kv.table, kv.capacity)
        kc, vc = kvcache.page_view(view(k)), kvcache.page_view(view(v))
        plan = cached.DecodePlan(call, tuple(q.shape), None, q_rows, out_rows, lse_rows, launch, kc, vc, kv_args,
                                 False)
        key, _, _ = cached.find(q, k, v, (False, None, num_splits, False, None, None), lengths, table)
    else:
        launch = dlaunch.DecodeLaunch(q_rows, out_rows, False, scale, num_splits, 132, dtype="float16",
                                      **({} if old else {"device_id": 0}))
        if old:
            plan = cached.DecodePlan(call, tuple(q.shape), None, q_rows, out_rows, lse_rows, launch)
            key, _, _ = cached.find(q, k, v, False, None, num_splits, False)
        else:
            plan = cached.DecodePlan(call, tuple(q.shape), None, q_rows, out_rows, lse_rows, launch)
            key, _, _ = cached.find(q, k, v, (False, None, num_splits, False))
    cached.register(key, plan)
    split = _launchable(mma.signature_for(launch.kv).args if hasattr(mma, "signature_for") else mma.SIGNATURE.args)
    f32 = types.float32
    combine = _launchable((types.Array(f32, 5, "A"), types.Array(f32, 4, "A"), types.Array(types.uint16, 4, "A"),
                           types.Array(f32, 3, "A"), types.boolean))
    launchables = {launch.split_kernel: split, launch.combine_kernel: combine}
    previous = rt_launch.prepared
    rt_launch.prepared = lambda kernel: launchables[kernel] if kernel in launchables else previous(kernel)
    if hasattr(dlaunch, "prepared"):  # (imported by name there)
        dlaunch.prepared = rt_launch.prepared
    return lambda: numba_attn_decode(q, k, v, num_splits, kwargs)


def numba_attn_decode(q, k, v, num_splits, kwargs):
    import numba_attn

    return numba_attn.flash_decode(q, k, v, num_splits=num_splits, **kwargs)


def _forward_case(np, torch):
    """A replay plan of flash_forward (one launch, one allocation), as ``runtime.replay`` records one."""
    import numba_attn
    from numba import types

    from numba_attn.runtime import replay

    replay.ENABLED = True
    replay._driver_current_device = lambda: 0
    q, k, v = (torch.randn(1, 2, 128, 64).half() for _ in range(3))
    options = (True, None, False, None, False, None, None)  # (api._flash_forward: causal ... window, softcap)
    key, _, layouts = replay.find("flash_forward", (q, k, v), options)
    array = types.Array(types.float16, 4, "A")
    entry = _launchable((array, array, array, array, types.Array(types.float32, 3, "A"), types.boolean,
                         types.float32, types.int64))
    values = [0] * entry.slots
    moves = tuple((4 + 13 * i, 1, i, 0) for i in range(3)) + ((4 + 39, 2, 0, 0),)
    ops = [("launch", entry, (2, 2, 1), (128, 1, 1), 0, values, moves)]
    plan = replay.Plan(__import__("numba_attn.runtime.arrays", fromlist=["x"]).fast_library("torch"), 0,
                       [((1, 2, 128, 64), "float16")], ops, (0,), False)
    replay._PLANS.put(key, plan)
    return lambda: numba_attn.flash_forward(q, k, v, causal=True)


def _ws_forward_case(np, torch):
    """A replay plan of flash_forward on the WS kernel (one launch, one allocation, four tensor maps: Q, K, V and the
    output's, for the TMA store), the maps' lookups hits of the map cache, as on a GPU once the arrays' pointers
    recur (there the caching allocator hands each call's output one of a few blocks; here three are taken in turn)."""
    from types import SimpleNamespace

    import numba_attn
    from numba_attn.forward import wgmma_ws
    from numba_attn.runtime import arrays, replay, tensor_map

    replay.ENABLED = True
    replay._driver_current_device = lambda: 0
    shape = (1, 2, 256, 64)
    q, k, v = (torch.randn(*shape).half() for _ in range(3))
    outputs = [torch.empty(shape, dtype=torch.float16) for _ in range(3)]
    library = arrays.fast_library("torch")

    class Outputs(type(library)):
        def empty(self, shape, dtype, device_id):
            outputs.append(outputs.pop(0))
            return outputs[-1]

    options = (True, None, False, None, False, None, None)  # (api._flash_forward: causal ... window, softcap)
    key, _, layouts = replay.find("flash_forward", (q, k, v), options)
    entry = _launchable(wgmma_ws.SIGNATURE.args)
    values = [0] * entry.slots
    # data pointers of q, k, v, out (13 slots per 4-d array, the pointer 5th); the maps after lse and 3 scalars
    moves = tuple((4 + 13 * i, 1, i, 0) for i in range(3)) + ((4 + 39, 2, 0, 0),)
    first_map = 4 * 13 + 11 + 3
    moves += tuple((first_map + i, 3, i, 0) for i in range(4))
    strides = tuple(2 * s for s in q.stride())
    maps = [(1, i, 0, shape, strides, rows, 2) for i, rows in enumerate((64, 128, 128))]
    maps.append((2, 0, 0, shape, strides, 64, 2))
    ops = [("launch", entry, (2, 2, 1), (384, 1, 1), 0, values, moves)]
    plan = replay.Plan(_outputs_library(library, Outputs), 0, [(shape, "float16")], ops, (0,), False, maps)
    replay._PLANS.put(key, plan)
    cache = tensor_map.TensorMaps(0)
    slab = SimpleNamespace(ptr=1 << 32)
    for n, x in enumerate([q, k, v] + outputs):
        rows = (64, 128, 128)[n] if n < 3 else 64
        cache._entries[(x.data_ptr(), shape, strides, 2, rows)] = tensor_map._Entry(slab, n, 7, False)
    tensor_map.maps_for = lambda device_id=None: cache
    return lambda: numba_attn.flash_forward(q, k, v, causal=True)


def _outputs_library(library, cls):
    """``library`` (the torch ops) as an instance of its subclass ``cls``."""
    clone = cls.__new__(cls)
    clone.__dict__.update(library.__dict__)
    return clone


def _varlen_case(np, torch, batch: int):
    """A replay plan of ``flash_forward_varlen`` with host offsets (one launch, one allocation, one upload: the
    schedule, whose copy on the plan's stream the recording left), as ``runtime.replay`` records one."""
    import numba_attn
    from numba import types

    from numba_attn import api
    from numba_attn.forward import varlen
    from numba_attn.runtime import arrays, replay

    replay.ENABLED = True
    replay._driver_current_device = lambda: 0
    total = 128 * batch
    q, k, v = (torch.randn(total, 2, 64).half() for _ in range(3))
    cu = np.arange(0, total + 1, 128, dtype=np.int32)
    arrays_, offsets = api._packed_key((q, k, v), cu, cu)
    options = (None, None, True, None, False, None, None, None) + offsets
    key, _, layouts = replay.find("flash_forward_varlen", arrays_, options)
    array = types.Array(types.float16, 4, "A")
    entry = _launchable((array, array, array, array, types.Array(types.float32, 3, "A"), types.boolean,
                         types.float32, types.Array(types.int32, 1, "A")))
    values = [0] * entry.slots
    schedule = varlen.host_schedule(cu.astype(np.int64), cu.astype(np.int64), 128, True, None)
    moves = tuple((4 + 13 * i, 1, i, 0) for i in range(3)) + ((4 + 39, 2, 0, 0), (4 + 13 * 4 + 11 + 2, 4, 0, 0))
    ops = [("launch", entry, (2, 2, 1), (128, 1, 1), 0, values, moves)]
    library = arrays.fast_library("torch")
    plan = replay.Plan(library, 0, [((total, 2, 64), "float16")], ops, (0,), False, (), (schedule,))
    copy = library.upload(schedule, 0)
    plan.uploaded[replay._stream_key(7)] = [(copy,), [copy.data_ptr()], False]
    replay._PLANS.put(key, plan)
    return lambda: numba_attn.flash_forward_varlen(q, k, v, cu, cu, causal=True)


def _varlen_checks_case(np, batch: int):
    """What the checked path does on the host for host offsets, apart from the copy: checks, schedule."""
    from numba_attn.forward import varlen

    total = 128 * batch
    cu = np.arange(0, total + 1, 128, dtype=np.int32)

    def checks():
        offsets = varlen.check_offsets(cu, cu, total, total, None, None)
        varlen.host_schedule(*offsets, 128, True, None)

    return checks


def _times(cases: dict, calls: int) -> dict:
    """Microseconds per call of each case: the best of 50 rounds, the cases taking turns in every round (so that
    the load of a shared machine, which comes and goes, falls on all of them alike)."""
    for fn in cases.values():
        for _ in range(20):
            fn()
    best = dict.fromkeys(cases, float("inf"))
    per_round = max(1, calls // 50)
    for _ in range(50):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / per_round * 1e6)
    return best


def _profile(fn, calls: int):
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler)
    return stats.total_calls / calls, stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", default=None, help="print the profile of the case whose name starts so")
    parser.add_argument("--lines", type=int, default=25)
    args = parser.parse_args()
    np, torch = _setup()
    from numba_attn.decode import cached

    cases = {"flash_forward (replay)": _forward_case(np, torch),
             "flash_forward on wgmma_ws, four maps (replay)": _ws_forward_case(np, torch)}
    for batch in (4, 64):
        cases[f"flash_forward_varlen host cu, batch {batch} (replay)"] = _varlen_case(np, torch, batch)
        cases[f"  its checked path's offsets work, batch {batch}"] = _varlen_checks_case(np, batch)
    for name, shape, splits in (("flash_decode GQA 8, pooled", (1, 32, 4, 4096, 128), None),
                                ("flash_decode MHA, 4 splits + combine", (1, 8, 8, 4096, 128), 4)):
        cases[name] = _decode_case(np, torch, *shape, splits, False)
    if "options" in inspect.signature(cached.find).parameters:
        cases["flash_decode paged, cache_seqlens"] = _decode_case(np, torch, 2, 32, 4, 4096, 128, None, True)
    times = _times(cases, args.calls)
    print(f"{'case':48s} {'us/call (CPU, stubs)':>22s} {'Python calls/call':>18s}")
    for name, fn in cases.items():
        calls, stats = _profile(fn, min(args.calls, 1000))
        print(f"{name:48s} {times[name]:22.1f} {calls:18.1f}", flush=True)
        if args.profile and name.startswith(args.profile):
            text = io.StringIO()
            stats.stream = text
            stats.sort_stats("tottime").print_stats(args.lines)
            print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
