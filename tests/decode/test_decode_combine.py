"""``combine_lse`` and the combine kernel (``numba_attn.decode.combine``) against ``reference.combine_lse``."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_attn
import reference
from tests.decode_checks import DTYPES
from tests.kernel_checks import TOLERANCE, assert_close_lse, rel_error, to_host


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
