"""Split-KV attention (Flash-Decoding) and the log-sum-exp merge of its partial results.

When there are few queries (decoding) the keys are split into ``num_splits``
contiguous ranges that are processed in parallel; each split produces a
normalised partial output ``o_s`` and its log-sum-exp ``lse_s``, and
:func:`combine_lse` merges them::

    lse = log(sum_s exp(lse_s))                     (computed as max + log-sum of shifted exps)
    out = sum_s exp(lse_s - lse) * o_s

Partition rule (kernels must use the same one to compare parts directly):
split ``s`` owns keys ``[boundaries[s], boundaries[s + 1])`` with the boundaries
of ``np.array_split``: the first ``seqlen_k % num_splits`` splits get
``ceil(seqlen_k / num_splits)`` keys and the rest ``floor(seqlen_k / num_splits)``.
:func:`split_boundaries` returns these offsets. With more splits than keys the
trailing splits are empty; an empty split (or one whose keys are all masked for a
query) has output 0 and ``lse = -inf`` and drops out of the merge. The merged
result does not depend on the partition, only the parts do.
"""

from __future__ import annotations

import numpy as np

from ._shapes import check_flag, check_positive_int, finish, prepare_qkv, resolve_sm_scale, to_float64
from .attention import _full_mask, _masked_attention
from .softmax import _shifted_exp

__all__ = ["split_boundaries", "split_kv_attention", "combine_lse"]


def split_boundaries(seqlen_k: int, num_splits: int) -> np.ndarray:
    """Key offsets ``[0, ..., seqlen_k]`` (length ``num_splits + 1``) of the splits.

    Same partition as ``np.array_split``: sizes differ by at most one, larger
    splits first, trailing splits empty when ``num_splits > seqlen_k``.
    """
    num_splits = check_positive_int(num_splits, "num_splits")
    if seqlen_k < 0:
        raise ValueError(f"seqlen_k must be >= 0; got {seqlen_k}")
    base_size, remainder = divmod(seqlen_k, num_splits)
    sizes = [base_size + 1 if split < remainder else base_size for split in range(num_splits)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def split_kv_attention(q, k, v, num_splits, causal=False, sm_scale=None, dtype=None, boundaries=None):
    """Attention of ``q`` against each of ``num_splits`` contiguous key ranges separately.

    Args:
        q, k, v, causal, sm_scale: as for :func:`reference.attention` (grouped-query
            heads, ``(seqlen, headdim)`` inputs and bottom-right causal masking
            included; the mask uses absolute key positions, so a split sees
            exactly the keys of the full problem that fall in its range).
        num_splits: number of key ranges (>= 1), partitioned as :func:`split_boundaries`.
        dtype: dtype of the returned arrays (default float64).
        boundaries: optional key offsets ``[0, ..., seqlen_k]`` (``num_splits + 1`` of them, non-decreasing) of
            another partition, e.g. a kernel's (a split ``s`` owns ``[boundaries[s], boundaries[s + 1])``).

    Returns:
        ``(o_parts, lse_parts)`` with shapes
        ``(num_splits, batch, heads_q, seqlen_q, headdim)`` and
        ``(num_splits, batch, heads_q, seqlen_q)`` (without the batch and heads
        axes for ``(seqlen, headdim)`` inputs). Each ``o_parts[s]`` is normalised
        over its own keys; a split that gives a row no visible key has 0 there
        and ``lse = -inf``. :func:`combine_lse` of the parts equals attention.
    """
    q, k, v, unbatched = prepare_qkv(q, k, v)
    num_splits = check_positive_int(num_splits, "num_splits")
    causal = check_flag(causal, "causal")
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    visible = _full_mask(seqlen_q, seqlen_k, causal)
    if boundaries is None:
        boundaries = split_boundaries(seqlen_k, num_splits)
    else:
        boundaries = np.asarray(boundaries)
        if (boundaries.shape != (num_splits + 1,) or not np.issubdtype(boundaries.dtype, np.integer)
                or boundaries[0] != 0 or boundaries[-1] != seqlen_k or (np.diff(boundaries) < 0).any()):
            raise ValueError(f"boundaries must be {num_splits + 1} non-decreasing integers from 0 to seqlen_k "
                             f"({seqlen_k}); got {boundaries.tolist()}")

    o_parts = np.zeros((num_splits,) + q.shape)
    lse_parts = np.zeros((num_splits,) + q.shape[:-1])
    for split, (start, end) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        o_parts[split], lse_parts[split] = _masked_attention(
            q, k[:, :, start:end], v[:, :, start:end], visible[:, start:end], sm_scale
        )
    return finish(o_parts, unbatched, dtype, leading=1), finish(lse_parts, unbatched, dtype, leading=1)


def combine_lse(o_parts, lse_parts, dtype=None):
    """Merge normalised partial attention outputs by their log-sum-exps.

    Args:
        o_parts: ``(num_parts, *rows, headdim)``, e.g.
            ``(num_splits, batch, heads, seqlen_q, headdim)``; part ``s`` is
            attention normalised over its own keys.
        lse_parts: ``(num_parts, *rows)``, the natural-log log-sum-exp of each part.
        dtype: dtype of the returned arrays (default float64).

    Returns:
        ``(out, lse)`` of shapes ``(*rows, headdim)`` and ``(*rows,)``::

            lse_max = max_s lse_s
            lse     = lse_max + log(sum_s exp(lse_s - lse_max))
            out     = sum_s exp(lse_s - lse) * o_s

        Parts with ``lse = -inf`` get weight 0 (their ``o`` must be finite:
        ``0 * NaN`` is NaN). If every part of a row is ``-inf`` (or there are no
        parts) that row gives ``out = 0``, ``lse = -inf``. A NaN or ``+inf`` lse
        makes the row's ``out`` and ``lse`` NaN (``+inf - +inf``).
        The merge is order-independent, and a merged ``(out, lse)`` can itself
        be merged again as a single part.
    """
    o_parts = to_float64(o_parts, "o_parts")
    lse_parts = to_float64(lse_parts, "lse_parts")
    if o_parts.ndim < 2:
        raise ValueError(
            f"o_parts must have shape (num_parts, ..., headdim); got shape {o_parts.shape}"
        )
    if lse_parts.shape != o_parts.shape[:-1]:
        raise ValueError(
            f"lse_parts must have shape {o_parts.shape[:-1]} (o_parts without its last axis); "
            f"got {lse_parts.shape}"
        )

    lse_max = np.max(lse_parts, axis=0, initial=-np.inf)
    with np.errstate(divide="ignore"):
        # sum 0 (every part empty) gives log 0 = -inf, the right lse for "no keys".
        lse = np.where(np.isneginf(lse_max), 0.0, lse_max) + np.log(
            np.sum(_shifted_exp(lse_parts, lse_max), axis=0)
        )
    weights = _shifted_exp(lse_parts, lse)
    # IEEE products: an empty part (lse = -inf) has weight 0, and 0 * NaN = NaN, so its o must be finite (the
    # parts of split_kv_attention and of the kernels are 0 there)
    out = np.sum(weights[..., None] * o_parts, axis=0)
    dtype = np.float64 if dtype is None else dtype
    return np.asarray(out, dtype=dtype), np.asarray(lse, dtype=dtype)
