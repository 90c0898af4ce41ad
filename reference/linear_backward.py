"""Backward passes of linear attention: the causal dot product (three forms) and the layer.

Causal dot product (:func:`reference.causal_dot_product`): with ``tril`` the mask ``j <= i``,
``out = (Q K^T * tril) V + Q S_0`` and the final state ``S_0 + K^T V``. Given ``dout`` (``G``), the gradient of
the output, and ``dstate``, the gradient of the returned final state (zeros when None)::

    dQ   = (G V^T * tril) K + G S_0^T
    dK   = (G V^T * tril)^T Q + V dstate^T
    dV   = (Q K^T * tril)^T G + K dstate
    dS_0 = Q^T G + dstate

:func:`causal_dot_product_backward` writes these out (the definition); the recurrent and chunked forms compute
the same in the orders kernels use: ``dQ`` by a forward sweep over the state ``S_i = S_0 + sum_{j<=i} k_j v_j^T``,
``dK`` and ``dV`` by a backward sweep over its gradient ``R_j = dstate + sum_{i>=j} q_i g_i^T`` (then
``dk_j = R_j v_j``, ``dv_j = R_j^T k_j`` and ``dS_0 = R_0``).

Layer (:func:`reference.linear_attention`, elu + 1 feature map ``phi``): ``out_i = n_i / z_i`` with the
numerator ``n_i = phi(q_i)^T sum_j phi(k_j) v_j^T`` and the normaliser ``z_i = phi(q_i) . sum_j phi(k_j) + eps``
(sums over ``j <= i`` when causal), so ``dn_i = g_i / z_i`` and ``dz_i = -(g_i . out_i) / z_i``; those flow
back through the causal dot product (or its non-causal matrix products) and the key sums, and finally through
``phi'(x) = 1`` for ``x > 0``, ``exp(x)`` otherwise.

Shapes and argument checks are those of the forward (any leading axes, ``(seqlen, E)`` included); ``dout``
has the output's shape. Gradients are always float64 (no ``dtype`` argument). Inputs are meant to be finite:
the forward's NaN and inf rules are not extended to the backward.
"""

from __future__ import annotations

import numpy as np

from ._shapes import check_positive_int, to_float64_shaped
from .linear import (
    _prepare_causal_inputs,
    _prepare_linear_attention_inputs,
    causal_dot_product,
    elu_feature_map,
)
from .softmax import _safe_divide

__all__ = [
    "causal_dot_product_backward",
    "causal_dot_product_backward_recurrent",
    "causal_dot_product_backward_chunked",
    "linear_attention_backward",
]


def _transpose(x):
    return x.swapaxes(-1, -2)


def _prepare_causal_backward(dout, q, k, v, initial_state, dstate):
    """The forward's checks plus ``dout`` (``v``'s shape) and ``dstate`` (the state's); zeros for None states.

    Returns float64 ``dout, q, k, v, initial_state, dstate`` and whether ``initial_state`` was given.
    """
    has_initial_state = initial_state is not None
    q, k, v, initial_state = _prepare_causal_inputs(q, k, v, initial_state)
    dout = to_float64_shaped(dout, "dout", v.shape, "the output's shape (v's)")
    if dstate is None:
        dstate = np.zeros(initial_state.shape)
    else:
        dstate = to_float64_shaped(dstate, "dstate", initial_state.shape, "the state's shape (leading axes, E, M)")
    return dout, q, k, v, initial_state, dstate, has_initial_state


def _result(dq, dk, dv, dinitial_state, has_initial_state):
    if has_initial_state:
        return dq, dk, dv, dinitial_state
    return dq, dk, dv


def causal_dot_product_backward(dout, q, k, v, *, initial_state=None, dstate=None):
    """Gradients of :func:`reference.causal_dot_product`, written out with the masked ``seqlen x seqlen`` products.

    Args:
        dout: gradient of the output, shape ``(batch, heads, seqlen, M)`` (``v``'s).
        q, k, v, initial_state: as for :func:`reference.causal_dot_product`.
        dstate: gradient of the returned final state ``S_0 + K^T V``, shape ``(batch, heads, E, M)``; None
            (the default) when the final state is not used. It is added to ``dS_0`` and reaches ``dk``, ``dv``.

    Returns:
        ``(dq, dk, dv)`` in float64 with the shapes of ``q``, ``k``, ``v``, and ``dinitial_state`` as a fourth
        element when ``initial_state`` is given.
    """
    dout, q, k, v, initial_state, dstate, has_initial_state = _prepare_causal_backward(
        dout, q, k, v, initial_state, dstate)
    # np.tril keeps the j <= i entries of the last two axes: (i, j) = (query, key) positions.
    dout_v = np.tril(dout @ _transpose(v))
    q_k = np.tril(q @ _transpose(k))
    dq = dout_v @ k + dout @ _transpose(initial_state)
    dk = _transpose(dout_v) @ q + v @ _transpose(dstate)
    dv = _transpose(q_k) @ dout + k @ dstate
    dinitial_state = _transpose(q) @ dout + dstate
    return _result(dq, dk, dv, dinitial_state, has_initial_state)


def causal_dot_product_backward_recurrent(dout, q, k, v, *, initial_state=None, dstate=None):
    """Gradients of the causal dot product as two RNNs, one position at a time (the fast-transformers CPU order).

    Forward sweep: ``S <- S + k_i v_i^T``, then ``dq_i = S g_i`` (the state ``out_i`` read). Backward sweep from
    the last position with ``R = dstate``: ``R <- R + q_i g_i^T``, then ``dk_i = R v_i`` and ``dv_i = R^T k_i``
    (every ``out_j``, ``j >= i``, and the final state read ``k_i v_i^T``); at the end ``dS_0 = R``. O(seqlen)
    steps of O(E M) work and memory. Arguments and results as :func:`causal_dot_product_backward`.
    """
    dout, q, k, v, state, grad_state, has_initial_state = _prepare_causal_backward(
        dout, q, k, v, initial_state, dstate)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for i in range(q.shape[-2]):
        state = state + k[..., i, :, None] * v[..., i, None, :]
        dq[..., i, :] = np.einsum("...em,...m->...e", state, dout[..., i, :])
    for i in reversed(range(q.shape[-2])):
        grad_state = grad_state + q[..., i, :, None] * dout[..., i, None, :]
        dk[..., i, :] = np.einsum("...em,...m->...e", grad_state, v[..., i, :])
        dv[..., i, :] = np.einsum("...em,...e->...m", grad_state, k[..., i, :])
    return _result(dq, dk, dv, grad_state, has_initial_state)


def causal_dot_product_backward_chunked(dout, q, k, v, *, chunk_size=64, initial_state=None, dstate=None):
    """Gradients of the causal dot product in chunks: quadratic inside a chunk, recurrent across chunks.

    For chunks ``c`` of ``chunk_size`` positions (the last one shorter when ``chunk_size`` does not divide
    seqlen), a forward sweep over the state before each chunk::

        dQ_c = (G_c V_c^T * tril) K_c + G_c S_{c-1}^T          S_c = S_{c-1} + K_c^T V_c

    then a backward sweep over the gradient ``R`` of the state after each chunk (``dstate`` after the last)::

        dK_c = (G_c V_c^T * tril)^T Q_c + V_c R^T               R <- R + Q_c^T G_c
        dV_c = (Q_c K_c^T * tril)^T G_c + K_c R

    and ``dS_0 = R`` at the end. ``chunk_size = 1`` is the recurrent form and ``chunk_size >= seqlen`` the
    definition. Other arguments and results as :func:`causal_dot_product_backward`.
    """
    dout, q, k, v, state, grad_state, has_initial_state = _prepare_causal_backward(
        dout, q, k, v, initial_state, dstate)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    seqlen = q.shape[-2]
    chunks = [np.s_[..., start:min(start + chunk_size, seqlen), :] for start in range(0, seqlen, chunk_size)]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for c in chunks:
        dq[c] = np.tril(dout[c] @ _transpose(v[c])) @ k[c] + dout[c] @ _transpose(state)
        state = state + _transpose(k[c]) @ v[c]
    for c in reversed(chunks):
        dk[c] = _transpose(np.tril(dout[c] @ _transpose(v[c]))) @ q[c] + v[c] @ _transpose(grad_state)
        dv[c] = _transpose(np.tril(q[c] @ _transpose(k[c]))) @ dout[c] + k[c] @ grad_state
        grad_state = grad_state + _transpose(q[c]) @ dout[c]
    return _result(dq, dk, dv, grad_state, has_initial_state)


def _elu_feature_map_derivative(x):
    """``phi'(x)`` of ``phi = elu + 1``: 1 for ``x > 0``, ``exp(x)`` for ``x <= 0`` (both 1 at 0: no kink)."""
    return np.where(x > 0, 1.0, np.exp(np.minimum(x, 0.0)))


def _reverse_cumsum(x, axis):
    """``sum_{i >= j} x_i`` along ``axis``: what reaches key ``j`` from every query that sees it."""
    return np.flip(np.cumsum(np.flip(x, axis), axis), axis)


def linear_attention_backward(dout, q, k, v, *, causal=False, eps=1e-6):
    """Gradients of :func:`reference.linear_attention` with its default elu + 1 feature map.

    Args:
        dout: gradient of the output, shape ``(batch, heads, seqlen_q, M)``.
        q, k, v, causal, eps: as for :func:`reference.linear_attention` (``seqlen_k`` may differ from
            ``seqlen_q`` when not causal). Only the elu + 1 feature map is supported.

    Returns:
        ``(dq, dk, dv)`` in float64 with the shapes of ``q``, ``k``, ``v``. A row whose denominator is exactly
        0 (no keys and ``eps = 0``) has output 0 whatever its inputs, and passes no gradient back.
    """
    q, k, v, causal, eps = _prepare_linear_attention_inputs(q, k, v, causal, eps)
    dout = to_float64_shaped(dout, "dout", q.shape[:-1] + v.shape[-1:], "the output's shape")

    phi_q, phi_k = elu_feature_map(q), elu_feature_map(k)
    if causal:
        numerator = causal_dot_product(phi_q, phi_k, v)
        key_sums = np.cumsum(phi_k, axis=-2)
    else:
        kv_state = _transpose(phi_k) @ v
        numerator = phi_q @ kv_state
        key_sums = np.sum(phi_k, axis=-2, keepdims=True)
    denominator = np.sum(phi_q * key_sums, axis=-1, keepdims=True) + eps
    out = _safe_divide(numerator, denominator)

    # out = numerator / denominator, per query row
    d_numerator = _safe_divide(dout, denominator)
    d_denominator = -_safe_divide(np.sum(dout * out, axis=-1, keepdims=True), denominator)

    # numerator: the causal dot product of phi(q), phi(k), v, or its non-causal matrix products
    if causal:
        dphi_q, dphi_k, dv = causal_dot_product_backward(d_numerator, phi_q, phi_k, v)
    else:
        d_kv_state = _transpose(phi_q) @ d_numerator
        dphi_q = d_numerator @ _transpose(kv_state)
        dphi_k = v @ _transpose(d_kv_state)
        dv = phi_k @ d_kv_state

    # denominator: z_i = phi(q_i) . key_sums_i, where key_sums_i sums phi(k_j) over the keys row i sees
    dphi_q = dphi_q + d_denominator * key_sums
    if causal:
        dphi_k = dphi_k + _reverse_cumsum(d_denominator * phi_q, axis=-2)
    else:
        dphi_k = dphi_k + np.sum(d_denominator * phi_q, axis=-2, keepdims=True)

    return dphi_q * _elu_feature_map_derivative(q), dphi_k * _elu_feature_map_derivative(k), dv
