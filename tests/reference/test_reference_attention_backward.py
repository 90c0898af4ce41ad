"""Properties of the attention backward references: the analytic gradients and FlashAttention-2's blockwise order."""

import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import (
    assert_close,
    attention_cases,
    block_sizes,
    causal_cases_with_unseen_queries,
    mask_by_hand,
    masked_attention_cases,
    seeds,
    windows,
)

from reference import attention, attention_backward, flash_attention_v2, flash_attention_v2_backward
from reference._masks import Band

# Central differences (f(x + h d) - f(x - h d)) / 2h have truncation error ~ h^2 |f'''| and rounding error
# ~ 1e-16 |f| / h; h = 1e-6 balances the two. Values of moderate size keep |f'''| small (logits up to ~10).
FD_STEP = 1e-6
FD_SCALES = st.sampled_from([0.1, 0.5, 1.0, 2.0])
# Tolerance: |FD - exact| <= FD_RTOL * sum_i |grad_i d_i| + FD_ATOL * loss_magnitude, about 100 times the
# rounding term (errors measured over 1500 random examples stay below 1% of it), while a wrong sign or a
# missing term is off by a fraction of the gradient itself.
FD_RTOL = 1e-6
FD_ATOL = 1e-8


def _flash_v2_backward(dout, q, k, v, causal=False, sm_scale=None, block_m=5, block_n=3, window=None, softcap=None):
    out, lse = attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True, window=window, softcap=softcap)
    return flash_attention_v2_backward(dout, q, k, v, out, lse, causal=causal, sm_scale=sm_scale,
                                       block_m=block_m, block_n=block_n, window=window, softcap=softcap)


BACKWARDS = {
    "attention_backward": attention_backward,
    "flash_attention_v2_backward": _flash_v2_backward,
}


def _dout(case, seed):
    return np.random.default_rng(seed).standard_normal(case.q.shape)


def _loss(case, dout, q, k, v):
    """``sum(dout * out)``: its gradient with respect to q, k, v is the backward of ``dout``."""
    return float(np.sum(dout * attention(q, k, v, **case.kwargs)))


def _loss_magnitude(case, dout):
    # out is a weighted mean of v rows: |out| <= max|v|, so sum |dout * out| <= sum|dout| max|v|.
    return float(np.sum(np.abs(dout))) * float(np.max(np.abs(case.v), initial=0.0))


def _directional_derivative(case, dout, directions):
    (q, k, v), step = (case.q, case.k, case.v), FD_STEP
    plus = _loss(case, dout, *(x + step * d for x, d in zip((q, k, v), directions)))
    minus = _loss(case, dout, *(x - step * d for x, d in zip((q, k, v), directions)))
    return (plus - minus) / (2 * step)


def _assert_fd_matches(fd, terms, case, dout, what):
    terms = np.asarray(terms)
    exact = float(np.sum(terms))
    tolerance = FD_RTOL * float(np.sum(np.abs(terms))) + FD_ATOL * _loss_magnitude(case, dout)
    assert abs(fd - exact) <= tolerance, f"{what}: finite difference {fd!r} != gradient {exact!r} (tol {tolerance})"


fd_cases = attention_cases(max_seqlen=6, max_headdim=4, scales=FD_SCALES)
# windows and soft-capping (caps from 0.5: a steeper tanh needs a smaller step)
masked_fd_cases = masked_attention_cases(max_seqlen=6, max_headdim=4, scales=FD_SCALES,
                                         softcap=st.none() | st.floats(0.5, 20.0))


@pytest.mark.parametrize("name", BACKWARDS)
@given(case=st.one_of(fd_cases, masked_fd_cases), seed=seeds)
def test_gradients_equal_central_differences_along_a_random_direction(name, case, seed):
    rng = np.random.default_rng(seed)
    dout = rng.standard_normal(case.q.shape)
    directions = [rng.standard_normal(x.shape) for x in (case.q, case.k, case.v)]
    gradients = BACKWARDS[name](dout, case.q, case.k, case.v, **case.kwargs)
    fd = _directional_derivative(case, dout, directions)
    # one direction for all three inputs at once, and each input on its own
    terms = [np.sum(g * d) for g, d in zip(gradients, directions)]
    _assert_fd_matches(fd, terms, case, dout, "q, k, v")
    for index, what in enumerate(("dq", "dk", "dv")):
        only = [d if i == index else np.zeros_like(d) for i, d in enumerate(directions)]
        _assert_fd_matches(_directional_derivative(case, dout, only), [terms[index]], case, dout, what)


@given(case=st.one_of(fd_cases, masked_fd_cases), seed=seeds, data=st.data())
def test_individual_gradient_entries_equal_central_differences(case, seed, data):
    dout = _dout(case, seed)
    gradients = attention_backward(dout, case.q, case.k, case.v, **case.kwargs)
    for index, (x, gradient) in enumerate(zip((case.q, case.k, case.v), gradients)):
        if x.size == 0:
            continue
        for _ in range(2):
            entry = data.draw(st.tuples(*(st.integers(0, n - 1) for n in x.shape)), label="entry")
            directions = [np.zeros_like(y) for y in (case.q, case.k, case.v)]
            directions[index][entry] = 1.0
            fd = _directional_derivative(case, dout, directions)
            _assert_fd_matches(fd, [gradient[entry]], case, dout, f"{'qkv'[index]}{list(entry)}")


def _gradient_atols(case, dout):
    """Absolute tolerances for ``(dq, dk, dv)``: the relative rounding of ``P`` times a bound on each gradient.

    A logit's absolute error (``case.lse_atol``) is a relative error of ``P``, and every gradient is a sum of
    terms proportional to ``P``: ``|P| <= 1`` with rows summing to <= 1, ``|dP|, |D| <= headdim max|dout| max|v|``.
    """
    q, k, v = case.as_4d()
    group = q.shape[1] // k.shape[1]
    sm_scale = 1.0 / np.sqrt(q.shape[-1]) if case.sm_scale is None else case.sm_scale
    largest = {name: float(np.max(np.abs(x), initial=0.0)) for name, x in (("q", q), ("k", k), ("v", v), ("do", dout))}
    queries_per_key = group * q.shape[2]
    dp_bound = q.shape[-1] * largest["do"] * largest["v"]
    bounds = (
        abs(sm_scale) * 2 * dp_bound * largest["k"],
        abs(sm_scale) * 2 * dp_bound * largest["q"] * queries_per_key,
        largest["do"] * queries_per_key,
    )
    return [10 * case.lse_atol * (1.0 + bound) for bound in bounds]


def assert_same_gradients(actual, expected, case, dout):
    for name, a, e, atol in zip(("dq", "dk", "dv"), actual, expected, _gradient_atols(case, dout)):
        assert a.dtype == np.float64, name
        assert_close(a, e, atol=atol)


@given(st.one_of(attention_cases(), masked_attention_cases()), block_sizes(), block_sizes(), seeds)
def test_flash_attention_v2_backward_equals_attention_backward_for_any_block_sizes(case, block_m, block_n, seed):
    dout = _dout(case, seed)
    expected = attention_backward(dout, case.q, case.k, case.v, **case.kwargs)
    actual = _flash_v2_backward(dout, case.q, case.k, case.v, block_m=block_m, block_n=block_n, **case.kwargs)
    assert_same_gradients(actual, expected, case, dout)


@pytest.mark.parametrize("name", BACKWARDS)
@given(case=attention_cases(unbatched=False), seed=seeds)
def test_grouped_query_gradients_are_the_summed_gradients_of_the_repeated_heads(name, case, seed):
    dout = _dout(case, seed)
    group = case.q.shape[1] // case.k.shape[1]
    k, v = np.repeat(case.k, group, axis=1), np.repeat(case.v, group, axis=1)
    dq_mha, dk_mha, dv_mha = BACKWARDS[name](dout, case.q, k, v, **case.kwargs)
    batch, heads_kv, seqlen_k, headdim = case.k.shape
    summed = [g.reshape(batch, heads_kv, group, seqlen_k, headdim).sum(axis=2) for g in (dk_mha, dv_mha)]
    actual = BACKWARDS[name](dout, case.q, case.k, case.v, **case.kwargs)
    assert_same_gradients(actual, (dq_mha, *summed), case, dout)


@pytest.mark.parametrize("name", BACKWARDS)
@given(case=causal_cases_with_unseen_queries(), seed=seeds)
def test_rows_that_see_no_key_get_zero_dq_and_add_nothing(name, case, seed):
    dout = _dout(case, seed)
    dq, dk, dv = BACKWARDS[name](dout, case.q, case.k, case.v, **case.kwargs)
    unseen = case.q.shape[-2] - case.k.shape[-2]
    assert (dq[..., :unseen, :] == 0).all()
    # whatever the gradient of those rows' outputs, it changes nothing
    changed = dout.copy()
    changed[..., :unseen, :] = 7.0
    for gradient, expected in zip(BACKWARDS[name](changed, case.q, case.k, case.v, **case.kwargs), (dq, dk, dv)):
        np.testing.assert_array_equal(gradient, expected)


@pytest.mark.parametrize("name", BACKWARDS)
@given(case=masked_attention_cases(window=st.tuples(st.none() | st.integers(0, 4), st.integers(0, 3)),
                                   lengths=st.tuples(st.integers(0, 12), st.integers(0, 12))), seed=seeds)
def test_rows_whose_window_holds_no_key_get_zero_dq_and_add_nothing(name, case, seed):
    dout = _dout(case, seed)
    dq, dk, dv = BACKWARDS[name](dout, case.q, case.k, case.v, **case.kwargs)
    _, lse = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    unseen = np.isneginf(lse)
    assert (dq[unseen] == 0).all()
    changed = dout.copy()
    changed[unseen] = 7.0
    for gradient, expected in zip(BACKWARDS[name](changed, case.q, case.k, case.v, **case.kwargs), (dq, dk, dv)):
        np.testing.assert_array_equal(gradient, expected)


@given(masked_attention_cases(unbatched=True, window=windows(optional=False)), block_sizes(), block_sizes(), seeds)
def test_flash_attention_v2_backward_visits_exactly_the_tiles_that_hold_a_visible_key(case, block_m, block_n, seed):
    """Query tiles wholly outside the band are skipped; every other tile (aligned to block_m) is visited once."""
    visited = []
    covers = Band.covers

    def recording(band, q_start, q_end, kv_start, kv_end, seqlen_q, seqlen_k):
        visited.append((kv_start, q_start))
        return covers(band, q_start, q_end, kv_start, kv_end, seqlen_q, seqlen_k)

    out, lse = attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Band, "covers", recording)
        flash_attention_v2_backward(_dout(case, seed), case.q, case.k, case.v, out, lse, block_m=block_m,
                                    block_n=block_n, **case.kwargs)
    seqlen_q, seqlen_k = case.q.shape[-2], case.k.shape[-2]
    visible = mask_by_hand(seqlen_q, seqlen_k, case.causal, case.window)
    expected = [(kv_start, q_start)
                for kv_start in range(0, seqlen_k, block_n) for q_start in range(0, seqlen_q, block_m)
                if visible[q_start:q_start + block_m, kv_start:kv_start + block_n].any()]
    assert visited == expected


@pytest.mark.parametrize("name", BACKWARDS)
@given(case=attention_cases(unbatched=True), seed=seeds)
def test_unbatched_inputs_equal_a_batch_of_one_head(name, case, seed):
    dout = _dout(case, seed)
    gradients = BACKWARDS[name](dout, case.q, case.k, case.v, **case.kwargs)
    gradients_4d = BACKWARDS[name](dout[None, None], *case.as_4d(), **case.kwargs)
    for gradient, gradient_4d, x in zip(gradients, gradients_4d, (case.q, case.k, case.v)):
        assert gradient.shape == x.shape
        np.testing.assert_array_equal(gradient, gradient_4d[0, 0])


@pytest.mark.parametrize("name", BACKWARDS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 0), (0, 5), (4, 0), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_and_length_one_sequences(name, seqlen_q, seqlen_k, causal):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, seqlen_q, 8))
    k = rng.standard_normal((2, 2, seqlen_k, 8))
    v = rng.standard_normal((2, 2, seqlen_k, 8))
    dout = rng.standard_normal(q.shape)
    dq, dk, dv = BACKWARDS[name](dout, q, k, v, causal=causal)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    if seqlen_q == 0:  # no query sees the keys
        assert (dk == 0).all() and (dv == 0).all()
    if seqlen_k == 0:
        assert (dq == 0).all()
    if seqlen_q == seqlen_k == 1:
        # One key has all the weight whatever q and k are, so only v has a gradient: the group's summed dout.
        # (Exactly 0 from the definition; the blockwise form recomputes P = exp(s - lse), 1 up to rounding.)
        assert_close(dq, np.zeros(q.shape), atol=1e-13)
        assert_close(dk, np.zeros(k.shape), atol=1e-13)
        assert_close(dv, dout.reshape(2, 2, 2, 1, 8).sum(axis=2))


def test_float16_inputs_give_float64_gradients():
    q = np.random.default_rng(1).standard_normal((1, 2, 5, 4)).astype(np.float16)
    for name, backward in BACKWARDS.items():
        assert all(g.dtype == np.float64 for g in backward(q, q, q, q)), name


def _arguments(q_shape=(2, 4, 5, 8), k_shape=(2, 2, 6, 8), dout_shape=None):
    dout_shape = q_shape if dout_shape is None else dout_shape
    return np.zeros(dout_shape), np.zeros(q_shape), np.zeros(k_shape), np.zeros(k_shape)


BAD_INPUTS = [
    ("dout", _arguments(dout_shape=(2, 4, 5, 7)), {}),
    ("dout", _arguments(dout_shape=(2, 4, 6, 8)), {}),
    ("dout", _arguments(dout_shape=(5, 8)), {}),
    ("dout", _arguments(q_shape=(5, 8), k_shape=(6, 8), dout_shape=(1, 1, 5, 8)), {}),
    ("dout", (np.zeros((5, 8), dtype=bool), np.zeros((5, 8)), np.zeros((6, 8)), np.zeros((6, 8))), {}),
    ("q", _arguments(q_shape=(4, 5, 8)), {}),
    ("k", _arguments(k_shape=(2, 2, 6, 7)), {}),
    ("heads", _arguments(k_shape=(2, 3, 6, 8)), {}),
    ("causal", _arguments(), {"causal": 1}),
    ("causal", _arguments(), {"causal": "yes"}),
    ("causal", _arguments(), {"causal": None}),
    ("sm_scale", _arguments(), {"sm_scale": "0.5"}),
    ("sm_scale", _arguments(), {"sm_scale": np.inf}),
    ("window", _arguments(), {"window": (-1, 0)}),
    ("window", _arguments(), {"window": (0, True)}),
    ("window", _arguments(), {"window": 4}),
    ("softcap", _arguments(), {"softcap": -1.0}),
    ("softcap", _arguments(), {"softcap": np.nan}),
    ("softcap", _arguments(), {"softcap": True}),
]


@pytest.mark.parametrize("function", [attention_backward, flash_attention_v2_backward])
@pytest.mark.parametrize("name, arrays, kwargs", BAD_INPUTS)
def test_bad_arguments_raise_value_error_naming_them(function, name, arrays, kwargs):
    dout, q, k, v = arrays
    saved = (np.zeros(q.shape), np.zeros(q.shape[:-1])) if function is flash_attention_v2_backward else ()
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        function(dout, q, k, v, *saved, **kwargs)


@pytest.mark.parametrize(
    "name, override",
    [
        ("out", {"out": np.zeros((2, 4, 5, 7))}),
        ("out", {"out": np.zeros((2, 4, 5))}),
        ("lse", {"lse": np.zeros((2, 4, 5, 8))}),
        ("lse", {"lse": np.zeros((2, 4, 6))}),
        ("block_m", {"block_m": 0}),
        ("block_m", {"block_m": 2.0}),
        ("block_n", {"block_n": -1}),
        ("block_n", {"block_n": True}),
    ],
)
def test_bad_saved_arrays_and_block_sizes_raise_value_error_naming_them(name, override):
    dout, q, k, v = _arguments()
    arguments = {"out": np.zeros(q.shape), "lse": np.zeros(q.shape[:-1]), "block_m": 4, "block_n": 4}
    arguments.update(override)
    out, lse = arguments.pop("out"), arguments.pop("lse")
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        flash_attention_v2_backward(dout, q, k, v, out, lse, **arguments)


@pytest.mark.parametrize("backward, forward", [(attention_backward, attention),
                                               (flash_attention_v2_backward, flash_attention_v2)])
def test_keyword_defaults_are_the_forwards(backward, forward):
    ours, theirs = inspect.signature(backward).parameters, inspect.signature(forward).parameters
    keywords = [name for name, p in ours.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords and all(ours[name].default == theirs[name].default for name in keywords)
