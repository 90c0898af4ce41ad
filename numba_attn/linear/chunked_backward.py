"""Backward of the causal dot product on the chunked tensor-core kernels: the forward's chunked walk (``launch``)
run three times on rearranged operands, two of them over the sequence from its last row.

With ``S_i = S_0 + sum_{j <= i} k_j v_j^T``, its gradient ``R_j = dstate + sum_{i >= j} q_i g_i^T`` (``g = dout``)
and ``tril`` the mask ``j <= i`` (``reference.causal_dot_product_backward_chunked``), per chunk ``c``::

    dQ_c = (G_c V_c^T * tril) K_c + G_c S_{c-1}^T        (a forward sweep over S)
    dK_c = (G_c V_c^T * tril)^T Q_c + V_c R_c^T          (a reverse sweep over R, R_c: after chunk c)
    dV_c = (Q_c K_c^T * tril)^T G_c + K_c R_c            dS_0 = R before the first chunk

Each is the forward ``out_c = (Q'_c K'_c^T * tril) V'_c + Q'_c H`` of other operands, ``H`` the state the walk
carries (``recurrent_backward`` has the same three walks on CUDA cores):

* ``dq``: the causal product of ``(g, v, k)`` from the initial state ``S_0^T``;
* ``dv``: the causal product of ``(k, q, g)`` with the rows reversed, from ``dstate``; its final state is ``dS_0``;
* ``dk``: the causal product of ``(v, g, q)`` with the rows reversed, from ``dstate^T``.

Reversed rows and transposed states are views with a negative row stride or swapped strides (``runtime.views``), so
nothing is copied, and every walk gets the forward's machinery: the segments of the sequence, their ``STATES``
pass, the register-state kernels for E' <= 128 (f16 / bf16 MMAs, float32 as 3xTF32 or with ``tf32`` one tf32 term)
and the shared-memory-state kernel otherwise. The reversed walks chunk the sequence from its last row, which changes
nothing but the rounding. ``dk`` and ``dv`` each recompute the increments ``Q_c^T G_c`` of their own ``R`` (one
transposed): a fused reverse walk reading ``R`` both ways would save one ``STATES`` pass and one read of q and dout.
"""
from __future__ import annotations

from ..runtime.views import reversed_axis, swapped_last_axes
from . import launch


def _transposed(state):
    return None if state is None else swapped_last_axes(state)


def launch_causal_backward(dout, q, k, v, dq, dk, dv, stream, *, initial_state=None, dstate=None,
                           dinitial_state=None, tf32=False, dtype=None, segments=None, scratch=None):
    """``dq, dk, dv`` (and ``dinitial_state`` when given) of the causal dot product on device views ``(batch, heads,
    seqlen, E | M)``, any strides: float16 / float32 arrays or uint16 bit views of ``dtype`` data (as
    ``launch.launch_causal``). ``initial_state``, ``dstate``, ``dinitial_state``: float32 ``(batch, heads, E, M)``
    views or None (zeros in; not written). ``dv`` None: no ``dv`` walk (and no ``dinitial_state``). ``tf32``: float32
    inputs in one tf32 term; ``segments``: sequence blocks per walk, None for the plan's choice."""
    options = {"tf32": tf32, "dtype": dtype, "segments": segments, "scratch": scratch}
    rev = _rows_reversed
    if q.shape[2] > 0:
        launch.launch_causal(dout, v, k, dq, stream, initial_state=_transposed(initial_state), **options)
        launch.launch_causal(rev(v), rev(dout), rev(q), rev(dk), stream, initial_state=_transposed(dstate),
                             **options)
    if dv is not None and (q.shape[2] > 0 or dinitial_state is not None):  # (no rows: dS_0 = dstate, or zeros)
        launch.launch_causal(rev(k), rev(q), rev(dout), rev(dv), stream, initial_state=dstate,
                             final_state=dinitial_state, **options)


def _rows_reversed(x):
    return reversed_axis(x, 2)
