"""The online softmax on MMA C fragments, shared by the tensor-core kernels: start, one key tile's step, the end.

A warp holds one 16-row m-tile of scores ``s[mt, nb, e]`` as C fragments: lane ``(g, t)`` has rows ``g`` (e = 0, 1)
and ``g + 8`` (e = 2, 3), keys ``8 nb + 2t + e % 2``. A row's statistics live in the 4 lanes that share ``g``
(``m_run`` / ``l_run`` entries ``2 mt`` and ``2 mt + 1``; ``l_run`` holds this lane's part of the row sum until
``row_sum``). Scores are in base 2; ``m`` is kept in the scores' units and multiplied by ``post`` (the exponent's
scale, ``exponent_scale``) where it meets them. At the end a row's lse is ``(m post + log2 l) ln 2`` and a row
that saw no key (``l = 0``) gives 0 and ``lse = -inf``.

Soft-capped scores (``softcap = c``, ``reference._masks``: ``c tanh(sm_scale q.k / c)``) are ``tanh(pre q.k)`` in the
scores' units with ``post = c log2(e)`` (``softcap_scales``): ``tanh`` is increasing and ``post > 0``, so the max
commutes with ``post`` whatever the sign of ``sm_scale``.
"""
from __future__ import annotations

import math

import numpy as np
from numba import float32, int32

from . import ptx
from .constants import ACC_INIT, LN2, LOG2E
from .mask import NO_WINDOW, UNBOUNDED, visible_keys_in
from .scores import cap_post, score_cap
from .staging import device_function, inlined_function

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)


def fragment_clear(m_tiles: int, blocks: int):
    """``clear(c)``: every value of an ``(m_tiles, blocks, 4)`` register array of C fragments to ``ACC_INIT``."""
    M_TILES = m_tiles
    BLOCKS = blocks

    @device_function
    def clear(c):
        for mt in range(M_TILES):
            for nb in range(BLOCKS):
                for e in range(4):
                    c[mt, nb, e] = ACC_INIT

    return clear


def softmax_start(m_tiles: int, o_blocks: int):
    """``start(m_run, l_run, acc)``: no key seen yet (``m = -inf``, ``l = 0``) and an empty ``(m_tiles, o_blocks,
    4)`` output accumulator."""
    M_TILES = m_tiles
    clear = fragment_clear(m_tiles, o_blocks)

    @device_function
    def start(m_run, l_run, acc):
        for i in range(2 * M_TILES):
            m_run[i] = _NEG_INF
            l_run[i] = _ZERO
        clear(acc)

    return start


def output_rescale(o_blocks: int):
    """``rescale(acc, alpha)``: the ``(1, o_blocks, 4)`` output accumulator's two rows times the ``alpha`` that
    ``softmax_update(rescale_output=False)`` gave, skipped when it is 1 in every lane of the warp (a warp vote: after
    the first tiles no row maximum moves). Inlined in Numba's IR: the kernels compile as with the loop written in."""
    O_BLOCKS = o_blocks
    ONE = np.float32(1.0)
    all_lanes = ptx.all_lanes

    @inlined_function
    def rescale(acc, alpha):
        if not all_lanes(alpha[0] == ONE and alpha[1] == ONE):  # warp-uniform
            for ob in range(O_BLOCKS):
                acc[0, ob, 0] *= alpha[0]
                acc[0, ob, 1] *= alpha[0]
                acc[0, ob, 2] *= alpha[1]
                acc[0, ob, 3] *= alpha[1]

    return rescale


def softcap_scales(sm_scale: float, softcap: float) -> tuple:
    """``(pre, post)`` float32 of soft-capped scores: the capped score in base 2 is ``tanh(pre * q.k) * post``, with
    ``pre = sm_scale / softcap`` and ``post = softcap * log2(e)`` (``softmax_step(softcap=True)``)."""
    return np.float32(sm_scale / softcap), np.float32(softcap * LOG2E)


@device_function
def exponent_scale(scale_log2, scale_first):
    """What scores are multiplied by inside the exponent: ``scale_log2``, or 1 when they were scaled first."""
    if scale_first:
        return float32(1.0)
    return scale_log2


def exponent_scale_for(softcap: float | None):
    """``exponent_scale`` itself without a cap; with ``softcap = c`` a function giving the compile-time ``c log2 e``
    (``scores.cap_post``: capped scores are ``tanh`` values, never scaled first)."""
    if softcap is None:
        return exponent_scale
    POST = cap_post(softcap)

    @device_function
    def capped_exponent_scale(scale, scale_first):
        return POST

    return capped_exponent_scale


@device_function
def row_sum(l_part):
    """A row's ``l`` from the parts of its 4 lanes (they differ in the two low lane bits)."""
    l_row = l_part + ptx.shfl_xor_f32(l_part, 1)
    return l_row + ptx.shfl_xor_f32(l_row, 2)


@device_function
def log_sum_exp(m_row, l_row, post):
    """The natural-log lse of a row with running max ``m_row`` (scores' units) and sum ``l_row``: -inf exactly where
    the row saw no key (``l`` stayed 0), NaN where a NaN or +inf score made ``l`` NaN."""
    return _NEG_INF if l_row == _ZERO else (m_row * post + math.log2(l_row)) * LN2


def softmax_update(m_tiles: int, s_blocks: int, o_blocks: int, scale_first: bool, rescale_output: bool,
                   window=NO_WINDOW, softcap: float | None = None, precise_tanh: bool = False, row_sums: bool = True,
                   p_exponent: int = 0):
    """``update(s, out, m_run, l_run, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post)``:
    ``softmax_step`` for each of the ``m_tiles`` m-tiles, each call with a constant m-tile index. (As a loop over
    m-tiles the body was too large for NVVM to unroll, and the register arrays it indexes went to local memory.)"""
    step = softmax_step(s_blocks, o_blocks, scale_first, rescale_output, window, softcap, precise_tanh, row_sums,
                        p_exponent)
    update = None
    for mt in range(m_tiles):
        update = _and_m_tile(update, step, mt)
    return update


def _and_m_tile(before, step, mt: int):
    """``before`` (None: nothing), then ``step`` on m-tile ``mt``."""
    MT = mt

    if before is None:
        def first(s, out, m_run, l_run, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post):
            step(s, out, m_run, l_run, MT, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post)

        return device_function(first)

    def then(s, out, m_run, l_run, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post):
        before(s, out, m_run, l_run, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post)
        step(s, out, m_run, l_run, MT, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post)

    return device_function(then)


def softmax_step(s_blocks: int, o_blocks: int, scale_first: bool, rescale_output: bool, window=NO_WINDOW,
                 softcap: float | None = None, precise_tanh: bool = False, row_sums: bool = True, p_exponent: int = 0):
    """``step(s, out, m_run, l_run, mt, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post)``:
    one key tile's online-softmax update of m-tile ``mt`` (base 2), for ``s_blocks`` n8 blocks of scores.

    Masks the keys ``mask.hidden_in(window)`` names (past ``key_end``; above the diagonal when ``causal``; outside
    the compile-time sliding ``window``), by the bounds ``mask.visible_keys_in`` gives each row (two 32-bit compares
    per element) -- only when ``needs_mask`` (``mask.tile_is_partial``). The running max is kept in the scores' units; ``P = exp2(s * post
    - m * post)`` replaces ``s`` in place, so a positive scale folds into the exponent's FFMA (``scale_first``: the
    scores are multiplied by ``scale_log2`` first, for a scale <= 0, which does not commute with max; then
    ``post = 1``). The row sums in ``l_run`` are rescaled by ``alpha = exp2((m_old - m_new) * post)`` and grown.

    ``softcap = c``: each score becomes ``tanh(s * scale_log2)`` first (``scores.score_cap``; ``scale_log2`` is then
    ``sm_scale / c`` and ``post`` is ``c log2 e``: ``exponent_scale_for``), with ``math.tanh`` when ``precise_tanh``
    and ``tanh.approx`` otherwise; never with ``scale_first``.

    ``rescale_output=True``: ``out`` is the ``(m_tiles, o_blocks, 4)`` accumulator, rescaled by ``alpha`` here --
    skipped when no row maximum of the warp moved (a warp vote; after the first tiles they rarely do).
    ``rescale_output=False``: ``out`` receives ``alpha`` at ``[2 mt]``, ``[2 mt + 1]`` for the caller to apply.

    ``softcap=True`` (the decode kernels, whose cap comes at run time): the same with ``math.tanh``, the caller passing
    ``pre`` as ``scale_log2`` and ``post = softcap * log2(e)`` (``softcap_scales``); ``scale_first`` is then ignored.
    ``softcap=False`` is no cap.

    ``row_sums=False``: ``l_run`` is left as it is (the caller sums P elsewhere: the fp8 WS kernel's P V MMA with a
    row of ones under V^T). ``p_exponent``: P (and so ``l_run``) times ``2 ** p_exponent`` -- the 8-bit kernels',
    whose P rounded to e4m3 then keeps its small values above the format's subnormals (``core.fp8.P_EXPONENT``); the
    caller takes the factor back before the epilogue."""
    S_BLOCKS = s_blocks
    P_SCALED = p_exponent != 0
    P_EXPONENT = np.float32(p_exponent)
    SUMS = row_sums
    O_BLOCKS = o_blocks
    if softcap is False:
        softcap = None
    if softcap is True:
        precise_tanh = True
    CAPPED = softcap is not None
    SCALE_FIRST = scale_first and not CAPPED
    RESCALE = rescale_output
    cap = score_cap(softcap, precise_tanh)
    visible = visible_keys_in(window)
    LOWER = window[0] != UNBOUNDED  # (without a left side only the upper bound is tested)
    SPAN = 1 << 20  # bounds relative to a lane's first key, clamped: 32-bit compares with constants
    NEG_INF = _NEG_INF
    ZERO = _ZERO
    exp2 = ptx.exp2_approx
    shfl_xor = ptx.shfl_xor_f32
    all_lanes = ptx.all_lanes

    def step(s, out, m_run, l_run, mt, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post):
        mx_0 = NEG_INF
        mx_1 = NEG_INF
        # the keys each of the lane's two rows sees, as columns of the lane's first key n0 + 2t: element (nb, e) is
        # column 8 nb + e % 2 (``mask.visible_keys_in``)
        lo_0 = lo_1 = hi_0 = hi_1 = int32(0)
        if needs_mask:
            first = n0 + 2 * t
            lo, hi = visible(row0 + 16 * mt, key_end, causal, diag_offset)
            lo_0 = int32(min(max(lo - first, -SPAN), SPAN))
            hi_0 = int32(min(max(hi - first, -SPAN), SPAN))
            lo, hi = visible(row0 + 16 * mt + 8, key_end, causal, diag_offset)
            lo_1 = int32(min(max(lo - first, -SPAN), SPAN))
            hi_1 = int32(min(max(hi - first, -SPAN), SPAN))
        for nb in range(S_BLOCKS):
            for e in range(4):
                x = s[mt, nb, e]
                if SCALE_FIRST:
                    x *= scale_log2
                if CAPPED:
                    x = cap(x, scale_log2)
                if needs_mask:
                    col = int32(8 * nb + e % 2)
                    if e < 2:
                        if col >= hi_0 or (LOWER and col < lo_0):
                            x = NEG_INF
                    else:
                        if col >= hi_1 or (LOWER and col < lo_1):
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
        if P_SCALED:
            shift_0 -= P_EXPONENT
            shift_1 -= P_EXPONENT
        sum_0 = ZERO
        sum_1 = ZERO
        for nb in range(S_BLOCKS):
            s[mt, nb, 0] = exp2(s[mt, nb, 0] * post - shift_0)
            s[mt, nb, 1] = exp2(s[mt, nb, 1] * post - shift_0)
            s[mt, nb, 2] = exp2(s[mt, nb, 2] * post - shift_1)
            s[mt, nb, 3] = exp2(s[mt, nb, 3] * post - shift_1)
            if SUMS:
                sum_0 += s[mt, nb, 0] + s[mt, nb, 1]
                sum_1 += s[mt, nb, 2] + s[mt, nb, 3]
        if SUMS:
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
