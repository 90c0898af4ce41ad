"""Split-KV decoding (``flash_decode``) and the LSE merge (``combine_lse``) against the float64 reference.

The unmarked tests run everywhere: under the Numba CUDA simulator (tiny shapes, the tiny simulator configuration of
``numba_attn.decode.simt``) and on a GPU when one is present. Tests marked ``gpu`` use realistic sizes and CuPy.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import numba_attn
import reference
from numba_attn.decode import launch as decode_launch
from numba_attn.decode import plan as split_plan
from numba_attn.decode import pool as decode_pool
from numba_attn.decode import simt as decode
from numba_attn.runtime.device import compute_capability, multiprocessor_count
from tests.kernel_checks import TOLERANCE, assert_close_lse, rel_error, to_host

DTYPES = ("float32", "float16")


def _qkv(rng, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype):
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    return q, k, v


def _check_attention(out, lse, q, k, v, causal, sm_scale=None):
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
    out = to_host(out)
    assert out.dtype == q.dtype
    assert not np.isnan(out).any(), "out has NaN"
    err = rel_error(out, ref_out)
    assert err <= TOLERANCE[str(q.dtype)], f"relative error {err:.3g}"
    assert_close_lse(lse, ref_lse)
    # rows that see no key: exactly 0 and -inf
    empty = np.isneginf(ref_lse)
    assert (out[empty] == 0).all()


def _dev(x):
    """A kernel-level argument: NumPy under the simulator, a Numba device array on a GPU."""
    if numba_attn.SIMULATOR:
        return x
    from numba import cuda

    return cuda.to_device(x)


# -- flash_decode vs reference.attention (simulator-sized) -----------------------------------------------------------
@st.composite
def decode_cases(draw, max_seqlen_q=4):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4]))
    seqlen_q = draw(st.integers(1, max_seqlen_q))
    # the simulator runs one Python thread per GPU thread: keep the number of launched blocks small
    assume(batch * kv_heads * group * seqlen_q <= 16)
    # short caches often: Lq > Lk (causal rows that see nothing) and more splits than keys
    seqlen_k = draw(st.one_of(st.integers(1, 5), st.integers(1, 40)))
    max_splits = max(1, 12 // (batch * kv_heads))
    num_splits = draw(st.integers(1, min(max_splits, seqlen_k + 3)))
    return dict(
        batch=batch,
        heads=kv_heads * group,
        kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        # every column layout of the simulator config (G = 1..8 lanes per key, padded and unpadded), few compiled
        # variants on a GPU
        head_dim=draw(st.sampled_from([1, 2, 3, 5, 8, 12, 17])),
        sm_scale=draw(st.sampled_from([None, 0.07, 1.0])),
        causal=draw(st.booleans()),
        num_splits=num_splits,
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


@given(case=decode_cases())
def test_flash_decode_matches_reference(case):
    # (pytest --hypothesis-show-statistics shows how often the interesting corners come up)
    event(f"{case['dtype']}, causal={case['causal']}, group={case['heads'] // case['kv_heads']}")
    if case["causal"] and case["seqlen_q"] > case["seqlen_k"]:
        event("causal rows that see no key")
    if case["num_splits"] > case["seqlen_k"]:
        event("more splits than keys")
    rng = np.random.default_rng(case["seed"])
    q, k, v = _qkv(rng, case["batch"], case["heads"], case["kv_heads"], case["seqlen_q"], case["seqlen_k"],
                   case["head_dim"], case["dtype"])
    out, lse = numba_attn.flash_decode(q, k, v, causal=case["causal"], num_splits=case["num_splits"],
                                       sm_scale=case["sm_scale"], return_lse=True)
    _check_attention(out, lse, q, k, v, case["causal"], sm_scale=case["sm_scale"])


@pytest.mark.parametrize("causal", [False, True])
def test_flash_decode_more_rows_than_a_pass(causal):
    # 2 q heads per kv head x 9 queries = 18 rows: several passes of the simulator's 2 rows (8 on a GPU: 3 passes);
    # causal with Lq > Lk leaves the first rows without any key
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 2, 1, 9, 7 if causal else 11, 5, "float32")
    out, lse = numba_attn.flash_decode(q, k, v, causal=causal, num_splits=2, return_lse=True)
    _check_attention(out, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_decode_strided_views(dtype):
    rng = np.random.default_rng(2)
    big_q = rng.standard_normal((1, 3, 4, 2 * 6)).astype(dtype)
    big_kv = rng.standard_normal((2, 19, 2, 6)).astype(dtype)  # (k/v, seqlen, heads, d): heads not outermost
    q = big_q[:, 1:3, 1:, ::2]  # (1, 2, 3, 6), every stride non-trivial
    k = big_kv[0, :, 1:].transpose(1, 0, 2)[None]  # (1, 1, 19, 6)
    v = big_kv[1, ::-1, :1].transpose(1, 0, 2)[None]  # negative seqlen stride
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    out, lse = numba_attn.flash_decode(q, k, v, causal=True, num_splits=3, return_lse=True, sm_scale=0.3)
    _check_attention(out, lse, q, k, v, True, sm_scale=0.3)


def test_flash_decode_more_splits_than_keys_and_empty_rows():
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 2, 1, 4, 2, 3, "float32")
    out, lse = numba_attn.flash_decode(q, k, v, causal=True, num_splits=7, return_lse=True)
    _check_attention(out, lse, q, k, v, True)
    out = to_host(out)
    lse = to_host(lse)
    # Lq = 4 > Lk = 2: queries 0 and 1 see no key
    assert (out[:, :, :2] == 0).all() and np.isneginf(lse[:, :, :2]).all()
    assert np.isfinite(lse[:, :, 2:]).all()


def test_flash_decode_no_keys_gives_zero():
    q = np.ones((1, 2, 3, 4), np.float32)
    k = np.ones((1, 1, 0, 4), np.float32)
    out, lse = numba_attn.flash_decode(q, k, k, num_splits=3, return_lse=True)
    assert (to_host(out) == 0).all() and np.isneginf(to_host(lse)).all()


def test_flash_decode_auto_splits_and_2d_inputs():
    rng = np.random.default_rng(4)
    q, k, v = (x[0, 0] for x in _qkv(rng, 1, 1, 1, 2, 23, 7, "float16"))
    out = numba_attn.flash_decode(q, k, v, causal=True)
    assert out.shape == (2, 7) and out.dtype == np.float16
    ref = reference.attention(q, k, v, causal=True)
    assert rel_error(out, ref) <= TOLERANCE["float16"]


def test_split_kernel_parts_match_reference_split_kv():
    # the split kernel alone, with empty trailing splits (num_splits > seqlen_k is not clamped at this level)
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 1, 2, 1, 2, 3, 5, "float32")
    num_splits = 5
    o_parts = _dev(np.full((num_splits,) + q.shape, np.nan, np.float32))
    lse_parts = _dev(np.full((num_splits,) + q.shape[:-1], np.nan, np.float32))
    sm_scale = 1 / math.sqrt(5)
    decode.launch_split(_dev(q), _dev(k), _dev(v), o_parts, lse_parts, True, sm_scale, True, 0)
    ref_o, ref_lse = reference.split_kv_attention(q, k, v, num_splits, causal=True)
    assert rel_error(to_host(o_parts), ref_o) <= TOLERANCE["float32"]
    assert_close_lse(lse_parts, ref_lse)
    assert (to_host(o_parts)[3:] == 0).all()


def test_flash_decode_propagates_nan():
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, 1, 2, 1, 2, 9, 4, "float32")
    q[0, 1, 0, 2] = np.nan  # one query row
    out, lse = (to_host(x) for x in numba_attn.flash_decode(q, k, v, num_splits=2, return_lse=True))
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(out[0, 1, 0]).all() and np.isfinite(out[0, 0]).all()


# -- choose_num_splits ------------------------------------------------------------------------------------------------
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


# -- combine_lse vs reference.combine_lse -----------------------------------------------------------------------------
@st.composite
def combine_cases(draw):
    num_splits = draw(st.integers(1, 5))
    rows = draw(st.sampled_from([(1, 1, 1), (1, 2, 3), (2, 1, 2), (2, 2, 2)]))
    head_dim = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    dtype = draw(st.sampled_from(DTYPES))
    o_parts = rng.standard_normal((num_splits,) + rows + (head_dim,)).astype(dtype)
    lse_parts = (rng.standard_normal((num_splits,) + rows) * draw(st.sampled_from([1.0, 30.0]))).astype(np.float32)
    empty_prob = draw(st.sampled_from([0.0, 0.3, 0.7]))
    empty = rng.random(lse_parts.shape) < empty_prob
    lse_parts[empty] = -np.inf
    o_parts[empty] = 0  # what the split kernel writes for an empty part
    if draw(st.booleans()):
        lse_parts[:, 0, 0, 0] = -np.inf  # one row with every part empty
        o_parts[:, 0, 0, 0] = 0
    return o_parts, lse_parts


@settings(max_examples=30)
@given(case=combine_cases())
def test_combine_lse_matches_reference(case):
    o_parts, lse_parts = case
    out, lse = numba_attn.combine_lse(o_parts, lse_parts)
    ref_out, ref_lse = reference.combine_lse(o_parts, lse_parts)
    out, lse = to_host(out), to_host(lse)
    assert out.dtype == o_parts.dtype and lse.dtype == np.float32
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_error(out, ref_out) <= TOLERANCE[str(o_parts.dtype)]
    assert_close_lse(lse, ref_lse, tol=1e-5)
    all_empty = np.isneginf(lse_parts).all(axis=0)
    assert (out[all_empty] == 0).all() and np.isneginf(lse[all_empty]).all()


@settings(max_examples=15)
@given(case=combine_cases(), data=st.data())
def test_combine_lse_is_order_independent(case, data):
    o_parts, lse_parts = case
    perm = data.draw(st.permutations(range(o_parts.shape[0])))
    out, lse = (to_host(x) for x in numba_attn.combine_lse(o_parts, lse_parts))
    out_p, lse_p = (to_host(x) for x in numba_attn.combine_lse(o_parts[perm], lse_parts[perm]))
    # a different summation order may round differently, nothing more
    np.testing.assert_allclose(out_p.astype(np.float64), out, rtol=2e-3 if o_parts.dtype == np.float16 else 1e-5,
                               atol=1e-3 if o_parts.dtype == np.float16 else 1e-6)
    np.testing.assert_allclose(lse_p, lse, rtol=1e-6, atol=1e-6)


def test_combine_lse_3d_and_all_empty():
    rng = np.random.default_rng(6)
    o_parts = rng.standard_normal((3, 4, 5)).astype(np.float32)
    lse_parts = rng.standard_normal((3, 4)).astype(np.float32)
    lse_parts[:, 1] = -np.inf
    o_parts[:, 1] = 0
    lse_parts[0, 2] = -np.inf
    out, lse = numba_attn.combine_lse(o_parts, lse_parts)
    ref_out, ref_lse = reference.combine_lse(o_parts, lse_parts)
    assert to_host(out).shape == (4, 5) and to_host(lse).shape == (4,)
    assert rel_error(out, ref_out) <= TOLERANCE["float32"]
    assert_close_lse(lse, ref_lse)
    assert (to_host(out)[1] == 0).all() and np.isneginf(to_host(lse)[1])


def test_combine_lse_single_part_is_identity():
    rng = np.random.default_rng(7)
    o_parts = rng.standard_normal((1, 1, 2, 3, 4)).astype(np.float32)
    lse_parts = rng.standard_normal((1, 1, 2, 3)).astype(np.float32)
    out, lse = numba_attn.combine_lse(o_parts, lse_parts)
    np.testing.assert_allclose(to_host(out), o_parts[0], rtol=1e-6)
    np.testing.assert_allclose(to_host(lse), lse_parts[0], rtol=1e-6)


def test_combine_lse_propagates_nan():
    o_parts = np.ones((2, 3, 2), np.float32)
    lse_parts = np.zeros((2, 3), np.float32)
    lse_parts[0, 0] = np.nan  # NaN lse
    lse_parts[:, 1] = -np.inf
    lse_parts[1, 1] = np.nan  # NaN next to an empty part
    o_parts[1, 2, 0] = np.nan  # NaN in a value
    out, lse = (to_host(x) for x in numba_attn.combine_lse(o_parts, lse_parts))
    ref_out, ref_lse = reference.combine_lse(o_parts, lse_parts)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(out[:2]).all() and np.isnan(lse[:2]).all() and np.isnan(out[2, 0])
    assert np.isclose(out[2, 1], 1.0, rtol=1e-6) and np.isclose(lse[2], math.log(2), rtol=1e-6)


# -- bad input --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [0, -1, 1.5, True, "2"])
def test_flash_decode_rejects_bad_num_splits(num_splits):
    q = np.zeros((1, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="num_splits"):
        numba_attn.flash_decode(q, q, q, num_splits=num_splits)


def test_combine_lse_rejects_bad_input():
    o_parts = np.zeros((2, 1, 1, 3, 4), np.float32)
    lse_parts = np.zeros((2, 1, 1, 3), np.float32)
    with pytest.raises(ValueError, match="lse_parts"):
        numba_attn.combine_lse(o_parts, lse_parts[:, :, :, :2])
    with pytest.raises(ValueError, match="lse_parts"):
        numba_attn.combine_lse(o_parts, lse_parts[None])
    with pytest.raises(TypeError, match="lse_parts"):
        numba_attn.combine_lse(o_parts, lse_parts.astype(np.float16))
    with pytest.raises(TypeError, match="o_parts"):
        numba_attn.combine_lse(o_parts.astype(np.float64), lse_parts)
    with pytest.raises(ValueError, match="o_parts"):
        numba_attn.combine_lse(o_parts[:, 0], lse_parts[:, 0])  # rank 4
    with pytest.raises(ValueError, match="o_parts|num_splits"):
        numba_attn.combine_lse(o_parts[:0], lse_parts[:0])


# -- the tensor-core split kernel (decode_mma) for GQA groups -------------------------------------------
def test_grouped_heads_view():
    from numba_attn.runtime.views import grouped_heads

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
    from numba_attn.decode import dispatch
    from numba_attn.runtime.attention_args import AttentionArgs
    from numba_attn.runtime.shapes import attention_shape

    if not numba_attn.SIMULATOR and dispatch.compute_capability() < (8, 0):
        pytest.skip("no tensor-core kernel below sm_80")

    def decides(dtype, heads, kv_heads, seqlen_q, causal, layout="contig"):
        q, k, v = _qkv(np.random.default_rng(0), 1, heads, kv_heads, seqlen_q, 40, 16, dtype)
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
    shape = attention_shape(*_qkv(np.random.default_rng(0), 1, 8, 2, 1, 40, 16, "float16"))
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
    q, k, v = _qkv(rng, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim, "float16")
    out, lse = numba_attn.flash_decode(_dev(q), _dev(k), _dev(v), causal=causal, num_splits=num_splits,
                                       return_lse=True)
    _check_attention(to_host(out), to_host(lse), q, k, v, causal)


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
    from numba_attn import api
    from numba_attn.decode import mma as decode_mma
    from numba_attn.core import ptx

    if not numba_attn.SIMULATOR and compute_capability() < decode_mma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    rng = np.random.default_rng(seqlen_k + rows)
    q, k, v = _qkv(rng, 1, kv_heads, kv_heads, rows, seqlen_k, head_dim, "float32")
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
    o_parts = _dev(np.full((num_splits,) + q.shape, np.nan, np.float32))
    lse_parts = _dev(np.full((num_splits,) + q.shape[:3], np.nan, np.float32))
    launch.launch_split(_dev(q), _dev(k), _dev(v), o_parts, lse_parts, 0, plan if tail else None)
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
    from numba_attn import api
    from numba_attn.decode import mma as decode_mma

    if not numba_attn.SIMULATOR and compute_capability() < decode_mma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    block_n = decode_mma.config_for(head_dim).block_n
    pool_first = lead_splits * lead_tiles * block_n
    seqlen_k = pool_first + int(pool_tiles * block_n)
    rng = np.random.default_rng(seqlen_k + rows)
    q, k, v = (x.astype(np.float16) for x in _qkv(rng, 1, kv_heads, kv_heads, rows, seqlen_k, head_dim, "float32"))
    launch = decode_launch.DecodeLaunch(q, q, True, 0.3, None, 1, dtype="float16",
                                     vector_loads=decode_launch.vector_loads_ok(q, k, v))
    plan = split_plan.SplitPlan(lead_splits, lead_tiles * block_n, lead_tiles * block_n, lead_splits, pool_first)
    counters = launch.counters(plan, 0)
    expected = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), sm_scale=0.3, return_lse=True)
    for _ in range(2):
        o_parts = _dev(np.full((lead_splits,) + q.shape, np.nan, np.float32))
        lse_parts = _dev(np.full((lead_splits,) + q.shape[:3], np.nan, np.float32))
        launch.launch_split(_dev(q), _dev(k), _dev(v), o_parts, lse_parts, 0, plan, counters)
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
    import dataclasses

    from numba_attn import api
    from numba_attn.decode import mma as decode_mma
    from numba_attn.core import ptx

    if not numba_attn.SIMULATOR and compute_capability() < decode_mma.MIN_COMPUTE_CAPABILITY:
        pytest.skip("no tensor-core kernel below sm_80")
    config = dataclasses.replace(decode_mma.config_for(head_dim), merge_weight_parts=weight_parts)
    block_n = config.block_n
    pool_first = lead_splits * 2 * block_n
    seqlen_k = pool_first + int(pool_tiles * block_n)
    rng = np.random.default_rng(seqlen_k + rows)
    q, k, v = _qkv(rng, 1, kv_heads, kv_heads, rows, seqlen_k, head_dim, "float32")
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
        out = _dev(np.full(q.shape, poison, q.dtype))
        lse = _dev(np.full(q.shape[:3], np.nan, np.float32))
        launch(_dev(q), _dev(k), _dev(v), out, lse, 0, lambda shape: decode._scratch(shape, 0), plan=plan)
        got = _bf16_values(out) if dtype == "bfloat16" else to_host(out).astype(np.float64)
        assert not np.isnan(got).any()
        assert rel_error(got, expected_out) <= TOLERANCE[dtype]
        if write_lse:
            assert_close_lse(to_host(lse), expected_lse)
        else:
            assert np.isnan(to_host(lse)).all()
        assert (to_host(launch.counters(plan, 0))[:launch.pool_words] == 0).all()


@settings(max_examples=300)
@given(batch=st.integers(1, 64), kv_heads=st.integers(1, 64), rows=st.integers(1, 64),
       seqlen_k=st.integers(1, 1 << 22), sm_count=st.integers(1, 200), kind=st.sampled_from(["default", "wide",
                                                                                              "no pool"]))
def test_plan_splits_cuts_every_key_once(batch, kv_heads, rows, seqlen_k, sm_count, kind):
    """The ranges of ``plan_splits`` as the kernel takes them: abutting from key 0 to the end (every key in exactly
    one range, or in the pool behind the lead ranges), whole tiles but for the last, lead ranges filling at most one
    wave of blocks and no shorter than the tail ranges, a grid the launch accepts."""
    import dataclasses

    from numba_attn.decode import mma as decode_mma

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
    import dataclasses

    from numba_attn.decode import mma as dm

    # GQA 8 (B8 Hkv4, 8 rows) on 132 SMs: 8 lead ranges per row tile, the last fifth of the keys their pool
    assert split_plan.plan_splits(8, 4, 8, 65536, 132) == split_plan.SplitPlan(8, 102 * 64, 102 * 64, 8, 8 * 102 * 64)
    assert split_plan.plan_splits(8, 4, 8, 16384, 132) == split_plan.SplitPlan(8, 25 * 64, 25 * 64, 8, 8 * 25 * 64)
    # short cache: lead ranges of about MIN_KEYS_PER_SPLIT keys, pool included
    assert split_plan.plan_splits(8, 4, 8, 2048, 132) == split_plan.SplitPlan(4, 6 * 64, 6 * 64, 4, 4 * 6 * 64)
    # one lead range per row tile (multi-head): no pool to share; tail ranges balance the end
    plan = split_plan.plan_splits(8, 32, 1, 16384, 132)
    assert plan.lead_splits == 1 and plan.num_splits > 1 and not plan.pooled
    # without the pool: equal ranges, or lead and tail ranges where the lead ranges are long
    no_pool = dataclasses.replace(dm.DEFAULT_CONFIG, key_pool=False)
    assert split_plan.plan_splits(8, 4, 8, 65536, 132, no_pool) == split_plan.SplitPlan(8, 102 * 64, 7 * 64, 8 + 30)
    assert split_plan.plan_splits(8, 4, 8, 16384, 132, no_pool) == split_plan.uniform_plan(16384, 8, 64)
    assert split_plan.plan_splits(8, 4, 8, 2048, 132, no_pool) == split_plan.uniform_plan(2048, 4, 64)


# -- bfloat16 (uint16 bit views, the way torch's bfloat16 travels) -------------------------------------------------
def _bf16_inputs(rng, *shape_args):
    """bfloat16 bit views of q, k, v and their exact values (float64) for the reference."""
    from numba_attn.core import ptx

    arrays = _qkv(rng, *shape_args, "float32")
    bits = [ptx.float32_to_bf16_bits(x) for x in arrays]
    return bits, [ptx.bf16_bits_to_float32(x).astype(np.float64) for x in bits]


def _bf16_values(bits):
    from numba_attn.core import ptx

    return ptx.bf16_bits_to_float32(to_host(bits)).astype(np.float64)


BF16_NAN = 0x7FC0  # poison: unwritten output elements show as NaN


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_launch_bfloat16_bit_views(num_splits, causal):
    """The SIMT split kernel (and the combine for several splits) on bfloat16 bits: inputs converted on load, the
    output rounded to bfloat16 on store, every element written."""
    rng = np.random.default_rng(20 + num_splits)
    (q, k, v), values = _bf16_inputs(rng, 1, 4, 2, 2, 19, 6)
    out = _dev(np.full(q.shape, BF16_NAN, np.uint16))
    lse = _dev(np.full(q.shape[:3], np.nan, np.float32))
    decode.launch(_dev(q), _dev(k), _dev(v), out, lse, True, 0.4, causal, num_splits, 0, dtype="bfloat16")
    ref_out, ref_lse = reference.attention(*values, causal=causal, sm_scale=0.4, return_lse=True)
    got = _bf16_values(out)
    assert not np.isnan(got).any()
    assert rel_error(got, ref_out) <= TOLERANCE["bfloat16"]
    assert_close_lse(lse, ref_lse)


def test_decode_tensor_core_path_bfloat16_bit_views():
    """The GQA tensor-core split kernel and the combine on bfloat16 bits (several splits: the combine writes)."""
    from numba_attn.decode import dispatch
    from numba_attn.runtime.attention_args import AttentionArgs
    from numba_attn.runtime.shapes import attention_shape
    from numba_attn.decode import mma as decode_mma

    if not numba_attn.SIMULATOR and dispatch.compute_capability() < (8, 0):
        pytest.skip("no tensor-core kernel below sm_80")
    rng = np.random.default_rng(30)
    (q, k, v), values = _bf16_inputs(rng, 1, 4, 1, 1, 45, 16)
    out = _dev(np.full(q.shape, BF16_NAN, np.uint16))
    lse = _dev(np.full(q.shape[:3], np.nan, np.float32))
    args = (_dev(q), _dev(k), _dev(v), out, lse, True)
    grouped = dispatch.on_tensor_cores("bfloat16", attention_shape(q, k, v), AttentionArgs(*args, 1.0, True))
    assert grouped is not None
    q_rows, out_rows, lse_rows = grouped
    decode_launch.launch_decode(q_rows, args[1], args[2], out_rows, lse_rows, True, 0.25, 2, 0,
                            lambda shape: decode._scratch(shape, 0), 1, dtype="bfloat16")
    ref_out, ref_lse = reference.attention(*values, causal=True, sm_scale=0.25, return_lse=True)
    got = _bf16_values(out)
    assert not np.isnan(got).any()
    assert rel_error(got, ref_out) <= TOLERANCE["bfloat16"]
    assert_close_lse(lse, ref_lse)


# -- GPU, realistic sizes ---------------------------------------------------------------------------------------------
GPU_CASES = [
    # batch, heads, kv_heads, head_dim, seqlen_k, seqlen_q, dtype, causal, num_splits
    (2, 8, 2, 128, 16384, 1, "float16", False, None),
    (2, 8, 2, 128, 16384, 4, "float16", True, None),
    (2, 8, 8, 64, 4097, 1, "float32", False, None),
    (2, 8, 8, 64, 4097, 4, "float32", True, 7),
    (2, 8, 2, 59, 4097, 4, "float16", True, 16),
    (2, 8, 2, 59, 4097, 1, "float32", False, 1),
    (1, 32, 8, 128, 16384, 1, "float16", False, None),
    (1, 16, 2, 256, 4097, 2, "float16", True, None),
    (2, 4, 4, 1, 1000, 3, "float32", True, 5),
    # the tensor-core split kernel: GQA 8 with odd lengths, many / few splits, two passes at 256, element copies at 59
    (2, 32, 4, 128, 65537, 1, "float16", True, None),
    (2, 8, 8, 128, 16385, 1, "float16", True, None),  # multi-head: the tensor-core split kernel as well
    (1, 8, 8, 64, 3001, 2, "float16", False, 5),
    (1, 16, 2, 128, 3001, 3, "float16", False, 64),
    (2, 16, 4, 256, 5000, 1, "float16", False, None),
    (2, 16, 4, 59, 5000, 1, "float16", True, 3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,seqlen_k,seqlen_q,dtype,causal,num_splits", GPU_CASES)
def test_gpu_flash_decode(batch, heads, kv_heads, head_dim, seqlen_k, seqlen_q, dtype, causal, num_splits):
    import cupy

    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype)
    out, lse = numba_attn.flash_decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal,
                                       num_splits=num_splits, return_lse=True)
    assert isinstance(out, cupy.ndarray)
    _check_attention(out.get(), lse.get(), q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 9])
def test_gpu_launch_writes_poisoned_output_strided(dtype, num_splits):
    """Kernel level: NaN-filled out and lse are fully overwritten, inputs are strided CuPy views."""
    import cupy
    from numba import cuda

    rng = np.random.default_rng(11)
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = 2, 8, 2, 3, 5000, 96
    big_q = cupy.asarray(rng.standard_normal((batch, seqlen_q, heads, head_dim + 8)).astype(dtype))
    big_kv = cupy.asarray(rng.standard_normal((2, batch, seqlen_k, kv_heads, head_dim)).astype(dtype))
    q = big_q[..., :head_dim].transpose(0, 2, 1, 3)
    k = big_kv[0].transpose(0, 2, 1, 3)
    v = big_kv[1].transpose(0, 2, 1, 3)
    out = cupy.full((batch, heads, seqlen_q, head_dim), np.nan, dtype=dtype)
    lse = cupy.full((batch, heads, seqlen_q), np.nan, dtype=np.float32)
    sm_scale = 0.11
    decode.launch(
        *(cuda.as_cuda_array(x) for x in (q, k, v, out, lse)), True, sm_scale, True, num_splits,
        cuda.default_stream(),
    )
    cuda.default_stream().synchronize()
    _check_attention(out.get(), lse.get(), q.get(), k.get(), v.get(), True, sm_scale=sm_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,seqlen_k,seqlen_q,causal,num_splits", [
    (2, 8, 8, 128, 16384, 1, False, None),  # MHA: the tensor-core split kernel and the combine
    (1, 4, 4, 64, 3001, 3, True, 1),  # one split: the split kernel writes bfloat16 itself
    (2, 32, 4, 128, 16385, 1, True, None),  # GQA 8: the tensor-core split kernel
    (1, 16, 2, 59, 5000, 1, False, 7),  # GQA, element copies (head dim 59)
])
def test_gpu_flash_decode_bfloat16_torch(batch, heads, kv_heads, head_dim, seqlen_k, seqlen_q, causal, num_splits):
    import torch

    rng = np.random.default_rng(13)
    (q, k, v), values = _bf16_inputs(rng, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim)
    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) for x in (q, k, v))
    out, lse = numba_attn.flash_decode(tq, tk, tv, causal=causal, num_splits=num_splits, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == tq.shape
    ref_out, ref_lse = reference.attention(*values, causal=causal, return_lse=True)
    assert rel_error(out.float().cpu().numpy(), ref_out) <= TOLERANCE["bfloat16"]
    assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
def test_gpu_split_parts_and_many_rows():
    """Parts equal reference.split_kv_attention (empty splits included); seqlen_q = 100 loops over row passes."""
    import cupy
    from numba import cuda

    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, 1, 8, 2, 100, 300, 64, "float32")
    num_splits = 3
    o_parts = cupy.full((num_splits,) + q.shape, np.nan, np.float32)
    lse_parts = cupy.full((num_splits,) + q.shape[:-1], np.nan, np.float32)
    decode.launch_split(
        *(cuda.as_cuda_array(cupy.asarray(x)) for x in (q, k, v)), cuda.as_cuda_array(o_parts),
        cuda.as_cuda_array(lse_parts), True, 0.125, True, cuda.default_stream(),
    )
    cuda.default_stream().synchronize()
    ref_o, ref_lse = reference.split_kv_attention(q, k, v, num_splits, causal=True, sm_scale=0.125)
    assert rel_error(o_parts.get(), ref_o) <= TOLERANCE["float32"]
    assert_close_lse(lse_parts.get(), ref_lse)
    out, lse = numba_attn.flash_decode(*(cupy.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
    _check_attention(out.get(), lse.get(), q, k, v, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_parts, head_dim", [(16, 128), (3, 59), (77, 128)])
def test_gpu_combine_lse(dtype, num_parts, head_dim):
    """Fewer parts than groups of the block, and more than a warp's lanes (several parts per lane in the lse
    reduction, several per group in the sums); a head dim no group width divides."""
    import cupy

    rng = np.random.default_rng(13 + num_parts)
    o_parts = rng.standard_normal((num_parts, 2, 8, 4, head_dim)).astype(dtype)
    lse_parts = (rng.standard_normal((num_parts, 2, 8, 4)) * 10).astype(np.float32)
    lse_parts[rng.random(lse_parts.shape) < 0.3] = -np.inf
    lse_parts[:, 1, 3, 2] = -np.inf
    out, lse = numba_attn.combine_lse(cupy.asarray(o_parts), cupy.asarray(lse_parts))
    ref_out, ref_lse = reference.combine_lse(o_parts, lse_parts)
    assert rel_error(out.get(), ref_out) <= TOLERANCE[dtype]
    assert_close_lse(lse.get(), ref_lse, tol=1e-5)
    assert (out.get()[1, 3, 2] == 0).all()


@pytest.mark.gpu
def test_gpu_flash_decode_on_non_default_stream():
    """Inputs are produced on a non-blocking stream behind a long queue of work; the result must be ordered after it
    by running on that stream, and is read after synchronising that stream only."""
    import cupy

    rng = np.random.default_rng(14)
    q, k, v = _qkv(rng, 2, 8, 2, 4, 16384, 128, "float16")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        busy = cupy.ones((2048, 2048), np.float32)
        for _ in range(20):
            busy = busy @ busy * (1.0 / 2048)  # keeps s busy for a while before the inputs exist
        zero = (busy[0, 0] - 1.0).astype(np.float16)  # 0, but only once the queue has drained
        q_d, k_d, v_d = (cupy.asarray(x) + zero for x in (q, k, v))
        out, lse = numba_attn.flash_decode(q_d, k_d, v_d, causal=True, num_splits=16, return_lse=True)
    s.synchronize()
    _check_attention(out.get(), lse.get(), q, k, v, True)


# -- repeated calls served by decode plans (numba_attn.decode.cached) ---------------------------------------------
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
    from numba_attn.decode import cached as _decode_plan

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
    from numba_attn.decode import cached as _decode_plan

    _decode_plan.clear()
    rng = np.random.default_rng(41)
    heads, seqlen_q, head_dim = shape
    (q, k, v), values = _bf16_inputs(rng, 1, heads, heads // 8 if heads >= 8 else 1, seqlen_q, 3000, head_dim)
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
    q2, k2, v2 = (x[0, 0].astype(np.float16) for x in _qkv(rng, 1, 1, 1, 1, 2500, 64, "float32"))
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
    q, k, v = _qkv(rng, 2, 32, 4, 1, 6000, 128, "float16")
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
    q2, k2, v2 = _qkv(rng, 2, 32, 4, 1, 6000, 128, "float16")
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
        q3, k3, v3 = _qkv(rng, 2, 32, 4, 1, 6000, 128, "float16")
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

    from numba_attn.decode import mma as decode_mma

    pool = decode_pool.PoolCounters()
    monkeypatch.setattr(decode_pool, "POOL_COUNTERS", pool)
    rng = np.random.default_rng(44)
    shape = (2, 32, 4, 1, 6000, 128)
    assert split_plan.plan_splits(2, 4, 8, 6000, multiprocessor_count()).pooled
    tensors = tuple(torch.from_numpy(x).cuda() for x in _qkv(rng, *shape, "float16"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        numba_attn.flash_decode(*tensors)
    torch.cuda.synchronize()
    counters = pool._streams[(torch.cuda.current_device(), stream.cuda_stream, 0)]
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
        data = _qkv(rng, *shape, "float16")
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
    cases = [_qkv(rng, 2, 32, 4, 1, 9000 + 500 * n, 128, "float16") for n in range(3)]
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
