"""Backward pass of scaled dot-product attention: the analytic definition and FlashAttention-2's blockwise order.

With the forward of :mod:`reference.attention` (``U = sm_scale * q @ k^T``, ``S = U`` or with ``softcap = c``
``S = c * tanh(U / c)``, masked to ``-inf``, ``P = softmax(S)``, ``out = P @ v``) and ``dout`` the gradient of a
loss with respect to ``out``::

    dv  = P^T @ dout
    dP  = dout @ v^T
    D_i = sum_j P_ij dP_ij  =  dout_i . out_i         (one number per query row)
    dS  = P * (dP - D)                                (the softmax's Jacobian, row by row)
    dU  = dS * (1 - tanh(U / c)^2)                    (the cap's derivative; dU = dS without softcap)
    dq  = sm_scale * dU @ k
    dk  = sm_scale * dU^T @ q

Both functions compute these gradients of ``out`` (``lse`` is not differentiated). Conventions, those of the
forward:

* Shapes are ``(batch, heads, seqlen, headdim)``, or ``(seqlen, headdim)`` for all inputs at once; ``dq`` has
  ``q``'s shape and ``dk``, ``dv`` those of ``k``, ``v``. ``seqlen_q != seqlen_k`` is allowed.
* Grouped-query attention: query head ``h`` reads key/value head ``h // (Hq // Hkv)``, so ``dk`` and ``dv`` of a
  key/value head are the sums over the query heads of its group.
* Causal masking is aligned bottom-right: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``;
  ``window=(left, right)`` is the forward's band around the same diagonal.
  A masked pair has ``P_ij = 0`` and so ``dS_ij = 0``: it contributes to no gradient.
* A query row that sees no key (output 0, ``lse = -inf``) has ``dq = 0`` and adds nothing to ``dk`` or ``dv``;
  a key that no query sees (``seqlen_q == 0``) gets ``dk = dv = 0``.
* The gradients are always float64 (there is no ``dtype`` argument): they are the ground truth for kernels.
* Inputs are meant to be finite; the NaN and inf rules of the forward (:mod:`reference`) are not extended to
  the backward.

Argument checks and defaults are those of the forward: flags must be ``bool``, ``sm_scale`` defaults to
``1/sqrt(headdim)``, and a ``dout`` (or saved ``out`` / ``lse``) of the wrong shape is a ValueError naming it.
"""

from __future__ import annotations

import numpy as np

from ._masks import cap_scores, softcap_slope
from ._shapes import (
    check_flag,
    check_positive_int,
    finish,
    kv_head_for_q_head,
    prepare_qkv,
    resolve_sm_scale,
    to_float64_shaped,
)
from .attention import _check_mask_and_scores
from .softmax import _shifted_exp, safe_softmax

__all__ = ["attention_backward", "flash_attention_v2_backward"]


def _prepare_like_output(array, name, shape, unbatched, meaning):
    """``array`` checked against ``shape`` (rank 4, or its last axes for unbatched inputs) and made rank 4."""
    expected = shape[2:] if unbatched else shape
    array = to_float64_shaped(array, name, expected, meaning)
    return array[None, None] if unbatched else array


def _finish_gradients(dq, dk, dv, unbatched):
    return tuple(finish(gradient, unbatched, None) for gradient in (dq, dk, dv))


def attention_backward(dout, q, k, v, *, causal=False, sm_scale=None, window=None, softcap=None):
    """Gradients of :func:`reference.attention`'s output, with the score matrix materialised.

    Args:
        dout: gradient of the output, the output's shape ``(batch, heads_q, seqlen_q, headdim)``
            (or ``(seqlen_q, headdim)``).
        q, k, v, causal, sm_scale, window, softcap: as for :func:`reference.attention` (grouped-query heads,
            bottom-right causal mask and window, ``sm_scale`` default ``1/sqrt(headdim)``, soft-capping).

    Returns:
        ``(dq, dk, dv)`` in float64, with the shapes of ``q``, ``k`` and ``v``. ``dk`` and ``dv`` are summed
        over each key/value head's group of query heads; rows that see no key give ``dq = 0``.

    ``D`` is computed here from its definition, ``rowsum(P * dP)``; :func:`flash_attention_v2_backward` uses
    the equal ``rowsum(dout * out)``, as the kernels do.
    """
    q, k, v, unbatched = prepare_qkv(q, k, v)
    dout = _prepare_like_output(dout, "dout", q.shape, unbatched, "the output's shape")
    band, softcap = _check_mask_and_scores(check_flag(causal, "causal"), window, softcap)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    batch, heads_q, seqlen_q, headdim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    # Query heads viewed as (Hkv, group): a group shares one key/value head, and summing over the group
    # axis (g) in the einsums below is exactly the grouped-query sum of dk and dv.
    grouped = (batch, heads_kv, heads_q // heads_kv, seqlen_q, headdim)
    q_g, dout_g = q.reshape(grouped), dout.reshape(grouped)

    visible = band.visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k)
    uncapped = sm_scale * np.einsum("bhgqd,bhkd->bhgqk", q_g, k)
    scores = np.where(visible, cap_scores(uncapped, softcap), -np.inf)
    p = safe_softmax(scores)  # a row that sees no key is all 0

    dv = np.einsum("bhgqk,bhgqd->bhkd", p, dout_g)
    dp = np.einsum("bhgqd,bhkd->bhgqk", dout_g, v)
    delta = np.sum(p * dp, axis=-1, keepdims=True)
    ds = p * (dp - delta)
    if softcap is not None:
        ds = ds * softcap_slope(uncapped, softcap)
    dq = sm_scale * np.einsum("bhgqk,bhkd->bhgqd", ds, k)
    dk = sm_scale * np.einsum("bhgqk,bhgqd->bhkd", ds, q_g)
    return _finish_gradients(dq.reshape(q.shape), dk, dv, unbatched)


def flash_attention_v2_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    causal=False,
    sm_scale=None,
    block_m=64,
    block_n=64,
    window=None,
    softcap=None,
):
    """The FlashAttention-2 backward pass (Dao, 2023, Algorithm 2), written out in NumPy.

    Nothing of size ``seqlen_q x seqlen_k`` is kept; the forward's ``out`` and ``lse`` are all it saves:

    * Preprocessing: ``D_i = rowsum(dout_i * out_i)`` for every query row (a separate kernel on a GPU).
    * Key/value blocks of ``block_n`` rows OUTER (one thread block each), query blocks of ``block_m`` rows
      INNER. ``dk_j`` and ``dv_j`` of the key block are accumulated across the query blocks (registers on a
      GPU) and written once; ``dq_i`` is accumulated across key blocks in the full ``dq`` array (atomic adds
      in HBM on a GPU).
    * Per pair of blocks, ``P_ij`` is recomputed from the saved lse, in base 2 as the forward does it:
      ``P_ij = exp2(sm_scale * log2(e) * q_i . k_j - lse_i * log2(e))``; rows with ``lse = -inf`` (they see
      no key) have ``P = 0`` and contribute nothing. Then::

          dv_j += P_ij^T dout_i
          dP_ij = dout_i v_j^T
          dS_ij = P_ij * (dP_ij - D_i)              (times 1 - tanh^2 of the uncapped score with softcap)
          dq_i += sm_scale * dS_ij k_j
          dk_j += sm_scale * dS_ij^T q_i

    * Causal: key ``kv_start`` is first seen by query ``kv_start - (seqlen_k - seqlen_q)``, so the query loop
      starts at the block holding that row (all blocks if it is negative, none if it is past the last row):
      blocks wholly above the diagonal are never visited. As in :func:`reference.flash_attention_v2`, only
      blocks straddling the diagonal (``kv_end - 1 > q_start + seqlen_k - seqlen_q``) get an element mask.
      A window skips on both sides: the query loop runs over the blocks holding the rows that see some key of
      the key block (``Band.query_range``), and only blocks not wholly inside the band are masked.

    Grouped-query heads work on ``k``, ``v`` repeated per query head; ``dk`` and ``dv`` are summed over each
    group at the end. Block sizes (names and defaults of the forward's) need not divide the sequence lengths
    and may exceed them.

    Args:
        dout: gradient of the output, the output's shape.
        q, k, v, causal, sm_scale, window, softcap: as for :func:`reference.flash_attention_v2`.
        out, lse: the forward's output and natural-log lse (``return_lse=True``), shapes
            ``(batch, heads_q, seqlen_q, headdim)`` and ``(batch, heads_q, seqlen_q)`` (or unbatched).
        block_m, block_n: query and key block sizes.

    Returns:
        ``(dq, dk, dv)`` in float64, equal up to rounding to :func:`attention_backward`'s.
    """
    q, k, v, unbatched = prepare_qkv(q, k, v)
    dout = _prepare_like_output(dout, "dout", q.shape, unbatched, "the output's shape")
    out = _prepare_like_output(out, "out", q.shape, unbatched, "the output's shape")
    lse = _prepare_like_output(lse, "lse", q.shape[:-1], unbatched, "the shape of the forward's lse")
    band, softcap = _check_mask_and_scores(check_flag(causal, "causal"), window, softcap)
    block_m = check_positive_int(block_m, "block_m")
    block_n = check_positive_int(block_n, "block_n")
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    batch, heads_q, seqlen_q, headdim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    kv_heads = kv_head_for_q_head(heads_q, heads_kv)
    k, v = k[:, kv_heads], v[:, kv_heads]  # per query head; dk, dv are summed over each group at the end
    score_scale = sm_scale * np.log2(np.e)
    lse_base2 = lse * np.log2(np.e)
    sees_no_key = np.isneginf(lse)

    delta = np.sum(dout * out, axis=-1)
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)

    for kv_start in range(0, seqlen_k, block_n):
        kv_end = min(kv_start + block_n, seqlen_k)
        k_j = k[:, :, kv_start:kv_end]
        v_j = v[:, :, kv_start:kv_end]
        dk_j = np.zeros(k_j.shape)
        dv_j = np.zeros(v_j.shape)

        # the queries that see some key of the block; query blocks wholly outside are skipped
        q_begin, q_stop = band.query_range(kv_start, kv_end, seqlen_q, seqlen_k)

        for q_start in range(q_begin // block_m * block_m, q_stop, block_m):
            q_end = min(q_start + block_m, seqlen_q)
            q_i = q[:, :, q_start:q_end]
            dout_i = dout[:, :, q_start:q_end]

            products = q_i @ k_j.swapaxes(-1, -2)
            if softcap is None:
                s_ij = score_scale * products
            else:
                uncapped = sm_scale * products
                s_ij = np.log2(np.e) * cap_scores(uncapped, softcap)
            if not band.covers(q_start, q_end, kv_start, kv_end, seqlen_q, seqlen_k):
                visible = band.visible(np.arange(q_start, q_end), np.arange(kv_start, kv_end), seqlen_q, seqlen_k)
                s_ij = np.where(visible, s_ij, -np.inf)

            # exp2(s - lse) with the saved lse; a row with lse = -inf sees no key and has P = 0 (its scores
            # here are all masked; only an lse that is not the forward's of q, k could overflow).
            with np.errstate(over="ignore"):
                p_ij = _shifted_exp(s_ij, lse_base2[:, :, q_start:q_end, None], exp=np.exp2)
            p_ij = np.where(sees_no_key[:, :, q_start:q_end, None], 0.0, p_ij)

            dv_j += p_ij.swapaxes(-1, -2) @ dout_i
            dp_ij = dout_i @ v_j.swapaxes(-1, -2)
            ds_ij = p_ij * (dp_ij - delta[:, :, q_start:q_end, None])
            if softcap is not None:
                ds_ij = ds_ij * softcap_slope(uncapped, softcap)
            dq[:, :, q_start:q_end] += sm_scale * (ds_ij @ k_j)
            dk_j += sm_scale * (ds_ij.swapaxes(-1, -2) @ q_i)

        dk[:, :, kv_start:kv_end] = dk_j
        dv[:, :, kv_start:kv_end] = dv_j

    grouped = (batch, heads_kv, heads_q // heads_kv, seqlen_k, headdim)
    return _finish_gradients(dq, dk.reshape(grouped).sum(axis=2), dv.reshape(grouped).sum(axis=2), unbatched)
