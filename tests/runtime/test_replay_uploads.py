"""Plans of calls that copy host values to the device (``runtime.replay``: ``note_upload``, ``host_values``): varlen
calls with host ``cu_seqlens``, whose schedule is made on the host, and fp8 descale factors.

A plan keeps the bytes of each upload and a device copy per stream; its key holds the host values the upload was
made from, so a call with other values never replays another call's schedule. On the CPU a stand-in library and
a stand-in kernel (which reads its "schedule" from a fake device memory) drive the recorder and the plans through
``runtime.serving.served`` and ``api._packed_key``, as ``flash_forward_varlen`` does.
"""
from __future__ import annotations

import numpy as np
import pytest

from numba_attn.runtime import replay


class _Array:
    def __init__(self, ptr):
        self.ptr = ptr


class _Memory:
    """A fake device: pointer -> NumPy array."""

    def __init__(self):
        self.arrays, self.next = {}, 0x7F0000000000

    def put(self, value: np.ndarray) -> _Array:
        self.next += 1 << 20
        self.arrays[self.next] = value
        return _Array(self.next)


class _Ops:
    """Stand-in for ``arrays.fast_library``: allocations and uploads in ``_Memory``, a settable current stream."""

    def __init__(self, memory: _Memory):
        self.memory, self.current, self.uploads = memory, 7, 0

    def empty(self, shape, dtype, device_id):
        return self.memory.put(np.full(shape, -1, np.int64))

    def upload(self, host, device_id):
        self.uploads += 1
        return self.memory.put(np.array(host, copy=True))

    @staticmethod
    def pointer(x):
        return x.ptr

    def stream(self, device_id):
        return self.current


class _Kernel:
    """Stand-in for ``launch._Launchable``: ``kernel(schedule, out)`` copies the schedule into ``out``."""

    arrays = [(np.dtype(np.int32), 1), (np.dtype(np.int64), 1)]

    def __init__(self, memory: _Memory):
        self.memory, self.streams = memory, []

    def launch(self, grid, block, shared_bytes, stream, values):
        replay.note_launch(self, grid, block, shared_bytes, stream, values)
        schedule, out = self.memory.arrays[values[4]], self.memory.arrays[values[11]]
        out[:] = schedule
        self.streams.append(stream)


def _schedule(offsets) -> np.ndarray:
    """What the stand-in checked path makes of host offsets (the real one: ``forward.varlen.host_schedule``)."""
    return np.diff(np.asarray(offsets, np.int64)).astype(np.int32)


@pytest.fixture
def fake(monkeypatch):
    from numba_attn.runtime import arrays

    memory = _Memory()
    ops = _Ops(memory)
    monkeypatch.setattr(replay, "ENABLED", True)
    monkeypatch.setattr(arrays, "fast_layout", lambda x: x if isinstance(x, tuple) and len(x) == 6 else None)
    monkeypatch.setattr(arrays, "_library_of", lambda x: "torch")
    monkeypatch.setattr(arrays, "fast_library", lambda library: ops)
    monkeypatch.setattr(replay, "_driver_current_device", lambda: 0)
    capturing = set()
    monkeypatch.setattr(replay, "_capture_status", lambda stream: stream in capturing)
    replay.clear()
    used = []
    original = replay.Plan.run
    monkeypatch.setattr(replay.Plan, "run", lambda self, layouts: used.append(self) or original(self, layouts))
    yield memory, ops, _Kernel(memory), used, capturing
    replay.clear()


def _varlen_call(fake, cu_q, cu_k=None):
    """One call through ``served`` with ``api._packed_key``'s key; returns the schedule the kernel saw."""
    from numba_attn import api
    from numba_attn.runtime.serving import served

    memory, ops, kernel, _, _ = fake
    cu_k = cu_q if cu_k is None else cu_k
    q = (np.float16, 0, (8, 2, 4), (16, 8, 2), 0x10000000, np.dtype(np.float16))  # a layout (``fast_layout``)

    def checked():
        schedule = _schedule(cu_q)
        n = schedule.size
        out = ops.empty((n,), "int64", 0)
        replay.note_alloc(out, out.ptr, (n,), "int64", 8 * n)
        copy = ops.upload(schedule, 0)
        replay.note_upload(copy, copy.ptr, 4 * n, schedule)
        kernel.launch((1, 1, 1), (32, 1, 1), 0, ops.current,
                      [0, 0, n, 4, copy.ptr, n, 4, 0, 0, n, 8, out.ptr, n, 8])
        return out

    arrays, options = api._packed_key((q,), cu_q, cu_k)
    out = served("varlen", arrays, (True,) + options, checked)
    return memory.arrays[out.ptr].copy()


def test_host_offsets_replay_their_own_schedule(fake):
    """Offsets A, A, B, A (same total) as NumPy, a list and a torch CPU tensor: each call sees the schedule of its own
    offsets; the repeats replay, with the plan's device copy and no upload per call."""
    _, ops, _, used, _ = fake
    a, b = [0, 3, 3, 8], [0, 1, 7, 8]
    for step, (offsets, replayed) in enumerate([(np.array(a, np.int32), 0), (list(a), 0), (np.array(b, np.int32), 0),
                                                (np.array(a, np.int32), 1), (np.array(b, np.int32), 1)]):
        before = len(used)
        assert np.array_equal(_varlen_call(fake, offsets), _schedule(offsets)), step
        assert len(used) - before == replayed, step
    assert ops.uploads == 3  # the three recordings' own copies: replays on their stream copy nothing


def test_other_dtypes_and_kinds_of_one_value(fake):
    """A list of ints is an int64 array: its key is an int64 array's; an int32 array of the same values and a
    torch CPU tensor make plans of their own (each checked once), never a replay of a wrong schedule."""
    torch = pytest.importorskip("torch")
    _, _, _, used, _ = fake
    values = [0, 2, 5, 8]
    for offsets in (values, np.array(values, np.int64), np.array(values, np.int32), torch.tensor(values),
                    np.array(values, np.int32)[::1]):
        assert np.array_equal(_varlen_call(fake, offsets), _schedule(values))
    assert len(used) == 3  # int64 array after the list; the torch int64 tensor; the int32 view


def test_uploads_are_copied_per_stream_and_kept_for_captures(fake):
    """A replay on another stream copies the schedule once for that stream; inside a capture a stream with a copy
    replays (the copy is then kept for the life of the process), one without takes the checked path."""
    _, ops, kernel, used, capturing = fake
    offsets = np.array([0, 4, 8], np.int32)
    _varlen_call(fake, offsets)
    ops.current = 9
    for _ in range(2):
        assert np.array_equal(_varlen_call(fake, offsets), _schedule(offsets))
    assert ops.uploads == 2 and len(used) == 2 and kernel.streams[-1] == 9
    kept = len(replay._captured)
    capturing.add(9)
    assert np.array_equal(_varlen_call(fake, offsets), _schedule(offsets))
    assert len(replay._captured) == kept + 1 and len(used) == 3
    ops.current = 11
    capturing.add(11)
    launched = len(kernel.streams)
    _varlen_call(fake, offsets)  # no copy for stream 11: the plan declines, the checked path runs (and uploads)
    assert len(used) == 4 and len(kernel.streams) == launched + 1 and ops.uploads == 3


def test_many_streams_copy_per_call(fake, monkeypatch):
    _, ops, _, used, _ = fake
    monkeypatch.setattr(replay, "UPLOAD_STREAMS", 2)
    offsets = [0, 5, 8]
    _varlen_call(fake, offsets)
    for stream in (20, 21, 22, 22):
        ops.current = stream
        assert np.array_equal(_varlen_call(fake, offsets), _schedule(offsets))
    assert len(used) == 4 and ops.uploads == 1 + 1 + 1 + 2  # recorded, stream 20 kept, 21 and 22 per call


def test_host_values_key_values_and_decline_what_they_cannot_read():
    torch = pytest.importorskip("torch")
    key = replay.host_values
    assert key(np.array([0, 3, 5], np.int32)) == key(np.array([0, 3, 5, 9], np.int32)[:3])
    assert key(np.array([0, 3, 5], np.int32)) != key(np.array([0, 3, 6], np.int32))
    assert key([0, 3, 5]) == key(np.array([0, 3, 5]))
    assert key([0, 3.0, 5]) != key([0, 3, 5])  # (a float list is an error of the checked path, not a replay)
    assert key(torch.tensor([0, 3, 5], dtype=torch.int32)) == key(np.array([0, 3, 5], np.int32))
    assert key(3) is None and key(None) is None and key(np.float32(0.5)) is None  # numbers: no arrays
    assert key([0, [1, 2]]) == [] and key([object()]) == []  # unreadable here: no key (the checks raise)


def test_packed_keys_of_host_device_and_mixed_offsets(monkeypatch):
    from numba_attn import api

    q = object()
    device = object()  # not a host array: an array of the key
    assert api._packed_key((q,), device, device) == ((q, device, device), ())
    arrays, options = api._packed_key((q,), np.array([0, 2], np.int32), [0, 2])
    assert arrays == (q,) and options == (replay.host_values(np.array([0, 2], np.int32)), replay.host_values([0, 2]))
    arrays, options = api._packed_key((q,), [0, 2], device)  # mixed: no key (the checked path raises)
    assert options == ([],)
