"""Backward of the causal dot product as sequential SIMT walks: the forward's register-state walk (``recurrent``),
run three times on rearranged operands.

With ``S_i = S_0 + sum_{j <= i} k_j v_j^T`` and its gradient ``R_j = dstate + sum_{i >= j} q_i g_i^T`` (``g = dout``;
``reference.causal_dot_product_backward``)::

    dq_i = S_i g_i        dk_j = R_j v_j        dv_j = R_j^T k_j        dS_0 = R_0

Each is the forward's read ``out_i = q_i^T H_i`` of a state ``H`` that the walk updates with one outer product per
row before reading it, for other operands:

* ``dq``: ``H_i = S_i^T = S_0^T + sum_{j <= i} v_j k_j^T`` (``M x E``), read with ``g_i``: the forward walk of
  ``(g, v, k)`` from ``S_0^T`` (a transposed view, no copy);
* ``dv``: ``H_j = R_j`` (``E x M``), read with ``k_j``: the walk of ``(k, q, g)`` from the last row to the first,
  from ``dstate``; the state it ends with is ``dS_0``;
* ``dk``: ``H_j = R_j^T`` (``M x E``), read with ``v_j``: the walk of ``(v, g, q)`` from the last row, from
  ``dstate^T``.

The forward walk reduces its read over the state's rows inside a block and splits the columns over blocks, so
``dk`` and ``dv``, which reduce ``R`` along different axes, take one reverse walk each: three walks where two would
do (a reverse walk that reads ``R`` both ways needs a reduction across the M split; not done yet). State and sums
are float32; the outputs are written in the inputs' dtype, ``dS_0`` in float32.
"""
from __future__ import annotations

from numba import float32

from ..runtime.views import swapped_last_axes as transposed
from .recurrent import _walk
from .recurrent_plan import LinearConfig, default_config


def launch_causal_dot_product_backward(dout, q, k, v, dq, dk, dv, stream, *, initial_state=None, dstate=None,
                                       dinitial_state=None, m_splits=None, config: LinearConfig | None = None):
    """``dq, dk, dv`` (and ``dinitial_state``, when given) of the causal dot product on device views ``(batch, heads,
    seqlen, E | M)``, any strides; ``initial_state``, ``dstate``, ``dinitial_state``: float32 ``(batch, heads, E,
    M)`` views or None (zeros in; not written). ``dv`` None: no ``dv`` walk (and no ``dinitial_state``).
    ``m_splits``: blocks per (batch, head) along each walk's state columns (None: ``recurrent_plan.choose_m_splits``;
    E for the ``dq`` and ``dk`` walks, M for ``dv``)."""
    config = config or default_config()
    zero = float32(0.0)
    _walk(dout, v, k, dq, stream, False, zero, m_splits, config,
          init=None if initial_state is None else transposed(initial_state))
    if dv is not None:
        _walk(k, q, dout, dv, stream, False, zero, m_splits, config, reverse=True, init=dstate,
              final=dinitial_state)
    _walk(v, dout, q, dk, stream, False, zero, m_splits, config, reverse=True,
          init=None if dstate is None else transposed(dstate))

