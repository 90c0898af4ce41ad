"""Properties of the linear attention references (Katharopoulos et al., 2020)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import assert_close, block_sizes, linear_cases, seeds, seqlens, value_scales

from reference import (
    causal_dot_product,
    causal_dot_product_chunked,
    causal_dot_product_quadratic,
    causal_dot_product_recurrent,
    elu_feature_map,
    linear_attention,
)

METHODS = ["quadratic", "recurrent", "chunked"]


def _per_row_definition(q, k, v, initial_state):
    """``V'_i = sum_{j <= i} (q_i . k_j) v_j + q_i^T S_0`` one position at a time."""
    out = np.zeros(v.shape)
    for i in range(q.shape[-2]):
        for j in range(i + 1):
            out[..., i, :] += np.sum(q[..., i, :] * k[..., j, :], axis=-1)[..., None] * v[..., j, :]
        if initial_state is not None:
            out[..., i, :] += np.einsum("...e,...em->...m", q[..., i, :], initial_state)
    return out


@given(linear_cases(max_seqlen=16))
def test_quadratic_form_equals_the_per_row_definition(case):
    expected = _per_row_definition(case.q, case.k, case.v, case.initial_state)
    actual = causal_dot_product_quadratic(case.q, case.k, case.v, case.initial_state)
    assert_close(actual, expected, atol=case.atol)


@given(linear_cases(), block_sizes())
def test_the_three_forms_agree_for_any_chunk_size(case, chunk_size):
    expected_out, expected_state = causal_dot_product_quadratic(
        case.q, case.k, case.v, case.initial_state, return_state=True)
    for out, state in (
        causal_dot_product_recurrent(case.q, case.k, case.v, case.initial_state, return_state=True),
        causal_dot_product_chunked(case.q, case.k, case.v, chunk_size, case.initial_state,
                                   return_state=True),
    ):
        assert_close(out, expected_out, atol=case.atol)
        assert_close(state, expected_state, atol=case.atol)


@given(linear_cases())
def test_final_state_is_initial_state_plus_k_transpose_v(case):
    _, state = causal_dot_product(case.q, case.k, case.v, initial_state=case.initial_state,
                                  return_state=True)
    initial = 0.0 if case.initial_state is None else case.initial_state
    expected = initial + np.einsum("...je,...jm->...em", case.k, case.v)
    assert_close(state, expected, atol=case.atol)


@pytest.mark.parametrize("method", METHODS)
@given(case=linear_cases(), chunk_size=block_sizes(), data=st.data())
def test_two_pieces_with_the_state_carried_equal_the_whole(method, case, chunk_size, data):
    split = data.draw(st.integers(0, case.q.shape[-2]), label="split")
    kwargs = {"method": method, "chunk_size": chunk_size, "return_state": True}
    first = np.s_[..., :split, :]
    second = np.s_[..., split:, :]
    out_1, state_1 = causal_dot_product(case.q[first], case.k[first], case.v[first],
                                        initial_state=case.initial_state, **kwargs)
    out_2, state_2 = causal_dot_product(case.q[second], case.k[second], case.v[second],
                                        initial_state=state_1, **kwargs)
    out, state = causal_dot_product(case.q, case.k, case.v, initial_state=case.initial_state, **kwargs)
    assert_close(np.concatenate([out_1, out_2], axis=-2), out, atol=case.atol)
    assert_close(state_2, state, atol=case.atol)


@pytest.mark.parametrize("method", METHODS)
@given(case=linear_cases(unbatched=True))
def test_unbatched_inputs_equal_a_batch_of_one_head(method, case):
    state = case.initial_state
    out, final_state = causal_dot_product(case.q, case.k, case.v, method=method, chunk_size=5,
                                          initial_state=state, return_state=True)
    out_4d, final_state_4d = causal_dot_product(
        case.q[None, None], case.k[None, None], case.v[None, None], method=method, chunk_size=5,
        initial_state=None if state is None else state[None, None], return_state=True)
    assert out.shape == case.v.shape
    np.testing.assert_array_equal(out, out_4d[0, 0])
    np.testing.assert_array_equal(final_state, final_state_4d[0, 0])
    for causal in (False, True):
        np.testing.assert_array_equal(
            linear_attention(case.q, case.k, case.v, causal=causal),
            linear_attention(case.q[None, None], case.k[None, None], case.v[None, None],
                             causal=causal)[0, 0])


@pytest.mark.parametrize("method", METHODS)
def test_length_one_sequence_is_a_scaled_value(method):
    q, k, v = np.array([[1.0, 2.0]]), np.array([[3.0, -1.0]]), np.array([[0.5, 4.0, -2.0]])
    np.testing.assert_allclose(causal_dot_product(q, k, v, method=method), (1.0 * 3 - 2) * v,
                               rtol=1e-15)


@pytest.mark.parametrize("method", METHODS)
def test_empty_sequence(method):
    q, v = np.zeros((2, 3, 0, 4)), np.zeros((2, 3, 0, 5))
    state = np.ones((2, 3, 4, 5))
    out, final_state = causal_dot_product(q, q, v, method=method, initial_state=state,
                                          return_state=True)
    assert out.shape == (2, 3, 0, 5)
    np.testing.assert_array_equal(final_state, state)
    assert linear_attention(q, q, v, causal=True).shape == (2, 3, 0, 5)
    # Queries but no keys: the denominator is eps alone, and with eps = 0 the row is defined as 0.
    queries = np.ones((2, 3, 4, 4))
    for eps in (1e-6, 0.0):
        np.testing.assert_array_equal(linear_attention(queries, q, v, eps=eps), np.zeros((2, 3, 4, 5)))


@st.composite
def linear_attention_inputs(draw, causal):
    """q ``(..., seqlen_q, E)``, k ``(..., seqlen_k, E)``, v ``(..., seqlen_k, M)``; seqlen_q == seqlen_k if causal."""
    leading = draw(st.sampled_from([(), (1,), (2, 3)]))
    seqlen_q = draw(seqlens(0, 24))
    seqlen_k = seqlen_q if causal else draw(seqlens(0, 24))
    features, values = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(seeds))
    q = draw(value_scales) * rng.standard_normal(leading + (seqlen_q, features))
    k = draw(value_scales) * rng.standard_normal(leading + (seqlen_k, features))
    v = draw(value_scales) * rng.standard_normal(leading + (seqlen_k, values))
    eps = draw(st.sampled_from([1e-6, 0.0, 1.0]))
    return q, k, v, eps


def _linear_attention_definition(q, k, v, causal, eps, feature_map=elu_feature_map):
    """``out = A V / (A 1 + eps)`` with ``A_ij = phi(q_i) . phi(k_j)``, masked to ``j <= i`` if causal.

    A row with no keys and ``eps = 0`` has denominator 0 and is defined to be 0.
    """
    similarity = np.einsum("...ie,...je->...ij", feature_map(q), feature_map(k))
    if causal:
        similarity = similarity * np.tril(np.ones(similarity.shape[-2:]))
    denominator = similarity.sum(axis=-1, keepdims=True) + eps
    with np.errstate(invalid="ignore"):
        return np.where(denominator == 0, 0.0, (similarity @ v) / denominator)


def _linear_attention_tolerance(v):
    # phi > 0, so each output row is a weighted mean of v rows (weights summing to <= 1)
    # and rounding is relative to max|v| even where the result cancels to near 0.
    return 1e-13 * float(np.max(np.abs(v), initial=0.0))


@given(linear_attention_inputs(causal=False))
def test_non_causal_linear_attention_equals_its_definition(inputs):
    q, k, v, eps = inputs
    expected = _linear_attention_definition(q, k, v, False, eps)
    assert_close(linear_attention(q, k, v, eps=eps), expected, atol=_linear_attention_tolerance(v))


@given(linear_attention_inputs(causal=True))
def test_causal_linear_attention_equals_the_masked_definition(inputs):
    q, k, v, eps = inputs
    expected = _linear_attention_definition(q, k, v, True, eps)
    actual = linear_attention(q, k, v, causal=True, eps=eps)
    assert_close(actual, expected, atol=_linear_attention_tolerance(v))


@pytest.mark.parametrize("causal", [False, True])
@given(data=st.data())
def test_the_feature_map_argument_replaces_elu_plus_one(causal, data):
    q, k, v, eps = data.draw(linear_attention_inputs(causal=causal))
    feature_map = lambda x: np.abs(x) + 0.5  # noqa: E731  (positive, and unlike elu + 1)
    expected = _linear_attention_definition(q, k, v, causal, eps, feature_map)
    actual = linear_attention(q, k, v, causal=causal, eps=eps, feature_map=feature_map)
    assert_close(actual, expected, atol=_linear_attention_tolerance(v))


@given(st.floats(-700, 700))
def test_elu_feature_map_is_elu_plus_one_and_positive(x):
    expected = (x if x > 0 else np.expm1(x)) + 1.0
    phi = elu_feature_map(np.array([x]))[0]
    assert phi > 0
    assert abs(phi - expected) <= 1e-15 * max(1.0, abs(expected)) + 1e-16


def test_dtype_argument_casts_results():
    q = np.ones((2, 3, 4), dtype=np.float32)
    assert causal_dot_product(q, q, q).dtype == np.float64
    for method in METHODS:
        out, state = causal_dot_product(q, q, q, method=method, return_state=True, dtype=np.float32)
        assert out.dtype == state.dtype == np.float32
    assert linear_attention(q, q, q, dtype=np.float32).dtype == np.float32
    assert elu_feature_map(q, dtype=np.float16).dtype == np.float16


BAD_CAUSAL_INPUTS = [
    ("q", dict(q=np.zeros(4))),
    ("k", dict(k=np.zeros((2, 6, 3)))),
    ("k", dict(k=np.zeros((2, 5, 4)))),
    ("v", dict(v=np.zeros((2, 6, 7)))),
    ("initial_state", dict(initial_state=np.zeros((2, 5, 3)))),
    ("initial_state", dict(initial_state=np.zeros((3, 7)))),
    ("chunk_size", dict(chunk_size=0)),
    ("chunk_size", dict(chunk_size=-4)),
    ("method", dict(method="parallel")),
]


@pytest.mark.parametrize("name, override", BAD_CAUSAL_INPUTS)
def test_bad_causal_dot_product_inputs_raise_value_error_naming_the_argument(name, override):
    arguments = dict(q=np.zeros((2, 5, 3)), k=np.zeros((2, 5, 3)), v=np.zeros((2, 5, 7)),
                     method="chunked", chunk_size=2, initial_state=None)
    arguments.update(override)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        causal_dot_product(**arguments)


@pytest.mark.parametrize(
    "name, q_shape, k_shape, v_shape, causal",
    [
        ("q", (3,), (3,), (3,), False),
        ("k", (2, 5, 3), (2, 5, 4), (2, 5, 7), False),
        ("k", (2, 5, 3), (1, 5, 3), (1, 5, 7), False),
        ("v", (2, 5, 3), (2, 6, 3), (2, 5, 7), False),
        ("k", (2, 5, 3), (2, 6, 3), (2, 6, 7), True),
    ],
)
def test_bad_linear_attention_inputs_raise_value_error_naming_the_argument(
        name, q_shape, k_shape, v_shape, causal):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        linear_attention(np.zeros(q_shape), np.zeros(k_shape), np.zeros(v_shape), causal=causal)
