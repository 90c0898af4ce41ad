"""How decoding cuts the keys: ``simt.choose_num_splits`` and the tensor-core plans of ``numba_attn.decode.plan``
(host code only, fast everywhere)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from numba_attn.decode import mma as decode_mma
from numba_attn.decode import plan as split_plan
from numba_attn.decode import simt as decode


@settings(max_examples=200)
@given(
    batch=st.integers(1, 64),
    kv_heads=st.integers(1, 64),
    group=st.integers(1, 8),
    seqlen_q=st.integers(1, 16),
    seqlen_k=st.integers(0, 1 << 20),
    sm_count=st.integers(1, 200),
)
def test_choose_num_splits(batch, kv_heads, group, seqlen_q, seqlen_k, sm_count):
    splits = decode.choose_num_splits(batch, kv_heads * group, kv_heads, seqlen_q, seqlen_k, sm_count)
    assert isinstance(splits, int) and 1 <= splits <= decode.MAX_SPLITS
    if splits > 1:
        # every split keeps enough keys to pay for its part of the combine
        assert seqlen_k // splits >= decode.MIN_KEYS_PER_SPLIT
        # and no more splits than needed to fill the GPU
        assert batch * kv_heads * (splits - 1) < decode.TARGET_BLOCKS_PER_SM * sm_count
    if seqlen_k >= decode.MIN_KEYS_PER_SPLIT * decode.MAX_SPLITS:
        # long caches fill the GPU (up to the split cap)
        assert batch * kv_heads * splits >= min(decode.TARGET_BLOCKS_PER_SM * sm_count, batch * kv_heads
                                                * decode.MAX_SPLITS)


def test_choose_num_splits_examples():
    # batch 1, 8 kv heads, 16k cache on 132 SMs: 64 splits of 256 keys (512 blocks)
    assert decode.choose_num_splits(1, 32, 8, 1, 16384, 132) == 64
    # plenty of (batch, kv_head) blocks already: no split, no combine
    assert decode.choose_num_splits(128, 64, 8, 1, 16384, 132) == 1
    # short cache: no split
    assert decode.choose_num_splits(1, 8, 8, 1, 300, 132) == 1


@settings(max_examples=300)
@given(batch=st.integers(1, 64), kv_heads=st.integers(1, 64), rows=st.integers(1, 64),
       seqlen_k=st.integers(1, 1 << 22), sm_count=st.integers(1, 200), kind=st.sampled_from(["default", "wide",
                                                                                              "no pool"]))
def test_plan_splits_cuts_every_key_once(batch, kv_heads, rows, seqlen_k, sm_count, kind):
    """The ranges of ``plan_splits`` as the kernel takes them: abutting from key 0 to the end (every key in exactly
    one range, or in the pool behind the lead ranges), whole tiles but for the last, lead ranges filling at most one
    wave of blocks and no shorter than the tail ranges, a grid the launch accepts."""
    config = {"default": decode_mma.DEFAULT_CONFIG, "wide": decode_mma.WIDE_CONFIG,
              "no pool": dataclasses.replace(decode_mma.DEFAULT_CONFIG, key_pool=False)}[kind]
    plan = split_plan.plan_splits(batch, kv_heads, rows, seqlen_k, sm_count, config)
    starts, ends = plan.ranges(seqlen_k)
    assert 1 <= plan.lead_splits <= plan.num_splits <= 65535
    assert starts[0] == 0 and (starts[1:] == starts[:-1] + np.where(
        np.arange(plan.num_splits - 1) < plan.lead_splits, plan.lead_keys, plan.tail_keys)).all()
    assert plan.lead_keys % config.block_n == 0 and plan.tail_keys % config.block_n == 0
    assert 0 < plan.tail_keys <= plan.lead_keys
    blocks = batch * kv_heads * -(-rows // 16)
    if plan.lead_splits > 1:
        assert blocks * plan.lead_splits <= config.blocks_per_sm * sm_count
    if plan.pooled:  # own ranges from key 0 to the pool; the pool a share of the keys, at least one tile
        assert config.key_pool and plan.num_splits == plan.lead_splits > 1
        assert plan.pool_first == plan.lead_splits * plan.lead_keys == ends[-1] < seqlen_k
        assert plan.lead_keys >= 2 * config.block_n  # every block asks for pool tiles in time
        pool_share = (seqlen_k - plan.pool_first) / seqlen_k
        event(f"pool share {round(pool_share, 1)}")
        assert pool_share <= split_plan.POOL_FRACTION + (plan.lead_splits + 1) * config.block_n / seqlen_k
        assert plan.pool_first + plan.lead_splits * config.block_n >= seqlen_k * (1 - split_plan.POOL_FRACTION)
        return
    assert ends[-1] == seqlen_k and (ends[:-1] <= starts[1:]).all()
    nonempty = starts < ends
    assert nonempty.any() and (ends[nonempty][:-1] == starts[nonempty][1:]).all()
    if plan.lead_splits > 1:
        assert plan.lead_keys >= split_plan.MIN_KEYS_PER_SPLIT
    if plan.num_splits > plan.lead_splits:  # tail ranges: a share of the keys, behind long lead ranges
        assert plan.lead_keys >= split_plan.MIN_LEAD_TILES * config.block_n
        tail_share = (seqlen_k - plan.lead_splits * plan.lead_keys) / seqlen_k
        event(f"tail share {round(tail_share, 1)}")
        assert 0 < tail_share <= split_plan.TAIL_FRACTION + (plan.lead_splits + 1) * config.block_n / seqlen_k


def test_plan_splits_examples():
    # GQA 8 (B8 Hkv4, 8 rows) on 132 SMs: 8 lead ranges per row tile, the last fifth of the keys their pool
    assert split_plan.plan_splits(8, 4, 8, 65536, 132) == split_plan.SplitPlan(8, 102 * 64, 102 * 64, 8, 8 * 102 * 64)
    assert split_plan.plan_splits(8, 4, 8, 16384, 132) == split_plan.SplitPlan(8, 25 * 64, 25 * 64, 8, 8 * 25 * 64)
    # short cache: lead ranges of about MIN_KEYS_PER_SPLIT keys, pool included
    assert split_plan.plan_splits(8, 4, 8, 2048, 132) == split_plan.SplitPlan(4, 6 * 64, 6 * 64, 4, 4 * 6 * 64)
    # one lead range per row tile (multi-head): no pool to share; tail ranges balance the end
    plan = split_plan.plan_splits(8, 32, 1, 16384, 132)
    assert plan.lead_splits == 1 and plan.num_splits > 1 and not plan.pooled
    # without the pool: equal ranges, or lead and tail ranges where the lead ranges are long
    no_pool = dataclasses.replace(decode_mma.DEFAULT_CONFIG, key_pool=False)
    assert split_plan.plan_splits(8, 4, 8, 65536, 132, no_pool) == split_plan.SplitPlan(8, 102 * 64, 7 * 64, 8 + 30)
    assert split_plan.plan_splits(8, 4, 8, 16384, 132, no_pool) == split_plan.uniform_plan(16384, 8, 64)
    assert split_plan.plan_splits(8, 4, 8, 2048, 132, no_pool) == split_plan.uniform_plan(2048, 4, 64)


@pytest.mark.parametrize("max_splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("key_pool", [True, False])
def test_plan_splits_stays_within_max_splits(max_splits, key_pool):
    """At most ``max_splits`` ranges (the device's grid z), every key still in one range or in the pool."""
    config = dataclasses.replace(decode_mma.DEFAULT_CONFIG, key_pool=key_pool)
    for batch, kv_heads, rows, seqlen_k, sm_count in ((8, 4, 8, 65536, 132), (8, 32, 1, 16384, 132),
                                                      (1, 1, 1, 1 << 22, 200)):
        plan = split_plan.plan_splits(batch, kv_heads, rows, seqlen_k, sm_count, config, max_splits)
        assert 1 <= plan.num_splits <= max_splits
        starts, ends = plan.ranges(seqlen_k)
        assert starts[0] == 0 and (ends[-1] == seqlen_k or plan.pool_first == ends[-1])
