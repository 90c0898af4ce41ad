"""The backward's element-wise step: the attention weights ``P`` recomputed from the forward's lse, and ``dS = P (dP -
D)``, on MMA C fragments for the tensor-core backward kernels (``probabilities_and_grads``), element by element for
the CUDA-core ones (``weight_and_gradient``).

Fragments ``s[mt, nb, e]`` (scores) and ``dp[mt, nb, e]`` (``dO V^T``) as in ``softmax``: lane ``(g, t)`` has
fragment rows ``g`` (e = 0, 1) and ``g + 8`` (e = 2, 3) of each 16-row m-tile and columns ``8 nb + 2t + e % 2``.
Either the rows are keys and the columns query rows (``keys_on_rows``: the key-block kernel's ``S^T = K Q^T``, whose
``P^T`` and ``dS^T`` feed ``dV += P^T dO`` and ``dK += dS^T Q`` from registers) or the other way round (the
query-block kernel's ``S = Q K^T``, whose ``dS`` feeds ``dQ += dS K``).

Each query row's statistics sit in shared memory as float32 pairs ``(lse log2(e), D)`` (``backward.preprocess``):
``lse log2(e)`` is ``+inf`` for a row that sees no key (and for the padding rows past the sequence), so its ``P =
exp2(s scale_log2 - lse log2(e))`` is 0 without a test. The scale may have either sign (it is applied inside the
exponent, never to a running max). Masked elements (``mask.hidden_in`` of the kernel's window, tested only where
``needs_mask``) get ``P = 0``.

Soft-capped scores (``core.scores``: ``y = tanh(q.k sm_scale / c)``, the softmax's score ``c y``) take the kernels'
score-scale argument ``sm_scale / c`` and the compile-time ``c log2 e``: ``P = exp2(y c log2 e - lse log2 e)`` and
``dS = P (dP - D) (1 - y^2)``, the cap's derivative folded in, so that ``dQ = sm_scale dS K`` and ``dK = sm_scale
dS^T Q`` stay as they are. ``weight_and_gradient`` is that element step, shared with the CUDA-core kernels; it
caps with the forward's ``tanh`` (``scores.score_cap``: ``precise`` for the CUDA-core kernels, ``tanh.approx`` for
the 16-bit tensor-core ones), so the recomputed ``P`` is the forward's.
"""
from __future__ import annotations

import math

import numpy as np

from . import ptx
from .mask import NO_WINDOW, first_seeing_row, hidden, hidden_in
from .scores import cap_post, score_cap
from .staging import device_function

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


def weight_and_gradient(softcap: float | None = None, precise: bool = False):
    """``element(x, dpx, lse2, delta, masked, scale_log2) -> (p, ds)``: the attention weight of raw score ``x``
    (``q.k``) of a row with ``lse log2(e) = lse2`` and ``D = delta``, and ``dS = P (dP - D)`` (times ``1 - y^2``
    with a cap, module docstring); ``masked``: ``P = 0``. ``precise``: ``math.exp2`` / ``math.tanh`` (the CUDA-core
    kernels), else the SFU's ``ex2.approx`` / ``tanh.approx``."""
    CAPPED = softcap is not None
    POST = cap_post(softcap) if CAPPED else _ONE
    cap = score_cap(softcap, precise)
    exp2 = math.exp2 if precise else ptx.exp2_approx

    @device_function
    def element(x, dpx, lse2, delta, masked, scale_log2):
        if CAPPED:
            y = cap(x, scale_log2)
            p = exp2(y * POST - lse2)
            if masked:
                p = _ZERO
            return p, p * (dpx - delta) * (_ONE - y * y)
        p = exp2(x * scale_log2 - lse2)
        if masked:  # (a select: -inf scores would turn into +inf under a negative scale)
            p = _ZERO
        return p, p * (dpx - delta)

    return element


def probabilities_and_grads(m_tiles: int, blocks: int, keys_on_rows: bool, window=NO_WINDOW,
                            softcap: float | None = None):
    """``step(s, dp, stats, stats_at, needs_mask, row0, col0, key_end, causal, diag_offset, scale_log2)``: ``s``
    becomes ``P`` and ``dp`` becomes ``dS``, in place, for ``(m_tiles, blocks, 4)`` register arrays.

    ``row0``: this lane's first fragment row (``g`` included), ``col0``: its first column (``2t`` included), both as
    positions in their sequences. ``stats`` is the float32 view of shared memory; ``stats_at`` indexes this lane's
    first pair: with ``keys_on_rows`` the pair of query column ``col0`` (read as ``(lse, D)`` of columns ``col0,
    col0 + 1`` in one 16-byte load per n8 block, 16 floats apart), else the pair of row ``row0`` (8 floats per row:
    ``+16`` for ``g + 8``, ``+32`` per m-tile). ``window`` (``mask.window_sides``) and ``softcap``: the kernel's
    compile-time mask and cap (with a cap ``scale_log2`` is ``sm_scale / c``)."""
    M_TILES = m_tiles
    BLOCKS = blocks
    KEYS_ON_ROWS = keys_on_rows
    load_pair = ptx.load_f32x2
    load_two_pairs = ptx.load_f32x4_1d
    element = weight_and_gradient(softcap)
    hidden = hidden_in(window)

    @device_function
    def is_hidden(row, col, key_end, causal, diag_offset):
        if KEYS_ON_ROWS:
            return hidden(row, col, key_end, causal, diag_offset)
        return hidden(col, row, key_end, causal, diag_offset)

    def step(s, dp, stats, stats_at, needs_mask, row0, col0, key_end, causal, diag_offset, scale_log2):
        lse_a = d_a = lse_b = d_b = _ZERO
        for mt in range(M_TILES):
            if not KEYS_ON_ROWS:  # query rows on rows: row g, then g + 8
                lse_a, d_a = load_pair(stats, stats_at + 32 * mt)
                lse_b, d_b = load_pair(stats, stats_at + 32 * mt + 16)
            for nb in range(BLOCKS):
                if KEYS_ON_ROWS:  # query rows on columns: columns 2t, 2t + 1 of the n8 block
                    lse_a, d_a, lse_b, d_b = load_two_pairs(stats, stats_at + 16 * nb)
                for e in range(4):
                    row = row0 + 16 * mt + 8 * (e // 2)
                    col = col0 + 8 * nb + e % 2
                    masked = False
                    if needs_mask:
                        masked = is_hidden(row, col, key_end, causal, diag_offset)
                    # the statistics of element e's query row: by column (e % 2) or by row (e // 2)
                    first = (e % 2 == 0) if KEYS_ON_ROWS else (e < 2)
                    s[mt, nb, e], dp[mt, nb, e] = element(s[mt, nb, e], dp[mt, nb, e], lse_a if first else lse_b,
                                                          d_a if first else d_b, masked, scale_log2)

    return device_function(step)


def probabilities_then_grads(m_tiles: int, blocks: int, keys_on_rows: bool):
    """``(probs, grads)``: ``probabilities_and_grads`` in two halves, for kernels whose ``dP`` lands after ``S``
    (the warpgroup backward computes ``P`` while the ``dP`` MMAs still run).

    ``probs(s, stats, stats_at, needs_mask, row0, col0, key_end, causal, diag_offset, scale_log2)``: ``s`` becomes
    ``P`` in place; ``grads(s, dp, stats, stats_at)``: ``dp`` becomes ``dS = P (dP - D)`` (``s`` holding ``P``).
    Arguments as ``probabilities_and_grads``'s step (``stats_at`` the same index for both)."""
    M_TILES = m_tiles
    BLOCKS = blocks
    KEYS_ON_ROWS = keys_on_rows
    exp2 = ptx.exp2_approx
    load_pair = ptx.load_f32x2
    load_two_pairs = ptx.load_f32x4_1d

    @device_function
    def is_hidden(row, col, key_end, causal, diag_offset):
        if KEYS_ON_ROWS:
            return hidden(row, col, key_end, causal, diag_offset)
        return hidden(col, row, key_end, causal, diag_offset)

    @device_function
    def probs(s, stats, stats_at, needs_mask, row0, col0, key_end, causal, diag_offset, scale_log2):
        lse_a = lse_b = _ZERO
        for mt in range(M_TILES):
            if not KEYS_ON_ROWS:
                lse_a, _ = load_pair(stats, stats_at + 32 * mt)
                lse_b, _ = load_pair(stats, stats_at + 32 * mt + 16)
            for nb in range(BLOCKS):
                if KEYS_ON_ROWS:
                    lse_a, _, lse_b, _ = load_two_pairs(stats, stats_at + 16 * nb)
                for e in range(4):
                    first = (e % 2 == 0) if KEYS_ON_ROWS else (e < 2)
                    p = exp2(s[mt, nb, e] * scale_log2 - (lse_a if first else lse_b))
                    if needs_mask:
                        # (a select: -inf scores would turn into +inf under a negative scale)
                        if is_hidden(row0 + 16 * mt + 8 * (e // 2), col0 + 8 * nb + e % 2, key_end, causal,
                                     diag_offset):
                            p = _ZERO
                    s[mt, nb, e] = p

    @device_function
    def grads(s, dp, stats, stats_at):
        d_a = d_b = _ZERO
        for mt in range(M_TILES):
            if not KEYS_ON_ROWS:
                _, d_a = load_pair(stats, stats_at + 32 * mt)
                _, d_b = load_pair(stats, stats_at + 32 * mt + 16)
            for nb in range(BLOCKS):
                if KEYS_ON_ROWS:
                    _, d_a, _, d_b = load_two_pairs(stats, stats_at + 16 * nb)
                for e in range(4):
                    first = (e % 2 == 0) if KEYS_ON_ROWS else (e < 2)
                    dp[mt, nb, e] = s[mt, nb, e] * (dp[mt, nb, e] - (d_a if first else d_b))

    return probs, grads


def packed_probabilities_and_grads(blocks: int, pack):
    """``step(s, dp, pw, dw, stats, stats_at, needs_mask, row0, col0, key_end, causal, diag_offset, scale_log2)``:
    ``probabilities_and_grads`` for one m-tile of keys on rows (the warpgroup backward's ``S^T``, ``dP^T``) whose
    results go straight into 16-bit A fragments (``core.warpgroup.a_fragments``' word order): ``pw`` gets ``P^T``,
    ``dw`` gets ``dS^T``, two n8 blocks (one k-step) at a time, so that the float32 values of a k-step die before
    the next is computed (fewer live registers than the whole tile in float32 at once). ``pack(x0, x1)``: the
    rounding of a pair to one 32-bit word."""
    K_STEPS = blocks // 2
    exp2 = ptx.exp2_approx
    load_two_pairs = ptx.load_f32x4_1d

    @device_function
    def step(s, dp, pw, dw, stats, stats_at, needs_mask, row0, col0, key_end, causal, diag_offset, scale_log2):
        # the mask as two bounds: query column c sees key row0 (row0 + 8) iff c >= first_a (first_b)
        first_a = first_seeing_row(row0, key_end, causal, diag_offset)
        first_b = first_seeing_row(row0 + 8, key_end, causal, diag_offset)
        for kk in range(K_STEPS):
            for half in range(2):
                nb = 2 * kk + half
                lse_a, d_a, lse_b, d_b = load_two_pairs(stats, stats_at + 16 * nb)
                for e in range(4):
                    first = e % 2 == 0  # the statistics of query column col0 + 8 nb (+ 1)
                    p = exp2(s[0, nb, e] * scale_log2 - (lse_a if first else lse_b))
                    if needs_mask:
                        if col0 + 8 * nb + e % 2 < (first_a if e < 2 else first_b):
                            p = _ZERO
                    s[0, nb, e] = p
                    dp[0, nb, e] = p * (dp[0, nb, e] - (d_a if first else d_b))
                pw[4 * kk + 2 * half] = pack(s[0, nb, 0], s[0, nb, 1])
                pw[4 * kk + 2 * half + 1] = pack(s[0, nb, 2], s[0, nb, 3])
                dw[4 * kk + 2 * half] = pack(dp[0, nb, 0], dp[0, nb, 1])
                dw[4 * kk + 2 * half + 1] = pack(dp[0, nb, 2], dp[0, nb, 3])

    return step
