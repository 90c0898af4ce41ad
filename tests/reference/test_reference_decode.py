"""Properties of split-KV attention and the log-sum-exp combine."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import assert_close, attention_cases, causal_cases_with_unseen_queries, split_counts

from reference import attention, combine_lse, split_boundaries, split_kv_attention


def assert_same_attention(actual, expected, case):
    (out, lse), (expected_out, expected_lse) = actual, expected
    assert_close(out, expected_out, atol=case.out_atol)
    assert_close(lse, expected_lse, atol=case.lse_atol)


@given(attention_cases(), split_counts())
def test_split_then_combine_equals_attention_for_any_number_of_splits(case, num_splits):
    o_parts, lse_parts = split_kv_attention(case.q, case.k, case.v, num_splits, **case.kwargs)
    assert o_parts.shape == (num_splits,) + case.q.shape
    assert lse_parts.shape == (num_splits,) + case.q.shape[:-1]
    expected = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    assert_same_attention(combine_lse(o_parts, lse_parts), expected, case)


@given(attention_cases(), split_counts(), st.data())
def test_split_then_combine_equals_attention_for_any_partition(case, num_splits, data):
    """Uneven ranges (a kernel's lead and tail ranges, empty ones included) merge to the same attention."""
    seqlen_k = case.k.shape[-2]
    cuts = sorted(data.draw(st.lists(st.integers(0, seqlen_k), min_size=num_splits - 1, max_size=num_splits - 1)))
    boundaries = np.array([0] + cuts + [seqlen_k])
    o_parts, lse_parts = split_kv_attention(case.q, case.k, case.v, num_splits, boundaries=boundaries,
                                            **case.kwargs)
    empty = boundaries[1:] == boundaries[:-1]
    assert (o_parts[empty] == 0).all() and np.isneginf(lse_parts[empty]).all()
    expected = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    assert_same_attention(combine_lse(o_parts, lse_parts), expected, case)


@pytest.mark.parametrize("boundaries", [[0, 3], [0, 2, 1, 5], [1, 2, 5], [0, 2, 6], [0.0, 2.0, 5.0]])
def test_bad_boundaries_raise_value_error_naming_them(boundaries):
    q = np.zeros((5, 4))
    with pytest.raises(ValueError, match="boundaries"):
        split_kv_attention(q, q, q, 2, boundaries=boundaries)


@given(attention_cases(), split_counts(), st.data())
def test_combine_does_not_depend_on_the_order_of_the_parts(case, num_splits, data):
    o_parts, lse_parts = split_kv_attention(case.q, case.k, case.v, num_splits, **case.kwargs)
    order = data.draw(st.permutations(range(num_splits)))
    assert_same_attention(combine_lse(o_parts[order], lse_parts[order]),
                          combine_lse(o_parts, lse_parts), case)


@given(attention_cases(), split_counts(), st.data())
def test_a_combined_group_of_parts_acts_as_a_single_part(case, num_splits, data):
    o_parts, lse_parts = split_kv_attention(case.q, case.k, case.v, num_splits, **case.kwargs)
    in_group = np.array(data.draw(st.lists(st.booleans(), min_size=num_splits, max_size=num_splits)))
    # The group may be empty: combining no parts gives the identity (0, -inf).
    group_out, group_lse = combine_lse(o_parts[in_group], lse_parts[in_group])
    nested = combine_lse(np.concatenate([group_out[None], o_parts[~in_group]]),
                         np.concatenate([group_lse[None], lse_parts[~in_group]]))
    assert_same_attention(nested, combine_lse(o_parts, lse_parts), case)


@given(attention_cases(), split_counts())
def test_splits_without_keys_give_zero_and_minus_inf(case, num_splits):
    o_parts, lse_parts = split_kv_attention(case.q, case.k, case.v, num_splits, **case.kwargs)
    boundaries = split_boundaries(case.k.shape[-2], num_splits)
    empty = boundaries[1:] == boundaries[:-1]
    assert (o_parts[empty] == 0).all()
    assert np.isneginf(lse_parts[empty]).all()
    assert not np.isnan(o_parts).any() and not np.isnan(lse_parts).any()


@given(causal_cases_with_unseen_queries(), split_counts())
def test_queries_that_see_no_key_give_zero_and_minus_inf_in_every_part(case, num_splits):
    o_parts, lse_parts = split_kv_attention(case.q, case.k, case.v, num_splits, **case.kwargs)
    unseen = case.q.shape[-2] - case.k.shape[-2]
    assert (o_parts[..., :unseen, :] == 0).all()
    assert np.isneginf(lse_parts[..., :unseen]).all()
    out, lse = combine_lse(o_parts, lse_parts)
    assert (out[..., :unseen, :] == 0).all()
    assert np.isneginf(lse[..., :unseen]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[..., unseen:]).all()


@given(st.integers(0, 60), split_counts(80))
def test_partition_is_that_of_numpy_array_split(seqlen_k, num_splits):
    boundaries = split_boundaries(seqlen_k, num_splits)
    sizes = np.diff(boundaries)
    assert boundaries[0] == 0 and boundaries[-1] == seqlen_k and len(sizes) == num_splits
    assert sizes.max() - sizes.min() <= 1
    assert (np.diff(sizes) <= 0).all()
    expected = [len(part) for part in np.array_split(np.arange(seqlen_k), num_splits)]
    assert sizes.tolist() == expected


@given(attention_cases(unbatched=True), split_counts())
def test_unbatched_inputs_equal_a_batch_of_one_head(case, num_splits):
    o_parts, lse_parts = split_kv_attention(case.q, case.k, case.v, num_splits, **case.kwargs)
    o_4d, lse_4d = split_kv_attention(*case.as_4d(), num_splits, **case.kwargs)
    assert o_parts.shape == (num_splits,) + case.q.shape
    np.testing.assert_array_equal(o_parts, o_4d[:, 0, 0])
    np.testing.assert_array_equal(lse_parts, lse_4d[:, 0, 0])
    out, lse = combine_lse(o_parts, lse_parts)
    out_4d, lse_4d = combine_lse(o_4d, lse_4d)
    np.testing.assert_array_equal(out, out_4d[0, 0])
    np.testing.assert_array_equal(lse, lse_4d[0, 0])


@pytest.mark.parametrize("num_parts", [0, 1, 3])
def test_combining_parts_that_are_all_minus_inf_gives_zero_and_minus_inf(num_parts):
    o_parts = np.zeros((num_parts, 2, 5, 4))
    lse_parts = np.full((num_parts, 2, 5), -np.inf)
    out, lse = combine_lse(o_parts, lse_parts)
    assert out.shape == (2, 5, 4) and lse.shape == (2, 5)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_dtype_argument_casts_every_result():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(3))
    o_parts, lse_parts = split_kv_attention(q, k, v, 4, dtype=np.float32)
    assert o_parts.dtype == lse_parts.dtype == np.float32
    out, lse = combine_lse(o_parts, lse_parts, dtype=np.float32)
    assert out.dtype == lse.dtype == np.float32
    assert combine_lse(o_parts, lse_parts)[0].dtype == np.float64


@pytest.mark.parametrize("num_splits", [0, -2, 1.5, None])
def test_bad_num_splits_raise_value_error_naming_it(num_splits):
    q = np.zeros((4, 8))
    with pytest.raises(ValueError, match="num_splits"):
        split_kv_attention(q, q, q, num_splits)


@pytest.mark.parametrize(
    "name, o_shape, lse_shape",
    [
        ("o_parts", (3,), (3,)),
        ("lse_parts", (3, 2, 5, 4), (3, 2, 4)),
        ("lse_parts", (3, 2, 5, 4), (2, 2, 5)),
    ],
)
def test_bad_combine_shapes_raise_value_error_naming_the_argument(name, o_shape, lse_shape):
    with pytest.raises(ValueError, match=name):
        combine_lse(np.zeros(o_shape), np.zeros(lse_shape))


def test_split_kv_attention_validates_like_attention():
    with pytest.raises(ValueError, match=r"\bk\b"):
        split_kv_attention(np.zeros((1, 4, 5, 8)), np.zeros((1, 3, 5, 8)), np.zeros((1, 3, 5, 8)), 2)
