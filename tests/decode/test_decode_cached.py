"""Decoding on a GPU across calls: repeated calls served by decode plans (``numba_attn.decode.cached``), CUDA graphs,
the pool's counters in graphs and on many streams, launches that overlap."""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.decode import cached as _decode_plan
from numba_attn.decode import plan as split_plan
from numba_attn.decode import pool as decode_pool
from numba_attn.runtime.device import multiprocessor_count
from tests.decode_checks import bf16_inputs, qkv
from tests.kernel_checks import TOLERANCE, assert_close_lse, rel_error, to_host


def _gpu_maker(library):
    if library == "torch":
        import torch

        return lambda x: torch.from_numpy(x).cuda(), lambda x: x.float().cpu().numpy()
    import cupy

    return cupy.asarray, lambda x: x.get().astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_gpu_planned_calls_skip_the_checks_and_stay_right(library, monkeypatch):
    """After one checked call, calls of the same kind go through its plan -- the checked path is not entered again --
    while the cache grows (a slice of a longer buffer, or contiguous with new strides) and on another stream."""
    from numba_attn import api

    make, host = _gpu_maker(library)
    _decode_plan.clear()
    rng = np.random.default_rng(40)
    q = rng.standard_normal((2, 32, 1, 128)).astype(np.float16)
    k_buf, v_buf = (rng.standard_normal((2, 4, 9000, 136)).astype(np.float16) for _ in range(2))
    qd, kd, vd = make(q), make(k_buf), make(v_buf)

    def check(out, length, k=None, v=None):
        k = k_buf[:, :, :length, :128] if k is None else k
        v = v_buf[:, :, :length, :128] if v is None else v
        ref = reference.attention(q, k, v)
        assert rel_error(host(out), ref) <= TOLERANCE["float16"]

    check(numba_attn.flash_decode(qd, kd[:, :, :5000, :128], vd[:, :, :5000, :128]), 5000)
    assert len(_decode_plan._PLANS) == 1

    def checked_path(*args, **kwargs):
        raise AssertionError("the checked path ran for a planned call")

    monkeypatch.setattr(api, "_attention", checked_path)
    for length in (5001, 8999, 1, 4097):
        check(numba_attn.flash_decode(qd, kd[:, :, :length, :128], vd[:, :, :length, :128]), length)
    k_new, v_new = (rng.standard_normal((2, 4, 777, 128)).astype(np.float16) for _ in range(2))
    check(numba_attn.flash_decode(qd, make(k_new), make(v_new)), 777, k_new, v_new)
    if library == "cupy":  # a non-blocking stream busy with the inputs' producer: the plan launches on it
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            busy = cupy.ones((2048, 2048), np.float32)
            for _ in range(20):
                busy = busy @ busy * (1.0 / 2048)
            zero = (busy[0, 0] - 1.0).astype(np.float16)
            out = numba_attn.flash_decode(qd + zero, kd[:, :, :3000, :128] + zero, vd[:, :, :3000, :128] + zero)
        stream.synchronize()
        check(out, 3000)
    monkeypatch.undo()

    # what the key does not pin down goes back to the checked path: K and V of different lengths ...
    with pytest.raises(ValueError, match="seqlen"):
        numba_attn.flash_decode(qd, kd[:, :, :100, :128], vd[:, :, :101, :128])
    # ... and rows that cannot be read in aligned 16-byte pieces are another kind of call (element copies)
    check(numba_attn.flash_decode(qd, kd[:, :, :2000, 1:129], vd[:, :, :2000, 1:129]), 2000,
          k_buf[:, :, :2000, 1:129], v_buf[:, :, :2000, 1:129])
    assert len(_decode_plan._PLANS) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 1, 64), (8, 3, 64)])
def test_gpu_planned_calls_bfloat16_lse_and_2d(shape, monkeypatch):
    """Plans for torch bfloat16 with lse, and for unbatched (seqlen, headdim) inputs."""
    import torch

    from numba_attn import api

    _decode_plan.clear()
    rng = np.random.default_rng(41)
    heads, seqlen_q, head_dim = shape
    (q, k, v), values = bf16_inputs(rng, 1, heads, heads // 8 if heads >= 8 else 1, seqlen_q, 3000, head_dim)
    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) for x in (q, k, v))
    for call in range(3):
        if call == 1:
            monkeypatch.setattr(api, "_attention", lambda *a, **kw: pytest.fail("checked path"))
        length = 3000 - 7 * call
        out, lse = numba_attn.flash_decode(tq, tk[:, :, :length], tv[:, :, :length], return_lse=True)
        ref_out, ref_lse = reference.attention(values[0], values[1][:, :, :length], values[2][:, :, :length],
                                               return_lse=True)
        assert out.dtype == torch.bfloat16
        assert rel_error(out.float().cpu().numpy(), ref_out) <= TOLERANCE["bfloat16"]
        assert_close_lse(lse, ref_lse)
    monkeypatch.undo()
    # (seqlen, headdim) inputs: k and v's length is their first axis
    q2, k2, v2 = (x[0, 0].astype(np.float16) for x in qkv(rng, 1, 1, 1, 1, 2500, 64, "float32"))
    for length in (2500, 2499):
        out = numba_attn.flash_decode(torch.from_numpy(q2).cuda(), torch.from_numpy(k2[:length]).cuda(),
                                      torch.from_numpy(v2[:length]).cuda())
        ref = reference.attention(q2, k2[:length], v2[:length])
        assert out.shape == q2.shape
        assert rel_error(out.float().cpu().numpy(), ref) <= TOLERANCE["float16"]


@pytest.mark.gpu
def test_gpu_flash_decode_in_a_cuda_graph():
    """A decoding step captured in a torch CUDA graph (after one call outside it) replays right on new data: the
    way to take the per-call host time out of a decode loop."""
    import torch

    rng = np.random.default_rng(42)
    q, k, v = qkv(rng, 2, 32, 4, 1, 6000, 128, "float16")
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    numba_attn.flash_decode(tq, tk, tv)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        numba_attn.flash_decode(tq, tk, tv)  # warm-up on the capture stream, as torch asks
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = numba_attn.flash_decode(tq, tk, tv)
    q2, k2, v2 = qkv(rng, 2, 32, 4, 1, 6000, 128, "float16")
    for dst, src in ((tq, q2), (tk, k2), (tv, v2)):
        dst.copy_(torch.from_numpy(src))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out.float().cpu().numpy(), reference.attention(q2, k2, v2)) <= TOLERANCE["float16"]
    # a second graph, captured on the warm-up stream itself; replays of both and plain calls in between, on new data
    graph2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph2, stream=stream):
        out2 = numba_attn.flash_decode(tq, tk, tv)
    for _ in range(2):
        q3, k3, v3 = qkv(rng, 2, 32, 4, 1, 6000, 128, "float16")
        for dst, src in ((tq, q3), (tk, k3), (tv, v3)):
            dst.copy_(torch.from_numpy(src))
        graph.replay()
        graph2.replay()
        plain = numba_attn.flash_decode(tq, tk, tv)
        torch.cuda.synchronize()
        expected = reference.attention(q3, k3, v3)
        for got in (out, out2, plain):
            assert rel_error(got.float().cpu().numpy(), expected) <= TOLERANCE["float16"]


@pytest.mark.gpu
def test_gpu_pooled_decode_in_graphs_with_and_without_arena(monkeypatch):
    """Pooled plans in CUDA graphs: a capture takes counters from the arena zeroed beforehand or, once the arena is
    used up, from its scratch, zeroed by a captured memset. Replays of both and plain calls on the capture stream
    stay right on new data, and the stream's counters are zero between calls. A plain call on a new stream beyond
    ``MAX_STREAMS`` zeroes counters of its own."""
    import torch


    pool = decode_pool.PoolCounters()
    monkeypatch.setattr(decode_pool, "POOL_COUNTERS", pool)
    rng = np.random.default_rng(44)
    shape = (2, 32, 4, 1, 6000, 128)
    assert split_plan.plan_splits(2, 4, 8, 6000, multiprocessor_count()).pooled
    tensors = tuple(torch.from_numpy(x).cuda() for x in qkv(rng, *shape, "float16"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        numba_attn.flash_decode(*tensors)
    torch.cuda.synchronize()
    counters = pool._streams.get((torch.cuda.current_device(), stream.cuda_stream, 0))
    assert (to_host(counters) == 0).all()
    graphs, outs = [], []
    for exhausted in (False, True):
        arena = pool._arenas[torch.cuda.current_device()]
        if exhausted:
            arena[1] = arena[0].shape[0]
        taken = arena[1]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs.append(numba_attn.flash_decode(*tensors))
        graphs.append(graph)
        assert arena[1] == taken + (0 if exhausted else 2 * 2 * 4)  # 2 x (batch x kv heads) row tiles
    for _ in range(3):
        data = qkv(rng, *shape, "float16")
        for dst, src in zip(tensors, data):
            dst.copy_(torch.from_numpy(src))
        with torch.cuda.stream(stream):
            for graph in graphs:
                graph.replay()
            plain = numba_attn.flash_decode(*tensors)
        torch.cuda.synchronize()
        expected = reference.attention(*data)
        for got in outs + [plain]:
            assert rel_error(got.float().cpu().numpy(), expected) <= TOLERANCE["float16"]
        assert (to_host(counters) == 0).all()
    # a new stream once MAX_STREAMS streams have counters: the call zeroes its own, in its scratch
    pool.MAX_STREAMS = len(pool._streams)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        for _ in range(2):
            got = numba_attn.flash_decode(*tensors)
    torch.cuda.synchronize()
    assert len(pool._streams) == pool.MAX_STREAMS
    assert rel_error(got.float().cpu().numpy(), expected) <= TOLERANCE["float16"]


@pytest.mark.gpu
def test_gpu_decode_stays_right_when_launches_overlap():
    """Decoding steps that run at the same time share nothing (each has its own scratch for the parts): two graphs
    captured from one stream and replayed at the same time on two streams, beside plain calls on a third, each on
    its own data, many times."""
    import torch

    rng = np.random.default_rng(43)
    cases = [qkv(rng, 2, 32, 4, 1, 9000 + 500 * n, 128, "float16") for n in range(3)]
    tensors = [tuple(torch.from_numpy(x).cuda() for x in case) for case in cases]
    expected = [reference.attention(*case) for case in cases]
    for args in tensors:
        numba_attn.flash_decode(*args)
    capture = torch.cuda.Stream()
    with torch.cuda.stream(capture):
        for args in tensors[:2]:
            numba_attn.flash_decode(*args)  # warm-up on the capture stream
    torch.cuda.synchronize()
    graphs, outs = [], []
    for args in tensors[:2]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture):
            outs.append(numba_attn.flash_decode(*args))
        graphs.append(graph)
    streams = [torch.cuda.Stream() for _ in range(3)]
    for _ in range(20):
        for graph, stream in zip(graphs, streams):
            with torch.cuda.stream(stream):
                graph.replay()
        with torch.cuda.stream(streams[2]):
            plain = numba_attn.flash_decode(*tensors[2])
        torch.cuda.synchronize()
        for got, want in zip(outs + [plain], expected):
            assert rel_error(got.float().cpu().numpy(), want) <= TOLERANCE["float16"]
