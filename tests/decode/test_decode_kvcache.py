"""``flash_decode`` with KV-cache options (ragged ``cache_seqlens``, paged caches, windows, softcap) against
``reference.attention_with_kvcache``, on the SIMT split kernel (float32) and the tensor-core one (float16), and its
argument checks.

The unmarked tests are simulator-sized; the ``gpu`` ones (``test_decode_kvcache_gpu.py``) use real sizes.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.decode import kvcache
from numba_attn.decode import launch as decode_launch
from numba_attn.decode import mma as decode_mma
from numba_attn.decode import plan as split_plan
from numba_attn.decode import simt as decode_simt
from numba_attn.runtime.device import compute_capability
from tests.decode_checks import dev
from tests.kernel_checks import TOLERANCE, assert_close_lse, rel_error, to_host


def make_cache(rng, batch, heads, kv_heads, seqlen_q, head_dim, capacity, dtype, page_size=None, spare_pages=2):
    """q and a dense cache, or a paged one whose pages lie in a shuffled order (and some are never used), with
    its block table padded by -1 past each row's pages where there is room."""
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim)).astype(dtype)
    if page_size is None:
        k, v = (rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(dtype) for _ in range(2))
        return q, k, v, None
    max_pages = -(-capacity // page_size)
    num_pages = batch * max_pages + spare_pages
    k, v = (rng.standard_normal((num_pages, page_size, kv_heads, head_dim)).astype(dtype) for _ in range(2))
    table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
    return q, k, v, table


def check(q, k, v, table, lengths, *, window=None, softcap=None, causal=False, num_splits=None, sm_scale=None,
          path=None, monkeypatch=None):
    """flash_decode against the reference (out and lse; rows that see no key: exactly 0 and -inf). ``path``:
    "simt" or "mma", the kernel that must run."""
    if path is not None:
        ran = []
        for name, module in (("simt", decode_simt), ("mma", decode_launch.DecodeLaunch)):
            original = module.launch if name == "simt" else module.__call__

            def spy(*args, _original=original, _name=name, **kwargs):
                ran.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, "launch" if name == "simt" else "__call__", spy)
    out, lse = numba_attn.flash_decode(q, k, v, cache_seqlens=lengths, block_table=table, window=window,
                                       softcap=softcap, causal=causal, num_splits=num_splits, sm_scale=sm_scale,
                                       return_lse=True)
    ref_out, ref_lse = reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table,
                                                        window=window, softcap=softcap, causal=causal,
                                                        sm_scale=sm_scale, return_lse=True)
    out = to_host(out)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_error(out, ref_out) <= TOLERANCE[str(q.dtype)]
    assert_close_lse(lse, ref_lse)
    assert (out[np.isneginf(ref_lse)] == 0).all()
    if path is not None:
        assert ran == [path], ran


# -- the SIMT split kernel (float32) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    # ragged rows of 0 keys and of the full capacity; more splits than some rows have keys; GQA 2
    dict(batch=3, lengths=[0, 40, 7], num_splits=3),
    # pages of 16 in a shuffled order, a partial last page, a page table padded with -1
    dict(batch=2, lengths=[17, 33], page_size=16, num_splits=2, capacity=48),
    # pages of 32, a window around each row's own diagonal with three queries (rows with no key in it)
    dict(batch=2, lengths=[9, 64], page_size=32, seqlen_q=3, window=(3, 1), num_splits=2, capacity=64),
    # causal queries, a left window, softcap, full rows
    dict(batch=1, lengths=None, seqlen_q=2, causal=True, window=(6, None), softcap=2.0, num_splits=2),
])
def test_simt_kvcache_matches_reference(poisoned_outputs, monkeypatch, case):
    case = dict(case)
    rng = np.random.default_rng(sum(map(ord, repr(sorted(case.items())))))
    batch, capacity = case.pop("batch"), case.pop("capacity", 40)
    q, k, v, table = make_cache(rng, batch, 2, 1, case.pop("seqlen_q", 1), 12, capacity, "float32",
                                case.pop("page_size", None))
    lengths = case.pop("lengths")
    if table is not None and lengths is not None:  # pages past a row's keys may hold anything: -1
        for row, length in enumerate(lengths):
            table[row, -(-length // k.shape[1]):] = -1
    check(q, k, v, table, None if lengths is None else np.array(lengths, np.int32), path="simt",
          monkeypatch=monkeypatch, **case)


# -- the tensor-core split kernel (float16) --------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    # ragged incl. 0 and full; shuffled pages of 16; two splits
    dict(lengths=[0, 64], page_size=16, num_splits=2, capacity=64),
    # pages of 12 (no power of two: the loader divides), a partial last page, the table padded with -1
    dict(lengths=[13, 48], page_size=12, num_splits=2, capacity=48),
    # a window's left side at each row's length, softcap, GQA 2 in one row tile; dense cache
    dict(lengths=[50, 9], window=(20, 0), causal=True, softcap=1.5, num_splits=2, capacity=64),
])
def test_mma_kvcache_matches_reference(poisoned_outputs, monkeypatch, case):
    if not numba_attn.SIMULATOR and compute_capability() < decode_mma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    case = dict(case)
    rng = np.random.default_rng(len(repr(case)))
    q, k, v, table = make_cache(rng, 2, 2, 1, 1, 16, case.pop("capacity"), "float16", case.pop("page_size", None))
    lengths = case.pop("lengths")
    if table is not None:  # pages past a row's keys may hold anything: -1
        for row, length in enumerate(lengths):
            table[row, -(-length // k.shape[1]):] = -1
    check(q, k, v, table, np.array(lengths, np.int32), path="mma", monkeypatch=monkeypatch, **case)


def test_mma_pooled_plan_with_ragged_pages():
    """A pooled plan over the capacity with rows of other lengths: a full row whose blocks take pool tiles, and a
    short one whose second range and pool are empty -- every block still arrives, and the last one merges."""
    if not numba_attn.SIMULATOR and compute_capability() < decode_mma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    config = decode_mma.config_for(16)
    block_n = config.block_n
    capacity = 5 * block_n
    rng = np.random.default_rng(7)
    q, k, v, table = make_cache(rng, 2, 2, 1, 1, 16, capacity, "float16", page_size=block_n // 2)
    lengths = np.array([capacity - 3, block_n + 5], np.int32)
    options = kvcache.KvOptions(ragged=True, paged=True)
    kv = kvcache.KvCache(options, dev(lengths), dev(table), capacity, None)
    q_rows = q.reshape(2, 1, 2, 16)
    out = dev(np.full(q_rows.shape, np.nan, np.float16))
    lse = dev(np.full(q_rows.shape[:3], np.nan, np.float32))
    launch = decode_launch.DecodeLaunch(q_rows, q_rows, True, 0.25, None, 1, config=config, dtype="float16", kv=kv)
    plan = split_plan.SplitPlan(2, 2 * block_n, 2 * block_n, 2, 4 * block_n)
    assert launch.merges(plan)
    pages = kvcache.page_view
    launch(dev(q_rows), pages(dev(k)), pages(dev(v)), out, lse, 0, lambda shape: decode_simt._scratch(shape, 0),
           plan=plan, kv_args=(kv.seqlens, kv.table, capacity))
    ref_out, ref_lse = reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table,
                                                        sm_scale=0.25, return_lse=True)
    assert rel_error(to_host(out).reshape(q.shape), ref_out) <= TOLERANCE["float16"]
    assert_close_lse(to_host(lse).reshape(ref_lse.shape), ref_lse)
    assert (to_host(launch.counters(plan, 0))[:launch.pool_words] == 0).all()


def test_device_lengths_are_read_when_the_kernel_runs():
    """Device cache_seqlens (Numba device arrays, int32) are not checked or read on the host: two calls with other
    values in the same array see the new lengths."""
    from numba import cuda

    rng = np.random.default_rng(3)
    q, k, v, _ = make_cache(rng, 2, 2, 2, 1, 8, 24, "float32")
    lengths = cuda.to_device(np.array([5, 24], np.int32))
    qd, kd, vd = (cuda.to_device(x) for x in (q, k, v))
    for values in ([5, 24], [24, 0]):
        lengths.copy_to_device(np.array(values, np.int32))
        out = to_host(numba_attn.flash_decode(qd, kd, vd, cache_seqlens=lengths, num_splits=2))
        ref = reference.attention_with_kvcache(q, k, v, cache_seqlens=np.array(values))
        assert rel_error(out, ref) <= TOLERANCE["float32"]


# -- argument checks --------------------------------------------------------------------------------------------------
def _bad(rng, **changes):
    q, k, v, table = make_cache(rng, 2, 2, 1, 1, 8, 32, "float32", page_size=8)
    args = dict(q=q, k=k, v=v, cache_seqlens=np.array([3, 32], np.int32), block_table=table)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, error, name", [
    (dict(cache_seqlens=np.array([3, 33], np.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=np.array([-1, 3], np.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=np.array([3], np.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=np.array([3.0, 4.0])), TypeError, "cache_seqlens"),
    (dict(cache_seqlens="3"), TypeError, "cache_seqlens"),
    (dict(block_table=np.array([[0, 1, 2, 3], [4, 5, 6, 10]], np.int32)), ValueError, "block_table"),
    (dict(block_table=np.array([[-1, 1, 2, 3], [4, 5, 6, 7]], np.int32)), ValueError, "block_table"),
    (dict(block_table=np.zeros((3, 4), np.int32)), ValueError, "block_table"),
    (dict(block_table=np.zeros((2, 4), np.float32)), TypeError, "block_table"),
    (dict(v=np.zeros((10, 8, 1, 4), np.float32)), ValueError, "v_cache"),
    (dict(k=np.zeros((10, 8, 3, 8), np.float32)), ValueError, "k_cache"),
    (dict(k=np.zeros((10, 8, 8), np.float32)), ValueError, "k_cache"),
])
def test_bad_cache_arguments_name_the_argument(changes, error, name):
    args = _bad(np.random.default_rng(5), **changes)
    with pytest.raises(error, match=name):
        numba_attn.flash_decode(args["q"], args["k"], args["v"], cache_seqlens=args["cache_seqlens"],
                                block_table=args["block_table"])


def test_device_index_arrays_must_be_int32():
    from numba import cuda

    rng = np.random.default_rng(6)
    args = _bad(rng)
    q, k, v = (cuda.to_device(args[n]) for n in ("q", "k", "v"))
    with pytest.raises(TypeError, match="cache_seqlens"):
        numba_attn.flash_decode(q, k, v, cache_seqlens=cuda.to_device(np.array([3, 4], np.int64)),
                                block_table=args["block_table"])
    with pytest.raises(TypeError, match="block_table"):
        numba_attn.flash_decode(q, k, v, block_table=cuda.to_device(args["block_table"].astype(np.int64)))
    with pytest.raises(ValueError, match="softcap"):
        numba_attn.flash_decode(q, k, v, block_table=args["block_table"], softcap=-1.0)


def test_unread_table_entries_and_options_that_change_nothing():
    """Entries past a row's pages are never read (-1 is fine); window=(None, None) and softcap=0 are no options:
    such calls take the default kernels."""
    rng = np.random.default_rng(8)
    args = _bad(rng)
    table = args["block_table"].copy()
    table[0, 1:] = -1  # row 0 has 3 keys: one page
    check(args["q"], args["k"], args["v"], table, args["cache_seqlens"])
    assert kvcache.options_for(False, False, (None, None), False, None) is None
    assert kvcache.options_for(False, False, (None, 4), True, None) is None  # causal bounds the right side already
    out = numba_attn.flash_decode(args["q"][:, :1], args["q"][:, :1], args["q"][:, :1], window=(None, None),
                                  softcap=0)
    assert out.shape == (2, 1, 1, 8)
