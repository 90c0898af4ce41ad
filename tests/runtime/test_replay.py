"""Recorded plans (``runtime.replay``): a repeated call of one kind replays the first call's launches with the new
arrays' pointers and gives the answers of the checked path and of ``reference``.

The CPU tests drive the recorder with stand-in launchables: which pointers a plan may move, what makes it refuse.
The GPU tests call every public function repeatedly on fresh inputs, with the caching allocator's free blocks
poisoned between calls (a replay that launched nothing would return stale memory), against ``reference``.
"""
from __future__ import annotations

import numpy as np
import pytest

from numba_attn.runtime import replay


class _Launchable:
    """Stand-in for ``launch._Launchable``: one 1-d array argument and one scalar."""

    arrays = [(np.dtype(np.float32), 1), None]

    def __init__(self):
        self.launched = []

    def launch(self, grid, block, shared_bytes, stream, values):
        self.launched.append(list(values))


class _Array:
    def __init__(self, ptr):
        self.ptr = ptr


class _Ops:
    """Stand-in for ``arrays.fast_library``: "allocates" at increasing fake addresses."""

    def __init__(self):
        self.next = 0x7F0000000000

    def empty(self, shape, dtype, device_id):
        self.next += 1 << 20
        return _Array(self.next)

    @staticmethod
    def pointer(x):
        return x.ptr

    @staticmethod
    def stream(device_id):
        return 7


def _layout(ptr, n=64):
    return (np.float32, 0, (n,), (4,), ptr, np.dtype(np.float32))


def _record(ptr_of_launch, scalar=3, returned=None, refuse=None):
    """Record one fake call: an allocation at 0x5000_0000, a launch taking ``ptr_of_launch``; returns the plan."""
    launchable = _Launchable()
    recorder = replay._Recorder()
    out = _Array(0x50000000)
    recorder.allocs.append((out, 0x50000000, 256, (64,), "float32"))
    recorder.ops.append(("launch", launchable, (1, 1, 1), (32, 1, 1), 0, 5,
                         [0, 0, 64, 4, ptr_of_launch, 64, 4, scalar]))
    if refuse:
        recorder.refused = refuse
    plan = recorder.plan(("x",), [_layout(0x40000000)], out if returned is None else returned)
    return plan, launchable


@pytest.fixture
def fake_library(monkeypatch):
    from numba_attn.runtime import arrays

    monkeypatch.setattr(arrays, "_library_of", lambda x: "torch")
    monkeypatch.setattr(arrays, "fast_library", lambda library: _Ops())
    monkeypatch.setattr(replay, "_driver_current_device", lambda: 0)


@pytest.mark.parametrize("where, kind", [(0x40000000 + 16, "input"), (0x50000000 + 128, "allocation")])
@pytest.mark.usefixtures("fake_library")
def test_plan_moves_pointers_into_inputs_and_allocations(where, kind):
    plan, launchable = _record(where)
    assert plan is not None
    result = plan.run([_layout(0x60000000)])
    assert launchable.launched, "the replay launched nothing"
    values = launchable.launched[-1]
    if kind == "input":
        assert values[4] == 0x60000000 + 16
    else:
        assert values[4] == result.ptr + 128 and result.ptr != 0x50000000
    assert values[:4] + values[5:] == [0, 0, 64, 4, 64, 4, 3]


@pytest.mark.usefixtures("fake_library")
def test_plan_keeps_pointers_of_kept_buffers():
    replay.keep(0x30000000, 64)
    plan, launchable = _record(0x30000000 + 8)
    plan.run([_layout(0x60000000)])
    assert launchable.launched[-1][4] == 0x30000000 + 8


@pytest.mark.parametrize("case", ["unknown pointer", "pointer in a scalar", "returns an input", "refused"])
@pytest.mark.usefixtures("fake_library")
def test_no_plan_where_a_replay_could_be_wrong(case):
    if case == "unknown pointer":  # memory the call did not allocate and the process does not keep
        plan, _ = _record(0x20000000)
    elif case == "pointer in a scalar":
        plan, _ = _record(0x40000000, scalar=0x50000000 + 8)
    elif case == "returns an input":
        plan, _ = _record(0x40000000, returned=_Array(0x40000000))
    else:
        plan, _ = _record(0x40000000, refuse="tuning")
    assert plan is None


@pytest.mark.usefixtures("fake_library")
def test_plan_declines_another_current_device(monkeypatch):
    plan, launchable = _record(0x40000000)
    monkeypatch.setattr(replay, "_driver_current_device", lambda: 1)
    assert plan.run([_layout(0x60000000)]) is None and not launchable.launched


def test_keys_tell_options_and_layouts_apart(monkeypatch):
    from numba_attn.runtime import arrays

    monkeypatch.setattr(replay, "ENABLED", True)
    monkeypatch.setattr(arrays, "fast_layout", lambda x: x)

    def key(layout, options):
        return replay.find("f", (layout,), options)[0]

    base = key(_layout(0x40000000), (True, None))
    assert key(_layout(0x40000000 + 512), (True, None)) == base  # pointers move, alignment stays
    assert key(_layout(0x40000000 + 16), (True, None)) != base  # alignment differs
    assert key(_layout(0x40000000, 32), (True, None)) != base  # shape differs
    assert key(_layout(0x40000000), (1, None)) != base  # 1 == True, but only True passes the checks
    assert key(_layout(0x40000000), ([1], None)) is None  # unhashable: no plan, the checks say what is wrong


@pytest.mark.usefixtures("fake_library")
def test_plan_moves_a_tensor_map_with_its_array(monkeypatch):
    """A scalar that is a noted tensor map becomes the map of the moved array (of the same element size), made before
    anything launches; where no map can be had the plan launches nothing."""
    from numba_attn.runtime import launch, tensor_map

    asked = []

    class _Maps:
        def address_of(self, ptr, shape, strides, rows, stream, itemsize, capturing=None):
            asked.append((ptr, shape, strides, rows, stream, itemsize))
            return None if ptr == 0x70000000 + 32 else 0x90000000 + ptr % 0x1000000

    monkeypatch.setattr(tensor_map, "maps_for", lambda device_id=None: _Maps())
    # the fake stream (7) is no driver handle: on a GPU the real query would read through it
    monkeypatch.setattr(launch, "stream_capture_status", lambda stream: False)
    launchable = _Launchable()
    recorder = replay._Recorder()
    out = _Array(0x50000000)
    recorder.allocs.append((out, 0x50000000, 256, (64,), "float32"))
    recorder.maps[0x30000080] = (0x40000000 + 32, (64,), (4,), 16, 1)
    recorder.ops.append(("launch", launchable, (1, 1, 1), (32, 1, 1), 0, 5,
                         [0, 0, 64, 4, 0x50000000, 64, 4, np.uint64(0x30000080)]))
    plan = recorder.plan(("x",), [_layout(0x40000000)], out)
    assert plan is not None
    plan.run([_layout(0x60000000)])
    assert asked[-1] == (0x60000000 + 32, (64,), (4,), 16, 7, 1)
    assert launchable.launched[-1][7] == 0x90000000 + 32
    launchable.launched.clear()
    assert plan.run([_layout(0x70000000)]) is None and not launchable.launched


@pytest.mark.usefixtures("fake_library")
def test_no_plan_for_a_tensor_map_of_unknown_memory():
    launchable = _Launchable()
    recorder = replay._Recorder()
    out = _Array(0x50000000)
    recorder.allocs.append((out, 0x50000000, 256, (64,), "float32"))
    recorder.maps[0x30000080] = (0x20000000, (64,), (4,), 16, 2)
    recorder.ops.append(("launch", launchable, (1, 1, 1), (32, 1, 1), 0, 5,
                         [0, 0, 64, 4, 0x50000000, 64, 4, 0x30000080]))
    assert recorder.plan(("x",), [_layout(0x40000000)], out) is None


# -- on the GPU -------------------------------------------------------------------------------------------------------
def _poison_free_blocks(torch):
    """Fill memory the caching allocator holds free with NaN, so a replay that launched nothing shows."""
    junk = torch.full((1 << 22,), float("nan"), device="cuda")
    del junk


def _rel(actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


@pytest.fixture
def replays(monkeypatch):
    """The plans replayed during a test (one entry per ``Plan.run``), no plan recorded before it."""
    replay.clear()
    used = []
    original = replay.Plan.run
    monkeypatch.setattr(replay.Plan, "run", lambda self, layouts: used.append(self) or original(self, layouts))
    return used


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("function", ["flash_forward", "flash_forward lse", "combine_lse", "causal_dot_product",
                                      "causal_dot_product state", "linear_attention"])
def test_replayed_calls_match_reference(function, dtype, replays):
    torch = pytest.importorskip("torch")
    import numba_attn
    import reference

    if dtype == "bfloat16" and function == "combine_lse":
        pytest.skip("combine_lse takes float16 / float32 parts")
    rng = np.random.default_rng(1)
    tolerance = {"float16": 3e-3, "float32": 2e-5, "bfloat16": 2e-2}[dtype]
    tdtype = getattr(torch, dtype)
    for call in range(4):
        _poison_free_blocks(torch)
        if function == "combine_lse":
            o = rng.standard_normal((3, 2, 4, 5, 64)).astype(np.float32)
            lse = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
            got = numba_attn.combine_lse(torch.tensor(o, device="cuda", dtype=tdtype), torch.tensor(lse, device="cuda"))
            expected = reference.combine_lse(o.astype(dtype).astype(np.float64), lse)
            pairs = list(zip(got, expected))
        else:
            shape = (2, 4, 200, 64)
            x = [rng.standard_normal(shape).astype(np.float32) * (0.3 if "causal" in function else 1)
                 for _ in range(3)]
            t = [torch.tensor(a, device="cuda", dtype=tdtype) for a in x]
            x = [a.cpu().double().numpy() for a in t]  # what the kernels see
            if function.startswith("flash_forward"):
                lse = function.endswith("lse")
                got = numba_attn.flash_forward(*t, causal=True, return_lse=lse)
                expected = reference.attention(*x, causal=True, return_lse=lse)
            elif function.startswith("causal_dot_product"):
                state = function.endswith("state")
                got = numba_attn.causal_dot_product(*t, return_state=state)
                expected = reference.causal_dot_product(*x, return_state=state)
            else:
                got = numba_attn.linear_attention(*t, causal=True)
                expected = reference.linear_attention(*x, causal=True)
            pairs = list(zip(got, expected)) if isinstance(got, tuple) else [(got, expected)]
        for g, e in pairs:
            error = _rel(g.float().cpu().numpy(), e)
            assert error < tolerance, (call, error)
    assert len(replays) == 3, "the calls after the first were not replayed"


@pytest.mark.gpu
def test_replays_follow_the_callers_stream_and_new_layouts():
    torch = pytest.importorskip("torch")
    import numba_attn
    import reference

    replay.clear()
    rng = np.random.default_rng(2)
    side = torch.cuda.Stream()
    for step in range(3):
        x = [rng.standard_normal((1, 2, 130, 64)).astype(np.float16) for _ in range(3)]
        t = [torch.tensor(a, device="cuda") for a in x]
        if step == 2:  # a sliced (strided, offset) q: another key
            wide = torch.tensor(np.concatenate([x[0], x[0]], axis=-1), device="cuda")
            t[0] = wide[..., 64:]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _poison_free_blocks(torch)
            got = numba_attn.flash_forward(*t)
        torch.cuda.current_stream().wait_stream(side)
        expected = reference.attention(*[a.astype(np.float64) for a in x])
        assert _rel(got.float().cpu().numpy(), expected) < 3e-3, step


@pytest.mark.gpu
def test_warp_specialised_calls_replay_with_their_tensor_maps(replays):
    """``wgmma_ws`` reads q, k, v through tensor maps: repeated calls on new tensors replay, each with the maps of its
    own tensors (a replay with the first call's maps would return the first call's answer)."""
    torch = pytest.importorskip("torch")
    import numba_attn
    import reference
    from numba_attn.forward import wgmma_ws

    if not wgmma_ws.supports("float16", 128):
        pytest.skip("needs sm_90")
    rng = np.random.default_rng(3)
    for call in range(4):
        _poison_free_blocks(torch)
        x = [rng.standard_normal((1, 2, 1100, 128)).astype(np.float16) for _ in range(3)]
        t = [torch.tensor(a, device="cuda") for a in x]
        got = numba_attn.flash_forward(*t, causal=True, backend="wgmma_ws")
        if call == 0:
            assert replay.last_outcome() == "planned", replay.last_outcome()
        expected = reference.attention(*[a.astype(np.float64) for a in x], causal=True)
        assert _rel(got.float().cpu().numpy(), expected) < 3e-3, call
    assert len(replays) == 3, "the calls after the first were not replayed"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_replayed_backward_matches_reference(dtype, causal, replays):
    """``flash_backward`` on fresh tensors (grouped-query heads, seqlens no tile divides): the calls after the first
    replay, and every call's gradients match ``reference.attention_backward``."""
    torch = pytest.importorskip("torch")
    import numba_attn
    import reference

    rng = np.random.default_rng(4)
    tolerance = {"float16": 3e-3, "float32": 2e-5, "bfloat16": 2e-2}[dtype]
    tdtype = getattr(torch, dtype)
    for call in range(4):
        _poison_free_blocks(torch)
        shapes = [(2, 4, 150, 64), (2, 2, 130, 64), (2, 2, 130, 64), (2, 4, 150, 64)]
        t = [torch.tensor(rng.standard_normal(s).astype(np.float32), device="cuda", dtype=tdtype) for s in shapes]
        q, k, v, dout = t
        x = [a.cpu().double().numpy() for a in t]
        out, lse = reference.attention(*x[:3], causal=causal, return_lse=True)
        out_t = torch.tensor(out, device="cuda", dtype=tdtype)
        lse_t = torch.tensor(lse, device="cuda", dtype=torch.float32)
        got = numba_attn.flash_backward(dout, q, k, v, out_t, lse_t, causal=causal)
        assert len(replays) == call, "the calls after the first were not replayed"
        expected = reference.attention_backward(x[3], *x[:3], causal=causal)
        for g, e in zip(got, expected):
            error = _rel(g.float().cpu().numpy(), e)
            assert error < tolerance, (call, error)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_replayed_varlen_calls_follow_device_offsets(dtype, replays):
    """Packed sequences with device ``cu_seqlens``: the calls after the first replay, each with its own lengths (same
    total and batch: one key), forward and backward against ``reference``; host offsets replay by their values."""
    torch = pytest.importorskip("torch")
    import numba_attn
    import reference

    rng = np.random.default_rng(5)
    tolerance = {"float16": 3e-3, "bfloat16": 2e-2}[dtype]
    tdtype = getattr(torch, dtype)
    lengths = [[100, 300, 200], [1, 598, 1], [250, 0, 350], [600, 0, 0]]
    for call, lens in enumerate(lengths):
        _poison_free_blocks(torch)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        t = [torch.tensor(rng.standard_normal((600, 4, 64)).astype(np.float32), device="cuda", dtype=tdtype)
             for _ in range(4)]
        q, k, v, dout = t
        x = [a.cpu().double().numpy() for a in t]
        cu_t = torch.tensor(cu, device="cuda")
        out, lse = numba_attn.flash_forward_varlen(q, k, v, cu_t, cu_t, max_seqlen_q=600, max_seqlen_k=600,
                                                   causal=True, return_lse=True)
        grads = numba_attn.flash_backward_varlen(dout, q, k, v, out, lse, cu_t, cu_t, max_seqlen_q=600,
                                                 max_seqlen_k=600, causal=True)
        assert len(replays) == 2 * call, (call, len(replays))  # forward and backward replayed after the first
        expected = reference.attention_varlen(*x[:3], cu, cu, causal=True)
        assert _rel(out.float().cpu().numpy(), expected) < tolerance, call
        expected_grads = reference.attention_varlen_backward(x[3], *x[:3], cu, cu, causal=True)
        for g, e in zip(grads, expected_grads):
            assert _rel(g.float().cpu().numpy(), e) < tolerance, call
    before = len(replays)
    numba_attn.flash_forward_varlen(q, k, v, cu, cu, causal=True)  # host offsets: a plan of their values
    numba_attn.flash_forward_varlen(q, k, v, cu, cu, causal=True)
    assert len(replays) == before + 1  # (host offsets: test_replay_functions.py)
