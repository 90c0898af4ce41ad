"""A planned ``flash_decode`` call (``decode.cached``) launches what the checked path launches, checked on the CPU:
torch CPU tensors stand in for CUDA tensors and the driver is stubbed, so each launch's packed parameters can be
compared (the planned path itself runs only on a GPU otherwise)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import numba_attn  # noqa: E402

# (on a GPU the planned path runs for real: tests/decode/test_decode_cached.py)
pytestmark = pytest.mark.skipif(not numba_attn.SIMULATOR, reason="a CPU check of the planned path's parameters")

from numba_attn.decode import cached, dispatch, kvcache, pool  # noqa: E402
from numba_attn.decode import launch as decode_launch  # noqa: E402
from numba_attn.runtime import arrays, device  # noqa: E402
from numba_attn.runtime import launch as rt_launch  # noqa: E402
from numba_attn.runtime.attention_args import AttentionArgs  # noqa: E402
from numba_attn.runtime.device import DeviceView  # noqa: E402
from numba_attn.runtime.shapes import AttentionShape  # noqa: E402


class _Driver:
    @staticmethod
    def cuStreamIsCapturing(stream, ref):
        ref._obj.value = 0
        return 0


class _Recorder:
    """A prepared launchable that notes what it is launched with."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def launch(self, grid, block, shared_bytes, stream, values):
        self.launches.append((self.name, tuple(grid), tuple(block), shared_bytes, stream, list(values)))


@pytest.fixture
def cpu_device(monkeypatch):
    """The planned path's GPU pieces on the CPU; returns the list the launches are noted in."""
    kept, launches = [], []

    def zeroed_words(count):
        kept.append(np.zeros(count, np.uint32))
        return DeviceView(kept[-1].ctypes.data, (count,), (4,), np.uint32, None)

    dtypes = arrays._torch_dtypes()

    def fast_layout(x):
        if not isinstance(x, torch.Tensor):
            return None
        itemsize = dtypes[x.dtype].itemsize
        return (x.dtype, 0, tuple(x.shape), tuple(s * itemsize for s in x.stride()), x.data_ptr(), dtypes[x.dtype])

    class CpuOps(arrays._TorchOps):
        def empty(self, shape, dtype, device_id):
            return torch.empty(shape, dtype=getattr(torch, dtype))

        def stream(self, device_id):
            return 0

    counters = pool.PoolCounters()
    counters._unused = DeviceView(0, (0,), (4,), np.uint32, None)
    monkeypatch.setattr(pool, "POOL_COUNTERS", counters)
    monkeypatch.setattr(rt_launch, "_cuda_library", lambda: _Driver)
    monkeypatch.setattr(rt_launch, "zeroed_words", zeroed_words)
    monkeypatch.setattr(rt_launch, "SIMULATOR", False)
    monkeypatch.setattr(decode_launch, "SIMULATOR", False)
    monkeypatch.setattr(device, "current_device_id", lambda: 0)
    monkeypatch.setattr(cached, "_driver_current_device", lambda: 0)
    monkeypatch.setattr(arrays, "fast_layout", fast_layout)
    monkeypatch.setitem(arrays._FAST_LIBRARIES, "torch", CpuOps())
    recorders = {}

    def prepared(kernel):
        if kernel not in recorders:
            recorders[kernel] = _Recorder(len(recorders), launches)
        return recorders[kernel]

    monkeypatch.setattr(rt_launch, "prepared", prepared)
    monkeypatch.setattr(decode_launch, "prepared", prepared)
    cached.clear()
    yield launches
    cached.clear()


def _checked(q, k, v, num_splits, plan_key, kv=None, paged=False):
    """dispatch.run as the checked path calls it; returns the output tensor."""
    view = arrays._device_view_of_torch
    out = torch.empty_like(q)
    call = SimpleNamespace(library="torch", kind="torch", device_id=0, dtype="float16", stream=0,
                           scratch=lambda shape, dtype="float32": view(torch.empty(shape, dtype=getattr(torch, dtype))))
    kv_heads = k.shape[2] if paged else k.shape[1]
    capacity = kv.capacity if kv is not None else k.shape[2]
    shape = AttentionShape(q.shape[0], q.shape[1], kv_heads, q.shape[2], capacity, q.shape[3], 4)
    kd, vd = view(k), view(v)
    if paged:
        kd, vd = kvcache.page_view(kd), kvcache.page_view(vd)
    lse = DeviceView(0, (1, 1, 1), (4, 4, 4), np.float32, None)
    args = AttentionArgs(view(q), kd, vd, view(out), lse, False, 0.125, False)
    dispatch.run(call, shape, args, num_splits, plan_key, kv)
    return out


def _compare(checked, planned, planned_out, checked_out):
    """The planned call's launches against the checked call's: the same kernels, grids, blocks, shared memory and
    parameters, but for the pointers into each call's own output and scratch (one to one)."""
    assert len(checked) == len(planned) >= 1
    for a, b in zip(checked, planned):
        assert a[:5] == b[:5]
        va, vb = a[5], b[5]
        assert len(va) == len(vb)
        pointers = {checked_out.data_ptr(): planned_out.data_ptr()}
        for i, (x, y) in enumerate(zip(va, vb)):
            if x != y:
                pointers.setdefault(x, y)
                assert pointers[x] == y, f"parameter {i}: {x} and {y}"


def _calls(launches, checked, planned):
    """The launches of ``checked()`` and of ``planned()``, and what each returned."""
    start = len(launches)
    checked_out = checked()
    middle = len(launches)
    planned_out = planned()
    return launches[start:middle], launches[middle:], checked_out, planned_out


@pytest.mark.parametrize("heads, kv_heads, seqlen, num_splits, launches", [
    (32, 4, 4096, None, 1),  # GQA 8: a pooled plan, merged in the kernel
    (8, 8, 3000, 4, 2),  # multi-head, the caller's splits: split kernel and combine
])
def test_planned_call_launches_what_the_checked_path_launches(cpu_device, monkeypatch, heads, kv_heads, seqlen,
                                                              num_splits, launches):
    monkeypatch.setattr(dispatch, "multiprocessor_count", lambda: 132)
    q = torch.randn(2, heads, 1, 64).half()
    k_buf, v_buf = (torch.randn(2, kv_heads, seqlen + 100, 64).half() for _ in range(2))
    key = ("test", heads, num_splits)
    _checked(q, k_buf[:, :, :seqlen], v_buf[:, :, :seqlen], num_splits, key)
    plan = cached._PLANS.get(key)
    assert plan is not None and plan.growing
    for length in (seqlen, seqlen + 37):  # a growing cache: the plan serves another length too
        k, v = k_buf[:, :, :length], v_buf[:, :, :length]
        checked, planned, checked_out, planned_out = _calls(
            cpu_device, lambda: _checked(q, k, v, num_splits, None),
            lambda: plan.run([arrays.fast_layout(x) for x in (q, k, v)]))
        assert planned_out.shape == q.shape and len(planned) == launches
        _compare(checked, planned, planned_out, checked_out)
    assert plan.run([arrays.fast_layout(x) for x in (q, k_buf[:, :, :10], v_buf[:, :, :11])]) is None
    # a contiguous cache of another length has other strides: the same key, and the launch takes its strides
    options = (False, None, num_splits, False)
    k, v = k_buf[:, :, :seqlen - 5].contiguous(), v_buf[:, :, :seqlen - 5].contiguous()
    key, _, layouts = cached.find(q, k, v, options)
    assert key == cached.find(q, k_buf[:, :, :seqlen], v_buf[:, :, :seqlen], options)[0]
    checked, planned, checked_out, planned_out = _calls(cpu_device, lambda: _checked(q, k, v, num_splits, None),
                                                        lambda: plan.run(layouts))
    _compare(checked, planned, planned_out, checked_out)


def test_planned_paged_call_moves_only_the_pointers(cpu_device):
    q = torch.randn(2, 32, 1, 128).half()
    k, v = (torch.randn(40, 64, 4, 128).half() for _ in range(2))
    table = torch.from_numpy(np.random.default_rng(0).permutation(40)[:32].reshape(2, 16).astype(np.int32))
    lengths = torch.tensor([1000, 77], dtype=torch.int32)
    view = arrays._device_view_of_torch
    options = kvcache.KvOptions(ragged=True, paged=True)
    kv = kvcache.KvCache(options, view(lengths), view(table), 16 * 64, None)
    _checked(q, k, v, None, "paged", kv, paged=True)
    plan = cached._PLANS.get("paged")
    assert plan is not None and not plan.growing
    # other arrays of the same kind: the planned call takes their pointers
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    lengths2, table2 = lengths.clone() + 3, table.clone()
    kv2 = kvcache.KvCache(options, view(lengths2), view(table2), 16 * 64, None)
    checked, planned, checked_out, planned_out = _calls(
        cpu_device, lambda: _checked(q2, k2, v2, None, None, kv2, paged=True),
        lambda: plan.run([arrays.fast_layout(x) for x in (q2, k2, v2, lengths2, table2)]))
    _compare(checked, planned, planned_out, checked_out)
    values = planned[0][5]
    for x in (q2, k2, v2, lengths2, table2):
        assert x.data_ptr() in values
