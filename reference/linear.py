"""Linear attention ("Transformers are RNNs", Katharopoulos et al., 2020).

Replacing ``exp(q . k)`` by a kernel ``phi(q) . phi(k)`` lets the sums over keys
be factored out of the per-query work::

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j) + eps)

With causal masking the sums run over ``j <= i``, which is a recurrence over a
state ``S_i = S_{i-1} + phi(k_i) v_i^T`` of shape ``(E, M)``: an RNN. The core
primitive, with no feature map and no normalisation, is the causal dot product::

    V'_i = sum_{j <= i} (q_i . k_j) v_j

given here in three forms that a kernel can follow (quadratic, recurrent,
chunked) plus the full :func:`linear_attention` layer.

Shapes: ``q`` and ``k`` are ``(batch, heads, seqlen, E)`` and ``v`` is
``(batch, heads, seqlen, M)``; ``E`` and ``M`` may differ. Any leading axes
work as long as q, k and v share them, including none: ``(seqlen, E)``.
Everything is computed in float64; ``dtype`` casts the returned arrays.
"""

from __future__ import annotations

import numpy as np

from ._shapes import check_flag, check_positive_int, check_real, to_float64
from .softmax import _safe_divide, _visible_matmul

__all__ = [
    "elu_feature_map",
    "causal_dot_product",
    "causal_dot_product_quadratic",
    "causal_dot_product_recurrent",
    "causal_dot_product_chunked",
    "linear_attention",
]

_METHODS = ("quadratic", "recurrent", "chunked")


def elu_feature_map(x, dtype=None) -> np.ndarray:
    """``phi(x) = elu(x) + 1``: ``x + 1`` for ``x > 0`` and ``exp(x)`` for ``x <= 0``.

    The paper's feature map; it is positive, so the normaliser of linear
    attention is positive. ``exp(x)`` is used for the negative branch rather than
    ``expm1(x) + 1`` because the latter rounds to 0 for very negative ``x``.
    """
    x = to_float64(x, "x")
    # np.minimum keeps exp from overflowing on the branch that np.where discards.
    result = np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    return np.asarray(result, dtype=np.float64 if dtype is None else dtype)


def _prepare_causal_inputs(q, k, v, initial_state):
    """Validate causal dot product inputs; return float64 ``q, k, v, initial_state``."""
    q = to_float64(q, "q")
    k = to_float64(k, "k")
    v = to_float64(v, "v")
    if q.ndim < 2:
        raise ValueError(f"q must have shape (batch, heads, seqlen, E) or (seqlen, E); got {q.shape}")
    if k.shape != q.shape:
        raise ValueError(f"k must have the same shape as q {q.shape}; got {k.shape}")
    if v.ndim != q.ndim or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"v must have shape {q.shape[:-1] + ('M',)} (q's shape with any last axis); got {v.shape}"
        )
    leading = q.shape[:-2]
    state_shape = leading + (q.shape[-1], v.shape[-1])
    if initial_state is None:
        initial_state = np.zeros(state_shape)
    else:
        initial_state = to_float64(initial_state, "initial_state")
        if initial_state.shape != state_shape:
            raise ValueError(
                f"initial_state must have shape {state_shape} (leading axes, E, M); "
                f"got {initial_state.shape}"
            )
    return q, k, v, initial_state


def _finish(out, state, return_state, dtype):
    return_state = check_flag(return_state, "return_state")
    dtype = np.float64 if dtype is None else dtype
    out = np.asarray(out, dtype=dtype)
    if return_state:
        return out, np.asarray(state, dtype=dtype)
    return out


def causal_dot_product_quadratic(q, k, v, initial_state=None, return_state=False, dtype=None):
    """Causal dot product as one masked matrix product: ``(Q K^T * tril) V``.

    O(seqlen^2) work, the definition the other forms are checked against.
    ``initial_state`` ``S_0`` of shape ``(batch, heads, E, M)`` adds ``q_i^T S_0``
    to every row; with ``return_state`` the result is ``(out, S_0 + K^T V)``.
    """
    q, k, v, initial_state = _prepare_causal_inputs(q, k, v, initial_state)
    seqlen = q.shape[-2]
    lower_triangle = np.tril(np.ones((seqlen, seqlen), dtype=bool))
    # masked, not multiplied by 0: a later key holding NaN or inf must not reach an earlier row
    out = _visible_matmul(q @ k.swapaxes(-1, -2), v, lower_triangle) + q @ initial_state
    final_state = initial_state + k.swapaxes(-1, -2) @ v
    return _finish(out, final_state, return_state, dtype)


def causal_dot_product_recurrent(q, k, v, initial_state=None, return_state=False, dtype=None):
    """Causal dot product as an RNN, one position at a time (the fast-transformers CPU kernel).

    ``S <- S + k_i v_i^T`` then ``out_i = q_i^T S``: the state is updated before
    the output so that position ``i`` sees its own key (``j <= i``). O(seqlen)
    steps of O(E M) work and O(E M) memory. Arguments as
    :func:`causal_dot_product_quadratic`.
    """
    q, k, v, state = _prepare_causal_inputs(q, k, v, initial_state)
    out = np.zeros(v.shape)
    for i in range(q.shape[-2]):
        state = state + k[..., i, :, None] * v[..., i, None, :]
        out[..., i, :] = np.einsum("...e,...em->...m", q[..., i, :], state)
    return _finish(out, state, return_state, dtype)


def causal_dot_product_chunked(
    q, k, v, chunk_size=64, initial_state=None, return_state=False, dtype=None
):
    """Causal dot product in chunks: quadratic inside a chunk, recurrent across chunks.

    For each chunk ``c`` of ``chunk_size`` positions (the last one shorter when
    ``chunk_size`` does not divide seqlen)::

        out_c = (Q_c K_c^T * tril) V_c  +  Q_c S_{c-1}     (intra-chunk + inter-chunk)
        S_c   = S_{c-1} + K_c^T V_c

    ``chunk_size = 1`` is the recurrent form and ``chunk_size >= seqlen`` the
    quadratic one; in between is how GPU kernels trade the two. Other arguments
    as :func:`causal_dot_product_quadratic`.
    """
    q, k, v, state = _prepare_causal_inputs(q, k, v, initial_state)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    seqlen = q.shape[-2]
    out = np.zeros(v.shape)
    for start in range(0, seqlen, chunk_size):
        end = min(start + chunk_size, seqlen)
        q_c, k_c, v_c = q[..., start:end, :], k[..., start:end, :], v[..., start:end, :]
        lower_triangle = np.tril(np.ones((end - start, end - start), dtype=bool))
        intra_chunk = _visible_matmul(q_c @ k_c.swapaxes(-1, -2), v_c, lower_triangle)
        out[..., start:end, :] = intra_chunk + q_c @ state
        state = state + k_c.swapaxes(-1, -2) @ v_c
    return _finish(out, state, return_state, dtype)


def causal_dot_product(
    q, k, v, method="quadratic", chunk_size=64, initial_state=None, return_state=False, dtype=None
):
    """``V'_i = sum_{j <= i} (q_i . k_j) v_j  (+ q_i^T S_0)`` by the chosen method.

    Args:
        q, k: ``(batch, heads, seqlen, E)`` (or any leading axes, or none).
        v: ``(batch, heads, seqlen, M)``.
        method: ``"quadratic"``, ``"recurrent"`` or ``"chunked"``; all give the
            same result up to rounding.
        chunk_size: chunk length for ``"chunked"`` (validated >= 1 for every method).
        initial_state: ``S_0`` of shape ``(batch, heads, E, M)``, default zeros;
            carrying the returned state into the next call processes a sequence
            in pieces.
        return_state: also return the final state ``S_0 + K^T V``.
        dtype: dtype of the returned arrays (default float64).

    Returns:
        ``out`` of shape ``(batch, heads, seqlen, M)``, or ``(out, final_state)``.
    """
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    if method == "quadratic":
        return causal_dot_product_quadratic(q, k, v, initial_state, return_state, dtype)
    if method == "recurrent":
        return causal_dot_product_recurrent(q, k, v, initial_state, return_state, dtype)
    if method == "chunked":
        return causal_dot_product_chunked(q, k, v, chunk_size, initial_state, return_state, dtype)
    raise ValueError(f"method must be one of {_METHODS}; got {method!r}")


def _prepare_linear_attention_inputs(q, k, v, causal, eps):
    """Validate :func:`linear_attention`'s arguments; return float64 ``q, k, v`` and the checked ``causal, eps``."""
    q = to_float64(q, "q")
    k = to_float64(k, "k")
    v = to_float64(v, "v")
    causal = check_flag(causal, "causal")
    eps = check_real(eps, "eps")
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0; got {eps!r}")
    if q.ndim < 2:
        raise ValueError(f"q must have shape (batch, heads, seqlen, E) or (seqlen, E); got {q.shape}")
    if k.ndim != q.ndim or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k must have q's leading axes and feature size E, shape "
            f"{q.shape[:-2] + ('seqlen_k', q.shape[-1])}; got {k.shape}"
        )
    if v.ndim != k.ndim or v.shape[:-1] != k.shape[:-1]:
        raise ValueError(
            f"v must have shape {k.shape[:-1] + ('M',)} (k's shape with any last axis); got {v.shape}"
        )
    if causal and k.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"k must have the same seqlen as q when causal; got {k.shape[-2]} and {q.shape[-2]}"
        )
    return q, k, v, causal, eps


def linear_attention(q, k, v, causal=False, eps=1e-6, feature_map=elu_feature_map, dtype=None):
    """The linear attention layer: feature map, numerator and normaliser.

    Non-causal::

        out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T (sum_j phi(k_j)) + eps)

    Causal: the same with both sums over ``j <= i``; the numerator is
    :func:`causal_dot_product` of ``phi(q), phi(k), v`` and the normaliser uses
    a cumulative sum of ``phi(k)``. ``eps`` is added to the denominator (the
    scalar ``phi(q_i) . sum_j phi(k_j)``), after the dot product, per query row;
    it keeps the division finite. A row whose denominator is exactly 0 (no keys
    and ``eps = 0``) gives 0, like an attention row that sees no key.

    Args:
        q: ``(batch, heads, seqlen_q, E)`` (any leading axes, or none).
        k: ``(batch, heads, seqlen_k, E)``; ``seqlen_k == seqlen_q`` when causal.
        v: ``(batch, heads, seqlen_k, M)``.
        feature_map: applied to ``q`` and ``k`` (float64 arrays); default
            :func:`elu_feature_map`.
        dtype: dtype of the returned array (default float64).

    Returns:
        ``(batch, heads, seqlen_q, M)``. No softmax scale is applied.
    """
    q, k, v, causal, eps = _prepare_linear_attention_inputs(q, k, v, causal, eps)
    phi_q = to_float64(feature_map(q), "feature_map(q)")
    phi_k = to_float64(feature_map(k), "feature_map(k)")
    if causal:
        numerator = causal_dot_product(phi_q, phi_k, v)
        key_sums = np.cumsum(phi_k, axis=-2)
    else:
        kv_state = phi_k.swapaxes(-1, -2) @ v
        numerator = phi_q @ kv_state
        key_sums = np.sum(phi_k, axis=-2, keepdims=True)
    denominator = np.sum(phi_q * key_sums, axis=-1, keepdims=True) + eps
    return np.asarray(_safe_divide(numerator, denominator), dtype=np.float64 if dtype is None else dtype)
