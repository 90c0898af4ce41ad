"""Properties of the attention references: the definition, FlashAttention-1 and FlashAttention-2."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import (
    assert_close,
    attention_cases,
    block_sizes,
    causal_cases_with_unseen_queries,
)

from reference import attention, combine_lse, flash_attention_v1, flash_attention_v2, split_kv_attention


def _split_then_combine(q, k, v, causal=False, sm_scale=None, return_lse=False, dtype=None):
    parts = split_kv_attention(q, k, v, 3, causal=causal, sm_scale=sm_scale)
    out, lse = combine_lse(*parts, dtype=dtype)
    return (out, lse) if return_lse else out


ALGORITHMS = {
    "attention": attention,
    "flash_attention_v1": lambda *args, **kwargs: flash_attention_v1(*args, block_r=3, block_c=5, **kwargs),
    "flash_attention_v2": lambda *args, **kwargs: flash_attention_v2(*args, block_m=5, block_n=3, **kwargs),
    "split_kv_attention+combine_lse": _split_then_combine,
}


def assert_same_attention(actual, expected, case):
    (out, lse), (expected_out, expected_lse) = actual, expected
    assert_close(out, expected_out, atol=case.out_atol)
    assert_close(lse, expected_lse, atol=case.lse_atol)


def _per_row_definition(case):
    """Attention written one query row at a time with Python loops, from the definition."""
    q, k, v = case.as_4d()
    batch, heads_q, seqlen_q, headdim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    sm_scale = 1.0 / math.sqrt(headdim) if case.sm_scale is None else case.sm_scale
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    for b in range(batch):
        for h in range(heads_q):
            kv_head = h // (heads_q // heads_kv)
            for i in range(seqlen_q):
                keys = [j for j in range(seqlen_k)
                        if not case.causal or j <= i + seqlen_k - seqlen_q]
                if not keys:
                    continue
                scores = [sm_scale * float(np.dot(q[b, h, i], k[b, kv_head, j])) for j in keys]
                largest = max(scores)
                weights = [math.exp(score - largest) for score in scores]
                total = math.fsum(weights)
                out[b, h, i] = sum(w * v[b, kv_head, j] for w, j in zip(weights, keys)) / total
                lse[b, h, i] = largest + math.log(total)
    if case.unbatched:
        return out[0, 0], lse[0, 0]
    return out, lse


@given(attention_cases(max_seqlen=12, max_headdim=6))
def test_attention_equals_the_per_row_definition(case):
    expected = _per_row_definition(case)
    actual = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    assert_same_attention(actual, expected, case)


@given(attention_cases(), st.data())
def test_selected_rows_equal_those_rows_of_the_full_attention(case, data):
    seqlen_q = case.q.shape[-2]
    rows = data.draw(st.lists(st.integers(0, max(seqlen_q - 1, 0)), max_size=2 * seqlen_q), label="rows")
    out, lse = attention(case.q, case.k, case.v, return_lse=True, rows=rows, **case.kwargs)
    full_out, full_lse = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    np.testing.assert_array_equal(out, full_out[..., rows, :])
    np.testing.assert_array_equal(lse, full_lse[..., rows])


def test_selected_rows_out_of_range_are_refused():
    q = np.zeros((1, 1, 4, 2))
    with pytest.raises(ValueError, match=r"rows: expected query row indices in \[0, 4\)"):
        attention(q, q, q, rows=[0, 4])


@given(attention_cases())
def test_lse_is_the_logsumexp_of_the_masked_scaled_scores(case):
    q, k, v = case.as_4d()
    k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    sm_scale = 1.0 / np.sqrt(q.shape[-1]) if case.sm_scale is None else case.sm_scale
    scores = sm_scale * np.einsum("bhid,bhjd->bhij", q, k)
    if case.causal:
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
        hidden = np.arange(seqlen_k)[None, :] > np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
        scores[..., hidden] = -np.inf
    expected = np.logaddexp.reduce(scores, axis=-1, initial=-np.inf)
    _, lse = attention(*case.as_4d(), return_lse=True, **case.kwargs)
    assert_close(lse, expected, atol=case.lse_atol)


@given(attention_cases(), block_sizes(), block_sizes())
def test_flash_attention_v1_equals_attention_for_any_block_sizes(case, block_r, block_c):
    expected = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    actual = flash_attention_v1(case.q, case.k, case.v, return_lse=True,
                                block_r=block_r, block_c=block_c, **case.kwargs)
    assert_same_attention(actual, expected, case)


@given(attention_cases(), block_sizes(), block_sizes())
def test_flash_attention_v2_equals_attention_for_any_block_sizes(case, block_m, block_n):
    expected = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    actual = flash_attention_v2(case.q, case.k, case.v, return_lse=True,
                                block_m=block_m, block_n=block_n, **case.kwargs)
    assert_same_attention(actual, expected, case)


@pytest.mark.parametrize("name", ALGORITHMS)
@given(case=causal_cases_with_unseen_queries())
def test_queries_that_see_no_key_give_zero_and_minus_inf(name, case):
    out, lse = ALGORITHMS[name](case.q, case.k, case.v, return_lse=True, **case.kwargs)
    unseen = case.q.shape[-2] - case.k.shape[-2]
    assert (out[..., :unseen, :] == 0).all()
    assert np.isneginf(lse[..., :unseen]).all()
    assert np.isfinite(out).all()
    assert np.isfinite(lse[..., unseen:]).all()


@pytest.mark.parametrize("name", ALGORITHMS)
@given(case=attention_cases(unbatched=False))
def test_grouped_query_attention_equals_repeating_kv_heads(name, case):
    group_size = case.q.shape[1] // case.k.shape[1]
    k = np.repeat(case.k, group_size, axis=1)
    v = np.repeat(case.v, group_size, axis=1)
    actual = ALGORITHMS[name](case.q, case.k, case.v, return_lse=True, **case.kwargs)
    expected = ALGORITHMS[name](case.q, k, v, return_lse=True, **case.kwargs)
    assert_same_attention(actual, expected, case)


@pytest.mark.parametrize("name", ALGORITHMS)
@given(case=attention_cases(unbatched=True))
def test_unbatched_inputs_equal_a_batch_of_one_head(name, case):
    out, lse = ALGORITHMS[name](case.q, case.k, case.v, return_lse=True, **case.kwargs)
    out_4d, lse_4d = ALGORITHMS[name](*case.as_4d(), return_lse=True, **case.kwargs)
    assert out.shape == case.q.shape and lse.shape == case.q.shape[:1]
    np.testing.assert_array_equal(out, out_4d[0, 0])
    np.testing.assert_array_equal(lse, lse_4d[0, 0])


@given(attention_cases(causal=False), st.randoms(use_true_random=False))
def test_non_causal_attention_does_not_depend_on_key_order(case, random):
    permutation = list(range(case.k.shape[-2]))
    random.shuffle(permutation)
    expected = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    actual = attention(case.q, case.k[..., permutation, :], case.v[..., permutation, :],
                       return_lse=True, **case.kwargs)
    assert_same_attention(actual, expected, case)


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 0), (0, 5), (4, 0), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_and_length_one_sequences(name, seqlen_q, seqlen_k, causal):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, seqlen_q, 8))
    k = rng.standard_normal((2, 2, seqlen_k, 8))
    v = rng.standard_normal((2, 2, seqlen_k, 8))
    out, lse = ALGORITHMS[name](q, k, v, causal=causal, return_lse=True)
    assert out.shape == (2, 4, seqlen_q, 8) and lse.shape == (2, 4, seqlen_q)
    if seqlen_k == 0:
        assert (out == 0).all() and np.isneginf(lse).all()
    if seqlen_q == seqlen_k == 1:
        # A single key gets all the weight: the output is that key's value.
        assert_close(out, np.repeat(v, 2, axis=1))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_dtype_argument_casts_output_and_lse(name):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)).astype(np.float16) for _ in range(3))
    out, lse = ALGORITHMS[name](q, k, v, return_lse=True)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    out16, lse16 = ALGORITHMS[name](q, k, v, return_lse=True, dtype=q.dtype)
    assert out16.dtype == np.float16 and lse16.dtype == np.float16
    np.testing.assert_array_equal(out16, out.astype(np.float16))
    np.testing.assert_array_equal(lse16, lse.astype(np.float16))


def test_return_lse_false_returns_only_the_output():
    q = np.ones((3, 4))
    for function in (attention, flash_attention_v1, flash_attention_v2):
        assert isinstance(function(q, q, q), np.ndarray)


def _qkv(q_shape=(2, 4, 5, 8), k_shape=(2, 2, 6, 8), v_shape=None):
    v_shape = k_shape if v_shape is None else v_shape
    return np.zeros(q_shape), np.zeros(k_shape), np.zeros(v_shape)


BAD_INPUTS = [
    ("q", _qkv(q_shape=(4, 5, 8)), {}),
    ("k", _qkv(k_shape=(2, 2, 1, 6, 8)), {}),
    ("k", _qkv(k_shape=(3, 2, 6, 8)), {}),
    ("k", _qkv(k_shape=(2, 2, 6, 7)), {}),
    ("v", _qkv(v_shape=(2, 2, 6, 7)), {}),
    ("v", _qkv(v_shape=(2, 2, 5, 8)), {}),
    ("v", _qkv(v_shape=(2, 1, 6, 8)), {}),
    ("heads", _qkv(k_shape=(2, 3, 6, 8)), {}),
    ("rank", _qkv(q_shape=(5, 8)), {}),
    ("q", (np.zeros((5, 8), dtype=bool), np.zeros((5, 8)), np.zeros((5, 8))), {}),
]


@pytest.mark.parametrize("function", [attention, flash_attention_v1, flash_attention_v2])
@pytest.mark.parametrize("name, arrays, kwargs", BAD_INPUTS)
def test_bad_shapes_raise_value_error_naming_the_argument(function, name, arrays, kwargs):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        function(*arrays, **kwargs)


@pytest.mark.parametrize(
    "function, argument",
    [
        (flash_attention_v1, "block_r"),
        (flash_attention_v1, "block_c"),
        (flash_attention_v2, "block_m"),
        (flash_attention_v2, "block_n"),
    ],
)
@pytest.mark.parametrize("value", [0, -1, 2.0, None])
def test_bad_block_sizes_raise_value_error_naming_them(function, argument, value):
    with pytest.raises(ValueError, match=argument):
        function(*_qkv(), **{argument: value})
