"""Which keys a query sees, and the score it gives them: the mask and score rules every attention function shares.

Masks. Positions are absolute and aligned bottom-right, as in FlashAttention-2: query ``i`` of ``seqlen_q`` sits on
the diagonal at key position ``i' = i + seqlen_k - seqlen_q``, and every mask is a band around that diagonal::

    query i sees key j  iff  i' - left <= j <= i' + right          (None on a side: unbounded)

* no mask:              ``left = right = None``
* causal:               ``right = 0``
* ``window=(l, r)``:    ``left = l``, ``right = r`` (a sliding window, as FlashAttention's ``window_size``)
* causal and a window:  ``right = min(r, 0)`` (``0`` if ``r`` is None)

Causal with ``seqlen_q == seqlen_k`` is the usual lower triangle; with ``seqlen_q < seqlen_k`` the queries are the
last ``seqlen_q`` positions of the sequence (decoding with a KV cache); with ``seqlen_q > seqlen_k`` the first
``seqlen_q - seqlen_k`` queries see nothing.

:func:`mask_band` turns the ``causal`` and ``window`` arguments into a :class:`Band`; a new mask kind is one more
case there. :class:`Band` gives the element mask of any block of positions, the key range a block of queries can
see (tiles wholly outside it are skipped) and the query range that can see a block of keys (the backward's skip).
A query whose band holds no key of ``[0, seqlen_k)`` sees nothing: output 0 and ``lse = -inf``.

Scores. ``s_ij = sm_scale * q_i . k_j``, then with ``softcap = c`` (FlashAttention's soft-capping, as in Gemma 2)
``s_ij = c * tanh(s_ij / c)``, and then the mask (``-inf`` where a key is not seen). Capped scores lie in
``(-c, c)``: a raw score of ``+-inf`` becomes ``+-c``, a finite score, so the NaN and inf rules of :mod:`reference`
apply to the capped score (only NaN survives the cap). ``softcap=None`` or ``0``: no capping.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from ._shapes import ArgumentTypeError, check_real

__all__ = ["Band", "mask_band", "check_window", "check_softcap", "cap_scores", "softcap_slope"]


@dataclass(frozen=True)
class Band:
    """Query ``i`` sees key ``j`` iff ``i' - left <= j <= i' + right`` with ``i' = i + seqlen_k - seqlen_q``.

    ``left`` and ``right`` are ints >= 0 or None (unbounded on that side). All methods take absolute positions
    and the full ``seqlen_q``, ``seqlen_k``, so any block of the mask is computed on its own.
    """

    left: int | None = None
    right: int | None = None

    @property
    def masks_nothing(self) -> bool:
        return self.left is None and self.right is None

    def visible(self, query_positions, key_positions, seqlen_q: int, seqlen_k: int) -> np.ndarray:
        """Boolean ``(len(query_positions), len(key_positions))`` array, True where the key is seen."""
        diagonal = np.asarray(query_positions)[:, None] + (seqlen_k - seqlen_q)
        keys = np.asarray(key_positions)[None, :]
        visible = np.ones((diagonal.shape[0], keys.shape[1]), dtype=bool)
        if self.left is not None:
            visible &= keys >= diagonal - self.left
        if self.right is not None:
            visible &= keys <= diagonal + self.right
        return visible

    def key_range(self, q_start: int, q_end: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        """``[begin, end)``: the keys some query of ``[q_start, q_end)`` (non-empty) may see, within ``[0, seqlen_k)``.

        ``(0, 0)`` when the block sees no key. Tiles of keys wholly outside are skipped by the blockwise forms.
        """
        offset = seqlen_k - seqlen_q
        begin = 0 if self.left is None else max(q_start + offset - self.left, 0)
        end = seqlen_k if self.right is None else min(q_end + offset + self.right, seqlen_k)
        return (begin, end) if begin < end else (0, 0)

    def query_range(self, kv_start: int, kv_end: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        """``[begin, end)``: the queries that may see some key of ``[kv_start, kv_end)`` (non-empty), within
        ``[0, seqlen_q)``; ``(0, 0)`` when no query sees the block. Query blocks wholly outside are skipped.
        """
        offset = seqlen_k - seqlen_q
        begin = 0 if self.right is None else max(kv_start - self.right - offset, 0)
        end = seqlen_q if self.left is None else min(kv_end + self.left - offset, seqlen_q)
        return (begin, end) if begin < end else (0, 0)

    def covers(self, q_start: int, q_end: int, kv_start: int, kv_end: int, seqlen_q: int, seqlen_k: int) -> bool:
        """Whether every query of ``[q_start, q_end)`` sees every key of ``[kv_start, kv_end)``: no element mask needed.

        The first query's last key and the last query's first key bound the block. Causal: true for blocks wholly
        below the diagonal, false for those straddling it.
        """
        offset = seqlen_k - seqlen_q
        right_ok = self.right is None or kv_end - 1 <= q_start + offset + self.right
        left_ok = self.left is None or kv_start >= q_end - 1 + offset - self.left
        return right_ok and left_ok


def mask_band(causal: bool, window) -> Band:
    """The band of ``causal`` (a checked bool) and ``window`` (None or a checked ``(left, right)``)."""
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    return Band(left, right)


def _is_int(value) -> bool:
    # bool is an Integral in Python, but window=(True, 0) is never what the caller meant.
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_window(window):
    """``window`` as None (no window) or a tuple ``(left, right)`` of ints >= 0 or None (unbounded on that side).

    A tuple or list of two entries; anything else (another length, a bool, a float, -1 for "unbounded") is a
    ValueError naming ``window`` (an ``ArgumentTypeError`` for a wrong type).
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)):
        raise ArgumentTypeError(f"window must be None or a (left, right) tuple; got {window!r}")
    if len(window) != 2:
        raise ValueError(f"window must have two entries (left, right); got {window!r}")
    for side, value in zip(("left", "right"), window):
        if value is None:
            continue
        if not _is_int(value):
            raise ArgumentTypeError(f"window {side} must be an int >= 0 or None (unbounded); got {value!r}")
        if value < 0:
            raise ValueError(f"window {side} must be an int >= 0 or None (unbounded); got {value}")
    return tuple(None if value is None else int(value) for value in window)


def check_softcap(softcap):
    """``softcap`` as a float > 0, or None for no capping (``None`` or ``0``); a finite real number otherwise."""
    if softcap is None:
        return None
    value = check_real(softcap, "softcap", allow_none=True)
    if value == 0:
        return None
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"softcap must be a finite number > 0 (None or 0: no capping); got {softcap!r}")
    return value


def cap_scores(scores, softcap):
    """``softcap * tanh(scores / softcap)``, or ``scores`` unchanged when ``softcap`` is None."""
    if softcap is None:
        return scores
    with np.errstate(over="ignore"):  # a tiny softcap: scores / softcap = +-inf, tanh = +-1
        return softcap * np.tanh(scores / softcap)


def softcap_slope(scores, softcap):
    """The derivative of :func:`cap_scores` at the uncapped ``scores``: ``1 - tanh(scores / softcap)^2`` (1 if None)."""
    if softcap is None:
        return np.ones_like(scores)
    with np.errstate(over="ignore"):
        return 1.0 - np.tanh(scores / softcap) ** 2
