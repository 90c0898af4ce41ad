"""Properties of sliding windows and soft-capping on the attention references (issue #29)."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import (
    assert_close,
    block_sizes,
    lengths_with_unseen_queries,
    mask_by_hand,
    masked_attention_cases,
    softcaps,
    windows,
)

from reference import attention, flash_attention_v1, flash_attention_v2
from reference._masks import Band

ALGORITHMS = {
    "attention": attention,
    "flash_attention_v1": lambda *args, **kwargs: flash_attention_v1(*args, block_r=3, block_c=5, **kwargs),
    "flash_attention_v2": lambda *args, **kwargs: flash_attention_v2(*args, block_m=5, block_n=3, **kwargs),
}

small_cases = masked_attention_cases(max_seqlen=12, max_headdim=6)


def assert_same_attention(actual, expected, case):
    (out, lse), (expected_out, expected_lse) = actual, expected
    assert_close(out, expected_out, atol=case.out_atol)
    assert_close(lse, expected_lse, atol=case.lse_atol)


def _attention_by_hand(case):
    """Dense attention with the hand-built mask and ``c * tanh(s / c)`` written out: ``(out, lse)``."""
    q, k, v = case.as_4d()
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if case.sm_scale is None else case.sm_scale
    scores = sm_scale * np.einsum("bhid,bhjd->bhij", q, k)
    if case.softcap is not None:
        scores = case.softcap * np.tanh(scores / case.softcap)
    scores = np.where(mask_by_hand(q.shape[2], k.shape[2], case.causal, case.window), scores, -np.inf)
    lse = np.logaddexp.reduce(scores, axis=-1, initial=-np.inf)
    seen = np.isfinite(lse)[..., None]
    weights = np.where(seen, np.exp(scores - np.where(seen, lse[..., None], 0.0)), 0.0)
    out = np.einsum("bhij,bhjd->bhid", weights, v)
    return (out[0, 0], lse[0, 0]) if case.unbatched else (out, lse)


@pytest.mark.parametrize("name", ALGORITHMS)
@given(case=small_cases)
def test_window_and_softcap_equal_the_dense_mask_and_tanh_by_hand(name, case):
    actual = ALGORITHMS[name](case.q, case.k, case.v, return_lse=True, **case.kwargs)
    assert_same_attention(actual, _attention_by_hand(case), case)


@given(masked_attention_cases(window=st.none(), causal=False))
def test_window_none_zero_is_causal(case):
    for function in (attention, flash_attention_v2):
        expected = function(case.q, case.k, case.v, return_lse=True, **{**case.kwargs, "causal": True})
        actual = function(case.q, case.k, case.v, return_lse=True, **case.kwargs, window=(None, 0))
        for a, e in zip(actual, expected):
            np.testing.assert_array_equal(a, e)


@given(masked_attention_cases(window=st.none()))
def test_window_unbounded_on_both_sides_masks_nothing_more(case):
    for function in (attention, flash_attention_v2):
        expected = function(case.q, case.k, case.v, return_lse=True, **case.kwargs)
        actual = function(case.q, case.k, case.v, return_lse=True, **case.kwargs, window=[None, None])
        for a, e in zip(actual, expected):
            np.testing.assert_array_equal(a, e)


@given(masked_attention_cases(window=st.tuples(st.none() | st.integers(0, 5), st.integers(0, 5)), causal=True))
def test_causal_with_a_window_takes_the_right_side_min_0(case):
    left, right = case.window
    expected = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    actual = attention(case.q, case.k, case.v, return_lse=True,
                       **{**case.kwargs, "causal": False, "window": (left, min(right, 0))})
    for a, e in zip(actual, expected):
        np.testing.assert_array_equal(a, e)


@given(masked_attention_cases(softcap=st.none()))
def test_softcap_zero_is_no_softcap(case):
    expected = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    for a, e in zip(attention(case.q, case.k, case.v, return_lse=True, **case.kwargs, softcap=0), expected):
        np.testing.assert_array_equal(a, e)


@given(masked_attention_cases(softcap=st.none()))
def test_a_large_softcap_approaches_no_softcap(case):
    # c tanh(s / c) = s - s^3 / (3 c^2) + ...: with c = 1e4 (1 + max |s|) a score moves by at most 4e-9 (1 + max|s|).
    magnitude = case.score_magnitude()
    softcap = 1e4 * (1.0 + magnitude)
    out, lse = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    capped_out, capped_lse = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs, softcap=softcap)
    shift = 4e-9 * (1.0 + magnitude)
    assert_close(capped_lse, lse, atol=case.lse_atol + shift)
    assert_close(capped_out, out, atol=case.out_atol + 2 * shift * float(np.max(np.abs(case.v), initial=0.0)))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_cap_turns_infinite_scores_finite_and_keeps_nan(name):
    """The NaN and inf rules apply to the capped score: a raw +-inf score is +-c, a NaN score stays NaN."""
    q = np.array([[np.inf, 0.0], [np.nan, 0.0], [1.0, 0.0]])
    k = np.array([[1.0, 0.0], [-1.0, 0.0]])
    v = np.array([[1.0, 2.0], [3.0, 4.0]])
    with np.errstate(invalid="ignore"):
        out, lse = ALGORITHMS[name](q, k, v, sm_scale=1.0, softcap=2.0, return_lse=True)
        uncapped, _ = ALGORITHMS[name](q, k, v, sm_scale=1.0, return_lse=True)
    weight = 1.0 / (1.0 + math.exp(-4.0))  # softmax of the capped scores (2, -2)
    assert_close(out[0], weight * v[0] + (1 - weight) * v[1])
    assert_close(lse[0:1], [math.log(math.exp(2.0) + math.exp(-2.0))])
    assert np.isnan(out[1]).all() and np.isnan(lse[1])
    assert np.isnan(uncapped[0]).all()  # without the cap, a +inf score makes the row NaN
    assert np.isfinite(out[2]).all() and np.isfinite(lse[2])


@given(masked_attention_cases(max_seqlen=12, softcap=st.floats(0.05, 50.0)))
def test_capped_scores_bound_the_lse(case):
    """Every capped score lies in (-c, c), so ``lse`` lies within ``c`` of ``log(number of keys seen)``."""
    _, lse = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    seen = mask_by_hand(case.q.shape[-2], case.k.shape[-2], case.causal, case.window).sum(axis=-1)
    with np.errstate(divide="ignore"):
        log_seen = np.log(seen)
    finite = seen > 0
    assert (np.abs(lse[..., finite] - log_seen[finite]) <= case.softcap * (1 + 1e-12)).all()
    assert np.isneginf(lse[..., ~finite]).all()


@given(masked_attention_cases(), block_sizes(), block_sizes())
def test_flash_attention_v1_and_v2_equal_attention_for_any_block_sizes(case, block_a, block_b):
    expected = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    v1 = flash_attention_v1(case.q, case.k, case.v, return_lse=True, block_r=block_a, block_c=block_b, **case.kwargs)
    v2 = flash_attention_v2(case.q, case.k, case.v, return_lse=True, block_m=block_a, block_n=block_b, **case.kwargs)
    assert_same_attention(v1, expected, case)
    assert_same_attention(v2, expected, case)


@given(masked_attention_cases(unbatched=True, window=windows(optional=False)), block_sizes(), block_sizes())
def test_flash_attention_v2_visits_exactly_the_tiles_that_hold_a_visible_key(case, block_m, block_n):
    """Tiles wholly outside the band are skipped; every other tile (aligned to block_n) is visited once."""
    visited = []
    covers = Band.covers

    def recording(band, q_start, q_end, kv_start, kv_end, seqlen_q, seqlen_k):
        visited.append((q_start, kv_start))
        return covers(band, q_start, q_end, kv_start, kv_end, seqlen_q, seqlen_k)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Band, "covers", recording)
        flash_attention_v2(case.q, case.k, case.v, block_m=block_m, block_n=block_n, **case.kwargs)
    seqlen_q, seqlen_k = case.q.shape[-2], case.k.shape[-2]
    visible = mask_by_hand(seqlen_q, seqlen_k, case.causal, case.window)
    expected = [(q_start, kv_start)
                for q_start in range(0, seqlen_q, block_m) for kv_start in range(0, seqlen_k, block_n)
                if visible[q_start:q_start + block_m, kv_start:kv_start + block_n].any()]
    assert visited == expected


@st.composite
def cases_with_unseen_rows(draw):
    """A window ``(left, right)`` and ``seqlen_q > seqlen_k + right``: the first rows' windows end before key 0."""
    right = draw(st.integers(0, 3))
    seqlen_q, seqlen_k = draw(lengths_with_unseen_queries(max_seqlen=14))
    seqlen_q = max(seqlen_q, seqlen_k + right + 1)
    window = (draw(st.none() | st.integers(0, 4)), right)
    return draw(masked_attention_cases(window=st.just(window), lengths=st.just((seqlen_q, seqlen_k))))


@pytest.mark.parametrize("name", ALGORITHMS)
@given(case=cases_with_unseen_rows())
def test_rows_whose_window_holds_no_key_give_zero_and_minus_inf(name, case):
    out, lse = ALGORITHMS[name](case.q, case.k, case.v, return_lse=True, **case.kwargs)
    seqlen_q, seqlen_k = case.q.shape[-2], case.k.shape[-2]
    right = min(case.window[1], 0) if case.causal else case.window[1]
    # rows i < seqlen_q - seqlen_k - right have i' + right < 0; the others see at least key max(0, i' - left)
    unseen = seqlen_q - seqlen_k - right if seqlen_k else seqlen_q
    assert unseen >= 1
    assert (out[..., :unseen, :] == 0).all()
    assert np.isneginf(lse[..., :unseen]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[..., unseen:]).all()


@pytest.mark.parametrize("name", ALGORITHMS)
@given(case=masked_attention_cases(max_seqlen=12, max_headdim=6), poison=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_keys_outside_the_window_never_affect_a_row(name, case, poison):
    q, k, v = case.as_4d()
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    visible = mask_by_hand(seqlen_q, seqlen_k, case.causal, case.window)
    expected = ALGORITHMS[name](q, k, v, return_lse=True, **case.kwargs)
    for i in range(seqlen_q):
        hidden = ~visible[i]
        poisoned_k, poisoned_v = k.copy(), v.copy()
        poisoned_k[:, :, hidden], poisoned_v[:, :, hidden] = poison, poison
        with np.errstate(invalid="ignore", over="ignore"):  # the poisoned scores of the other rows
            out, lse = ALGORITHMS[name](q, poisoned_k, poisoned_v, return_lse=True, **case.kwargs)
        np.testing.assert_array_equal(out[:, :, i], expected[0][:, :, i])
        np.testing.assert_array_equal(lse[:, :, i], expected[1][:, :, i])


@given(masked_attention_cases(), st.data())
def test_selected_rows_equal_those_rows_of_the_full_attention(case, data):
    seqlen_q = case.q.shape[-2]
    rows = data.draw(st.lists(st.integers(0, max(seqlen_q - 1, 0)), max_size=2 * seqlen_q), label="rows")
    out, lse = attention(case.q, case.k, case.v, return_lse=True, rows=rows, **case.kwargs)
    full_out, full_lse = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    np.testing.assert_array_equal(out, full_out[..., rows, :])
    np.testing.assert_array_equal(lse, full_lse[..., rows])


@given(windows(), softcaps())
def test_window_and_softcap_accept_their_documented_forms(window, softcap):
    q = np.random.default_rng(3).standard_normal((4, 2))
    listed = None if window is None else [np.int64(side) if side is not None else None for side in window]
    for function in (attention, flash_attention_v1, flash_attention_v2):
        expected = function(q, q, q, window=window, softcap=softcap)
        np.testing.assert_array_equal(function(q, q, q, window=listed, softcap=softcap), expected)


BAD_WINDOWS = [(-1, 0), (0, -1), (-1, -1), (True, 0), (0, np.bool_(False)), (1.0, 2), (1, "2"), (1,), (1, 2, 3),
               [None], "ab", 3, np.array([1, 2]), {0: 1, 1: 2}]
BAD_SOFTCAPS = [-1.0, -1e-300, np.nan, np.inf, -np.inf, True, np.bool_(True), "1", 1j, [1.0]]


@pytest.mark.parametrize("function", [attention, flash_attention_v1, flash_attention_v2])
@pytest.mark.parametrize("window", BAD_WINDOWS, ids=repr)
def test_bad_windows_raise_value_error_naming_it(function, window):
    q = np.zeros((3, 2))
    with pytest.raises(ValueError, match=r"^window\b"):
        function(q, q, q, window=window)


@pytest.mark.parametrize("function", [attention, flash_attention_v1, flash_attention_v2])
@pytest.mark.parametrize("softcap", BAD_SOFTCAPS, ids=repr)
def test_bad_softcaps_raise_value_error_naming_it(function, softcap):
    q = np.zeros((3, 2))
    with pytest.raises(ValueError, match=r"^softcap\b"):
        function(q, q, q, softcap=softcap)
