"""The Python sources of the tensor-core backward's two kernels (``backward.mma`` has the configuration, the compiled
builders and the launches; its docstring describes the work split).

Register arrays (``cuda.local.array``) are indexed only with loop variables of compile-time trip counts that NVVM
unrolls, so that they stay in registers; shared memory is one dynamic buffer seen as uint16 (tiles, ``ldmatrix``),
uint32 (the packed ``dS^T`` stores) and float32 (the stats). ``ldmatrix`` addresses are computed in 32 bits
(``ptx.ldmatrix_x4_short``): hoisted 64-bit offsets made the key-block kernel spill.
"""
from __future__ import annotations

import numpy as np
from numba import float32, uint16, uint32

from ..core import ptx
from ..core.block_info import (QUERY_MAJOR, block_position_of, key_block_bounds_of, key_tile_walk,
                               lane_position, query_tile_range, sequence_bounds_of)
from ..core.epilogue import add_fragments, as_16bit, store_fragments
from ..core.gradients import probabilities_and_grads
from ..core.mask import tile_is_partial
from ..core.softmax import fragment_clear
from ..core.staging import device_function, kernel_body, tile_loader
from ..forward.common import PLAIN
from ..runtime.device import cuda
from .preprocess import stats_loader


def _mma_into(bf16: bool):
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16

    @device_function
    def mma_into(c, mt, n, a0, a1, a2, a3, b0, b1):
        """``c[mt, n, :] += A B``: one MMA accumulating into a C fragment of a register array."""
        c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3] = mma(a0, a1, a2, a3, b0, b1,
                                                                 c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3])

    return mma_into


def _packed(m_tiles: int, blocks: int, pack):
    """``pack_c(words, c)``: the ``(m_tiles, blocks, 4)`` float32 C fragments ``c`` rounded to 16 bits in pairs,
    ``words[mt, nb, 0] = (c0, c1)`` (row g) and ``[mt, nb, 1] = (c2, c3)`` (row g + 8). Words ``[mt, 2j, 0]``,
    ``[mt, 2j, 1]``, ``[mt, 2j + 1, 0]``, ``[mt, 2j + 1, 1]`` are the A fragment of k-step ``j`` (the ``ptx``
    docstring's C -> A identity), and each word is also the pair a lane stores of a transposed copy. Packed once, the
    float32 fragments are dead before the products that use them."""
    M_TILES = m_tiles
    BLOCKS = blocks

    @device_function
    def pack_c(words, c):
        for mt in range(M_TILES):
            for nb in range(BLOCKS):
                words[mt, nb, 0] = pack(c[mt, nb, 0], c[mt, nb, 1])
                words[mt, nb, 1] = pack(c[mt, nb, 2], c[mt, nb, 3])

    return pack_c


def _entry(body, packed: bool, key_block: bool):
    """The kernel function running ``body(..., schedule)``: ``kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal,
    scale_log2, sm_scale)`` (``key_block``) or ``kernel(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale)``,
    with the int32 ``schedule`` as a last argument for packed sequences (otherwise the body's ``schedule`` is
    ``stats``, never read as one)."""
    if key_block and packed:
        def packed_key_kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale, schedule):
            body(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale, schedule)

        return packed_key_kernel
    if key_block:
        def key_kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale):
            body(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale, stats)

        return key_kernel
    if packed:
        def packed_query_kernel(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale, schedule):
            body(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale, schedule)

        return packed_query_kernel

    def query_kernel(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale):
        body(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale, stats)

    return query_kernel


def key_block_source(config, d_pad: int, bf16: bool, vector_loads: bool, want_dv: bool,
                     want_dk: bool, atomic_dq: bool, vector_red: bool, variant=PLAIN):
    """The Python function of one key-block specialisation (not yet jitted); also what the offline checks compile.
    ``want_dv`` / ``want_dk``: which of ``dV`` and ``dK`` this launch computes (both unless the head dim takes two
    passes); ``atomic_dq`` (with ``want_dk``): ``dQ`` by reductions into ``dq_acc``; ``variant``
    (``forward.common.Variant``): the window (only the query tiles that see the block are walked), the cap and packed
    sequences (a key schedule, ``backward.varlen``)."""
    if atomic_dq and not want_dk:
        raise ValueError("atomic_dq needs want_dk (dS)")
    W, KT = config.warps, config.key_tiles
    BLOCK_N, BLOCK_M, STAGES = config.block_n, config.block_m, config.stages
    ROW = d_pad + 8
    D_PAD = d_pad
    WANT_DV, WANT_DK, ATOMIC_DQ = want_dv, want_dk, atomic_dq
    Q_BLOCKS = BLOCK_M // 8  # n8 blocks of S^T (query columns)
    D_STEPS = d_pad // 16  # k-steps of S^T, dP^T
    M_STEPS = BLOCK_M // 16  # k-steps of dV, dK (query rows); also the m-tiles of dQ
    D_BLOCKS = d_pad // 8  # n8 blocks of dK, dV
    KEY_STEPS = BLOCK_N // 16  # k-steps of dQ = dS K
    # the warp's K and V A fragments in registers for the whole walk (4 KT d_pad / 16 words each) instead of an
    # ldmatrix per tile: small head dims only (at 64 it adds a few spills)
    KV_REGS = config.kv_in_registers and KT * D_STEPS <= 4
    # shared memory, 16-bit units: K, V; stages of (Q, dO, stats: block_m float32 pairs); dS^T
    K_OFF = 0
    V_OFF = BLOCK_N * ROW
    STAGE0 = 2 * BLOCK_N * ROW
    Q_TILE = BLOCK_M * ROW
    STAGE = 2 * Q_TILE + 4 * BLOCK_M
    DS_OFF = STAGE0 + STAGES * STAGE
    DS_ROW = BLOCK_M + 8
    # dQ = dS K: the warps of one group of DQ_ROWS m-tiles split the 16-column pairs of the head dim
    DQ_ROWS = config.dq_row_tiles
    GROUPS = M_STEPS // DQ_ROWS
    PAIRS = -(-(d_pad // 16) // (W // GROUPS))  # 16-column pairs per warp
    DQ_BLOCKS = 2 * PAIRS
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    ldmatrix = ptx.ldmatrix_x4_short
    ldmatrix_trans = ptx.ldmatrix_x4_trans_short
    store_word = ptx.store1
    commit = ptx.cp_async_commit
    wait_tile = ptx.cp_async_wait_group(STAGES - 2)
    wait_all = ptx.cp_async_wait_all
    threads = 32 * W
    load_keys = tile_loader(threads, ROW, d_pad, BLOCK_N, np.uint16, vector_loads)
    load_rows = tile_loader(threads, ROW, d_pad, BLOCK_M, np.uint16, vector_loads)
    load_stats = stats_loader(threads, BLOCK_M, variant.packed)
    position = block_position_of(QUERY_MAJOR, BLOCK_N, variant.packed)
    bounds = key_block_bounds_of(variant.packed)
    query_range = query_tile_range(BLOCK_M, BLOCK_N, variant.window)
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    clear_st = fragment_clear(KT, Q_BLOCKS)
    clear_acc = fragment_clear(KT, D_BLOCKS)
    clear_dq = fragment_clear(DQ_ROWS, DQ_BLOCKS)
    grads = probabilities_and_grads(KT, Q_BLOCKS, True, variant.window, variant.softcap)
    store = store_fragments(KT, D_BLOCKS, as_16bit(bf16))
    add_dq = add_fragments(DQ_ROWS, DQ_BLOCKS, vector_red)
    mma_into = _mma_into(bf16)
    pack_c = _packed(KT, Q_BLOCKS, pack)

    @device_function
    def load_tile(q, dout, stats, smem, floats, base, b, h, m0, tid, seqlen_q, head_dim):
        """Start the copies of query tile ``m0`` of head ``h``: Q, dO and their stats into the stage at ``base``."""
        load_rows(q[b, h], smem, base, tid, m0, seqlen_q, 0, head_dim)
        load_rows(dout[b, h], smem, base + Q_TILE, tid, m0, seqlen_q, 0, head_dim)
        load_stats(stats[b, h], floats, (base + 2 * Q_TILE) // 2, tid, m0, seqlen_q)

    @kernel_body
    def body(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale, schedule):
        tid, warp, lane, g, t = lane_position()
        # a block per (batch, kv head, key block): k in q's place gives the kv head and its views
        b, hk, n0, k_head, _, v_head, _ = position(k, k, v, k, False, schedule)
        row_start, seqlen_q, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]
        group = q.shape[1] // k.shape[1]
        key0 = 16 * KT * warp  # this warp's first key in the block
        # ldmatrix row addresses of this lane (lane 8i + r: row r of matrix i). a_lane: matrices (rows +0, cols +0),
        # (+8, +0), (+0, +8), (+8, +8): the A fragment of a [row][k] tile, or (.trans) the B fragments of two n8
        # blocks of a [k][n] tile. b_lane: (+0, +0), (+0, +8), (+8, +0), (+8, +8): the B fragments of two n8 blocks
        # of a [n][k] tile, or (.trans, over dS^T [key][query]) the A fragment of dS.
        a_lane = (8 * ((lane // 8) % 2) + lane % 8) * ROW + 8 * (lane // 16)
        b_lane = (8 * (lane // 16) + lane % 8) * ROW + 8 * ((lane // 8) % 2)
        ds_lane = (8 * (lane // 16) + lane % 8) * DS_ROW + 8 * ((lane // 8) % 2)

        smem = cuda.shared.array(0, uint16)  # dynamic: the layout above
        words = cuda.shared.array(0, uint32)  # the same memory: dS^T stored as packed pairs
        floats = cuda.shared.array(0, float32)  # the same memory: the stats
        ka = cuda.local.array((KT, D_STEPS, 4), uint32)  # K's A fragments (k-step kk, or only [kt, 0])
        va = cuda.local.array((KT, D_STEPS, 4), uint32)
        pw = cuda.local.array((KT, Q_BLOCKS, 2), uint32)  # P^T, packed
        dw = cuda.local.array((KT, Q_BLOCKS, 2), uint32)  # dS^T, packed
        qa = cuda.local.array((DQ_ROWS, 4), uint32)
        s = cuda.local.array((KT, Q_BLOCKS, 4), float32)
        dp = cuda.local.array((KT, Q_BLOCKS, 4), float32)
        acc_v = cuda.local.array((KT, D_BLOCKS, 4), float32)
        acc_k = cuda.local.array((KT, D_BLOCKS, 4), float32)
        acc_q = cuda.local.array((DQ_ROWS, DQ_BLOCKS, 4), float32)

        load_keys(k_head, smem, K_OFF, tid, n0, key_end, 0, head_dim)
        if WANT_DK:  # (dP = dO V^T only feeds dS)
            load_keys(v_head, smem, V_OFF, tid, n0, key_end, 0, head_dim)
        # the query tiles that see these keys: from the diagonal (causal) or a window's right edge to its left edge
        m_begin, m_end = query_range(n0, row_start, seqlen_q, key_end, causal, diag_offset)
        tiles = max(0, (m_end - m_begin + BLOCK_M - 1) // BLOCK_M)  # per query head
        total = group * tiles  # the walk: head-major over (query head of the group, query tile)
        for ahead in range(STAGES - 1):  # tiles 0 .. STAGES - 2, one commit group each (K and V in the first)
            if ahead < total:
                gi = ahead // tiles
                load_tile(q, dout, stats, smem, floats, STAGE0 + ahead * STAGE, b, hk * group + gi,
                          m_begin + (ahead - gi * tiles) * BLOCK_M, tid, seqlen_q, head_dim)
            commit()
        if WANT_DV:
            clear_acc(acc_v)
        if WANT_DK:
            clear_acc(acc_k)
        if KV_REGS and total > 0:
            wait_all()
            cuda.syncthreads()  # K and V have landed
            for kk in range(D_STEPS):
                for kt in range(KT):
                    at = a_lane + (key0 + 16 * kt) * ROW + 16 * kk
                    ka[kt, kk, 0], ka[kt, kk, 1], ka[kt, kk, 2], ka[kt, kk, 3] = ldmatrix(smem, K_OFF + at)
                    if WANT_DK:
                        va[kt, kk, 0], va[kt, kk, 1], va[kt, kk, 2], va[kt, kk, 3] = ldmatrix(smem, V_OFF + at)

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
                load_tile(q, dout, stats, smem, floats, STAGE0 + (jn % STAGES) * STAGE, b, hk * group + gn,
                          m_begin + (jn - gn * tiles) * BLOCK_M, tid, seqlen_q, head_dim)
            commit()  # an empty group past the last tile keeps "oldest group = tile j" true

            # ---- S^T = K Q^T, dP^T = V dO^T: one Q / dO fragment feeds every key tile of the warp --------------
            clear_st(s)
            clear_st(dp)
            for kk in range(D_STEPS):
                f = kk if KV_REGS else 0  # where this k-step's K / V fragments are
                if not KV_REGS:
                    for kt in range(KT):
                        at = a_lane + (key0 + 16 * kt) * ROW + 16 * kk
                        ka[kt, 0, 0], ka[kt, 0, 1], ka[kt, 0, 2], ka[kt, 0, 3] = ldmatrix(smem, K_OFF + at)
                        if WANT_DK:
                            va[kt, 0, 0], va[kt, 0, 1], va[kt, 0, 2], va[kt, 0, 3] = ldmatrix(smem, V_OFF + at)
                for nb in range(0, Q_BLOCKS, 2):
                    b0, b1, b2, b3 = ldmatrix(smem, base + b_lane + 8 * nb * ROW + 16 * kk)
                    for kt in range(KT):
                        x0, x1, x2, x3 = ka[kt, f, 0], ka[kt, f, 1], ka[kt, f, 2], ka[kt, f, 3]
                        mma_into(s, kt, nb, x0, x1, x2, x3, b0, b1)
                        mma_into(s, kt, nb + 1, x0, x1, x2, x3, b2, b3)
                    if WANT_DK:
                        c0, c1, c2, c3 = ldmatrix(smem, base + Q_TILE + b_lane + 8 * nb * ROW + 16 * kk)
                        for kt in range(KT):
                            x0, x1, x2, x3 = va[kt, f, 0], va[kt, f, 1], va[kt, f, 2], va[kt, f, 3]
                            mma_into(dp, kt, nb, x0, x1, x2, x3, c0, c1)
                            mma_into(dp, kt, nb + 1, x0, x1, x2, x3, c2, c3)

            # ---- P^T and dS^T on the fragments; masks only where the tile crosses the diagonal or the last key ---
            grads(s, dp, floats, (base + 2 * Q_TILE) // 2 + 4 * t, partial(n0, m0, key_end, causal, diag_offset),
                  n0 + key0 + g, m0 + 2 * t, key_end, causal, diag_offset, scale_log2)
            if WANT_DV:
                pack_c(pw, s)
            if WANT_DK:
                pack_c(dw, dp)
            if ATOMIC_DQ:  # dS^T -> shared memory (16 bits, as the MMAs see it) for dQ = dS K
                for kt in range(KT):
                    at = DS_OFF + (key0 + 16 * kt + g) * DS_ROW + 2 * t
                    for nb in range(Q_BLOCKS):
                        store_word(words, (at + 8 * nb) // 2, dw[kt, nb, 0])
                        store_word(words, (at + 8 * DS_ROW + 8 * nb) // 2, dw[kt, nb, 1])

            # ---- dV += P^T dO, dK += dS^T Q: P^T / dS^T from registers, dO / Q as B by ldmatrix.trans ------------
            for kq in range(M_STEPS):
                for ob in range(0, D_BLOCKS, 2):
                    at = a_lane + 16 * kq * ROW + 8 * ob
                    if WANT_DV:
                        b0, b1, b2, b3 = ldmatrix_trans(smem, base + Q_TILE + at)
                        for kt in range(KT):
                            x0, x1 = pw[kt, 2 * kq, 0], pw[kt, 2 * kq, 1]
                            x2, x3 = pw[kt, 2 * kq + 1, 0], pw[kt, 2 * kq + 1, 1]
                            mma_into(acc_v, kt, ob, x0, x1, x2, x3, b0, b1)
                            mma_into(acc_v, kt, ob + 1, x0, x1, x2, x3, b2, b3)
                    if WANT_DK:
                        c0, c1, c2, c3 = ldmatrix_trans(smem, base + at)
                        for kt in range(KT):
                            x0, x1 = dw[kt, 2 * kq, 0], dw[kt, 2 * kq, 1]
                            x2, x3 = dw[kt, 2 * kq + 1, 0], dw[kt, 2 * kq + 1, 1]
                            mma_into(acc_k, kt, ob, x0, x1, x2, x3, c0, c1)
                            mma_into(acc_k, kt, ob + 1, x0, x1, x2, x3, c2, c3)

            # ---- dQ += sm_scale dS K: this warp's m-tiles and columns, added by reductions ---------------------------
            if ATOMIC_DQ:
                cuda.syncthreads()  # dS^T of every warp is in
                mq0 = (warp % GROUPS) * DQ_ROWS
                d0 = (warp // GROUPS) * 16 * PAIRS
                clear_dq(acc_q)
                for kn in range(KEY_STEPS):
                    for mw in range(DQ_ROWS):
                        qa[mw, 0], qa[mw, 1], qa[mw, 2], qa[mw, 3] = ldmatrix_trans(
                            smem, DS_OFF + ds_lane + 16 * kn * DS_ROW + 16 * (mq0 + mw))
                    for ob in range(0, DQ_BLOCKS, 2):
                        if d0 + 8 * ob < D_PAD:  # (warp-uniform: the last warp's share may be short)
                            b0, b1, b2, b3 = ldmatrix_trans(smem, K_OFF + a_lane + 16 * kn * ROW + d0 + 8 * ob)
                            for mw in range(DQ_ROWS):
                                mma_into(acc_q, mw, ob, qa[mw, 0], qa[mw, 1], qa[mw, 2], qa[mw, 3], b0, b1)
                                mma_into(acc_q, mw, ob + 1, qa[mw, 0], qa[mw, 1], qa[mw, 2], qa[mw, 3], b2, b3)
                add_dq(acc_q, dq_acc[b, h], m0 + 16 * mq0 + g, seqlen_q, d0 + 2 * t, D_PAD, sm_scale)

        # ---- every key of the block is written, 0 where no row sees it ------------------------------------------------
        # (the views made here, not at the start: nothing of them stays live through the walk)
        if WANT_DV:
            store(acc_v, dv[b, hk], n0 + key0 + g, key_end, 2 * t, head_dim, float32(1.0))
        if WANT_DK:
            store(acc_k, dk[b, hk], n0 + key0 + g, key_end, 2 * t, head_dim, sm_scale)

    return _entry(body, variant.packed, key_block=True)


def query_block_source(config, d_pad: int, bf16: bool, vector_loads: bool, variant=PLAIN):
    """The Python function of one query-block specialisation (``deterministic=True``'s ``dQ``); ``variant`` as
    ``key_block_source``'s (packed sequences: the forward's schedule, over ``dq_block_m``-row blocks)."""
    W, MT = config.dq_warps, config.dq_m_tiles
    BLOCK_M, BLOCK_N, STAGES = config.dq_block_m, config.dq_block_n, config.dq_stages
    ROW = d_pad + 8
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S (keys)
    D_STEPS = d_pad // 16  # k-steps of S, dP
    N_STEPS = BLOCK_N // 16  # k-steps of dQ = dS K
    D_BLOCKS = d_pad // 8  # n8 blocks of dQ
    # shared memory, 16-bit units: Q, dO, stats (resident); stages of (K, V)
    Q_OFF = 0
    DO_OFF = BLOCK_M * ROW
    STATS_OFF = 2 * BLOCK_M * ROW
    STAGE0 = STATS_OFF + 4 * BLOCK_M
    TILE = BLOCK_N * ROW
    STAGE = 2 * TILE
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    ldmatrix = ptx.ldmatrix_x4_short
    ldmatrix_trans = ptx.ldmatrix_x4_trans_short
    commit = ptx.cp_async_commit
    wait_tile = ptx.cp_async_wait_group(STAGES - 2)
    threads = 32 * W
    load_rows = tile_loader(threads, ROW, d_pad, BLOCK_M, np.uint16, vector_loads)
    load_keys = tile_loader(threads, ROW, d_pad, BLOCK_N, np.uint16, vector_loads)
    load_stats = stats_loader(threads, BLOCK_M, variant.packed)
    position = block_position_of(QUERY_MAJOR, BLOCK_M, variant.packed)
    bounds = sequence_bounds_of(variant.packed)
    walk_tiles = key_tile_walk(BLOCK_M, BLOCK_N, variant.window)  # tiles wholly outside a window: skipped
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    clear_s = fragment_clear(MT, S_BLOCKS)
    clear_acc = fragment_clear(MT, D_BLOCKS)
    grads = probabilities_and_grads(MT, S_BLOCKS, False, variant.window, variant.softcap)
    store = store_fragments(MT, D_BLOCKS, as_16bit(bf16))
    mma_into = _mma_into(bf16)
    pack_c = _packed(MT, S_BLOCKS, pack)

    @kernel_body
    def body(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale, schedule):
        tid, warp, lane, g, t = lane_position()
        # causal: the longest (last) query blocks start first
        b, h, m0, q_head, k_head, v_head, dq_head = position(q, k, v, dq, causal, schedule)
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]
        warp_row = 16 * MT * warp
        a_lane = (8 * ((lane // 8) % 2) + lane % 8) * ROW + 8 * (lane // 16)  # as in the key-block kernel
        b_lane = (8 * (lane // 16) + lane % 8) * ROW + 8 * ((lane // 8) % 2)

        smem = cuda.shared.array(0, uint16)
        floats = cuda.shared.array(0, float32)  # the same memory: the stats
        qa = cuda.local.array((MT, 4), uint32)
        oa = cuda.local.array((MT, 4), uint32)
        dw = cuda.local.array((MT, S_BLOCKS, 2), uint32)  # dS, packed
        s = cuda.local.array((MT, S_BLOCKS, 4), float32)
        dp = cuda.local.array((MT, S_BLOCKS, 4), float32)
        acc = cuda.local.array((MT, D_BLOCKS, 4), float32)

        n_first, n_tiles = walk_tiles(m0, key_start, key_end, causal, diag_offset)  # <= 0: nothing to read
        load_rows(q_head, smem, Q_OFF, tid, m0, seqlen_q, 0, head_dim)
        load_rows(dout[b, h], smem, DO_OFF, tid, m0, seqlen_q, 0, head_dim)
        load_stats(stats[b, h], floats, STATS_OFF // 2, tid, m0, seqlen_q)
        for ahead in range(STAGES - 1):  # one commit group each (Q, dO and stats in the first)
            if ahead < n_tiles:
                n_ahead = n_first + ahead * BLOCK_N
                load_keys(k_head, smem, STAGE0 + ahead * STAGE, tid, n_ahead, key_end, 0, head_dim)
                load_keys(v_head, smem, STAGE0 + ahead * STAGE + TILE, tid, n_ahead, key_end, 0, head_dim)
            commit()
        clear_acc(acc)

        for j in range(n_tiles):
            n0 = n_first + j * BLOCK_N
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
                for mt in range(MT):
                    at = a_lane + (warp_row + 16 * mt) * ROW + 16 * kk
                    qa[mt, 0], qa[mt, 1], qa[mt, 2], qa[mt, 3] = ldmatrix(smem, Q_OFF + at)
                    oa[mt, 0], oa[mt, 1], oa[mt, 2], oa[mt, 3] = ldmatrix(smem, DO_OFF + at)
                for nb in range(0, S_BLOCKS, 2):
                    b0, b1, b2, b3 = ldmatrix(smem, base + b_lane + 8 * nb * ROW + 16 * kk)
                    c0, c1, c2, c3 = ldmatrix(smem, base + TILE + b_lane + 8 * nb * ROW + 16 * kk)
                    for mt in range(MT):
                        mma_into(s, mt, nb, qa[mt, 0], qa[mt, 1], qa[mt, 2], qa[mt, 3], b0, b1)
                        mma_into(s, mt, nb + 1, qa[mt, 0], qa[mt, 1], qa[mt, 2], qa[mt, 3], b2, b3)
                        mma_into(dp, mt, nb, oa[mt, 0], oa[mt, 1], oa[mt, 2], oa[mt, 3], c0, c1)
                        mma_into(dp, mt, nb + 1, oa[mt, 0], oa[mt, 1], oa[mt, 2], oa[mt, 3], c2, c3)

            # ---- P, dS on the fragments -------------------------------------------------------------------------
            grads(s, dp, floats, STATS_OFF // 2 + 2 * (warp_row + g), partial(n0, m0, key_end, causal, diag_offset),
                  m0 + warp_row + g, n0 + 2 * t, key_end, causal, diag_offset, scale_log2)

            # ---- dQ += dS K: dS from registers, K as B by ldmatrix.trans ------------------------------------------
            pack_c(dw, dp)
            for kn in range(N_STEPS):
                for ob in range(0, D_BLOCKS, 2):
                    b0, b1, b2, b3 = ldmatrix_trans(smem, base + a_lane + 16 * kn * ROW + 8 * ob)
                    for mt in range(MT):
                        x0, x1 = dw[mt, 2 * kn, 0], dw[mt, 2 * kn, 1]
                        x2, x3 = dw[mt, 2 * kn + 1, 0], dw[mt, 2 * kn + 1, 1]
                        mma_into(acc, mt, ob, x0, x1, x2, x3, b0, b1)
                        mma_into(acc, mt, ob + 1, x0, x1, x2, x3, b2, b3)

        store(acc, dq_head, m0 + warp_row + g, seqlen_q, 2 * t, head_dim, sm_scale)

    return _entry(body, variant.packed, key_block=False)
