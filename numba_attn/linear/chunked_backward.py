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
nothing but the rounding.

With ``FUSED`` (off by default: slow at 16k rows on an H100 with a plan of 128 segments, since changed, not
re-measured) and where the register-state kernels
take all three walks (E = M <= 128), they run as one problem each of a single pair of launches (``launch.launch_causal_walks``): one ``STATES`` launch for the ``dq`` and ``dv`` walks and
one walking launch for all three, the ``dk`` walk starting from the ``dv`` walk's increments ``sum q_j g_j^T``
transposed (its own would be ``sum g_j q_j^T``): two launches instead of six, one ``STATES`` pass fewer, the walks'
blocks sharing the GPU. Otherwise (the default) three separate forwards.
"""
from __future__ import annotations

import os

from ..runtime.views import reversed_axis, swapped_last_axes
from . import launch

#: the three walks as problems of one pair of launches where the register kernels take them; off by default
#: (``NUMBA_ATTN_LINEAR_BWD_FUSED=1`` turns it on): on an H100 (B4 H8 E=M=64 bfloat16 and float16) it matched the
#: three separate forwards at 1k and 4k rows but took 10.5 ms instead of 0.63 at 16k, where its plan had 128
#: segments (``register_launch.FUSED_SEGMENT_COST`` now makes it 8); not re-measured since
FUSED = os.environ.get("NUMBA_ATTN_LINEAR_BWD_FUSED", "0").strip().lower() in ("1", "true", "yes", "on")
#: float32 in 3xTF32 (FUSED): one walking launch per walk after the shared STATES launch; the three-problem walk of
#: 3xTF32 spills (120 bytes, 26 local loads / stores per chunk at E = M = 64, sm_90), the single ones do not
SPLIT_3XTF32 = False


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
    if FUSED and q.shape[2] > 0:
        walks = [(dout, v, k, dq, _transposed(initial_state))]  # dq: forward over S
        if dv is not None:  # dv: reversed over R, writes dS_0; dk: reversed over R^T, from dv's increments
            walks.append((rev(k), rev(q), rev(dout), rev(dv), dstate))
        walks.append((rev(v), rev(dout), rev(q), rev(dk), _transposed(dstate)))
        if launch.launch_causal_walks(walks, stream, final_state=dinitial_state, final_walk=1 if dv is not None else -1,
                                      borrow=dv is not None, split_3xtf32=SPLIT_3XTF32, **options):
            return
    if q.shape[2] > 0:
        launch.launch_causal(dout, v, k, dq, stream, initial_state=_transposed(initial_state), **options)
        launch.launch_causal(rev(v), rev(dout), rev(q), rev(dk), stream, initial_state=_transposed(dstate),
                             **options)
    if dv is not None and (q.shape[2] > 0 or dinitial_state is not None):  # (no rows: dS_0 = dstate, or zeros)
        launch.launch_causal(rev(k), rev(q), rev(dout), rev(dv), stream, initial_state=dstate,
                             final_state=dinitial_state, **options)


def _rows_reversed(x):
    return reversed_axis(x, 2)
