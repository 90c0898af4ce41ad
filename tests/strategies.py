"""Hypothesis strategies and comparison helpers shared by the reference tests.

Sizes are kept tiny (seqlen <= 40, headdim <= 16, batch and heads <= 3) so a
property can be checked on many examples quickly; the interesting cases are in
the *shapes* (length 1, lengths no block size divides, blocks longer than the
sequence, seqlen_q != seqlen_k, more splits than keys, grouped heads) and the
*magnitudes* (values from 1e-3 to 1e2, so logits reach about 1e4).

Random arrays come from ``np.random.default_rng(seed)`` with a drawn seed:
generation stays fast and shrinking still works on every other parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

# Values of q, k and v are standard normal times one of these; with headdim up
# to 16 and the default 1/sqrt(headdim) scale, 1e2 gives logits around 1e4.
VALUE_SCALES = (1e-3, 1e-1, 1.0, 10.0, 100.0)
MAX_LOGIT = 1e4

seeds = st.integers(min_value=0, max_value=2**32 - 1)
value_scales = st.sampled_from(VALUE_SCALES)


def seqlens(min_value: int = 0, max_value: int = 24):
    """Sequence lengths, with 1 and primes (no block size > 1 divides them) drawn on purpose."""
    primes = [p for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37) if min_value <= p <= max_value]
    special = [n for n in (min_value, 1) if min_value <= n <= max_value] + primes
    return st.one_of(st.sampled_from(special), st.integers(min_value, max_value))


def block_sizes(max_value: int = 48):
    """Block sizes >= 1: mostly small (many blocks), sometimes longer than any sequence here."""
    return st.one_of(st.integers(1, 8), st.integers(1, max_value))


def split_counts(max_value: int = 40):
    """Numbers of KV splits, including more splits than keys."""
    return st.one_of(st.integers(1, 4), st.integers(1, max_value))


@st.composite
def partitions(draw, length: int):
    """Block sizes (possibly 0) of an arbitrary partition of ``length`` into contiguous blocks."""
    cuts = sorted(draw(st.lists(st.integers(0, length), max_size=10)))
    return np.diff([0, *cuts, length]).tolist()


@st.composite
def logit_arrays(draw, max_rows: int = 3, max_length: int = 40, min_length: int = 0,
                 max_abs: float = MAX_LOGIT, masked: bool = True, shape=None):
    """``(rows, length)`` float64 logits in ``[-max_abs, max_abs]``; optionally ~1/4 are ``-inf``.

    ``shape`` fixes the shape instead of drawing it.

    Hypothesis draws the values itself here (ties, zeros, extremes, subnormals)
    since softmax is cheap and the edge values are the interesting ones.
    """
    if shape is None:
        shape = (draw(st.integers(1, max_rows)), draw(st.integers(min_length, max_length)))
    x = draw(hnp.arrays(np.float64, shape,
                        elements=st.floats(-max_abs, max_abs, allow_nan=False)))
    if masked and draw(st.booleans()):
        # sampled_from with repeats weights True at 1/4: masks are common but not overwhelming.
        mask = draw(hnp.arrays(np.bool_, shape, elements=st.sampled_from([False, False, False, True])))
        x = np.where(mask, -np.inf, x)
    return x


def standard_normal(rng, shape, scale):
    return scale * rng.standard_normal(shape)


@dataclass
class AttentionCase:
    """One attention problem: arrays plus the keyword arguments every algorithm takes.

    ``window`` and ``softcap`` (drawn by :func:`masked_attention_cases` only) join ``kwargs`` when set, so the
    cases of the functions without them stay valid for those.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool
    sm_scale: float | None
    window: tuple | None = None
    softcap: float | None = None

    @property
    def kwargs(self):
        kwargs = {"causal": self.causal, "sm_scale": self.sm_scale}
        if self.window is not None:
            kwargs["window"] = self.window
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        return kwargs

    @property
    def unbatched(self) -> bool:
        return self.q.ndim == 2

    def as_4d(self):
        if self.unbatched:
            return self.q[None, None], self.k[None, None], self.v[None, None]
        return self.q, self.k, self.v

    def score_magnitude(self) -> float:
        """``max_ij |sm_scale| * sum_d |q_id k_jd|``: what rounding in a logit is relative to.

        A logit near 0 can come from large cancelling products, so its absolute
        error scales with this, not with the logit itself.
        """
        q, k, _ = self.as_4d()
        sm_scale = 1.0 / np.sqrt(q.shape[-1]) if self.sm_scale is None else self.sm_scale
        k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
        products = np.abs(q) @ np.abs(k).swapaxes(-1, -2)
        return abs(sm_scale) * float(np.max(products, initial=0.0))

    @property
    def lse_atol(self) -> float:
        # Logits carry absolute error ~ headdim * 1.1e-16 * score_magnitude (<= 2e-15 * it here).
        return 1e-13 * (1.0 + self.score_magnitude())

    @property
    def out_atol(self) -> float:
        # An absolute logit error d changes a softmax weight by a relative d, and the
        # output is a weighted mean of v rows, so the error is about d * max|v|; it
        # only matters where the output itself is small from cancelling v values.
        return self.lse_atol * float(np.max(np.abs(self.v), initial=0.0))


@st.composite
def attention_cases(draw, max_seqlen: int = 24, max_headdim: int = 16, causal=None,
                    unbatched=None, lengths=None, scales=value_scales):
    """Attention problems: GQA group sizes 1-3, seqlen_q != seqlen_k, causal or not, any scale.

    ``causal`` / ``unbatched`` fix those choices when given; ``lengths`` is a
    strategy for ``(seqlen_q, seqlen_k)``; ``scales`` one for the magnitude of
    each of q, k and v (default :data:`VALUE_SCALES`). Unbatched cases are
    ``(seqlen, headdim)`` arrays.
    """
    if unbatched is None:
        unbatched = draw(st.booleans())
    if unbatched:
        batch = heads_kv = group_size = 1
    else:
        batch = draw(st.integers(1, 2))
        heads_kv = draw(st.integers(1, 2))
        group_size = draw(st.integers(1, 3))
    if lengths is None:
        seqlen_q = draw(seqlens(0, max_seqlen))
        # Equal lengths are the common case (the diagonal then passes through block corners).
        seqlen_k = draw(st.one_of(st.just(seqlen_q), seqlens(0, max_seqlen)))
    else:
        seqlen_q, seqlen_k = draw(lengths)
    headdim = draw(st.integers(1, max_headdim))
    rng = np.random.default_rng(draw(seeds))
    q = standard_normal(rng, (batch, heads_kv * group_size, seqlen_q, headdim), draw(scales))
    k = standard_normal(rng, (batch, heads_kv, seqlen_k, headdim), draw(scales))
    v = standard_normal(rng, (batch, heads_kv, seqlen_k, headdim), draw(scales))
    if unbatched:
        q, k, v = q[0, 0], k[0, 0], v[0, 0]
    if causal is None:
        causal = draw(st.booleans())
    sm_scale = draw(st.one_of(st.none(), st.sampled_from([0.0, 0.125, 1.0]),
                              st.floats(-1.0, 1.0, allow_nan=False)))
    return AttentionCase(q, k, v, causal, sm_scale)


def windows(max_side: int = 30, optional: bool = True):
    """``window`` arguments: ``(left, right)``, each side None (unbounded), small (0 included) or any size.

    With ``optional`` None (no window) too, a third of the time.
    """
    side = st.one_of(st.none(), st.integers(0, 3), st.integers(0, max_side))
    window = st.tuples(side, side)
    return st.one_of(st.none(), window, window) if optional else window


def softcaps():
    """``softcap`` arguments: None (off) or a cap from well below the logits here to well above most of them."""
    return st.one_of(st.none(), st.floats(0.05, 50.0))


@st.composite
def masked_attention_cases(draw, window=None, softcap=None, **kwargs):
    """:func:`attention_cases` (same keyword arguments) with a drawn ``window`` and ``softcap`` as well."""
    case = draw(attention_cases(**kwargs))
    window = draw(windows() if window is None else window)
    softcap = draw(softcaps() if softcap is None else softcap)
    return replace(case, window=window, softcap=softcap)


@st.composite
def lengths_with_unseen_queries(draw, max_seqlen: int = 24):
    """``(seqlen_q, seqlen_k)`` with seqlen_q > seqlen_k: causally, queries ``i < seqlen_q - seqlen_k`` see no key."""
    seqlen_k = draw(st.integers(0, max_seqlen - 1))
    seqlen_q = draw(st.integers(seqlen_k + 1, max_seqlen))
    return seqlen_q, seqlen_k


def causal_cases_with_unseen_queries(max_seqlen: int = 24):
    return attention_cases(causal=True, lengths=lengths_with_unseen_queries(max_seqlen))


@dataclass
class LinearCase:
    """A causal dot product / linear attention problem; ``initial_state`` may be None."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    initial_state: np.ndarray | None

    def magnitude(self) -> float:
        """Largest entry of ``sum_{j<=i} |q_i||k_j||v_j| + |q_i||S_0|``, what rounding is relative to."""
        q, k, v = np.abs(self.q), np.abs(self.k), np.abs(self.v)
        mask = np.tril(np.ones((q.shape[-2], q.shape[-2])))
        bound = ((q @ k.swapaxes(-1, -2)) * mask) @ v
        if self.initial_state is not None:
            bound = bound + q @ np.abs(self.initial_state)
        return float(np.max(bound, initial=0.0))

    @property
    def atol(self) -> float:
        # Sums of at most ~60 products: error <= 60 * 1.1e-16 * magnitude < 1e-14 * magnitude.
        return 1e-13 * (1.0 + self.magnitude())


@st.composite
def linear_cases(draw, max_seqlen: int = 40, with_state=None, unbatched=None):
    """Causal dot product inputs: q, k ``(batch, heads, seqlen, E)``, v ``(..., M)`` with E != M allowed."""
    if unbatched is None:
        unbatched = draw(st.booleans())
    leading = () if unbatched else (draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    seqlen = draw(seqlens(0, max_seqlen))
    features, values = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(seeds))
    q = standard_normal(rng, leading + (seqlen, features), draw(value_scales))
    k = standard_normal(rng, leading + (seqlen, features), draw(value_scales))
    v = standard_normal(rng, leading + (seqlen, values), draw(value_scales))
    if with_state is None:
        with_state = draw(st.booleans())
    initial_state = None
    if with_state:
        initial_state = standard_normal(rng, leading + (features, values), draw(value_scales))
    return LinearCase(q, k, v, initial_state)


def mask_by_hand(seqlen_q, seqlen_k, causal, window):
    """The band mask from its definition, one element at a time: query ``i`` sees key ``j`` iff
    ``i' - left <= j <= i' + right`` (``i' = i + seqlen_k - seqlen_q``, None: unbounded) and, if causal, ``j <= i'``."""
    left, right = (None, None) if window is None else window
    visible = np.zeros((seqlen_q, seqlen_k), dtype=bool)
    for i in range(seqlen_q):
        diagonal = i + seqlen_k - seqlen_q
        for j in range(seqlen_k):
            visible[i, j] = ((left is None or j >= diagonal - left) and (right is None or j <= diagonal + right)
                             and (not causal or j <= diagonal))
    return visible


def assert_close(actual, expected, *, rtol: float = 1e-10, atol: float = 0.0):
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|`` with exact infinities.

    NaN anywhere fails. Infinite entries (``lse = -inf`` for a row with no
    visible key) must be equal in both arrays, not merely close.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != expected {expected.shape}"
    assert not np.isnan(actual).any(), f"NaN in result:\n{actual}"
    assert not np.isnan(expected).any(), f"NaN in expected:\n{expected}"
    infinite = np.isinf(actual) | np.isinf(expected)
    np.testing.assert_array_equal(actual[infinite], expected[infinite],
                                  err_msg="infinite entries differ")
    np.testing.assert_allclose(actual[~infinite], expected[~infinite], rtol=rtol, atol=atol)
