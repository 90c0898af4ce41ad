"""Softmax three ways: naive, safe (max-subtracted) and online (block by block).

The online form is the idea every FlashAttention kernel is built on. A block of
logits ``x`` is summarised by its softmax *state* ``(m, l)``::

    m = max(x)                  running maximum
    l = sum(exp(x - m))         sum of exponentials relative to that maximum

and two states merge without looking at the logits again::

    m = max(m_a, m_b)
    l = l_a * exp(m_a - m) + l_b * exp(m_b - m)

The empty block has state ``(-inf, 0)``, which is the identity of the merge.
``exp(-inf - -inf)`` would be NaN, so wherever a maximum can still be ``-inf``
(nothing seen yet, or everything masked) the shift is taken as 0 instead: the
exponentials are then ``exp(-inf) = 0``, which is the right answer.

A row made only of ``-inf`` (every entry masked) has no softmax; the safe and
online versions return 0 for it, the same convention as attention uses for a
query that sees no key.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from ._shapes import check_positive_int, to_float64

__all__ = [
    "naive_softmax",
    "safe_softmax",
    "softmax_state",
    "merge_softmax_states",
    "online_softmax",
]


def _shifted_exp(x, m, exp=np.exp):
    """``exp(x - m)`` for ``x <= m``, giving 0 (not NaN) where ``m`` is ``-inf``.

    ``m = -inf`` only happens when every ``x`` it bounds is ``-inf`` too, and then
    each term is supposed to contribute nothing. ``exp`` may be ``np.exp2`` for
    maxima kept in base 2 (FlashAttention-2).
    """
    finite_m = np.where(np.isneginf(m), 0.0, m)
    return exp(x - finite_m)


def _safe_divide(numerator, denominator):
    """``numerator / denominator`` where a zero denominator (nothing seen) gives exactly 0.

    A zero denominator arises when every weight of the numerator is zero (no key seen, every score ``-inf``):
    such a row is 0 whatever the values hold, NaN included (``0 * NaN`` terms are not summed).
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator == 0, 0.0, numerator / np.where(denominator == 0, 1.0, denominator))


def _product(weights, values):
    # einsum, not matmul: each row's sum then does not depend on how many rows there are (BLAS blocks by size),
    # so a subset of the rows gives bit-identical results
    return np.einsum("...qk,...kd->...qd", weights, values)


def _visible_matmul(weights, values, visible=None):
    """``weights @ values`` summed over the visible terms only: ``sum_j [visible_ij] w_ij v_jd``.

    The terms that are summed follow IEEE arithmetic (``0 * inf`` is NaN, NaN propagates); the terms of keys a
    row does not see are not there at all, whatever their weight and value hold. ``visible`` is a boolean array
    that broadcasts to ``weights`` (None: every term is visible). A plain product would let an unseen NaN or inf
    through ``0 * NaN = NaN``. Shapes as ``np.matmul``: ``(..., q, k) @ (..., k, d)``.
    """
    weights = np.asarray(weights, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    visible = np.ones(weights.shape[-2:], dtype=bool) if visible is None else np.asarray(visible, dtype=bool)
    visible = np.broadcast_to(visible, np.broadcast_shapes(visible.shape, weights.shape))
    masked = np.where(visible, weights, 0.0)
    finite = np.isfinite(values)
    if finite.all():
        return _product(masked, values)  # masked terms are 0 * finite = 0
    with np.errstate(invalid="ignore", over="ignore"):
        out = _product(masked, np.where(finite, values, 0.0))

        def hits(rows, cols):  # whether some visible term has both properties
            return (rows.astype(np.float64) @ cols.astype(np.float64)) > 0

        positive, negative = visible & (weights > 0), visible & (weights < 0)
        plus = hits(positive, np.isposinf(values)) | hits(negative, np.isneginf(values))
        minus = hits(positive, np.isneginf(values)) | hits(negative, np.isposinf(values))
        nan = hits(visible, np.isnan(values)) | hits(visible & (weights == 0), np.isinf(values))
        out = np.where(plus, out + np.inf, out)
        out = np.where(minus, out - np.inf, out)  # +inf and -inf terms: NaN, as their sum
        return np.where(nan, np.nan, out)


def naive_softmax(x, axis: int = -1, dtype=None) -> np.ndarray:
    """``exp(x) / sum(exp(x))`` exactly as written.

    This overflows as soon as a logit exceeds about 709 (``exp`` of it is inf in
    float64), giving inf/inf = NaN; that failure is the reason the other two
    functions exist. Numpy's overflow warnings are silenced so callers can
    observe the inf/NaN result directly.
    """
    x = to_float64(x, "x")
    with np.errstate(over="ignore", invalid="ignore"):
        exponentials = np.exp(x)
        result = exponentials / np.sum(exponentials, axis=axis, keepdims=True)
    return np.asarray(result, dtype=np.float64 if dtype is None else dtype)


def safe_softmax(x, axis: int = -1, dtype=None) -> np.ndarray:
    """Softmax with the maximum subtracted first, so every exponent is <= 0 and cannot overflow.

    Mathematically identical to :func:`naive_softmax` (softmax is invariant to a
    shift of its input). A row that is entirely ``-inf`` gives 0.
    """
    x = to_float64(x, "x")
    row_max = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
    exponentials = _shifted_exp(x, row_max)
    return np.asarray(
        _safe_divide(exponentials, np.sum(exponentials, axis=axis, keepdims=True)),
        dtype=np.float64 if dtype is None else dtype,
    )


def softmax_state(x_block) -> tuple[np.ndarray, np.ndarray]:
    """The softmax state ``(m, l)`` of a block of logits along its last axis.

    ``m = max(x_block)`` and ``l = sum(exp(x_block - m))``, both of shape
    ``x_block.shape[:-1]``. An empty or all ``-inf`` block gives the identity
    state ``(-inf, 0)``.
    """
    x_block = to_float64(x_block, "x_block")
    if x_block.ndim < 1:
        raise ValueError(f"x_block must have at least one axis; got shape {x_block.shape}")
    m = np.max(x_block, axis=-1, initial=-np.inf)
    l = np.sum(_shifted_exp(x_block, m[..., None]), axis=-1)
    return m, l


def merge_softmax_states(state_a, state_b) -> tuple[np.ndarray, np.ndarray]:
    """Merge two softmax states ``(m, l)`` into the state of the concatenated blocks.

    ``m = max(m_a, m_b)`` and ``l = l_a * exp(m_a - m) + l_b * exp(m_b - m)``.
    The merge is commutative (exactly, in floating point), associative (up to
    rounding) and has the identity ``(-inf, 0)``; two empty states merge to an
    empty state without NaN.
    """
    m_a, l_a = (to_float64(part, "state_a") for part in state_a)
    m_b, l_b = (to_float64(part, "state_b") for part in state_b)
    m = np.maximum(m_a, m_b)
    l = l_a * _shifted_exp(m_a, m) + l_b * _shifted_exp(m_b, m)
    return m, l


def _block_boundaries(block_sizes, length: int) -> list[int]:
    """Offsets ``[0, ..., length]`` of the contiguous blocks described by ``block_sizes``."""
    if isinstance(block_sizes, numbers.Integral) and not isinstance(block_sizes, bool):
        block_size = check_positive_int(block_sizes, "block_sizes")
        return list(range(0, length, block_size)) + [length]
    if not isinstance(block_sizes, Sequence):
        raise ValueError(
            f"block_sizes must be a positive int or a sequence of block lengths; got {block_sizes!r}"
        )
    boundaries = [0]
    for size in block_sizes:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError(f"block_sizes must contain non-negative integers; got {block_sizes!r}")
        boundaries.append(boundaries[-1] + int(size))
    if boundaries[-1] != length:
        raise ValueError(
            f"block_sizes must add up to the row length {length}; they add up to {boundaries[-1]}"
        )
    return boundaries


def online_softmax(x, block_sizes: int | Sequence[int] = 64, dtype=None) -> np.ndarray:
    """Softmax along the last axis computed block by block, the way attention kernels do it.

    ``block_sizes`` partitions each row into contiguous blocks: an int ``b``
    means blocks of ``b`` logits (the last one shorter if ``b`` does not divide
    the row length); a sequence gives the length of each block in order and must
    add up to the row length (zero-length blocks are allowed and contribute the
    identity state).

    Pass 1 folds the blocks into a running state ``(m, l)`` with
    :func:`merge_softmax_states`; pass 2 normalises every logit with the final
    state, ``exp(x - m) / l``. The result equals :func:`safe_softmax` for every
    partition, up to rounding.
    """
    x = to_float64(x, "x")
    if x.ndim < 1:
        raise ValueError(f"x must have at least one axis; got shape {x.shape}")
    boundaries = _block_boundaries(block_sizes, x.shape[-1])

    state = (np.full(x.shape[:-1], -np.inf), np.zeros(x.shape[:-1]))
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        state = merge_softmax_states(state, softmax_state(x[..., start:end]))

    m, l = state
    result = _safe_divide(_shifted_exp(x, m[..., None]), l[..., None])
    return np.asarray(result, dtype=np.float64 if dtype is None else dtype)
