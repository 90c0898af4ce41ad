"""The tensor-core split kernel (``numba_attn.decode.mma``) and its launch (``numba_attn.decode.launch``): which calls
take it, its parts against ``reference.split_kv_attention`` over the plan's ranges, pooled plans and the in-kernel
merge, with poisoned outputs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.core import ptx
from numba_attn.decode import combine as decode_combine
from numba_attn.decode import dispatch
from numba_attn.decode import launch as decode_launch
from numba_attn.decode import mma as decode_mma
from numba_attn.decode import plan as split_plan
from numba_attn.decode import pool as decode_pool
from numba_attn.decode import simt as decode
from numba_attn.runtime.attention_args import AttentionArgs
from numba_attn.runtime.device import compute_capability
from numba_attn.runtime.shapes import attention_shape
from numba_attn.runtime.views import grouped_heads
from tests.decode_checks import BF16_NAN, bf16_inputs, bf16_values, check_attention, dev, qkv
from tests.kernel_checks import TOLERANCE, assert_close_lse, rel_error, to_host


def test_grouped_heads_view():
    x = np.arange(2 * 6 * 3 * 4, dtype=np.float32).reshape(2, 6, 3, 4)
    rows = grouped_heads(x, 2)  # group 3: row i * 3 + l of kv head g = row l of head 3g + i
    assert rows.shape == (2, 2, 9, 4)
    assert np.array_equal(rows, x.reshape(2, 2, 9, 4))
    one = x[:, :, :1]  # one row per head: any head stride works
    assert np.array_equal(grouped_heads(one, 3), one.reshape(2, 3, 2, 4))
    lse = np.arange(2 * 6 * 3, dtype=np.float32).reshape(2, 6, 3)
    assert np.array_equal(grouped_heads(lse, 1), lse.reshape(2, 1, 18))
    assert grouped_heads(x.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3), 2) is None  # (B, L, H, D) memory


def test_decode_takes_tensor_cores_only_where_it_applies():
    if not numba_attn.SIMULATOR and dispatch.compute_capability() < (8, 0):
        pytest.skip("no tensor-core kernel below sm_80")

    def decides(dtype, heads, kv_heads, seqlen_q, causal, layout="contig"):
        q, k, v = qkv(np.random.default_rng(0), 1, heads, kv_heads, seqlen_q, 40, 16, dtype)
        if layout == "blhd":
            q = q.transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3)
        out = np.zeros(q.shape, q.dtype)
        args = AttentionArgs(q, k, v, out, np.zeros(q.shape[:3], np.float32), True, 1.0, causal)
        return dispatch.on_tensor_cores(dtype, attention_shape(q, k, v), args) is not None

    assert decides("float16", 8, 2, 1, True)  # one row: the mask is a no-op
    assert decides("float16", 8, 2, 3, False)
    assert not decides("float16", 8, 2, 3, True)  # the mask depends on the row's position
    assert decides("float16", 8, 8, 1, False)  # multi-head caches too (group 1)
    assert not decides("float16", 8, 8, 3, True)  # several rows under a mask: the SIMT kernel
    assert not decides("float32", 8, 2, 1, False)
    shape = attention_shape(*qkv(np.random.default_rng(0), 1, 8, 2, 1, 40, 16, "float16"))
    q16 = np.zeros((1, 8, 1, 16), np.uint16)
    assert dispatch.on_tensor_cores("bfloat16", shape, AttentionArgs(
        q16, None, None, q16.copy(), np.zeros((1, 8, 1), np.float32), True, 1.0, True)) is not None
    assert not decides("float16", 8, 2, 3, False, layout="blhd")  # rows of a group not contiguous: no regrouping


@pytest.mark.parametrize(
    "heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, num_splits",
    [
        (4, 1, 1, 70, 16, True, None),  # GQA 4, one token, a tail tile
        (4, 2, 2, 45, 24, False, 2),  # two rows per head, a split that ends inside a tile
        (2, 1, 1, 33, 20, False, 5),  # element copies (headdim 20), more splits than key tiles: empty parts
    ],
)
def test_flash_decode_tensor_core_path(heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, num_splits):
    rng = np.random.default_rng(seqlen_k)
    q, k, v = qkv(rng, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, "float16")
    out, lse = numba_attn.flash_decode(dev(q), dev(k), dev(v), causal=causal, num_splits=num_splits,
                                       return_lse=True)
    check_attention(to_host(out), to_host(lse), q, k, v, causal)


@pytest.mark.parametrize(
    "kv_heads, rows, seqlen_k, head_dim, num_splits, sm_scale, dtype, tail",
    [
        (1, 4, 70, 16, 2, 0.3, "float16", None),  # the second split's tile: one warp's keys all past the end
        (2, 3, 33, 24, 5, 0.3, "float16", None),  # ranges of one tile: a split of one key, then empty splits
        (1, 20, 40, 16, 1, 0.25, "bfloat16", None),  # two row tiles (the second with 4 rows), bfloat16
        (1, 8, 50, 20, 2, -0.2, "float16", None),  # element copies (head dim 20); a negative scale (scores first)
        # lead and tail ranges (SplitPlan): 2 lead ranges of 2 tiles, then tail ranges of 1 tile, the last one
        # partial and one past the end
        (2, 5, 5 * 32 + 9, 24, 7, 0.3, "float16", (2, 2, 1)),
        (1, 8, 3 * 64 + 1, 16, 4, 0.2, "bfloat16", (1, 1, 2)),  # tail ranges longer than the lead range
    ],
)
def test_decode_mma_split_parts_match_reference_ranges(kv_heads, rows, seqlen_k, head_dim, num_splits, sm_scale,
                                                       dtype, tail):
    """The tensor-core split kernel alone: every part and lse of a poisoned buffer written, each equal to attention
    over its key range (the plan's ranges: equal whole tiles, or lead and tail ranges), the warps' merge inside the
    block included."""
    if not numba_attn.SIMULATOR and compute_capability() < decode_mma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    rng = np.random.default_rng(seqlen_k + rows)
    q, k, v = qkv(rng, 1, kv_heads, kv_heads, rows, seqlen_k, head_dim, "float32")
    if dtype == "bfloat16":
        q, k, v = (ptx.float32_to_bf16_bits(x) for x in (q, k, v))
        values = [ptx.bf16_bits_to_float32(x).astype(np.float64) for x in (q, k, v)]
    else:
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
        values = [x.astype(np.float64) for x in (q, k, v)]
    launch = decode_launch.DecodeLaunch(q, q, True, sm_scale, num_splits, 1, dtype=dtype,
                                        vector_loads=decode_launch.vector_loads_ok(q, k, v))
    block_n = launch.config.block_n
    if tail is None:
        plan = split_plan.uniform_plan(seqlen_k, num_splits, block_n)
    else:
        lead_splits, lead_tiles, tail_tiles = tail
        plan = split_plan.SplitPlan(lead_splits, lead_tiles * block_n, tail_tiles * block_n, num_splits)
    starts, ends = plan.ranges(seqlen_k)
    assert ends.max() == seqlen_k, "the case's ranges must reach the end of the keys"
    o_parts = dev(np.full((num_splits,) + q.shape, np.nan, np.float32))
    lse_parts = dev(np.full((num_splits,) + q.shape[:3], np.nan, np.float32))
    launch.launch_split(dev(q), dev(k), dev(v), o_parts, lse_parts, 0, plan if tail else None)
    o_ref, lse_ref = reference.split_kv_attention(*values, num_splits, sm_scale=sm_scale,
                                                  boundaries=plan.boundaries(seqlen_k))
    got = to_host(o_parts)
    assert not np.isnan(got).any()
    assert rel_error(got, o_ref) <= TOLERANCE[dtype]
    assert_close_lse(to_host(lse_parts), lse_ref)
    assert (got[np.isneginf(lse_ref)] == 0).all()


@pytest.mark.parametrize(
    "kv_heads, rows, lead_splits, lead_tiles, pool_tiles, head_dim",
    [
        (2, 3, 2, 2, 2.3, 16),  # a pool of 3 tiles, the last one partial
        (1, 20, 3, 2, 4, 24),  # two row tiles, each with its own pool and counters; element copies
    ],
)
def test_decode_mma_pooled_parts_merge_to_attention(kv_heads, rows, lead_splits, lead_tiles, pool_tiles, head_dim):
    """A pooled plan: each block's part covers its own range and the pool tiles it took at run time, so the parts
    merge to attention over all the keys, lse included (a tile taken twice or never would shift it); every part and
    lse of a poisoned buffer is written, and the counters are back at zero after each of two launches in a row."""
    if not numba_attn.SIMULATOR and compute_capability() < decode_mma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    block_n = decode_mma.config_for(head_dim).block_n
    pool_first = lead_splits * lead_tiles * block_n
    seqlen_k = pool_first + int(pool_tiles * block_n)
    rng = np.random.default_rng(seqlen_k + rows)
    q, k, v = (x.astype(np.float16) for x in qkv(rng, 1, kv_heads, kv_heads, rows, seqlen_k, head_dim, "float32"))
    launch = decode_launch.DecodeLaunch(q, q, True, 0.3, None, 1, dtype="float16",
                                        vector_loads=decode_launch.vector_loads_ok(q, k, v))
    plan = split_plan.SplitPlan(lead_splits, lead_tiles * block_n, lead_tiles * block_n, lead_splits, pool_first)
    counters = launch.counters(plan, 0)
    expected = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), sm_scale=0.3, return_lse=True)
    for _ in range(2):
        o_parts = dev(np.full((lead_splits,) + q.shape, np.nan, np.float32))
        lse_parts = dev(np.full((lead_splits,) + q.shape[:3], np.nan, np.float32))
        launch.launch_split(dev(q), dev(k), dev(v), o_parts, lse_parts, 0, plan, counters)
        parts, lses = to_host(o_parts), to_host(lse_parts)
        assert not np.isnan(parts).any() and not np.isnan(lses).any()
        out, lse = reference.combine_lse(parts, lses)
        assert rel_error(out, expected[0]) <= TOLERANCE["float16"]
        assert_close_lse(lse, expected[1])
        assert (to_host(counters)[:launch.pool_words] == 0).all()


@pytest.mark.parametrize(
    "kv_heads, rows, lead_splits, pool_tiles, head_dim, dtype, write_lse, weight_parts",
    [
        (2, 3, 2, 2.3, 16, "float16", True, 32),  # a partial last pool tile; an lse row of 3
        (1, 20, 3, 2, 24, "bfloat16", True, 1),  # two row tiles, 3 rounds of weights; element copies, d_pad 32
        (1, 9, 3, 1.5, 40, "float16", False, 32),  # no lse asked for: its buffer stays poisoned
    ],
)
def test_decode_mma_merges_pooled_parts_in_the_kernel(kv_heads, rows, lead_splits, pool_tiles, head_dim, dtype,
                                                      write_lse, weight_parts):
    """A pooled plan without the combine kernel: the row tile's last block merges the parts into out (and lse)
    itself. Poisoned outputs are fully written with attention over every key (lse included, or left alone when
    not asked for), and the counters are back at zero after each of two launches in a row."""
    if not numba_attn.SIMULATOR and compute_capability() < decode_mma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    config = dataclasses.replace(decode_mma.config_for(head_dim), merge_weight_parts=weight_parts)
    block_n = config.block_n
    pool_first = lead_splits * 2 * block_n
    seqlen_k = pool_first + int(pool_tiles * block_n)
    rng = np.random.default_rng(seqlen_k + rows)
    q, k, v = qkv(rng, 1, kv_heads, kv_heads, rows, seqlen_k, head_dim, "float32")
    q = q * 30  # logits of several hundred: the parts' lse differ widely
    if dtype == "bfloat16":
        q, k, v = (ptx.float32_to_bf16_bits(x) for x in (q, k, v))
        values = [ptx.bf16_bits_to_float32(x).astype(np.float64) for x in (q, k, v)]
        poison = BF16_NAN
    else:
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
        values = [x.astype(np.float64) for x in (q, k, v)]
        poison = np.float16(np.nan)
    launch = decode_launch.DecodeLaunch(q, q, write_lse, 0.3, None, 1, config=config, dtype=dtype,
                                        vector_loads=decode_launch.vector_loads_ok(q, k, v))
    plan = split_plan.SplitPlan(lead_splits, 2 * block_n, 2 * block_n, lead_splits, pool_first)
    assert launch.merges(plan)
    expected_out, expected_lse = reference.attention(*values, sm_scale=0.3, return_lse=True)
    for _ in range(2):
        out = dev(np.full(q.shape, poison, q.dtype))
        lse = dev(np.full(q.shape[:3], np.nan, np.float32))
        launch(dev(q), dev(k), dev(v), out, lse, 0, lambda shape: decode._scratch(shape, 0), plan=plan)
        got = bf16_values(out) if dtype == "bfloat16" else to_host(out).astype(np.float64)
        assert not np.isnan(got).any()
        assert rel_error(got, expected_out) <= TOLERANCE[dtype]
        if write_lse:
            assert_close_lse(to_host(lse), expected_lse)
        else:
            assert np.isnan(to_host(lse)).all()
        assert (to_host(launch.counters(plan, 0))[:launch.pool_words] == 0).all()


def test_decode_tensor_core_path_bfloat16_bit_views():
    """The GQA tensor-core split kernel and the combine on bfloat16 bits (several splits: the combine writes)."""
    if not numba_attn.SIMULATOR and dispatch.compute_capability() < (8, 0):
        pytest.skip("no tensor-core kernel below sm_80")
    rng = np.random.default_rng(30)
    (q, k, v), values = bf16_inputs(rng, 1, 4, 1, 1, 45, 16)
    out = dev(np.full(q.shape, BF16_NAN, np.uint16))
    lse = dev(np.full(q.shape[:3], np.nan, np.float32))
    args = (dev(q), dev(k), dev(v), out, lse, True)
    grouped = dispatch.on_tensor_cores("bfloat16", attention_shape(q, k, v), AttentionArgs(*args, 1.0, True))
    assert grouped is not None
    q_rows, out_rows, lse_rows = grouped
    decode_launch.launch_decode(q_rows, args[1], args[2], out_rows, lse_rows, True, 0.25, 2, 0,
                                lambda shape: decode._scratch(shape, 0), 1, dtype="bfloat16")
    ref_out, ref_lse = reference.attention(*values, causal=True, sm_scale=0.25, return_lse=True)
    got = bf16_values(out)
    assert not np.isnan(got).any()
    assert rel_error(got, ref_out) <= TOLERANCE["bfloat16"]
    assert_close_lse(lse, ref_lse)


def test_pool_counters_are_zero_after_an_interrupted_launch(monkeypatch):
    """A pooled launch that stops part-way (here: the first block to arrive raises) has drawn tickets from the
    stream's shared counters; they must be back at zero, or the next call on that stream skips pool tiles."""
    if not numba_attn.SIMULATOR:
        pytest.skip("stops a kernel part-way, which only the simulator can do")
    pool = decode_pool.PoolCounters()
    monkeypatch.setattr(decode_pool, "POOL_COUNTERS", pool)
    block_n = decode_mma.config_for(16).block_n
    pool_first = 2 * 2 * block_n
    rng = np.random.default_rng(50)
    q, k, v = (x.astype(np.float16) for x in qkv(rng, 1, 1, 1, 3, pool_first + 2 * block_n + 5, 16, "float32"))
    launch = decode_launch.DecodeLaunch(q, q, True, 0.3, None, 1, dtype="float16",
                                        vector_loads=decode_launch.vector_loads_ok(q, k, v))
    plan = split_plan.SplitPlan(2, 2 * block_n, 2 * block_n, 2, pool_first)
    assert launch.merges(plan)
    expected_out, expected_lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), sm_scale=0.3,
                                                     return_lse=True)

    def interrupted(*args):
        raise RuntimeError("interrupted")

    def run():
        out = dev(np.full(q.shape, np.nan, q.dtype))
        lse = dev(np.full(q.shape[:3], np.nan, np.float32))
        launch(dev(q), dev(k), dev(v), out, lse, 0, lambda shape: decode._scratch(shape, 0), plan=plan)
        return out, lse

    with monkeypatch.context() as patch:
        patch.setattr(ptx, "atomic_inc_acq_rel", interrupted)
        with pytest.raises(RuntimeError, match="interrupted"):
            run()
    assert (to_host(launch.counters(plan, 0))[:launch.pool_words] == 0).all()
    out, lse = run()
    assert rel_error(to_host(out), expected_out) <= TOLERANCE["float16"]
    assert_close_lse(to_host(lse), expected_lse)


@pytest.mark.parametrize("change", [dict(block_n=40), dict(warps=3, block_n=48), dict(stages=1), dict(stages=3),
                                    dict(merge_loads=0), dict(merge_weight_parts=3), dict(blocks_per_sm=0)])
def test_configs_are_checked_when_made(change):
    with pytest.raises(ValueError):
        dataclasses.replace(decode_mma.DEFAULT_CONFIG, **change)
    # what only a pooled kernel with the in-kernel merge needs
    if change in (dict(stages=3), dict(warps=3, block_n=48)):
        dataclasses.replace(decode_mma.DEFAULT_CONFIG, key_pool=False, **change)
    with pytest.raises(ValueError, match="d_pad"):
        decode_mma.layout_for(decode_mma.DEFAULT_CONFIG, 24)
    with pytest.raises(ValueError):
        dataclasses.replace(decode.GPU_CONFIG, rows=0)
    with pytest.raises(ValueError):
        decode_combine.CombineConfig(threads_x=64, split_groups=32)
