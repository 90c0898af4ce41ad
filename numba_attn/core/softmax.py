"""The online-softmax step on MMA C fragments, shared by the tensor-core flash kernels (``flash_mma``, ``flash_tf32``).

A warp holds one 16-row m-tile of scores ``s[mt, nb, e]`` as C fragments: lane ``(g, t)`` has rows ``g`` (e = 0, 1)
and ``g + 8`` (e = 2, 3), keys ``8 nb + 2t + e % 2``. A row's statistics live in the 4 lanes that share ``g``
(``m_run`` / ``l_run`` entries ``2 mt`` and ``2 mt + 1``).
"""
from __future__ import annotations

import numpy as np

from . import ptx
from .staging import device_function


def softmax_step(s_blocks: int, o_blocks: int, scale_first: bool, rescale_output: bool):
    """``step(s, out, m_run, l_run, mt, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post)``:
    one key tile's online-softmax update of m-tile ``mt`` (base 2), for ``s_blocks`` n8 blocks of scores.

    Masks keys ``>= key_end`` and, when ``causal``, keys ``> row + diag_offset`` -- only when ``needs_mask`` (tiles
    crossing the diagonal or the end of the keys). The running max is kept in the scores' units; ``P = exp2(s * post
    - m * post)`` replaces ``s`` in place, so a positive scale folds into the exponent's FFMA (``scale_first``: the
    scores are multiplied by ``scale_log2`` first, for a scale <= 0, which does not commute with max; then
    ``post = 1``). The row sums in ``l_run`` are rescaled by ``alpha = exp2((m_old - m_new) * post)`` and grown.

    ``rescale_output=True``: ``out`` is the ``(m_tiles, o_blocks, 4)`` accumulator, rescaled by ``alpha`` here --
    skipped when no row maximum of the warp moved (a warp vote; after the first tiles they rarely do).
    ``rescale_output=False``: ``out`` receives ``alpha`` at ``[2 mt]``, ``[2 mt + 1]`` for the caller to apply."""
    S_BLOCKS = s_blocks
    O_BLOCKS = o_blocks
    SCALE_FIRST = scale_first
    RESCALE = rescale_output
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    exp2 = ptx.exp2_approx
    shfl_xor = ptx.shfl_xor_f32
    all_lanes = ptx.all_lanes

    def step(s, out, m_run, l_run, mt, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post):
        mx_0 = NEG_INF
        mx_1 = NEG_INF
        for nb in range(S_BLOCKS):
            for e in range(4):
                x = s[mt, nb, e]
                if SCALE_FIRST:
                    x *= scale_log2
                if needs_mask:
                    key = n0 + 8 * nb + 2 * t + e % 2
                    row = row0 + 16 * mt + 8 * (e // 2)
                    if key >= key_end or (causal and key > row + diag_offset):
                        x = NEG_INF
                s[mt, nb, e] = x
            mx_0 = max(mx_0, max(s[mt, nb, 0], s[mt, nb, 1]))
            mx_1 = max(mx_1, max(s[mt, nb, 2], s[mt, nb, 3]))
        # the 4 lanes of a row differ in the two low lane bits
        mx_0 = max(mx_0, shfl_xor(mx_0, 1))
        mx_0 = max(mx_0, shfl_xor(mx_0, 2))
        mx_1 = max(mx_1, shfl_xor(mx_1, 1))
        mx_1 = max(mx_1, shfl_xor(mx_1, 2))
        new_0 = max(m_run[2 * mt], mx_0)
        new_1 = max(m_run[2 * mt + 1], mx_1)
        moved = True
        if RESCALE:
            moved = not all_lanes(new_0 == m_run[2 * mt] and new_1 == m_run[2 * mt + 1])
        # a row that has seen no key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN
        use_0 = new_0 if new_0 != NEG_INF else ZERO
        use_1 = new_1 if new_1 != NEG_INF else ZERO
        alpha_0 = exp2((m_run[2 * mt] - use_0) * post)
        alpha_1 = exp2((m_run[2 * mt + 1] - use_1) * post)
        m_run[2 * mt] = new_0
        m_run[2 * mt + 1] = new_1
        shift_0 = use_0 * post
        shift_1 = use_1 * post
        sum_0 = ZERO
        sum_1 = ZERO
        for nb in range(S_BLOCKS):
            s[mt, nb, 0] = exp2(s[mt, nb, 0] * post - shift_0)
            s[mt, nb, 1] = exp2(s[mt, nb, 1] * post - shift_0)
            s[mt, nb, 2] = exp2(s[mt, nb, 2] * post - shift_1)
            s[mt, nb, 3] = exp2(s[mt, nb, 3] * post - shift_1)
            sum_0 += s[mt, nb, 0] + s[mt, nb, 1]
            sum_1 += s[mt, nb, 2] + s[mt, nb, 3]
        l_run[2 * mt] = l_run[2 * mt] * alpha_0 + sum_0
        l_run[2 * mt + 1] = l_run[2 * mt + 1] * alpha_1 + sum_1
        if RESCALE:
            if moved:  # warp-uniform; alpha = 1 needs no rescale
                for ob in range(O_BLOCKS):
                    out[mt, ob, 0] *= alpha_0
                    out[mt, ob, 1] *= alpha_0
                    out[mt, ob, 2] *= alpha_1
                    out[mt, ob, 3] *= alpha_1
        else:
            out[2 * mt] = alpha_0
            out[2 * mt + 1] = alpha_1

    return device_function(step)
