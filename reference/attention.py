"""Scaled dot-product attention: the materialised definition and the two FlashAttention orders.

All three functions compute the same thing::

    S   = sm_scale * q @ k^T          (batch, heads, seqlen_q, seqlen_k)
    S   = softcap * tanh(S / softcap)   with ``softcap`` only; then masked to -inf
    P   = softmax(S, axis=-1)
    out = P @ v                       (batch, heads, seqlen_q, headdim)
    lse = log(sum(exp(S), axis=-1))   (batch, heads, seqlen_q), natural log

with ``sm_scale = 1/sqrt(headdim)`` unless given.

Conventions every kernel in the project follows:

* Shapes are ``(batch, heads, seqlen, headdim)``; ``(seqlen, headdim)`` inputs are
  accepted too and give ``(seqlen_q, headdim)`` outputs and ``(seqlen_q,)`` lse.
* Grouped-query attention: ``k`` and ``v`` may have ``Hkv`` heads with
  ``Hq % Hkv == 0``; query head ``h`` reads key/value head ``h // (Hq // Hkv)``.
  ``v`` has the same headdim as ``q`` and ``k``.
* Causal masking is aligned bottom-right (as FlashAttention-2): query ``i`` sees
  key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
* ``window=(left, right)`` is a sliding window around the same diagonal: query
  ``i`` sees key ``j`` iff ``i' - left <= j <= i' + right`` with
  ``i' = i + seqlen_k - seqlen_q``; None on a side is unbounded. With
  ``causal=True`` as well, ``right`` becomes ``min(right, 0)``. The causal mask
  is the window ``(None, 0)``: both are one band mask (:mod:`reference._masks`).
* ``softcap=c`` caps the scores before the mask and the softmax:
  ``S = c * tanh(S / c)`` (FlashAttention's convention; None or 0: off).
* A query row that sees no key at all (causal with ``seqlen_q > seqlen_k``, a
  window wholly outside ``[0, seqlen_k)``, or ``seqlen_k == 0``) has output
  exactly 0 and ``lse = -inf``; never NaN.
  ``seqlen_q == 0`` gives empty outputs.
* NaN and inf follow the rules in :mod:`reference`'s docstring: a NaN or
  ``+inf`` score makes the row NaN (output and lse), ``-inf`` scores weigh 0,
  and keys a row does not see never affect it (``_visible_matmul``).
* Everything is computed in float64; ``dtype`` casts the returned arrays
  (output and lse alike).
"""

from __future__ import annotations

import numpy as np

from ._masks import cap_scores, check_softcap, check_window, mask_band
from ._shapes import (
    check_flag,
    check_positive_int,
    finish,
    kv_head_for_q_head,
    prepare_qkv,
    resolve_sm_scale,
)
from .softmax import _safe_divide, _shifted_exp, _visible_matmul

__all__ = ["attention", "flash_attention_v1", "flash_attention_v2"]


def _masked_attention(q, k, v, visible, sm_scale, softcap=None):
    """Materialised attention on rank-4 float64 arrays with an explicit ``visible`` mask.

    ``visible`` is a boolean ``(seqlen_q, seqlen_k)`` array; ``softcap`` a checked
    cap (None: off). Grouped-query attention is handled by viewing the query
    heads as ``(Hkv, group)`` so that each group shares one key/value head
    without copying it. Returns ``(out, lse)``. Also used by the split-KV
    reference for each split and by :mod:`reference.varlen` for each sequence.
    """
    batch, heads_q, seqlen_q, headdim = q.shape
    heads_kv = k.shape[1]
    grouped_q = q.reshape(batch, heads_kv, heads_q // heads_kv, seqlen_q, headdim)

    scores = cap_scores(sm_scale * np.einsum("bhgqd,bhkd->bhgqk", grouped_q, k), softcap)
    scores = np.where(visible, scores, -np.inf)

    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
    unnormalised = _shifted_exp(scores, row_max)
    row_sum = np.sum(unnormalised, axis=-1, keepdims=True)
    out = _safe_divide(_visible_matmul(unnormalised, v[:, :, None], visible), row_sum)
    with np.errstate(divide="ignore"):
        # log(0) = -inf is exactly the lse of a row that sees no key.
        lse = np.log(row_sum[..., 0]) + np.where(np.isneginf(row_max[..., 0]), 0.0, row_max[..., 0])

    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def _full_mask(seqlen_q, seqlen_k, causal, window=None):
    """The ``(seqlen_q, seqlen_k)`` mask of checked ``causal`` and ``window`` arguments."""
    return mask_band(causal, window).visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k)


def _check_flags(causal, return_lse):
    return check_flag(causal, "causal"), check_flag(return_lse, "return_lse")


def _check_mask_and_scores(causal, window, softcap):
    """Checked ``(band, softcap)`` of the ``causal``, ``window`` and ``softcap`` arguments."""
    return mask_band(causal, check_window(window)), check_softcap(softcap)


def _return(out, lse, unbatched, return_lse, dtype):
    out = finish(out, unbatched, dtype)
    if return_lse:
        return out, finish(lse, unbatched, dtype)
    return out


def attention(q, k, v, causal=False, sm_scale=None, return_lse=False, dtype=None, rows=None, *, window=None,
              softcap=None):
    """Reference attention with the full score matrix materialised.

    Args:
        q: ``(batch, heads_q, seqlen_q, headdim)`` or ``(seqlen_q, headdim)``.
        k: ``(batch, heads_kv, seqlen_k, headdim)`` or ``(seqlen_k, headdim)``;
            ``heads_q`` must be a multiple of ``heads_kv``.
        v: same shape as ``k``.
        causal: mask key ``j`` for query ``i`` unless ``j <= i + seqlen_k - seqlen_q``.
        sm_scale: score scale, default ``1/sqrt(headdim)``.
        return_lse: also return the natural-log log-sum-exp of the scaled,
            (capped,) masked scores, shape ``(batch, heads_q, seqlen_q)``.
        dtype: dtype of the returned arrays (default float64).
        rows: optional query row indices: only those rows are computed (and
            returned, in that order), each masked at its position in the full
            ``seqlen_q`` sequence. For checking long sequences, where the full
            score matrix would not fit.
        window: None, or ``(left, right)`` with each side an int >= 0 or None
            (unbounded): query ``i`` sees only keys ``i' - left <= j <= i' + right``,
            ``i' = i + seqlen_k - seqlen_q``. Combined with ``causal``.
        softcap: None or 0 (off), or a finite ``c > 0``: scores become
            ``c * tanh(sm_scale * q.k / c)`` before the mask and the softmax.

    Returns:
        ``out`` of shape ``(batch, heads_q, seqlen_q, headdim)`` (``len(rows)``
        rows when ``rows`` is given), or ``(out, lse)``. Rows that see no key
        have ``out = 0`` and ``lse = -inf``.
    """
    q, k, v, unbatched = prepare_qkv(q, k, v)
    causal, return_lse = _check_flags(causal, return_lse)
    band, softcap = _check_mask_and_scores(causal, window, softcap)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if rows is None:
        rows = np.arange(seqlen_q)
    else:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= seqlen_q):
            raise ValueError(f"rows: expected query row indices in [0, {seqlen_q}), got {rows.min()}..{rows.max()}")
        q = q[:, :, rows]
    visible = band.visible(rows, np.arange(seqlen_k), seqlen_q, seqlen_k)
    out, lse = _masked_attention(q, k, v, visible, sm_scale, softcap)
    return _return(out, lse, unbatched, return_lse, dtype)


def flash_attention_v1(
    q,
    k,
    v,
    causal=False,
    sm_scale=None,
    return_lse=False,
    block_r=64,
    block_c=64,
    dtype=None,
    *,
    window=None,
    softcap=None,
):
    """Algorithm 1 of FlashAttention (Dao et al., 2022), written out in NumPy.

    The loop order is the paper's: key/value blocks of ``block_c`` rows in the
    OUTER loop, query blocks of ``block_r`` rows in the INNER loop. The output
    ``O`` and the softmax statistics ``l`` and ``m`` are full-size arrays (they
    live in HBM in the paper) that each inner iteration reads, updates and
    writes back::

        S_ij     = sm_scale * Q_i K_j^T                   (capped, then masked to -inf)
        m~_ij    = rowmax(S_ij);  P~_ij = exp(S_ij - m~_ij);  l~_ij = rowsum(P~_ij)
        m_new    = max(m_i, m~_ij)
        l_new    = exp(m_i - m_new) l_i + exp(m~_ij - m_new) l~_ij
        O_i     <- diag(l_new)^-1 (diag(l_i) exp(m_i - m_new) O_i + exp(m~_ij - m_new) P~_ij V_j)

    so ``O_i`` is normalised after every step. At the end ``lse = m + log(l)``.

    Causal and window masks are applied per element (no block is skipped:
    the paper's algorithm visits them all); a block in which some row sees no
    key gives that row ``m~ = -inf`` and ``l~ = 0``, which the shifted
    exponentials turn into a zero contribution instead of NaN. Block sizes need
    not divide the sequence lengths and may exceed them. Arguments, shapes and
    the zero-output / ``-inf``-lse convention are those of :func:`attention`.
    """
    q, k, v, unbatched = prepare_qkv(q, k, v)
    causal, return_lse = _check_flags(causal, return_lse)
    band, softcap = _check_mask_and_scores(causal, window, softcap)
    block_r = check_positive_int(block_r, "block_r")
    block_c = check_positive_int(block_c, "block_c")
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    kv_heads = kv_head_for_q_head(q.shape[1], k.shape[1])
    k, v = k[:, kv_heads], v[:, kv_heads]
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]

    o = np.zeros(q.shape)
    l = np.zeros(q.shape[:-1])
    m = np.full(q.shape[:-1], -np.inf)

    for kv_start in range(0, seqlen_k, block_c):
        kv_end = min(kv_start + block_c, seqlen_k)
        k_j = k[:, :, kv_start:kv_end]
        v_j = v[:, :, kv_start:kv_end]
        for q_start in range(0, seqlen_q, block_r):
            q_end = min(q_start + block_r, seqlen_q)
            q_i = q[:, :, q_start:q_end]
            o_i = o[:, :, q_start:q_end]
            l_i = l[:, :, q_start:q_end]
            m_i = m[:, :, q_start:q_end]

            s_ij = cap_scores(sm_scale * (q_i @ k_j.swapaxes(-1, -2)), softcap)
            visible = None
            if not band.masks_nothing:
                visible = band.visible(np.arange(q_start, q_end), np.arange(kv_start, kv_end), seqlen_q, seqlen_k)
                s_ij = np.where(visible, s_ij, -np.inf)

            m_tilde = np.max(s_ij, axis=-1)
            p_tilde = _shifted_exp(s_ij, m_tilde[..., None])
            l_tilde = np.sum(p_tilde, axis=-1)

            m_new = np.maximum(m_i, m_tilde)
            old_weight = _shifted_exp(m_i, m_new)
            block_weight = _shifted_exp(m_tilde, m_new)
            l_new = old_weight * l_i + block_weight * l_tilde

            o[:, :, q_start:q_end] = _safe_divide(
                (l_i * old_weight)[..., None] * o_i
                + block_weight[..., None] * _visible_matmul(p_tilde, v_j, visible),
                l_new[..., None],
            )
            l[:, :, q_start:q_end] = l_new
            m[:, :, q_start:q_end] = m_new

    with np.errstate(divide="ignore"):
        lse = m + np.log(l)
    return _return(o, lse, unbatched, return_lse, dtype)


def flash_attention_v2(
    q,
    k,
    v,
    causal=False,
    sm_scale=None,
    return_lse=False,
    block_m=64,
    block_n=64,
    dtype=None,
    *,
    window=None,
    softcap=None,
):
    """The FlashAttention-2 forward pass (Dao, 2023), written out in NumPy.

    Differences from :func:`flash_attention_v1`, each of which a kernel copies:

    * Loop order: query blocks of ``block_m`` rows OUTER (one thread block each
      on a GPU), key/value blocks of ``block_n`` rows INNER, so the running
      accumulator, ``m`` and ``l`` of a query block stay in registers.
    * The accumulator is kept un-normalised; each step only rescales it by
      ``exp2(m_old - m_new)``, and there is ONE division by ``l`` at the end.
    * Scores are in base 2: ``sm_scale * log2(e)`` is folded into the score
      scale so the exponentials are ``exp2`` (one hardware instruction), and
      ``m`` is a base-2 maximum. The natural-log lse is recovered at the end as
      ``lse = (m + log2(l)) * ln(2)``. With ``softcap`` the capped natural
      score is multiplied by ``log2(e)`` instead (``tanh`` comes first).
    * Causal: for a query block ``[q_start, q_end)`` the last row sees keys up
      to ``q_end - 1 + seqlen_k - seqlen_q``, so the KV loop stops at
      ``kv_stop = clip(q_end + seqlen_k - seqlen_q, 0, seqlen_k)``: blocks wholly
      above the diagonal are never visited. Only blocks reaching past the
      first row's last visible key (``q_start + seqlen_k - seqlen_q``), i.e.
      those straddling the diagonal, get an element mask.
    * Window: the same on both sides. The first row's first visible key is
      ``q_start + seqlen_k - seqlen_q - left``, so the loop starts at the block
      holding it (blocks stay aligned to multiples of ``block_n``, as a kernel's
      tiles) and ends after the block holding the last row's last visible key;
      blocks wholly outside the band are never visited, and only blocks not
      wholly inside it (``Band.covers``) get an element mask. A query block
      whose band holds no key visits nothing: output 0, ``lse = -inf``.

    Block sizes need not divide the sequence lengths and may exceed them.
    Arguments, shapes and the zero-output / ``-inf``-lse convention are those of
    :func:`attention`.
    """
    q, k, v, unbatched = prepare_qkv(q, k, v)
    causal, return_lse = _check_flags(causal, return_lse)
    band, softcap = _check_mask_and_scores(causal, window, softcap)
    block_m = check_positive_int(block_m, "block_m")
    block_n = check_positive_int(block_n, "block_n")
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    kv_heads = kv_head_for_q_head(q.shape[1], k.shape[1])
    k, v = k[:, kv_heads], v[:, kv_heads]
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    # exp(x) == exp2(x * log2(e)): fold log2(e) into the scale once instead of per exponential.
    score_scale = sm_scale * np.log2(np.e)

    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:-1])

    for q_start in range(0, seqlen_q, block_m):
        q_end = min(q_start + block_m, seqlen_q)
        q_i = q[:, :, q_start:q_end]
        accumulator = np.zeros(q_i.shape)
        m = np.full(q_i.shape[:-1], -np.inf)
        l = np.zeros(q_i.shape[:-1])

        # the keys some row of the block sees; tiles wholly outside are skipped
        kv_begin, kv_stop = band.key_range(q_start, q_end, seqlen_q, seqlen_k)

        for kv_start in range(kv_begin // block_n * block_n, kv_stop, block_n):
            kv_end = min(kv_start + block_n, seqlen_k)
            k_j = k[:, :, kv_start:kv_end]
            v_j = v[:, :, kv_start:kv_end]

            if softcap is None:
                s_ij = score_scale * (q_i @ k_j.swapaxes(-1, -2))
            else:
                s_ij = np.log2(np.e) * cap_scores(sm_scale * (q_i @ k_j.swapaxes(-1, -2)), softcap)
            visible = None
            if not band.covers(q_start, q_end, kv_start, kv_end, seqlen_q, seqlen_k):
                visible = band.visible(np.arange(q_start, q_end), np.arange(kv_start, kv_end), seqlen_q, seqlen_k)
                s_ij = np.where(visible, s_ij, -np.inf)

            m_new = np.maximum(m, np.max(s_ij, axis=-1))
            p_ij = _shifted_exp(s_ij, m_new[..., None], exp=np.exp2)
            rescale = _shifted_exp(m, m_new, exp=np.exp2)
            l = rescale * l + np.sum(p_ij, axis=-1)
            accumulator = rescale[..., None] * accumulator + _visible_matmul(p_ij, v_j, visible)
            m = m_new

        out[:, :, q_start:q_end] = _safe_divide(accumulator, l[..., None])
        with np.errstate(divide="ignore"):
            lse[:, :, q_start:q_end] = (m + np.log2(l)) * np.log(2.0)

    return _return(out, lse, unbatched, return_lse, dtype)
