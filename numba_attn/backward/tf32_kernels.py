"""The Python sources of the float32 tensor-core backward's two kernels (``backward.tf32`` has the configuration, the
compiled builders, the launches and, in its docstring, the work split and the fragment reads).

Register arrays (``cuda.local.array``) are indexed only with loop variables of compile-time trip counts that NVVM
unrolls, so that they stay in registers. Shared memory is one dynamic float32 buffer: fragment-swizzled tiles
(``core.tf32``), whose reads below are ``swizzled(col, s)`` plus the lane's ``2t`` (row pairs: rows ``g``, ``g + 8``,
XOR ``s_g``) or ``g`` (column pairs: rows ``2t``, ``2t + 1``, XORs ``s_e``, ``s_o``), and the stats pairs.
"""
from __future__ import annotations

import math

import numpy as np
from numba import float32, uint32

from ..core import ptx
from ..core.block_info import (QUERY_MAJOR, block_position, key_tiles, lane_position,
                               query_tiles_start, sequence_bounds)
from ..core.epilogue import add_fragments, as_float32, store_fragments
from ..core.gradients import probabilities_and_grads
from ..core.mask import tile_is_partial
from ..core.softmax import fragment_clear
from ..core.staging import device_function, tile_loader
from ..core.tf32 import fragment_swizzle, swizzled, swizzled_row_words, tf32_products
from ..runtime.device import cuda


def _c_to_a(blocks: int, rows: int, split):
    """``to_a(hi, lo, c)``: the float32 C fragments ``c[i, j]`` (``(rows, blocks, 4)``) split into the A fragments
    ``hi[i, j]``, ``lo[i, j]`` of k-step ``j`` (``ptx``: ``(a0, a1, a2, a3) = (c0, c2, c1, c3)``, k column ``t`` <->
    C column ``2t``). Split once, the float32 fragments are dead before the products that use them."""
    ROWS, BLOCKS = rows, blocks

    @device_function
    def to_a(hi, lo, c):
        for i in range(ROWS):
            for j in range(BLOCKS):
                for e in range(4):
                    hi[i, j, e], lo[i, j, e] = split(c[i, j, 2 * (e % 2) + e // 2])

    return to_a


def _column_products(rows: int, out_blocks: int, k_steps: int, row_words: int, k_chunk: int, split, mma_into):
    """``products(acc, r, hi, lo, smem, at, s_e, s_o)``: ``acc[i, ob] += A_i B`` for the ``rows`` A rows ``i`` of
    k-steps ``hi[i, 0..k_steps]`` / ``lo`` and B the ``[k][n]`` tile at ``smem[at ..]`` (rows of ``row_words``;
    ``at`` with the lane's ``2t row_words + g``) read as column pairs, split as read. The products of ``k_chunk``
    k-steps at a time go into the fresh ``r[i, 0]`` and are added to ``acc`` with float32 adds (``core.tf32``: the
    tensor cores' accumulation rounds toward zero)."""
    ROWS, OUT_BLOCKS, ROW = rows, out_blocks, row_words
    CHUNK = math.gcd(k_steps, k_chunk)
    CHUNKS = k_steps // CHUNK
    load1 = ptx.load1
    clear = fragment_clear(rows, 1)

    @device_function
    def products(acc, r, hi, lo, smem, at, s_e, s_o):
        for ob in range(OUT_BLOCKS):
            col_e = swizzled(8 * ob, s_e)
            col_o = swizzled(8 * ob, s_o)
            for c in range(CHUNKS):
                clear(r)
                for u in range(CHUNK):
                    kq = c * CHUNK + u
                    bh0, bl0 = split(load1(smem, at + 8 * kq * ROW + col_e))
                    bh1, bl1 = split(load1(smem, at + (8 * kq + 1) * ROW + col_o))
                    for i in range(ROWS):
                        mma_into(r, i, 0, hi, lo, kq, bh0, bh1, bl0, bl1)
                for i in range(ROWS):
                    for e in range(4):
                        acc[i, ob, e] += r[i, 0, e]

    return products


def _row_pairs(split):
    """``read(smem, at, out_hi, out_lo, i)``: the A fragment of rows ``g``, ``g + 8`` (``at``: row ``g``'s pair with
    the lane's ``2t``; row ``g + 8`` lies ``8 row`` words on, passed as ``at8``) split into ``out_hi[i, 0]`` /
    ``out_lo[i, 0]``."""
    load_f32x2 = ptx.load_f32x2

    @device_function
    def read(smem, at, at8, out_hi, out_lo, i):
        x0, x2 = load_f32x2(smem, at)  # row g: k columns t, t + 4 <-> words 2t, 2t + 1
        x1, x3 = load_f32x2(smem, at8)  # row g + 8
        out_hi[i, 0, 0], out_lo[i, 0, 0] = split(x0)
        out_hi[i, 0, 1], out_lo[i, 0, 1] = split(x1)
        out_hi[i, 0, 2], out_lo[i, 0, 2] = split(x2)
        out_hi[i, 0, 3], out_lo[i, 0, 3] = split(x3)

    return read


def key_block_source(config, d_pad: int, tf32_only: bool, vector_loads: bool, want_dv: bool, want_dk: bool,
                     atomic_dq: bool, vector_red: bool):
    """The Python function of one key-block specialisation (not yet jitted); also what the offline checks compile.
    ``want_dv`` / ``want_dk``: which of ``dV`` and ``dK`` this launch computes (both unless the head dim takes two
    passes); ``atomic_dq`` (with ``want_dk``): ``dQ`` by reductions into ``dq_acc``."""
    if atomic_dq and not want_dk:
        raise ValueError("atomic_dq needs want_dk (dS)")
    W, KT = config.warps, config.key_tiles
    BLOCK_N, BLOCK_M, STAGES = config.block_n, config.block_m, config.stages
    ROW = swizzled_row_words(d_pad)
    DS_ROW = swizzled_row_words(BLOCK_M)
    D_PAD = d_pad
    WANT_DV, WANT_DK, ATOMIC_DQ = want_dv, want_dk, atomic_dq
    Q_BLOCKS = BLOCK_M // 8  # n8 blocks of S^T (query columns) = k-steps of dV, dK
    D_STEPS = d_pad // 8  # k-steps of S^T, dP^T = n8 blocks of dK, dV
    KEY_STEPS = BLOCK_N // 8  # k-steps of dQ = dS K
    # shared memory, words: K (, V); stages of (Q, dO, stats: block_m float32 pairs); dS^T
    K_OFF = 0
    V_OFF = BLOCK_N * ROW
    STAGE0 = (2 if WANT_DK else 1) * BLOCK_N * ROW
    Q_TILE = BLOCK_M * ROW
    STAGE = 2 * Q_TILE + 2 * BLOCK_M
    DS_OFF = STAGE0 + STAGES * STAGE
    # dQ = dS K: the warps of one group of DQ_ROWS m-tiles split the n8 blocks of the head dim
    DQ_ROWS = config.dq_row_tiles
    GROUPS = BLOCK_M // 16 // DQ_ROWS
    DQ_BLOCKS = -(-D_STEPS // (W // GROUPS))  # n8 blocks per warp
    DQ_ALIGNED = DQ_BLOCKS % 4 == 0  # a warp's first column is a multiple of 32: its swizzle is the constant one
    DQ_EVEN = D_STEPS % (W // GROUPS) == 0  # every warp's share is whole: no test per n8 block
    DQ_CHUNK = math.gcd(KEY_STEPS, config.k_chunk)  # dQ's k-steps per fresh accumulator
    split, mma_into, mma_add = tf32_products(tf32_only)
    commit = ptx.cp_async_commit
    wait_tile = ptx.cp_async_wait_group(STAGES - 2)
    store_f32x2 = ptx.store_f32x2
    load1 = ptx.load1
    threads = 32 * W
    load_keys = tile_loader(threads, ROW, d_pad, BLOCK_N, np.float32, vector_loads, swizzle="fragments")
    load_rows = tile_loader(threads, ROW, d_pad, BLOCK_M, np.float32, vector_loads, swizzle="fragments")
    load_stats = tile_loader(threads, 4, 4, BLOCK_M // 2, np.float32, True)
    position = block_position(QUERY_MAJOR, BLOCK_N)
    first_tile = query_tiles_start(BLOCK_M)
    partial = tile_is_partial(BLOCK_N)
    clear_st = fragment_clear(KT, Q_BLOCKS)
    clear_acc = fragment_clear(KT, D_STEPS)
    clear_dq = fragment_clear(DQ_ROWS, DQ_BLOCKS)
    grads = probabilities_and_grads(KT, Q_BLOCKS, keys_on_rows=True)
    store = store_fragments(KT, D_STEPS, as_float32)
    add_dq = add_fragments(DQ_ROWS, DQ_BLOCKS, vector_red)
    to_a = _c_to_a(Q_BLOCKS, KT, split)
    read_a = _row_pairs(split)
    products = _column_products(KT, D_STEPS, Q_BLOCKS, ROW, config.k_chunk, split, mma_into)

    @device_function
    def load_tile(q, dout, stats, smem, base, b, h, m0, tid, seqlen_q, head_dim):
        """Start the copies of query tile ``m0`` of head ``h``: Q, dO and their stats into the stage at ``base``."""
        load_rows(q[b, h], smem, base, tid, m0, seqlen_q, 0, head_dim)
        load_rows(dout[b, h], smem, base + Q_TILE, tid, m0, seqlen_q, 0, head_dim)
        load_stats(stats[b, h], smem, base + 2 * Q_TILE, tid, m0 // 2, stats.shape[2], 0, 4)

    def kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale):
        tid, warp, lane, g, t = lane_position()
        # a block per (batch, kv head, key block): k in q's place gives the kv head and its views
        b, hk, n0, k_head, _, v_head, _ = position(k, k, v, k, False)
        seqlen_q, key_start, key_end, diag_offset = sequence_bounds(q, k, b)
        head_dim = q.shape[3]
        group = q.shape[1] // k.shape[1]
        key0 = 16 * KT * warp  # this warp's first key in the block
        s_g = fragment_swizzle(g)  # row pairs (rows g, g + 8)
        s_e = fragment_swizzle(2 * t)  # column pairs (rows 2t, 2t + 1)
        s_o = fragment_swizzle(2 * t + 1)
        row_lane = g * ROW + 2 * t
        col_lane = 2 * t * ROW + g
        ds_lane = 2 * t * DS_ROW + g  # dS^T read as column pairs

        smem = cuda.shared.array(0, float32)  # dynamic: the layout above
        ah = cuda.local.array((KT, 1, 4), uint32)  # K's A fragments of one k-step, tf32 hi / lo
        al = cuda.local.array((KT, 1, 4), uint32)
        vh = cuda.local.array((KT, 1, 4), uint32)  # V's
        vl = cuda.local.array((KT, 1, 4), uint32)
        ph = cuda.local.array((KT, Q_BLOCKS, 4), uint32)  # P^T, then dS^T, as A fragments
        pl = cuda.local.array((KT, Q_BLOCKS, 4), uint32)
        qh = cuda.local.array((DQ_ROWS, 1, 4), uint32)  # dS's A fragments of one k-step
        ql = cuda.local.array((DQ_ROWS, 1, 4), uint32)
        s = cuda.local.array((KT, Q_BLOCKS, 4), float32)
        dp = cuda.local.array((KT, Q_BLOCKS, 4), float32)
        r = cuda.local.array((KT, 1, 4), float32)  # one output block of one tile
        acc_v = cuda.local.array((KT, D_STEPS, 4), float32)
        acc_k = cuda.local.array((KT, D_STEPS, 4), float32)
        acc_q = cuda.local.array((DQ_ROWS, DQ_BLOCKS, 4), float32)
        rq = cuda.local.array((DQ_ROWS, DQ_BLOCKS, 4), float32)  # DQ_CHUNK k-steps of dQ

        load_keys(k_head, smem, K_OFF, tid, n0, key_end, 0, head_dim)
        if WANT_DK:  # (dP = dO V^T only feeds dS)
            load_keys(v_head, smem, V_OFF, tid, n0, key_end, 0, head_dim)
        m_begin = first_tile(n0, seqlen_q, causal, diag_offset)
        tiles = (seqlen_q - m_begin + BLOCK_M - 1) // BLOCK_M  # per query head (>= 0)
        total = group * tiles  # the walk: head-major over (query head of the group, query tile)
        for ahead in range(STAGES - 1):  # tiles 0 .. STAGES - 2, one commit group each (K and V in the first)
            if ahead < total:
                gi = ahead // tiles
                load_tile(q, dout, stats, smem, STAGE0 + ahead * STAGE, b, hk * group + gi,
                          m_begin + (ahead - gi * tiles) * BLOCK_M, tid, seqlen_q, head_dim)
            commit()
        if WANT_DV:
            clear_acc(acc_v)
        if WANT_DK:
            clear_acc(acc_k)

        for j in range(total):
            gi = j // tiles
            h = hk * group + gi
            m0 = m_begin + (j - gi * tiles) * BLOCK_M
            base = STAGE0 + (j % STAGES) * STAGE
            wait_tile()
            # tile j has landed for everyone; everyone is done with tile j - 1 (its stage, and dS^T)
            cuda.syncthreads()
            if j + STAGES - 1 < total:
                jn = j + STAGES - 1
                gn = jn // tiles
                load_tile(q, dout, stats, smem, STAGE0 + (jn % STAGES) * STAGE, b, hk * group + gn,
                          m_begin + (jn - gn * tiles) * BLOCK_M, tid, seqlen_q, head_dim)
            commit()  # an empty group past the last tile keeps "oldest group = tile j" true

            # ---- S^T = K Q^T, dP^T = V dO^T: one split Q / dO fragment feeds every key tile of the warp; each
            # k-step's products into fresh accumulators (core.tf32: the tensor cores round toward zero) ----------
            clear_st(s)
            clear_st(dp)
            for kk in range(D_STEPS):
                col = swizzled(8 * kk, s_g) + row_lane
                for kt in range(KT):
                    at = (key0 + 16 * kt) * ROW + col
                    read_a(smem, K_OFF + at, K_OFF + at + 8 * ROW, ah, al, kt)
                    if WANT_DK:
                        read_a(smem, V_OFF + at, V_OFF + at + 8 * ROW, vh, vl, kt)
                for nb in range(Q_BLOCKS):  # query rows 8 nb + g, words 2t, 2t + 1 of the k-step: b0, b1
                    y0, y1 = ptx.load_f32x2(smem, base + 8 * nb * ROW + col)
                    bh0, bl0 = split(y0)
                    bh1, bl1 = split(y1)
                    for kt in range(KT):
                        mma_add(s, kt, nb, ah, al, 0, bh0, bh1, bl0, bl1)
                    if WANT_DK:
                        y0, y1 = ptx.load_f32x2(smem, base + Q_TILE + 8 * nb * ROW + col)
                        bh0, bl0 = split(y0)
                        bh1, bl1 = split(y1)
                        for kt in range(KT):
                            mma_add(dp, kt, nb, vh, vl, 0, bh0, bh1, bl0, bl1)

            # ---- P^T and dS^T on the fragments; masks only where the tile crosses the diagonal or the last key ---
            grads(s, dp, smem, base + 2 * Q_TILE + 4 * t, partial(n0, m0, key_end, causal, diag_offset),
                  n0 + key0 + g, m0 + 2 * t, key_end, causal, diag_offset, scale_log2)
            if ATOMIC_DQ:  # dS^T -> shared memory (float32, split where read) for dQ = dS K
                for kt in range(KT):
                    for nb in range(Q_BLOCKS):
                        at = DS_OFF + (key0 + 16 * kt + g) * DS_ROW + 2 * t + swizzled(8 * nb, s_g)
                        store_f32x2(smem, at, dp[kt, nb, 0], dp[kt, nb, 1])
                        store_f32x2(smem, at + 8 * DS_ROW, dp[kt, nb, 2], dp[kt, nb, 3])

            # ---- dV += P^T dO, dK += dS^T Q: P^T / dS^T split in registers, dO / Q read as column pairs -----------
            if WANT_DV:
                to_a(ph, pl, s)
                products(acc_v, r, ph, pl, smem, base + Q_TILE + col_lane, s_e, s_o)
            if WANT_DK:
                to_a(ph, pl, dp)
                products(acc_k, r, ph, pl, smem, base + col_lane, s_e, s_o)

            # ---- dQ += sm_scale dS K: this warp's m-tiles and columns, added by reductions ---------------------------
            if ATOMIC_DQ:
                cuda.syncthreads()  # dS^T of every warp is in
                mq0 = (warp % GROUPS) * DQ_ROWS
                d0 = (warp // GROUPS) * 8 * DQ_BLOCKS
                clear_dq(acc_q)
                for c in range(KEY_STEPS // DQ_CHUNK):
                    clear_dq(rq)
                    for u in range(DQ_CHUNK):
                        kn = c * DQ_CHUNK + u
                        # A = dS (query rows 16 m + g, + 8; keys 8 kn + 2t, + 1) = dS^T read as column pairs
                        at = DS_OFF + 8 * kn * DS_ROW + ds_lane
                        for mw in range(DQ_ROWS):
                            c16 = 16 * (mq0 + mw)
                            x0 = load1(smem, at + swizzled(c16, s_e))
                            x1 = load1(smem, at + swizzled(c16 + 8, s_e))
                            x2 = load1(smem, at + DS_ROW + swizzled(c16, s_o))
                            x3 = load1(smem, at + DS_ROW + swizzled(c16 + 8, s_o))
                            qh[mw, 0, 0], ql[mw, 0, 0] = split(x0)
                            qh[mw, 0, 1], ql[mw, 0, 1] = split(x1)
                            qh[mw, 0, 2], ql[mw, 0, 2] = split(x2)
                            qh[mw, 0, 3], ql[mw, 0, 3] = split(x3)
                        kat = K_OFF + 8 * kn * ROW + col_lane
                        for ob in range(DQ_BLOCKS):
                            if DQ_EVEN or d0 + 8 * ob < D_PAD:  # (warp-uniform: the last warp's share may be short)
                                if DQ_ALIGNED:
                                    col_e = d0 + swizzled(8 * ob, s_e)
                                    col_o = d0 + swizzled(8 * ob, s_o)
                                else:
                                    col_e = swizzled(d0 + 8 * ob, s_e)
                                    col_o = swizzled(d0 + 8 * ob, s_o)
                                bh0, bl0 = split(load1(smem, kat + col_e))  # K row (key) 8 kn + 2t, column + g
                                bh1, bl1 = split(load1(smem, kat + ROW + col_o))
                                for mw in range(DQ_ROWS):
                                    mma_into(rq, mw, ob, qh, ql, 0, bh0, bh1, bl0, bl1)
                    for mw in range(DQ_ROWS):
                        for ob in range(DQ_BLOCKS):
                            for e in range(4):
                                acc_q[mw, ob, e] += rq[mw, ob, e]
                add_dq(acc_q, dq_acc[b, h], m0 + 16 * mq0 + g, seqlen_q, d0 + 2 * t, D_PAD, sm_scale)

        # ---- every key of the block is written, 0 where no row sees it ------------------------------------------------
        if WANT_DV:
            store(acc_v, dv[b, hk], n0 + key0 + g, key_end, 2 * t, head_dim, float32(1.0))
        if WANT_DK:
            store(acc_k, dk[b, hk], n0 + key0 + g, key_end, 2 * t, head_dim, sm_scale)

    return kernel


def query_block_source(config, d_pad: int, tf32_only: bool, vector_loads: bool):
    """The Python function of one query-block specialisation (``deterministic=True``'s ``dQ``)."""
    W, MT = config.dq_warps, config.dq_m_tiles
    BLOCK_M, BLOCK_N, STAGES = config.dq_block_m, config.dq_block_n, config.dq_stages
    ROW = swizzled_row_words(d_pad)
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S (keys) = k-steps of dQ = dS K
    D_STEPS = d_pad // 8  # k-steps of S, dP = n8 blocks of dQ
    # shared memory, words: Q, dO, stats (resident); stages of (K, V)
    Q_OFF = 0
    DO_OFF = BLOCK_M * ROW
    STATS_OFF = 2 * BLOCK_M * ROW
    STAGE0 = STATS_OFF + 2 * BLOCK_M
    TILE = BLOCK_N * ROW
    STAGE = 2 * TILE
    split, mma_into, mma_add = tf32_products(tf32_only)
    commit = ptx.cp_async_commit
    wait_tile = ptx.cp_async_wait_group(STAGES - 2)
    threads = 32 * W
    load_rows = tile_loader(threads, ROW, d_pad, BLOCK_M, np.float32, vector_loads, swizzle="fragments")
    load_keys = tile_loader(threads, ROW, d_pad, BLOCK_N, np.float32, vector_loads, swizzle="fragments")
    load_stats = tile_loader(threads, 4, 4, BLOCK_M // 2, np.float32, True)
    position = block_position(QUERY_MAJOR, BLOCK_M)
    count_tiles = key_tiles(BLOCK_M, BLOCK_N)
    partial = tile_is_partial(BLOCK_N)
    clear_s = fragment_clear(MT, S_BLOCKS)
    clear_acc = fragment_clear(MT, D_STEPS)
    grads = probabilities_and_grads(MT, S_BLOCKS, keys_on_rows=False)
    store = store_fragments(MT, D_STEPS, as_float32)
    to_a = _c_to_a(S_BLOCKS, MT, split)
    read_a = _row_pairs(split)
    products = _column_products(MT, D_STEPS, S_BLOCKS, ROW, config.k_chunk, split, mma_into)

    def kernel(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale):
        tid, warp, lane, g, t = lane_position()
        # causal: the longest (last) query blocks start first
        b, h, m0, q_head, k_head, v_head, dq_head = position(q, k, v, dq, causal)
        seqlen_q, key_start, key_end, diag_offset = sequence_bounds(q, k, b)
        head_dim = q.shape[3]
        warp_row = 16 * MT * warp
        s_g = fragment_swizzle(g)
        s_e = fragment_swizzle(2 * t)
        s_o = fragment_swizzle(2 * t + 1)
        row_lane = g * ROW + 2 * t
        col_lane = 2 * t * ROW + g

        smem = cuda.shared.array(0, float32)
        qh = cuda.local.array((MT, 1, 4), uint32)
        ql = cuda.local.array((MT, 1, 4), uint32)
        oh = cuda.local.array((MT, 1, 4), uint32)
        ol = cuda.local.array((MT, 1, 4), uint32)
        dh = cuda.local.array((MT, S_BLOCKS, 4), uint32)  # dS, as A fragments
        dl = cuda.local.array((MT, S_BLOCKS, 4), uint32)
        s = cuda.local.array((MT, S_BLOCKS, 4), float32)
        dp = cuda.local.array((MT, S_BLOCKS, 4), float32)
        r = cuda.local.array((MT, 1, 4), float32)
        acc = cuda.local.array((MT, D_STEPS, 4), float32)

        n_tiles = count_tiles(m0, key_start, key_end, causal, diag_offset)  # <= 0: nothing to read
        load_rows(q_head, smem, Q_OFF, tid, m0, seqlen_q, 0, head_dim)
        load_rows(dout[b, h], smem, DO_OFF, tid, m0, seqlen_q, 0, head_dim)
        load_stats(stats[b, h], smem, STATS_OFF, tid, m0 // 2, stats.shape[2], 0, 4)
        for ahead in range(STAGES - 1):  # one commit group each (Q, dO and stats in the first)
            if ahead < n_tiles:
                n_ahead = key_start + ahead * BLOCK_N
                load_keys(k_head, smem, STAGE0 + ahead * STAGE, tid, n_ahead, key_end, 0, head_dim)
                load_keys(v_head, smem, STAGE0 + ahead * STAGE + TILE, tid, n_ahead, key_end, 0, head_dim)
            commit()
        clear_acc(acc)

        for j in range(n_tiles):
            n0 = key_start + j * BLOCK_N
            base = STAGE0 + (j % STAGES) * STAGE
            wait_tile()
            cuda.syncthreads()  # tile j has landed for everyone; everyone is done with tile j - 1's stage
            if j + STAGES - 1 < n_tiles:
                nxt = STAGE0 + ((j + STAGES - 1) % STAGES) * STAGE
                n_next = n0 + (STAGES - 1) * BLOCK_N
                load_keys(k_head, smem, nxt, tid, n_next, key_end, 0, head_dim)
                load_keys(v_head, smem, nxt + TILE, tid, n_next, key_end, 0, head_dim)
            commit()

            # ---- S = Q K^T, dP = dO V^T ------------------------------------------------------------------------
            clear_s(s)
            clear_s(dp)
            for kk in range(D_STEPS):
                col = swizzled(8 * kk, s_g) + row_lane
                for mt in range(MT):
                    at = (warp_row + 16 * mt) * ROW + col
                    read_a(smem, Q_OFF + at, Q_OFF + at + 8 * ROW, qh, ql, mt)
                    read_a(smem, DO_OFF + at, DO_OFF + at + 8 * ROW, oh, ol, mt)
                for nb in range(S_BLOCKS):  # keys 8 nb + g
                    y0, y1 = ptx.load_f32x2(smem, base + 8 * nb * ROW + col)
                    bh0, bl0 = split(y0)
                    bh1, bl1 = split(y1)
                    for mt in range(MT):
                        mma_add(s, mt, nb, qh, ql, 0, bh0, bh1, bl0, bl1)
                    y0, y1 = ptx.load_f32x2(smem, base + TILE + 8 * nb * ROW + col)
                    bh0, bl0 = split(y0)
                    bh1, bl1 = split(y1)
                    for mt in range(MT):
                        mma_add(dp, mt, nb, oh, ol, 0, bh0, bh1, bl0, bl1)

            # ---- P, dS on the fragments -------------------------------------------------------------------------
            grads(s, dp, smem, STATS_OFF + 2 * (warp_row + g), partial(n0, m0, key_end, causal, diag_offset),
                  m0 + warp_row + g, n0 + 2 * t, key_end, causal, diag_offset, scale_log2)

            # ---- dQ += dS K: dS split in registers, K read as column pairs ------------------------------------------
            to_a(dh, dl, dp)
            products(acc, r, dh, dl, smem, base + col_lane, s_e, s_o)

        store(acc, dq_head, m0 + warp_row + g, seqlen_q, 2 * t, head_dim, sm_scale)

    return kernel
