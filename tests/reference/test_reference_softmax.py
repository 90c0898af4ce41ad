"""Properties of the softmax references: naive, safe, online and the (m, l) state merge."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import assert_close, block_sizes, logit_arrays, partitions

from reference import (
    merge_softmax_states,
    naive_softmax,
    online_softmax,
    safe_softmax,
    softmax_state,
)

# Probabilities below ~1e-308 are subnormal and keep only a few significant
# bits, so two correct computations can differ there by a large *relative*
# amount; an absolute slack of 1e-300 ignores exactly those.
SUBNORMAL_ATOL = 1e-300


@st.composite
def rows_and_partition(draw):
    x = draw(logit_arrays())
    return x, draw(partitions(x.shape[-1]))


@given(rows_and_partition())
def test_online_softmax_over_any_partition_equals_safe_softmax(case):
    x, sizes = case
    assert_close(online_softmax(x, sizes), safe_softmax(x), atol=SUBNORMAL_ATOL)


@given(logit_arrays(), block_sizes())
def test_online_softmax_with_an_integer_block_size_equals_safe_softmax(x, block_size):
    assert_close(online_softmax(x, block_size), safe_softmax(x), atol=SUBNORMAL_ATOL)


@st.composite
def state_triples(draw):
    """Three blocks of logits for the same rows; any of them may be empty or entirely -inf."""
    rows = draw(st.integers(1, 3))
    blocks = []
    for _ in range(3):
        block = draw(logit_arrays(shape=(rows, draw(st.integers(0, 12)))))
        if draw(st.sampled_from(["values", "values", "fully masked"])) == "fully masked":
            block = np.full_like(block, -np.inf)
        blocks.append(block)
    return blocks


@given(state_triples())
def test_merging_states_equals_the_state_of_the_concatenation(blocks):
    a, b, _ = blocks
    m, l = merge_softmax_states(softmax_state(a), softmax_state(b))
    m_whole, l_whole = softmax_state(np.concatenate([a, b], axis=-1))
    np.testing.assert_array_equal(m, m_whole)
    assert_close(l, l_whole)


@given(state_triples())
def test_merging_states_is_associative(blocks):
    a, b, c = (softmax_state(block) for block in blocks)
    m_left, l_left = merge_softmax_states(merge_softmax_states(a, b), c)
    m_right, l_right = merge_softmax_states(a, merge_softmax_states(b, c))
    # max is exactly associative; the rescaled sums only up to rounding.
    np.testing.assert_array_equal(m_left, m_right)
    assert_close(l_left, l_right)


@given(state_triples())
def test_merging_states_is_commutative_exactly(blocks):
    a, b, _ = (softmax_state(block) for block in blocks)
    m_ab, l_ab = merge_softmax_states(a, b)
    m_ba, l_ba = merge_softmax_states(b, a)
    # Floating-point max and + are commutative, so this is exact.
    np.testing.assert_array_equal(m_ab, m_ba)
    np.testing.assert_array_equal(l_ab, l_ba)


@given(state_triples())
def test_empty_state_is_the_identity_of_the_merge(blocks):
    state = softmax_state(blocks[0])
    empty = (np.full_like(state[0], -np.inf), np.zeros_like(state[1]))
    for merged in (merge_softmax_states(state, empty), merge_softmax_states(empty, state)):
        np.testing.assert_array_equal(merged[0], state[0])
        np.testing.assert_array_equal(merged[1], state[1])
    assert softmax_state(np.zeros((2, 0)))[0].tolist() == [-np.inf, -np.inf]
    assert softmax_state(np.zeros((2, 0)))[1].tolist() == [0.0, 0.0]


@st.composite
def rows_with_a_huge_logit(draw):
    """Finite logits in [-1e4, 1e4] where every row has at least one logit >= 1e3."""
    x = draw(logit_arrays(min_length=1, masked=False))
    positions = draw(st.lists(st.integers(0, x.shape[1] - 1), min_size=x.shape[0], max_size=x.shape[0]))
    huge = draw(st.lists(st.floats(1e3, 1e4), min_size=x.shape[0], max_size=x.shape[0]))
    x[np.arange(x.shape[0]), positions] = huge
    return x


@given(rows_with_a_huge_logit(), block_sizes())
def test_naive_softmax_overflows_where_safe_and_online_softmax_do_not(x, block_size):
    naive = naive_softmax(x)
    # exp(1e3) is inf in float64, so every row contains inf / inf = NaN.
    assert not np.isfinite(naive).all(axis=-1).any()

    safe = safe_softmax(x)
    online = online_softmax(x, block_size)
    assert np.isfinite(safe).all() and np.isfinite(online).all()
    assert_close(safe.sum(axis=-1), np.ones(x.shape[0]), rtol=0, atol=1e-13 * x.shape[1])
    assert_close(online, safe, atol=SUBNORMAL_ATOL)


@given(logit_arrays(max_abs=50.0, masked=False))
def test_naive_softmax_is_correct_when_it_does_not_overflow(x):
    assert_close(naive_softmax(x), safe_softmax(x), atol=SUBNORMAL_ATOL)


@given(logit_arrays(), st.floats(-1e4, 1e4))
def test_softmax_is_invariant_to_a_shift_of_the_logits(x, shift):
    # x + shift rounds to the grid of numbers near 2e4 (spacing 3.6e-12), which
    # perturbs each exp(x - max) by a relative ~1e-11 at most.
    assert_close(safe_softmax(x + shift), safe_softmax(x), rtol=1e-10, atol=SUBNORMAL_ATOL)
    assert_close(online_softmax(x + shift, 5), online_softmax(x, 5), rtol=1e-10, atol=SUBNORMAL_ATOL)


@given(logit_arrays(min_length=1))
def test_softmax_rows_sum_to_one_or_are_fully_masked(x):
    for result in (safe_softmax(x), online_softmax(x, 3)):
        fully_masked = np.isneginf(x).all(axis=-1)
        assert (result[fully_masked] == 0).all()
        assert_close(result[~fully_masked].sum(axis=-1), np.ones((~fully_masked).sum()),
                     rtol=0, atol=1e-13 * x.shape[1])


@given(logit_arrays())
def test_softmax_axis_argument(x):
    np.testing.assert_array_equal(safe_softmax(x.T, axis=0), safe_softmax(x).T)
    np.testing.assert_array_equal(naive_softmax(x.T, axis=0), naive_softmax(x).T)


def test_dtype_argument_casts_the_result():
    x = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    assert safe_softmax(x).dtype == np.float64
    for function in (naive_softmax, safe_softmax, online_softmax):
        result = function(x, dtype=np.float32)
        assert result.dtype == np.float32
        np.testing.assert_array_equal(result, function(x).astype(np.float32))


def test_empty_rows_and_empty_arrays():
    assert safe_softmax(np.zeros((3, 0))).shape == (3, 0)
    assert online_softmax(np.zeros((3, 0)), 4).shape == (3, 0)
    assert online_softmax(np.zeros((3, 0)), []).shape == (3, 0)


@pytest.mark.parametrize(
    "block_sizes_argument",
    [0, -3, [2, 2], [1, 1, 1, 1, 1, 1], [3, -1, 3], [2.5, 2.5], True],
)
def test_bad_block_sizes_raise_value_error_naming_it(block_sizes_argument):
    with pytest.raises(ValueError, match="block_sizes"):
        online_softmax(np.zeros((2, 5)), block_sizes_argument)


def test_non_numeric_input_raises_value_error_naming_it():
    with pytest.raises(ValueError, match="x_block"):
        softmax_state(np.array(["a", "b"]))
    with pytest.raises(ValueError, match="^x must"):
        safe_softmax(np.array([1 + 2j]))
