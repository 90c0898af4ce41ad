"""Properties of the real-batch references: packed variable-length sequences and KV caches (dense and paged)."""

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import (
    AttentionCase,
    assert_close,
    mask_by_hand,
    seeds,
    seqlens,
    softcaps,
    standard_normal,
    value_scales,
    windows,
)

from reference import attention, attention_backward, attention_varlen, attention_varlen_backward, attention_with_kvcache


def _options(draw):
    """``causal``, ``sm_scale``, ``window`` and ``softcap`` keyword arguments, as the attention cases draw them."""
    return {"causal": draw(st.booleans()),
            "sm_scale": draw(st.one_of(st.none(), st.sampled_from([0.0, 1.0]), st.floats(-1.0, 1.0))),
            "window": draw(windows(max_side=10)), "softcap": draw(softcaps())}


def _sequence_case(q, k, v, options):
    """The attention problem of one sequence, in ``(1, heads, seqlen, headdim)`` layout: its tolerances."""
    return AttentionCase(q, k, v, options["causal"], options["sm_scale"], options["window"], options["softcap"])


def assert_same_attention(actual, expected, case):
    (out, lse), (expected_out, expected_lse) = actual, expected
    assert_close(out, expected_out, atol=case.out_atol)
    assert_close(lse, expected_lse, atol=case.lse_atol)


# -- packed sequences ------------------------------------------------------------------------------------------------

@dataclass
class VarlenCase:
    q: np.ndarray  # (total_q, heads, headdim)
    k: np.ndarray  # (total_k, kv_heads, headdim)
    v: np.ndarray
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    options: dict

    def sequences(self):
        """Each sequence's rows of the packed q, its rows of k and v, and its ``(1, heads, seqlen, headdim)`` q, k, v."""
        for b in range(len(self.cu_seqlens_q) - 1):
            rows = slice(self.cu_seqlens_q[b], self.cu_seqlens_q[b + 1])
            keys = slice(self.cu_seqlens_k[b], self.cu_seqlens_k[b + 1])
            yield rows, keys, [x[None].transpose(0, 2, 1, 3) for x in (self.q[rows], self.k[keys], self.v[keys])]


@st.composite
def varlen_cases(draw, max_seqlen: int = 8, scales=value_scales, softcap=None):
    """Up to 4 sequences (empty ones too), seqlen_q != seqlen_k per sequence, GQA groups 1-3, any window and cap
    (``scales``: a strategy for the inputs' magnitudes; ``softcap``: one for the cap, else ``softcaps()``)."""
    batch = draw(st.integers(0, 4))
    lengths_q = draw(st.lists(seqlens(0, max_seqlen), min_size=batch, max_size=batch))
    lengths_k = draw(st.one_of(st.just(lengths_q), st.lists(seqlens(0, max_seqlen), min_size=batch, max_size=batch)))
    heads_kv, group, headdim = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(seeds))
    q = standard_normal(rng, (sum(lengths_q), heads_kv * group, headdim), draw(scales))
    k = standard_normal(rng, (sum(lengths_k), heads_kv, headdim), draw(scales))
    v = standard_normal(rng, (sum(lengths_k), heads_kv, headdim), draw(scales))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(dtype)
                  for lengths in (lengths_q, lengths_k))
    options = _options(draw)
    if softcap is not None:
        options["softcap"] = draw(softcap)
    return VarlenCase(q, k, v, cu_q, cu_k, options)


@given(varlen_cases())
def test_varlen_equals_each_sequence_on_its_own(case):
    out, lse = attention_varlen(case.q, case.k, case.v, case.cu_seqlens_q, case.cu_seqlens_k, return_lse=True,
                                **case.options)
    assert out.shape == case.q.shape and lse.shape == (case.q.shape[1], case.q.shape[0])
    for rows, _, (q, k, v) in case.sequences():
        expected = attention(q, k, v, return_lse=True, **case.options)
        actual = out[rows].transpose(1, 0, 2)[None], lse[:, rows][None]
        assert_same_attention(actual, expected, _sequence_case(q, k, v, case.options))


@given(varlen_cases())
def test_varlen_rows_that_see_no_key_give_zero_and_minus_inf(case):
    out, lse = attention_varlen(case.q, case.k, case.v, case.cu_seqlens_q, case.cu_seqlens_k, return_lse=True,
                                **case.options)
    for rows, _, (q, k, _) in case.sequences():
        seen = mask_by_hand(q.shape[2], k.shape[2], case.options["causal"], case.options["window"]).any(axis=1)
        assert (out[rows][~seen] == 0).all() and np.isneginf(lse[:, rows][:, ~seen]).all()
        assert np.isfinite(out[rows]).all() and np.isfinite(lse[:, rows][:, seen]).all()


@given(varlen_cases(), st.sampled_from([np.nan, np.inf]))
def test_other_sequences_never_affect_a_sequence(case, poison):
    expected = attention_varlen(case.q, case.k, case.v, case.cu_seqlens_q, case.cu_seqlens_k, **case.options)
    for rows, keys, _ in case.sequences():
        k, v = np.full_like(case.k, poison), np.full_like(case.v, poison)
        k[keys], v[keys] = case.k[keys], case.v[keys]
        with np.errstate(invalid="ignore", over="ignore"):  # the poisoned sequences
            out = attention_varlen(case.q, k, v, case.cu_seqlens_q, case.cu_seqlens_k, **case.options)
        np.testing.assert_array_equal(out[rows], expected[rows])


# -- the backward of packed sequences ----------------------------------------------------------------------------------

@given(varlen_cases(), seeds)
def test_varlen_backward_equals_each_sequence_on_its_own(case, seed):
    dout = np.random.default_rng(seed).standard_normal(case.q.shape)
    dq, dk, dv = attention_varlen_backward(dout, case.q, case.k, case.v, case.cu_seqlens_q, case.cu_seqlens_k,
                                           **case.options)
    assert (dq.shape, dk.shape, dv.shape) == (case.q.shape, case.k.shape, case.v.shape)
    for rows, keys, (q, k, v) in case.sequences():
        expected = attention_backward(dout[rows].transpose(1, 0, 2)[None], q, k, v, **case.options)
        for actual, want in zip((dq[rows], dk[keys], dv[keys]), expected):
            np.testing.assert_array_equal(actual, want[0].transpose(1, 0, 2))


# central differences: as tests/reference/test_reference_attention_backward.py (moderate values, caps from 0.5)
FD_STEP = 1e-6


@given(varlen_cases(max_seqlen=5, scales=st.sampled_from([0.1, 0.5, 1.0, 2.0]),
                    softcap=st.none() | st.floats(0.5, 20.0)), seeds)
def test_varlen_backward_equals_central_differences(case, seed):
    rng = np.random.default_rng(seed)
    dout = rng.standard_normal(case.q.shape)
    directions = [rng.standard_normal(x.shape) for x in (case.q, case.k, case.v)]
    grads = attention_varlen_backward(dout, case.q, case.k, case.v, case.cu_seqlens_q, case.cu_seqlens_k,
                                      **case.options)

    def loss(sign):
        q, k, v = (x + sign * FD_STEP * d for x, d in zip((case.q, case.k, case.v), directions))
        return float(np.sum(dout * attention_varlen(q, k, v, case.cu_seqlens_q, case.cu_seqlens_k, **case.options)))

    fd = (loss(1) - loss(-1)) / (2 * FD_STEP)
    terms = np.array([np.sum(g * d) for g, d in zip(grads, directions)])
    magnitude = float(np.sum(np.abs(dout))) * float(np.max(np.abs(case.v), initial=0.0))
    assert abs(fd - terms.sum()) <= 1e-6 * np.abs(terms).sum() + 1e-8 * magnitude


def test_varlen_backward_checks_dout_and_the_arguments():
    q, k, v = _packed()
    with pytest.raises(ValueError, match="^dout"):
        attention_varlen_backward(np.zeros((4, 4, 3)), q, k, v, [0, 3, 5], [0, 4, 6])
    with pytest.raises(ValueError, match="^cu_seqlens_q"):
        attention_varlen_backward(q, q, k, v, [0, 3, 4], [0, 4, 6])
    with pytest.raises(ValueError, match="^window"):
        attention_varlen_backward(q, q, k, v, [0, 3, 5], [0, 4, 6], window=(-1, 0))


def test_return_lse_false_returns_only_the_output():
    q = np.ones((5, 2, 3))
    out = attention_varlen(q, q, q, [0, 2, 5], np.array([0, 2, 5]))
    assert isinstance(out, np.ndarray) and out.shape == q.shape


def _packed(total_q=5, total_k=6, heads=4, kv_heads=2, headdim=3):
    """Packed q, k, v of two sequences (cu_seqlens_q [0, 3, 5], cu_seqlens_k [0, 4, 6])."""
    return (np.zeros((total_q, heads, headdim)),
            np.zeros((total_k, kv_heads, headdim)), np.zeros((total_k, kv_heads, headdim)))


def _starts_with(name):
    """Messages start with the argument's name; a heads mismatch is told as "q heads (..) must be a multiple"."""
    return r"^q heads\b" if name == "heads" else rf"^{name}\b"


BAD_VARLEN = [
    ("cu_seqlens_q", {"cu_seqlens_q": [0, 3, 2, 5], "cu_seqlens_k": [0, 2, 4, 6]}),  # decreasing
    ("cu_seqlens_q", {"cu_seqlens_q": [1, 3, 5]}),  # not from 0
    ("cu_seqlens_q", {"cu_seqlens_q": [0, 3, 4]}),  # ends before total_q
    ("cu_seqlens_q", {"cu_seqlens_q": [0, 3, 6]}),  # ends past total_q
    ("cu_seqlens_q", {"cu_seqlens_q": [-1, 3, 5]}),
    ("cu_seqlens_q", {"cu_seqlens_q": [0.0, 3.0, 5.0]}),
    ("cu_seqlens_q", {"cu_seqlens_q": [False, True]}),
    ("cu_seqlens_q", {"cu_seqlens_q": []}),
    ("cu_seqlens_q", {"cu_seqlens_q": [[0, 3, 5]]}),
    ("cu_seqlens_k", {"cu_seqlens_q": [0, 1, 3, 5], "cu_seqlens_k": [0, 4, 2, 6]}),
    ("cu_seqlens_k", {"cu_seqlens_k": [0, 7]}),
    ("cu_seqlens_k", {"cu_seqlens_k": [0, 6]}),  # one sequence, q has two
    ("cu_seqlens_k", {"cu_seqlens_k": [0, 2, 4, 6]}),  # three
    ("cu_seqlens_k", {"cu_seqlens_k": np.array([0, 2.5, 6])}),
    ("q", {"arrays": (np.zeros((1, 5, 4, 3)), *_packed()[1:])}),
    ("q", {"arrays": _packed(headdim=0)}),
    ("k", {"arrays": (_packed()[0], np.zeros((6, 2)), np.zeros((6, 2)))}),
    ("k", {"arrays": _packed(headdim=3)[:1] + _packed(headdim=2)[1:]}),
    ("v", {"arrays": _packed()[:2] + (np.zeros((6, 1, 3)),)}),
    ("heads", {"arrays": _packed(kv_heads=3)}),
    ("causal", {"causal": 1}),
    ("return_lse", {"return_lse": "yes"}),
    ("sm_scale", {"sm_scale": np.nan}),
    ("window", {"window": (-1, 0)}),
    ("window", {"window": (0, True)}),
    ("softcap", {"softcap": -2.0}),
    ("softcap", {"softcap": np.nan}),
]


@pytest.mark.parametrize("name, override", BAD_VARLEN, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_VARLEN)])
def test_bad_varlen_arguments_raise_value_error_naming_them(name, override):
    arguments = {"arrays": _packed(), "cu_seqlens_q": [0, 3, 5], "cu_seqlens_k": [0, 4, 6]}
    arguments.update(override)
    q, k, v = arguments.pop("arrays")
    with pytest.raises(ValueError, match=_starts_with(name)):
        attention_varlen(q, k, v, arguments.pop("cu_seqlens_q"), arguments.pop("cu_seqlens_k"), **arguments)


def test_the_valid_arguments_of_the_bad_argument_tests_are_accepted():
    q, k, v = _packed()
    assert attention_varlen(q, k, v, [0, 3, 5], [0, 4, 6]).shape == q.shape
    assert attention_varlen(q, k, v, [0, 1, 3, 5], [0, 2, 4, 6]).shape == q.shape


# -- KV caches -------------------------------------------------------------------------------------------------------

@dataclass
class CacheCase:
    q: np.ndarray  # (batch, heads, seqlen_q, headdim)
    k_dense: np.ndarray  # (batch, kv_heads, capacity, headdim)
    v_dense: np.ndarray
    k_pages: np.ndarray  # (num_pages, page_size, kv_heads, headdim): the dense cache, pages in a random order
    v_pages: np.ndarray
    block_table: np.ndarray  # (batch, max_pages) int32
    cache_seqlens: np.ndarray
    options: dict

    def whole(self):
        """The whole batch as one attention problem: tolerances that hold for every row."""
        return _sequence_case(self.q, self.k_dense, self.v_dense, self.options)


@st.composite
def cache_cases(draw):
    """A dense cache and the same keys in pages of any size, in any order, with unused pages among them."""
    batch, heads_kv, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    headdim, seqlen_q = draw(st.integers(1, 6)), draw(st.integers(0, 5))
    page_size, max_pages = draw(st.integers(1, 5)), draw(st.integers(0, 4))
    capacity = page_size * max_pages
    rng = np.random.default_rng(draw(seeds))
    q = standard_normal(rng, (batch, heads_kv * group, seqlen_q, headdim), draw(value_scales))
    k = standard_normal(rng, (batch, heads_kv, capacity, headdim), draw(value_scales))
    v = standard_normal(rng, (batch, heads_kv, capacity, headdim), draw(value_scales))
    cache_seqlens = np.array(draw(st.lists(st.integers(0, capacity), min_size=batch, max_size=batch)), np.int32)

    num_pages = batch * max_pages + draw(st.integers(0, 3))  # pages no row uses hold NaN
    order = draw(st.permutations(range(num_pages)))
    block_table = np.array(order[:batch * max_pages], dtype=np.int32).reshape(batch, max_pages)
    k_pages, v_pages = np.full((2, num_pages, page_size, heads_kv, headdim), np.nan)
    for b in range(batch):
        for p in range(max_pages):
            positions = slice(p * page_size, (p + 1) * page_size)
            k_pages[block_table[b, p]] = k[b, :, positions].transpose(1, 0, 2)
            v_pages[block_table[b, p]] = v[b, :, positions].transpose(1, 0, 2)
    return CacheCase(q, k, v, k_pages, v_pages, block_table, cache_seqlens, _options(draw))


@given(cache_cases())
def test_cache_seqlens_equals_slicing_the_dense_cache(case):
    out, lse = attention_with_kvcache(case.q, case.k_dense, case.v_dense, cache_seqlens=case.cache_seqlens,
                                      return_lse=True, **case.options)
    assert out.shape == case.q.shape and lse.shape == case.q.shape[:-1]
    for b, length in enumerate(case.cache_seqlens):
        q, k, v = case.q[b:b + 1], case.k_dense[b:b + 1, :, :length], case.v_dense[b:b + 1, :, :length]
        expected = attention(q, k, v, return_lse=True, **case.options)
        assert_same_attention((out[b:b + 1], lse[b:b + 1]), expected, _sequence_case(q, k, v, case.options))


@given(cache_cases())
def test_without_cache_seqlens_every_row_sees_the_whole_cache(case):
    expected = attention(case.q, case.k_dense, case.v_dense, return_lse=True, **case.options)
    for lengths in (None, case.k_dense.shape[2], np.full(case.q.shape[0], case.k_dense.shape[2])):
        actual = attention_with_kvcache(case.q, case.k_dense, case.v_dense, cache_seqlens=lengths, return_lse=True,
                                        **case.options)
        assert_same_attention(actual, expected, case.whole())


@given(cache_cases())
def test_paged_cache_equals_the_same_cache_laid_out_densely(case):
    expected = attention_with_kvcache(case.q, case.k_dense, case.v_dense, cache_seqlens=case.cache_seqlens,
                                      return_lse=True, **case.options)
    actual = attention_with_kvcache(case.q, case.k_pages, case.v_pages, cache_seqlens=case.cache_seqlens,
                                    block_table=case.block_table, return_lse=True, **case.options)
    assert_same_attention(actual, expected, case.whole())


@given(cache_cases(), st.sampled_from([np.nan, np.inf]))
def test_keys_past_cache_seqlens_and_unread_table_entries_never_matter(case, poison):
    """Poison past each row's length (dense), padding -1 in the table entries no row reads (paged): same results."""
    lengths = case.cache_seqlens
    k, v = case.k_dense.copy(), case.v_dense.copy()
    table = case.block_table.copy()
    page_size = case.k_pages.shape[1]
    for b, length in enumerate(lengths):
        k[b, :, length:], v[b, :, length:] = poison, poison
        table[b, -(-length // page_size):] = -1
    expected = attention_with_kvcache(case.q, case.k_dense, case.v_dense, cache_seqlens=lengths, **case.options)
    np.testing.assert_array_equal(attention_with_kvcache(case.q, k, v, cache_seqlens=lengths, **case.options),
                                  expected)
    expected = attention_with_kvcache(case.q, case.k_pages, case.v_pages, cache_seqlens=lengths,
                                      block_table=case.block_table, **case.options)
    paged = attention_with_kvcache(case.q, case.k_pages, case.v_pages, cache_seqlens=lengths, block_table=table,
                                   **case.options)
    np.testing.assert_array_equal(paged, expected)


@given(cache_cases())
def test_cache_rows_that_see_no_key_give_zero_and_minus_inf(case):
    out, lse = attention_with_kvcache(case.q, case.k_pages, case.v_pages, cache_seqlens=case.cache_seqlens,
                                      block_table=case.block_table, return_lse=True, **case.options)
    seqlen_q = case.q.shape[2]
    for b, length in enumerate(case.cache_seqlens):
        seen = mask_by_hand(seqlen_q, length, case.options["causal"], case.options["window"]).any(axis=1)
        assert (out[b][:, ~seen] == 0).all() and np.isneginf(lse[b][:, ~seen]).all()
        assert np.isfinite(out[b]).all() and np.isfinite(lse[b][:, seen]).all()


def _cache(batch=2, heads=4, kv_heads=2, seqlen_q=3, headdim=3, num_pages=5, page_size=2, max_pages=2):
    """q, a paged k_cache / v_cache and a block table whose pages hold 4 keys per row."""
    pages = np.zeros((num_pages, page_size, kv_heads, headdim))
    table = np.arange(batch * max_pages, dtype=np.int32).reshape(batch, max_pages)
    return np.zeros((batch, heads, seqlen_q, headdim)), pages, pages.copy(), table


BAD_CACHES = [
    ("block_table", {"block_table": np.array([[0, 1], [2, 5]])}),  # past num_pages
    ("block_table", {"block_table": np.array([[0, 1], [2, 9]]), "cache_seqlens": [4, 3]}),
    ("block_table", {"block_table": np.array([[0, -1], [2, 3]])}),  # negative, and read
    ("block_table", {"block_table": np.array([[0.0, 1.0], [2.0, 3.0]])}),
    ("block_table", {"block_table": np.array([0, 1, 2, 3])}),
    ("block_table", {"block_table": np.array([[0, 1]])}),  # batch 1, q has 2
    ("cache_seqlens", {"cache_seqlens": [4, 5]}),  # past the capacity 2 * 2
    ("cache_seqlens", {"cache_seqlens": [-1, 2]}),
    ("cache_seqlens", {"cache_seqlens": [1, 2, 3]}),
    ("cache_seqlens", {"cache_seqlens": [1.0, 2.0]}),
    ("cache_seqlens", {"cache_seqlens": True}),
    ("cache_seqlens", {"cache_seqlens": 5}),
    ("k_cache", {"k_cache": np.zeros((5, 2, 2)), "v_cache": np.zeros((5, 2, 2))}),
    ("k_cache", {"k_cache": np.zeros((5, 2, 2, 4)), "v_cache": np.zeros((5, 2, 2, 4))}),  # headdim 4, q has 3
    ("k_cache", {"k_cache": np.zeros((5, 0, 2, 3)), "v_cache": np.zeros((5, 0, 2, 3))}),  # page_size 0
    ("v_cache", {"v_cache": np.zeros((5, 2, 1, 3))}),
    ("heads", {"k_cache": np.zeros((5, 2, 3, 3)), "v_cache": np.zeros((5, 2, 3, 3))}),
    ("q", {"q": np.zeros((4, 3, 3))}),
    ("q", {"q": np.zeros((2, 4, 3, 0)), "k_cache": np.zeros((5, 2, 2, 0)), "v_cache": np.zeros((5, 2, 2, 0))}),
    ("k_cache", {"block_table": None, "k_cache": np.zeros((3, 2, 4, 3)), "v_cache": np.zeros((3, 2, 4, 3))}),
    ("causal", {"causal": None}),
    ("window", {"window": (2, -1)}),
    ("window", {"window": (np.bool_(True), None)}),
    ("softcap", {"softcap": 0.0 - 1e-9}),
    ("softcap", {"softcap": np.inf}),
]


@pytest.mark.parametrize("name, override", BAD_CACHES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CACHES)])
def test_bad_cache_arguments_raise_value_error_naming_them(name, override):
    q, k_cache, v_cache, block_table = _cache()
    arguments = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": block_table}
    arguments.update(override)
    with pytest.raises(ValueError, match=_starts_with(name)):
        attention_with_kvcache(arguments.pop("q"), arguments.pop("k_cache"), arguments.pop("v_cache"), **arguments)


def test_the_valid_cache_of_the_bad_argument_tests_is_accepted():
    q, k_cache, v_cache, block_table = _cache()
    out = attention_with_kvcache(q, k_cache, v_cache, block_table=block_table, cache_seqlens=[4, 1])
    assert out.shape == q.shape
    dense = np.zeros((2, 2, 4, 3))
    assert attention_with_kvcache(q, dense, dense, cache_seqlens=np.array([0, 4])).shape == q.shape
