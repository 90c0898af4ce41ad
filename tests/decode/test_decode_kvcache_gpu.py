"""``flash_decode`` with KV-cache options on a GPU, at real sizes: paged caches of 16..256-key pages against dense
ones and ``reference.attention_with_kvcache``, ragged lengths up to 16k, windows and softcap on both kernels, repeated
calls served by plans, and a CUDA graph that follows device ``cache_seqlens`` as they grow."""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.decode import cached as _decode_plan
from tests.kernel_checks import TOLERANCE, assert_close_lse, rel_error

pytestmark = pytest.mark.gpu


def _torch_cache(rng, batch, heads, kv_heads, seqlen_q, head_dim, capacity, dtype, page_size):
    """q, a paged cache (pages shuffled, two spare), its block table and the same keys as a dense cache; torch
    tensors on the GPU and their float64 values."""
    import torch

    max_pages = -(-capacity // page_size)
    num_pages = batch * max_pages + 2
    torch_dtype = getattr(torch, dtype)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda").to(torch_dtype)
    k_pages, v_pages = (torch.randn(num_pages, page_size, kv_heads, head_dim, device="cuda").to(torch_dtype)
                        for _ in range(2))
    table = torch.from_numpy(rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
                             .astype(np.int32)).cuda()
    # the dense cache (batch, kv_heads, capacity, headdim) of the same keys
    k_dense, v_dense = (pages[table.long()].reshape(batch, max_pages * page_size, kv_heads, head_dim)
                        [:, :capacity].transpose(1, 2).contiguous() for pages in (k_pages, v_pages))
    return q, k_pages, v_pages, table, k_dense, v_dense


def _values(*tensors):
    return [t.double().cpu().numpy() for t in tensors]


@pytest.mark.parametrize("page_size, dtype, heads, kv_heads", [
    (16, "float16", 32, 4), (64, "bfloat16", 32, 8), (256, "float16", 8, 8), (128, "float32", 16, 4),
    (48, "float16", 32, 8),  # (no power of two: the tensor-core loader divides)
])
def test_gpu_paged_ragged_matches_dense_and_reference(page_size, dtype, heads, kv_heads):
    """Rows of 16384, 1, 9000 and 0 keys (capacity 16384), pages in a shuffled order: the paged call equals the
    dense call with the same lengths (both against the reference), lse included."""
    import torch

    rng = np.random.default_rng(page_size)
    capacity = 16384
    q, k, v, table, k_dense, v_dense = _torch_cache(rng, 4, heads, kv_heads, 1, 128, capacity, dtype, page_size)
    lengths = torch.tensor([16384, 1, 9000, 0], dtype=torch.int32, device="cuda")
    paged = numba_attn.flash_decode(q, k, v, cache_seqlens=lengths, block_table=table, return_lse=True)
    dense = numba_attn.flash_decode(q, k_dense, v_dense, cache_seqlens=lengths, return_lse=True)
    qv, kv, vv = _values(q, k_dense, v_dense)
    ref_out, ref_lse = reference.attention_with_kvcache(qv, kv, vv, cache_seqlens=lengths.cpu().numpy(),
                                                        return_lse=True)
    for out, lse in (paged, dense):
        assert out.dtype == q.dtype
        assert rel_error(out.float().cpu().numpy(), ref_out) <= TOLERANCE[dtype]
        assert_close_lse(lse.cpu().numpy(), ref_lse)
    assert (paged[0][3] == 0).all()


@pytest.mark.parametrize("seqlen_q, causal, window, softcap, dtype", [
    (1, True, (1000, 0), 30.0, "float16"),  # tensor cores: a left window at each row's length, softcap
    (1, False, (4095, None), None, "bfloat16"),
    (4, True, (700, 0), 20.0, "float16"),  # several query positions: the SIMT kernel
    (3, False, (100, 50), None, "float32"),
])
def test_gpu_windows_and_softcap(seqlen_q, causal, window, softcap, dtype):
    import torch

    rng = np.random.default_rng(seqlen_q)
    q, k, v, table, _, _ = _torch_cache(rng, 3, 16, 2, seqlen_q, 64, 6000, dtype, 32)
    q = q * 4  # scores of tens: the cap matters
    lengths = torch.tensor([6000, 2500, 5], dtype=torch.int32, device="cuda")
    out = numba_attn.flash_decode(q, k, v, cache_seqlens=lengths, block_table=table, causal=causal, window=window,
                                  softcap=softcap)
    qv, kv, vv = _values(q, k, v)
    ref = reference.attention_with_kvcache(qv, kv, vv, cache_seqlens=lengths.cpu().numpy(),
                                           block_table=table.cpu().numpy(), causal=causal, window=window,
                                           softcap=softcap)
    assert rel_error(out.float().cpu().numpy(), ref) <= TOLERANCE[dtype]


def test_gpu_kvcache_plans_and_a_graph_that_follows_growing_lengths(monkeypatch):
    """After one checked call, calls of the same kind (new lengths in a new device array, new pages) skip the checks;
    a CUDA graph captured with device cache_seqlens replays right as the lengths grow (the kernels read them), and
    its split plan (made for the capacity) serves every length."""
    import torch

    from numba_attn import api
    from numba_attn.decode import dispatch

    rng = np.random.default_rng(11)
    q, k, v, table, _, _ = _torch_cache(rng, 2, 32, 4, 1, 128, 8192, "float16", 64)
    lengths = torch.tensor([100, 4000], dtype=torch.int32, device="cuda")
    qv, kv, vv = _values(q, k, v)
    tv = table.cpu().numpy()

    def check(out, now):
        ref = reference.attention_with_kvcache(qv, kv, vv, cache_seqlens=now, block_table=tv)
        assert rel_error(out.float().cpu().numpy(), ref) <= TOLERANCE["float16"]

    _decode_plan.clear()
    check(numba_attn.flash_decode(q, k, v, cache_seqlens=lengths, block_table=table), [100, 4000])
    monkeypatch.setattr(dispatch, "checked_with_cache", lambda *a, **kw: pytest.fail("checked path"))
    monkeypatch.setattr(api, "_attention", lambda *a, **kw: pytest.fail("checked path"))
    other = torch.tensor([8192, 0], dtype=torch.int32, device="cuda")
    check(numba_attn.flash_decode(q, k, v, cache_seqlens=other, block_table=table), [8192, 0])
    monkeypatch.undo()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        numba_attn.flash_decode(q, k, v, cache_seqlens=lengths, block_table=table)  # (warm-up on the stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = numba_attn.flash_decode(q, k, v, cache_seqlens=lengths, block_table=table)
    for now in ([100, 4000], [101, 4001], [2000, 8191], [8192, 8192], [0, 1]):
        lengths.copy_(torch.tensor(now, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check(out, now)


def test_gpu_cupy_device_index_arrays():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(12)
    q = cupy.asarray(rng.standard_normal((2, 8, 1, 64)).astype(np.float16))
    k, v = (cupy.asarray(rng.standard_normal((20, 32, 8, 64)).astype(np.float16)) for _ in range(2))
    table = cupy.asarray(rng.permutation(20)[:18].reshape(2, 9).astype(np.int32))
    lengths = cupy.asarray(np.array([288, 33], np.int32))
    out = numba_attn.flash_decode(q, k, v, cache_seqlens=lengths, block_table=table)
    ref = reference.attention_with_kvcache(*(x.get().astype(np.float64) for x in (q, k, v)),
                                           cache_seqlens=lengths.get(), block_table=table.get())
    assert rel_error(out.get().astype(np.float64), ref) <= TOLERANCE["float16"]
