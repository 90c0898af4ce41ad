"""The Python source of the warpgroup backward's key-block kernel (``backward.wgmma`` has the configuration, the
compiled builders, the launches and, in its docstring, the work split and the pipeline).

Shared memory is one dynamic buffer from a 1024-byte aligned start (the swizzle's period), seen as uint16 (the
swizzled tiles the tensor cores read), uint32 (the packed ``dS^T`` stores) and float32 (the stats). Register arrays
are indexed only with loop variables of compile-time trip counts, so that they stay in registers.
"""
from __future__ import annotations

import numpy as np
from numba import float32, uint16, uint32

from ..core import ptx
from ..core import warpgroup as wg
from ..core.block_info import QUERY_MAJOR, block_position, lane_position, query_tiles_start, sequence_bounds
from ..core.epilogue import add_fragments, as_16bit, store_fragments
from ..core.gradients import probabilities_then_grads
from ..core.mask import tile_is_partial
from ..core.dq_tile import tile_flusher, tile_stager
from ..core.ptx.bulk import bulk_wait_all, bulk_wait_read, bulk_wait_read1
from ..core.softmax import fragment_clear
from ..core.staging import device_function
from ..core.staging import tile_loader as row_loader
from ..forward.wgmma import tile_loader as swizzled_loader
from ..runtime.device import SIMULATOR, cuda

KEYS = wg.ROWS  # keys per warpgroup: the M of its S^T, dP^T, dV and dK products


def layout(config, d_pad: int) -> dict:
    """Offsets (16-bit elements from the aligned start) of the shared tiles: K and V (``block_n`` rows), ``dS^T``
    (``block_n`` rows of ``block_m`` query columns), ``stages`` x (Q, dO) (``block_m`` rows), then ``stages`` x
    the stats (``block_m`` float32 pairs), then (``dq_bulk``) two float32 ``dQ`` staging tiles (``core.dq_tile``).
    Every swizzled tile starts on a 1024-byte boundary."""
    atoms = wg.atom_columns(d_pad)
    kv = config.block_n * 64 * atoms
    rows = config.block_m * 64 * atoms
    out = {"K": 0, "V": kv, "DS": 2 * kv, "Q_TILE": rows}
    out["DS_TILE"] = config.block_n * config.block_m
    out["STAGE0"] = out["DS"] + (2 if config.one_barrier else 1) * out["DS_TILE"]
    out["STAGE"] = 2 * rows
    out["STATS0"] = out["STAGE0"] + config.stages * out["STAGE"]
    out["STATS_STAGE"] = 4 * config.block_m
    out["DQS"] = out["STATS0"] + config.stages * out["STATS_STAGE"]  # dq_bulk: two staging tiles of dQ
    out["DQS_TILE"] = 2 * config.block_m * d_pad  # (16-bit units; core.dq_tile's layout, rows unpadded)
    out["END"] = out["DQS"] + (config.dq_buffers * out["DQS_TILE"] if config.dq_bulk else 0)
    return out


def dq_split(config, d_pad: int) -> tuple:
    """``(m_blocks per warpgroup, column slices, slice width)`` of a tile's ``dQ = dS K`` (``block_m / 64``
    64-row m-blocks; warpgroups beyond them split the head-dim columns)."""
    m_blocks = config.block_m // KEYS
    if config.warpgroups < m_blocks:
        return m_blocks // config.warpgroups, 1, d_pad
    slices = config.warpgroups // m_blocks
    width = d_pad // slices
    # a slice is an MMA's N (a multiple of 8) and must not cross a 64-column atom of K (warpgroup docstring)
    if d_pad % slices or width % 8 or (width % 64 and 64 % width):
        raise ValueError(f"{config}: {slices} warpgroups cannot split the {d_pad} columns of dQ")
    return 1, slices, width


def key_block_source(config, d_pad: int, bf16: bool, atomic_dq: bool):
    """The Python function of one specialisation (not yet jitted); also what the offline checks compile.
    ``atomic_dq``: also ``dQ`` (``sm_scale dS K`` added to ``dq_acc`` by reductions); otherwise ``dq_acc`` is not
    touched (the deterministic query-block kernel of ``backward.mma`` computes ``dq``)."""
    NWG = config.warpgroups
    BLOCK_N, BLOCK_M, STAGES = config.block_n, config.block_m, config.stages
    THREADS = config.threads
    ATOMIC_DQ = atomic_dq
    ONE_BARRIER = config.one_barrier
    DQ_MMA = atomic_dq and config.probe != "no_dq"  # (probes: timing only, wrong dq)
    DQ_RED = DQ_MMA and config.probe != "no_red"
    DK_SMEM = DQ_MMA and config.dk_smem
    DQ_BULK = DQ_RED and config.dq_bulk
    at = layout(config, d_pad)
    K_OFF, V_OFF, DS_OFF, Q_TILE, DS_TILE = at["K"], at["V"], at["DS"], at["Q_TILE"], at["DS_TILE"]
    STAGE0, STAGE, STATS0, STATS_STAGE = at["STAGE0"], at["STAGE"], at["STATS0"], at["STATS_STAGE"]
    DQS, DQS_TILE = at["DQS"], at["DQS_TILE"]
    DQ_BUFS = config.dq_buffers
    # thread 0 waits for the read of the copy that used tile j's staging tile right after issuing tile j - 1's copy
    # (two staging tiles; measured faster at head dim 128), or late, before the barrier after which tile j is staged
    LATE_WAIT = config.dq_late_wait or DQ_BUFS == 1
    wait_staging_read = bulk_wait_read1 if DQ_BUFS == 2 else bulk_wait_read
    D_STEPS = d_pad // 16  # k-steps of S^T = K Q^T and dP^T = V dO^T
    M_STEPS = BLOCK_M // 16  # k-steps of dV = P^T dO and dK = dS^T Q
    P_WORDS = 4 * M_STEPS  # P^T / dS^T as A fragments: four 32-bit words per k-step
    KEY_STEPS = BLOCK_N // 16  # k-steps of dQ = dS K
    Q_BLOCKS = BLOCK_M // 8  # n8 blocks of S^T, dP^T
    D_BLOCKS = d_pad // 8  # n8 blocks of dK, dV
    MB_PER_WG, SLICES, DQ_N = dq_split(config, d_pad)
    DQ_BLOCKS = DQ_N // 8
    M_BLOCKS = BLOCK_M // KEYS  # 64-row m-blocks of dQ
    COLUMNS_SPLIT = NWG >= M_BLOCKS
    ROW_BYTES = 128  # one swizzled row of an atom column
    # ---- the warpgroup MMAs: each one asm block, committed as one group, waited for explicitly ------------------
    kq = wg.wgmma_ss(BLOCK_M, D_STEPS, bf16, wg.k_major(BLOCK_N, D_STEPS), wg.k_major(BLOCK_M, D_STEPS), wait=False)
    rows_b = wg.mn_major(BLOCK_M, M_STEPS)  # dO / Q as B[query][column]
    pv = wg.wgmma_rs(d_pad, M_STEPS, bf16, rows_b, True, wait=False)  # dV += P^T dO, dK += dS^T Q
    # dK += dS^T Q with dS^T read back from its shared tile (K-major A: keys x queries) instead of registers
    dk_from_tile = wg.wgmma_ss(d_pad, M_STEPS, bf16, wg.k_major(BLOCK_N, M_STEPS), wg.mn_major(BLOCK_M, M_STEPS),
                               trans_b=True, wait=False, accumulate=True)
    keys_ab = wg.mn_major(BLOCK_N, KEY_STEPS)  # dS^T as A[key][query], K as B[key][column]
    ds_k = wg.wgmma_ss(DQ_N, KEY_STEPS, bf16, keys_ab, keys_ab, trans_b=True, wait=False, trans_a=True)
    wait_s = wg.wgmma_wait(BLOCK_M, 1)  # S^T done (dP^T may run)
    wait_dp = wg.wgmma_wait(BLOCK_M, 1)  # dP^T done (dV may run)
    wait_dq_first = wg.wgmma_wait(DQ_N, 1)  # dV and dQ done (dK may run)
    wait_dq = wg.wgmma_wait(DQ_N, 0)
    wait_dk = wg.wgmma_wait(d_pad, 0)
    wait_dv = wg.wgmma_wait(d_pad, 0)
    fence = wg.fence_proxy_async
    shared_address = wg.shared_address
    commit = ptx.cp_async_commit
    wait_tile = ptx.cp_async_wait_group(STAGES - 2)  # the oldest tile in flight has landed
    wait_next = ptx.cp_async_wait_group(max(STAGES - 3, 0))  # one_barrier: tile j + 1 has landed
    wait_all = ptx.cp_async_wait_all
    store_word = ptx.store1
    load_keys = swizzled_loader(BLOCK_N, d_pad, THREADS)
    load_rows = swizzled_loader(BLOCK_M, d_pad, THREADS)
    load_stats = row_loader(THREADS, 4, 4, BLOCK_M // 2, np.float32, True)
    # key blocks on the grid's x (the launch's ``QUERY_MAJOR`` grid): the blocks resident at once share a few
    # heads, whose Q, dO and float32 dQ accumulator stay in L2
    position = block_position(QUERY_MAJOR, BLOCK_N)
    first_tile = query_tiles_start(BLOCK_M)
    partial = tile_is_partial(KEYS)
    clear_acc = fragment_clear(1, D_BLOCKS)
    probs, grads = probabilities_then_grads(1, Q_BLOCKS, keys_on_rows=True)
    pack_a = wg.a_fragments(M_STEPS, bf16)
    store = store_fragments(1, D_BLOCKS, as_16bit(bf16))
    add_dq = add_fragments(1, DQ_BLOCKS, not SIMULATOR, config.dq_quads)  # red.add.v2 / v4.f32: sm_90, as wgmma
    stage_dq = tile_stager(DQ_BLOCKS, d_pad)
    flush_dq = tile_flusher(BLOCK_M, d_pad, config.dq_evict_last)

    @device_function
    def load_tile(q, dout, stats, smem, floats, base, stats_base, b, h, m0, tid, seqlen_q, head_dim):
        """Start the copies of query tile ``m0`` of head ``h``: Q and dO into the stage at ``base``, their stats
        at ``stats_base``."""
        load_rows(q[b, h], smem, base, tid, m0, seqlen_q, head_dim)
        load_rows(dout[b, h], smem, base + Q_TILE, tid, m0, seqlen_q, head_dim)
        load_stats(stats[b, h], floats, stats_base // 2, tid, m0 // 2, stats.shape[2], 0, 4)

    @device_function
    def prefetch(q, dout, stats, smem, floats, base0, b, hk, group, tiles, m_begin, jn, total, tid, seqlen_q,
                 head_dim):
        """Start the copies of walk tile ``jn`` (if there is one) into its stage; commit a group either way (an
        empty group past the walk keeps "group i = tile i" true)."""
        if jn < total:
            gn = jn // tiles
            load_tile(q, dout, stats, smem, floats, base0 + STAGE0 + (jn % STAGES) * STAGE,
                      base0 + STATS0 + (jn % STAGES) * STATS_STAGE, b, hk * group + gn,
                      m_begin + (jn - gn * tiles) * BLOCK_M, tid, seqlen_q, head_dim)
        commit()

    @device_function
    def store_ds(smem_words, dw, ds_base, key_row, t):
        """This thread's ``dS^T`` pairs (A fragments ``dw``: rows ``key_row``, ``key_row + 8``, query columns ``8 nb
        + 2t, +1``) into the swizzled ``[key][query]`` tile at element ``ds_base``: one 32-bit store each; the 8 rows
        of a warp's store fall in 8 bank groups."""
        for nb in range(Q_BLOCKS):
            col = 8 * nb + 2 * t
            for half in range(2):
                row = key_row + 8 * half
                # (the 128-byte swizzle of ``warpgroup.swizzle``: the row's 16-byte piece XOR row % 8)
                byte = ((col // 64) * BLOCK_N + row) * ROW_BYTES + ((2 * (col % 64)) ^ ((row % 8) << 4))
                store_word(smem_words, (ds_base + byte // 2) // 2, dw[4 * (nb // 2) + 2 * (nb % 2) + half])

    def kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale):
        tid, warp, lane, g, t = lane_position()
        group_idx = ptx.warp_uniform(warp // 4)  # this thread's warpgroup: keys 64 group_idx .. of the block
        warp_in = warp % 4  # its warp in the warpgroup: accumulator rows 16 warp_in + g, + 8
        # a block per (batch, kv head, key block): k in q's place gives the kv head and its views
        b, hk, n0, k_head, _, v_head, _ = position(k, k, v, k, False)
        seqlen_q, key_start, key_end, diag_offset = sequence_bounds(q, k, b)
        head_dim = q.shape[3]
        group = q.shape[1] // k.shape[1]
        key_row = KEYS * group_idx + 16 * warp_in + g  # this thread's first key row in the block
        n_wg = n0 + KEYS * group_idx  # the warpgroup's first key

        smem = cuda.shared.array(0, uint16)
        words = cuda.shared.array(0, uint32)  # the same memory
        floats = cuda.shared.array(0, float32)  # the same memory
        base0 = ((1024 - shared_address(smem) % 1024) % 1024) // 2  # tiles start 1024-byte aligned
        s = cuda.local.array((1, Q_BLOCKS, 4), float32)  # S^T, then P^T
        dp = cuda.local.array((1, Q_BLOCKS, 4), float32)  # dP^T, then dS^T
        pw = cuda.local.array(P_WORDS, uint32)  # P^T packed: the A operand of dV += P^T dO
        dw = cuda.local.array(P_WORDS, uint32)  # dS^T packed
        acc_v = cuda.local.array((1, D_BLOCKS, 4), float32)
        acc_k = cuda.local.array((1, D_BLOCKS, 4), float32)
        acc_q = cuda.local.array((1, DQ_BLOCKS, 4), float32)

        k_at = base0 + K_OFF + KEYS * 64 * group_idx  # the warpgroup's 64 rows of K and V (A of S^T, dP^T)
        v_at = base0 + V_OFF + KEYS * 64 * group_idx
        ds_at = base0 + DS_OFF
        if COLUMNS_SPLIT:  # the warpgroups of one m-block of dQ take neighbouring column slices
            mb_first = group_idx % M_BLOCKS
            c0 = (group_idx // M_BLOCKS) * DQ_N
        else:
            mb_first = group_idx * MB_PER_WG
            c0 = 0
        load_keys(k_head, smem, base0 + K_OFF, tid, n0, key_end, head_dim)
        load_keys(v_head, smem, base0 + V_OFF, tid, n0, key_end, head_dim)
        m_begin = first_tile(n0, seqlen_q, causal, diag_offset)
        tiles = (seqlen_q - m_begin + BLOCK_M - 1) // BLOCK_M  # per query head (>= 0)
        total = group * tiles  # the walk: head-major over (query head of the group, query tile)
        for ahead in range(STAGES - 1):  # tiles 0 .. STAGES - 2, one commit group each (K and V in the first)
            if ahead < total:
                gi = ahead // tiles
                load_tile(q, dout, stats, smem, floats, base0 + STAGE0 + ahead * STAGE,
                          base0 + STATS0 + ahead * STATS_STAGE, b, hk * group + gi,
                          m_begin + (ahead - gi * tiles) * BLOCK_M, tid, seqlen_q, head_dim)
            commit()
        clear_acc(acc_v)
        clear_acc(acc_k)
        h_prev = hk * group
        m_prev = m_begin
        if ONE_BARRIER and total > 0:
            wait_tile()  # tile 0 (and K, V)
            fence()
            cuda.syncthreads()

        for j in range(total):
            gi = j // tiles
            h = hk * group + gi
            m0 = m_begin + (j - gi * tiles) * BLOCK_M
            stage = j % STAGES
            q_at = base0 + STAGE0 + stage * STAGE
            do_at = q_at + Q_TILE
            stats_at = (base0 + STATS0 + stage * STATS_STAGE) // 2 + 4 * t  # float index of column 2t's pair
            ds_j = ds_at + (j % 2) * DS_TILE if ONE_BARRIER else ds_at
            if not ONE_BARRIER:
                wait_tile()
                fence()  # the landed copies are read by the tensor cores (async proxy)
                # tile j has landed for everyone; everyone is done with tile j - 1 (its stage, and dS^T)
                cuda.syncthreads()
                prefetch(q, dout, stats, smem, floats, base0, b, hk, group, tiles, m_begin, j + STAGES - 1,
                         total, tid, seqlen_q, head_dim)
                if DQ_BULK and tid == 0 and j > 0:
                    # tile j - 1's staged dQ (published by the barrier) out by one bulk reduction
                    flush_dq(smem, base0 + DQS + ((j - 1) % DQ_BUFS) * DQS_TILE, dq_acc[b, h_prev], m_prev)
                    if not LATE_WAIT:
                        wait_staging_read()  # tile j - 2's copy has read the staging tile that tile j writes

            # ---- S^T = K Q^T and dP^T = V dO^T for the warpgroup's 64 keys; P^T under the dP^T MMAs -------------
            kq(s, smem, k_at, q_at)
            kq(dp, smem, v_at, do_at)
            wait_s(s)
            probs(s, floats, stats_at, partial(n_wg, m0, key_end, causal, diag_offset), n0 + key_row, m0 + 2 * t,
                  key_end, causal, diag_offset, scale_log2)
            pack_a(s, pw)
            pv(acc_v, pw, smem, do_at)  # dV += P^T dO: runs under dS^T
            wait_dp(dp)
            grads(s, dp, floats, stats_at)
            pack_a(dp, dw)
            if DQ_MMA:
                store_ds(words, dw, ds_j, key_row, t)
            if ONE_BARRIER:
                # the block's one barrier per tile: dS^T of every warpgroup is in, tile j + 1 has landed for
                # everyone, everyone is done with tile j - 1 (whose stage the copies of tile j + STAGES - 1 take)
                wait_next()
                fence()
                cuda.syncthreads()
                prefetch(q, dout, stats, smem, floats, base0, b, hk, group, tiles, m_begin, j + STAGES - 1,
                         total, tid, seqlen_q, head_dim)
            elif DQ_MMA:
                fence()
                if DQ_BULK and LATE_WAIT and tid == 0:
                    # as late as possible: the copy of tile j - DQ_BUFS has read the staging tile that tile j writes
                    # after this barrier (with two, tile j - 1's may still be reading the other)
                    wait_staging_read()
                cuda.syncthreads()  # every warpgroup's dS^T is in
            if DQ_MMA:
                # ---- dQ = dS K (dS^T read transposed), this warpgroup's m-blocks and columns; dK += dS^T Q runs
                # ---- under the reductions of dQ
                for i in range(MB_PER_WG):
                    mb = mb_first + i
                    ds_k(acc_q, smem, ds_j + mb * KEYS * BLOCK_N,
                         base0 + K_OFF + (c0 // 64) * 64 * BLOCK_N + c0 % 64)
                    if i == 0 and DK_SMEM:
                        dk_from_tile(acc_k, smem, ds_j + KEYS * 64 * group_idx, q_at)
                        wait_dq_first(acc_q)
                    elif i == 0:
                        pv(acc_k, dw, smem, q_at)
                        wait_dq_first(acc_q)
                    else:
                        wait_dq(acc_q)
                    if DQ_BULK:
                        stage_dq(floats, (base0 + DQS + (j % DQ_BUFS) * DQS_TILE) // 2, acc_q,
                                 KEYS * mb + 16 * warp_in + g, c0 + 2 * t, sm_scale)
                    elif DQ_RED:
                        add_dq(acc_q, dq_acc[b, h], m0 + KEYS * mb + 16 * warp_in + g, seqlen_q, c0 + 2 * t,
                               head_dim, sm_scale)  # (headdim is even: the pairs below it are whole)
                if DQ_BULK:
                    fence()  # the staged dQ is read by the bulk copies (async proxy) after the next barrier
            else:
                pv(acc_k, dw, smem, q_at)
            wait_dk(acc_k)  # (and dV): the stage of tile j is free once everyone passes the next barrier
            h_prev = h
            m_prev = m0
        if DQ_BULK and total > 0:
            cuda.syncthreads()  # the last tile's staged dQ is in
            if tid == 0:
                flush_dq(smem, base0 + DQS + ((total - 1) % DQ_BUFS) * DQS_TILE, dq_acc[b, h_prev], m_prev)
                bulk_wait_all()
        wait_dv(acc_v)
        wait_all()  # copies past the walk (none when it was empty but K, V): landed before the block ends

        row0 = n0 + key_row
        store(acc_v, dv[b, hk], row0, key_end, 2 * t, head_dim, float32(1.0))
        store(acc_k, dk[b, hk], row0, key_end, 2 * t, head_dim, sm_scale)

    return kernel
