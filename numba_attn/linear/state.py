"""Block position and the register-resident state of the chunked walks in ``linear_mma`` (16-bit inputs) and
``linear_mma_f32`` (float32): the same grid, segments and state layout in both, so the code lives here once.

A block is ``(head, M tile)`` along grid x and a segment along grid y. Warp ``w`` holds the E rows
``16 e .. 16 e + 15`` of H for ``e = w, w + warps, ...`` as m16n8 C fragments ``hm[i, ob, x]``: E row
``16 e + g + 8 (x // 2)``, column ``8 ob + 2 t + x % 2`` of the block's M tile (``g = lane // 4``, ``t = lane % 4``).
The increments of the segments (``STATES``) are a contiguous float32 scratch ``(rows, e_pad, cols)``, one row per
(head, M tile, segment but the last).
"""
from __future__ import annotations

import numpy as np

from ..core import ptx
from ..core.staging import device_function

#: predecessors' increments summed per round when a walking block starts: their loads are independent, so their
#: latencies overlap (one at a time, each waited for its global-memory round trip)
SUM_GROUP = 4


def stage_loader(load_qk, load_v, commit, k_off: int, v_off: int, has_q: bool):
    """``load_stage(q_head, k_head, v_head, smem, base, tid, c0, seqlen, e_dim, col0, m_dim)``: start the copies of
    one chunk's stage -- Q (when ``has_q``) at ``base``, K at ``base + k_off``, V's columns ``col0 ..`` at ``base +
    v_off`` -- with the kernel's own tile loaders, as one commit group."""
    HAS_Q = has_q
    K_OFF = k_off
    V_OFF = v_off

    @device_function
    def load_stage(q_head, k_head, v_head, smem, base, tid, c0, seqlen, e_dim, col0, m_dim):
        if HAS_Q:
            load_qk(q_head, smem, base, tid, c0, seqlen, 0, e_dim)
        load_qk(k_head, smem, base + K_OFF, tid, c0, seqlen, 0, e_dim)
        load_v(v_head, smem, base + V_OFF, tid, c0, seqlen, col0, m_dim)
        commit()

    return load_stage


def state_functions(warps: int, e_pad: int, cols: int, chunk: int, has_q: bool):
    """``(position, start_state, end_state)`` device functions for one specialisation (``has_q``: the CAUSAL walk;
    else the STATES pass)."""
    WARPS = warps
    E_PAD = e_pad
    COLS = cols
    C = chunk
    HAS_Q = has_q
    E_PER_WARP = -(-(e_pad // 16) // warps)
    O_BLOCKS = cols // 8
    ROW_BYTES = e_pad * cols * 4  # one segment's increment
    ZERO = np.float32(0.0)
    load_at = ptx.load_f32_at

    @device_function
    def position(bhm, seg, k, segment_chunks, state_segments, m_tiles):
        """Block ``(bhm, seg)`` of the grid -> (b, h, col0, row_begin, n_chunks, first_row): its head, first value
        column, first row, chunks to walk (<= 0: none) and first row of increments. (The kernel reads the block
        index: under the simulator only a kernel's own ``cuda`` knows it.)"""
        bh = bhm // m_tiles
        heads = k.shape[1]
        row_begin = seg * segment_chunks * C
        row_end = min(k.shape[2], row_begin + segment_chunks * C)
        return (bh // heads, bh % heads, (bhm % m_tiles) * COLS, row_begin, (row_end - row_begin + C - 1) // C,
                bhm * state_segments)

    @device_function
    def start_state(hm, init, increments, has_init, b, h, e_dim, m_dim, col0, first_row, seg, warp, g, t):
        """The state this block starts from: the initial state plus the increments of the segments before it
        (STATES: zero, it sums its own segment)."""
        for i in range(E_PER_WARP):
            e0 = 16 * (warp + i * WARPS) + g
            for ob in range(O_BLOCKS):
                for x in range(4):
                    hm[i, ob, x] = ZERO
                    e = e0 + 8 * (x // 2)
                    c = col0 + 8 * ob + 2 * t + x % 2
                    if HAS_Q and has_init and e < e_dim and c < m_dim:
                        hm[i, ob, x] = init[b, h, e, c]
        if HAS_Q:
            at = ((first_row * E_PAD + 16 * warp + g) * COLS + 2 * t) * 4  # bytes: one offset per lane
            for first in range(0, seg, SUM_GROUP):
                for i in range(E_PER_WARP):
                    if 16 * (warp + i * WARPS) < E_PAD:
                        for ob in range(O_BLOCKS):
                            for x in range(4):
                                cell = at + 4 * ((16 * WARPS * i + 8 * (x // 2)) * COLS + 8 * ob + x % 2)
                                total = ZERO
                                for r in range(SUM_GROUP):
                                    if first + r < seg:
                                        total += load_at(increments, cell + r * ROW_BYTES)
                                hm[i, ob, x] += total
                at += SUM_GROUP * ROW_BYTES

    @device_function
    def end_state(hm, increments, final, write_final, last_segment, b, h, e_dim, m_dim, col0, first_row, seg, warp,
                  g, t):
        """The segment's increment (STATES), or the final state (the last CAUSAL segment, if asked for)."""
        if not HAS_Q or (write_final and last_segment):
            for i in range(E_PER_WARP):
                e0 = 16 * (warp + i * WARPS) + g
                if e0 < E_PAD:
                    for ob in range(O_BLOCKS):
                        for x in range(4):
                            e = e0 + 8 * (x // 2)
                            c = 8 * ob + 2 * t + x % 2
                            if not HAS_Q:
                                increments[first_row + seg, e, c] = hm[i, ob, x]
                            elif e < e_dim and col0 + c < m_dim:
                                final[b, h, e, col0 + c] = hm[i, ob, x]

    return position, start_state, end_state
