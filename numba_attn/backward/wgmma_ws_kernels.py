"""The Python source of the warp-specialised backward's key-block kernel (``backward.wgmma_ws`` has the
configuration, the launch and, in its docstring, the roles and the pipeline).

Shared memory from a 1024-byte aligned start: K, V (``block_n`` rows), two ``dS^T`` tiles, ``stages`` x (Q, dO)
(``block_m`` rows), ``stages`` x the stats (``block_m`` float32 pairs), ``dq_buffers`` float32 ``dQ`` staging tiles
(``dq_writer``, ``core.dq_tile``'s layout), then the mbarriers (8 bytes each). The
per-tile math is ``wgmma_kernels``' (the same intrinsics and fragment steps), only fed by the producer's copies.
"""
from __future__ import annotations

from numba import float32, uint16, uint32

from ..core import ptx
from ..core import warpgroup as wg
from ..core.block_info import QUERY_MAJOR, block_position, lane_position, query_tiles_start, sequence_bounds
from ..core.epilogue import add_fragments, as_16bit, store_fragments
from ..core.gradients import packed_probabilities_and_grads, probabilities_then_grads
from ..core.mask import tile_is_partial
from ..core.ptx import tma, warp_uniform
from ..core.dq_tile import tile_flusher, tile_stager
from ..core.ptx.bulk import bulk_load_f32, bulk_wait_all, bulk_wait_read, bulk_wait_read1
from ..core.softmax import fragment_clear
from ..core.staging import device_function
from ..runtime.device import SIMULATOR, cuda
from .wgmma_kernels import KEYS, dq_split

WARPGROUP = wg.WARPGROUP_THREADS


def layout(config, d_pad: int) -> dict:
    """Offsets (16-bit elements from the aligned start) of the shared tiles and the mbarriers."""
    atoms = wg.atom_columns(d_pad)
    kv = config.block_n * 64 * atoms
    rows = config.block_m * 64 * atoms
    out = {"K": 0, "V": kv, "DS": 2 * kv, "DS_TILE": config.block_n * config.block_m, "Q_TILE": rows}
    out["STAGE0"] = out["DS"] + 2 * out["DS_TILE"]
    out["STAGE"] = 2 * rows
    out["STATS0"] = out["STAGE0"] + config.stages * out["STAGE"]
    out["STATS_STAGE"] = 4 * config.block_m
    out["DQS"] = out["STATS0"] + config.stages * out["STATS_STAGE"]  # dQ staging tiles (core.dq_tile's layout)
    out["DQS_TILE"] = 2 * config.block_m * d_pad
    out["BARS"] = out["DQS"] + (config.dq_buffers * out["DQS_TILE"] if config.dq_tiled else 0)  # K/V full, then
    # full, empty per stage
    out["END"] = out["BARS"] + 4 * (1 + 2 * config.stages)
    return out


def key_block_source(config, d_pad: int, bf16: bool, atomic_dq: bool):
    """The Python function of one specialisation (not yet jitted); ``atomic_dq`` as ``wgmma_kernels``."""
    CONSUMERS = config.consumers
    BLOCK_N, BLOCK_M, STAGES = config.block_n, config.block_m, config.stages
    ATOMIC_DQ = atomic_dq
    DQ_RED = atomic_dq and config.probe != "no_red"  # (the probe: timing only, wrong dq)
    DQ_WRITER = DQ_RED and config.dq_writer
    DK_SMEM = atomic_dq and config.dk_smem
    at = layout(config, d_pad)
    K_OFF, V_OFF, DS_OFF, DS_TILE, Q_TILE = at["K"], at["V"], at["DS"], at["DS_TILE"], at["Q_TILE"]
    STAGE0, STAGE, STATS0, STATS_STAGE, BARS = at["STAGE0"], at["STAGE"], at["STATS0"], at["STATS_STAGE"], at["BARS"]
    KV_FULL = BARS
    DQS, DQS_TILE = at["DQS"], at["DQS_TILE"]
    DQ_BUFS = config.dq_buffers
    WRITER_PAIR = WARPGROUP * config.consumers + 32  # consumers + the writer warp
    # named barriers of the staging tile of tile j: "staged" (consumers arrive, the writer waits), "free" (the writer
    # arrives once the bulk copy has read it, the consumers wait before writing it)
    STAGED, FREE = 2, 2 + DQ_BUFS
    FULL = BARS + 4  # + 4 stage
    EMPTY = BARS + 4 + 4 * STAGES
    ATOMS = wg.atom_columns(d_pad)
    KV_BOX = 64 * BLOCK_N  # elements of one 64-column box of K or V
    ROW_BOX = 64 * BLOCK_M
    KV_BYTES = 2 * 2 * BLOCK_N * 64 * ATOMS  # K and V, whole boxes (zero-filled parts count)
    STATS_BYTES = 8 * BLOCK_M
    STAGE_BYTES = 2 * 2 * BLOCK_M * 64 * ATOMS + STATS_BYTES
    EMPTY_ARRIVALS = 4 * CONSUMERS  # one per consumer warp
    PAIR = WARPGROUP * CONSUMERS  # the consumers' named barrier
    D_STEPS = d_pad // 16
    M_STEPS = BLOCK_M // 16
    KEY_STEPS = BLOCK_N // 16
    Q_BLOCKS = BLOCK_M // 8
    D_BLOCKS = d_pad // 8
    P_WORDS = 4 * M_STEPS
    MB_PER_WG, SLICES, DQ_N = dq_split(config, d_pad)
    # each consumer's dQ slice in DQ_PARTS MMAs of DQ_W columns (one live accumulator of DQ_W / 2 registers)
    DQ_PARTS = config.dq_parts if DQ_N % (8 * config.dq_parts) == 0 and (
        (DQ_N // config.dq_parts) % 64 == 0 or 64 % (DQ_N // config.dq_parts) == 0) else 1
    DQ_W = DQ_N // DQ_PARTS
    DQ_BLOCKS = DQ_W // 8
    M_BLOCKS = BLOCK_M // KEYS
    COLUMNS_SPLIT = CONSUMERS >= M_BLOCKS
    ROW_BYTES = 128
    kq = wg.wgmma_ss(BLOCK_M, D_STEPS, bf16, wg.k_major(BLOCK_N, D_STEPS), wg.k_major(BLOCK_M, D_STEPS), wait=False)
    pv = wg.wgmma_rs(d_pad, M_STEPS, bf16, wg.mn_major(BLOCK_M, M_STEPS), True, wait=False)
    # dK += dS^T Q with dS^T read back from its shared tile (K-major A: keys x queries) instead of registers
    dk_from_tile = wg.wgmma_ss(d_pad, M_STEPS, bf16, wg.k_major(BLOCK_N, M_STEPS), wg.mn_major(BLOCK_M, M_STEPS),
                               trans_b=True, wait=False, accumulate=True)
    keys_ab = wg.mn_major(BLOCK_N, KEY_STEPS)
    ds_k = wg.wgmma_ss(DQ_W, KEY_STEPS, bf16, keys_ab, keys_ab, trans_b=True, wait=False, trans_a=True)
    wait_s = wg.wgmma_wait(BLOCK_M, 1)
    wait_dp = wg.wgmma_wait(BLOCK_M, 1)
    wait_dq_first = wg.wgmma_wait(DQ_W, 1)
    wait_dq = wg.wgmma_wait(DQ_W, 0)
    wait_dk = wg.wgmma_wait(d_pad, 0)
    wait_dv = wg.wgmma_wait(d_pad, 0)
    fence = wg.fence_proxy_async
    shared_address = wg.shared_address
    init, arrive, arrive_tx, wait = tma.mbarrier_init, tma.mbarrier_arrive, tma.mbarrier_arrive_expect_tx, \
        tma.mbarrier_wait
    load_box = tma.tma_load_4d
    acquire = tma.tensormap_acquire
    elect_one = tma.elect_one
    bar_sync = tma.named_barrier_sync
    bar_arrive = tma.named_barrier_arrive
    fewer_registers = tma.setmaxnreg_dec(config.producer_registers)
    more_registers = tma.setmaxnreg_inc(config.consumer_registers)
    fence_init = tma.fence_mbarrier_init
    stage_dq = tile_stager(DQ_BLOCKS, d_pad)
    flush_dq = tile_flusher(BLOCK_M, d_pad, config.dq_evict_last)
    wait_read = bulk_wait_read1 if DQ_BUFS == 2 else bulk_wait_read
    store_word = ptx.store1
    # key blocks on the grid's x (the launch's ``QUERY_MAJOR`` grid): the blocks resident at once share a few
    # heads, whose Q, dO and float32 dQ accumulator stay in L2
    position = block_position(QUERY_MAJOR, BLOCK_N)
    first_tile = query_tiles_start(BLOCK_M)
    partial = tile_is_partial(KEYS)
    clear_acc = fragment_clear(1, D_BLOCKS)
    probs, grads = probabilities_then_grads(1, Q_BLOCKS, keys_on_rows=True)
    fused = packed_probabilities_and_grads(Q_BLOCKS, ptx.pack_bf16x2 if bf16 else ptx.pack_half2)
    FUSED = config.fused_grads
    wait_both = wg.wgmma_wait(BLOCK_M, 0)
    pack_a = wg.a_fragments(M_STEPS, bf16)
    store = store_fragments(1, D_BLOCKS, as_16bit(bf16))
    add_dq = add_fragments(1, DQ_BLOCKS, not SIMULATOR, config.dq_quads)

    @device_function
    def produce(smem, base0, stats, q_map, k_map, v_map, do_map, b, hk, group, n0, m_begin, tiles, total):
        """The producer thread: K and V of the block once, then Q, dO and the stats of every walk tile into its
        stage of the ring, once the consumers have freed it."""
        if total == 0:  # no query row sees these keys: nothing to copy (dK = dV = 0)
            return
        acquire(q_map)
        acquire(k_map)
        acquire(v_map)
        acquire(do_map)
        arrive_tx(smem, base0 + KV_FULL, KV_BYTES)
        for a in range(ATOMS):
            load_box(smem, base0 + K_OFF + a * KV_BOX, k_map, 64 * a, n0, hk, b, base0 + KV_FULL)
            load_box(smem, base0 + V_OFF + a * KV_BOX, v_map, 64 * a, n0, hk, b, base0 + KV_FULL)
        for j in range(total):
            gi = j // tiles
            h = hk * group + gi
            m0 = m_begin + (j - gi * tiles) * BLOCK_M
            stage = j % STAGES
            wait(smem, base0 + EMPTY + 4 * stage, ((j // STAGES) & 1) ^ 1)  # (the first round passes at once)
            full = base0 + FULL + 4 * stage
            arrive_tx(smem, full, STAGE_BYTES)
            q_at = base0 + STAGE0 + stage * STAGE
            for a in range(ATOMS):
                load_box(smem, q_at + a * ROW_BOX, q_map, 64 * a, m0, h, b, full)
                load_box(smem, q_at + Q_TILE + a * ROW_BOX, do_map, 64 * a, m0, h, b, full)
            bulk_load_f32(smem, base0 + STATS0 + stage * STATS_STAGE, stats[b, h], m0 // 2, STATS_BYTES, full)

    @device_function
    def on_buffer(first, buf, wait):
        """``bar.sync`` (``wait``) or ``bar.arrive`` of the writer and the consumers at barrier ``first + buf``, the
        id a constant in each branch (with an id computed at run time ptxas reserves all 16 barriers)."""
        if buf == 0:
            if wait:
                bar_sync(first, WRITER_PAIR)
            else:
                bar_arrive(first, WRITER_PAIR)
        elif wait:
            bar_sync(first + 1, WRITER_PAIR)
        else:
            bar_arrive(first + 1, WRITER_PAIR)

    @device_function
    def write_dq(smem, base0, dq_acc, b, hk, group, m_begin, tiles, total):
        """The writer warp: each tile's staged dQ added to ``dq_acc`` by ONE bulk reduction of an elected lane, its
        staging tile handed back (for tile j + DQ_BUFS) once the copy has read it -- with two tiles one tile later,
        so that the consumers never wait for a copy in flight."""
        for buf in range(DQ_BUFS):
            if buf < total:
                bar_arrive(FREE + buf, WRITER_PAIR)  # the staging tiles start free
        leader = elect_one()
        for j in range(total):
            gi = j // tiles
            h = hk * group + gi
            m0 = m_begin + (j - gi * tiles) * BLOCK_M
            on_buffer(STAGED, j % DQ_BUFS, True)  # the consumers' dQ of tile j is in
            if leader:
                flush_dq(smem, base0 + DQS + (j % DQ_BUFS) * DQS_TILE, dq_acc[b, h], m0)
                wait_read()  # the copy of tile j + 1 - DQ_BUFS has read its staging tile: tile j + 1's
            # (the warp reconverges here, after the leader's wait, before the aligned bar.arrive: as FA3's writer)
            if j + 1 >= DQ_BUFS and j + 1 < total:
                on_buffer(FREE, (j + 1) % DQ_BUFS, False)
        if leader:
            bulk_wait_all()

    @device_function
    def store_ds(smem_words, dw, ds_base, key_row, t):
        """As ``wgmma_kernels``' ``store_ds``: this thread's ``dS^T`` pairs into the swizzled ``[key][query]`` tile."""
        for nb in range(Q_BLOCKS):
            col = 8 * nb + 2 * t
            for half in range(2):
                row = key_row + 8 * half
                byte = ((col // 64) * BLOCK_N + row) * ROW_BYTES + ((2 * (col % 64)) ^ ((row % 8) << 4))
                store_word(smem_words, (ds_base + byte // 2) // 2, dw[4 * (nb // 2) + 2 * (nb % 2) + half])

    def kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale, q_map, k_map, v_map, do_map):
        tid, warp, lane, g, t = lane_position()
        b, hk, n0, _, _, _, _ = position(k, k, v, k, False)
        seqlen_q, key_start, key_end, diag_offset = sequence_bounds(q, k, b)
        head_dim = q.shape[3]
        group = q.shape[1] // k.shape[1]
        smem = cuda.shared.array(0, uint16)
        words = cuda.shared.array(0, uint32)
        floats = cuda.shared.array(0, float32)
        base0 = ((1024 - shared_address(smem) % 1024) % 1024) // 2
        m_begin = first_tile(n0, seqlen_q, causal, diag_offset)
        tiles = (seqlen_q - m_begin + BLOCK_M - 1) // BLOCK_M
        total = group * tiles
        if tid == 0:
            init(smem, base0 + KV_FULL, 1)
            for stage in range(STAGES):
                init(smem, base0 + FULL + 4 * stage, 1)
                init(smem, base0 + EMPTY + 4 * stage, EMPTY_ARRIVALS)
            fence_init()
        cuda.syncthreads()  # (the last block-wide barrier: the producer's idle warps leave after it)
        # (a shuffle, so that ptxas knows the warpgroup uniform and keeps the descriptors made from it in uniform
        # registers, as in the forward)
        role = warp_uniform(tid // WARPGROUP)
        if role == 0:
            fewer_registers()
            if warp == 0 and elect_one():
                produce(smem, base0, stats, q_map, k_map, v_map, do_map, b, hk, group, n0, m_begin, tiles, total)
            if DQ_WRITER and warp == 1:
                write_dq(smem, base0, dq_acc, b, hk, group, m_begin, tiles, total)
            return

        more_registers()
        c = role - 1  # this consumer: keys 64 c .. of the block
        warp_in = warp % 4
        key_row = KEYS * c + 16 * warp_in + g
        n_wg = n0 + KEYS * c
        s = cuda.local.array((1, Q_BLOCKS, 4), float32)
        dp = cuda.local.array((1, Q_BLOCKS, 4), float32)
        pw = cuda.local.array(P_WORDS, uint32)
        dw = cuda.local.array(P_WORDS, uint32)
        acc_v = cuda.local.array((1, D_BLOCKS, 4), float32)
        acc_k = cuda.local.array((1, D_BLOCKS, 4), float32)
        acc_q = cuda.local.array((1, DQ_BLOCKS, 4), float32)
        k_at = base0 + K_OFF + KEYS * 64 * c
        v_at = base0 + V_OFF + KEYS * 64 * c
        if COLUMNS_SPLIT:
            mb_first = c % M_BLOCKS
            c0 = (c // M_BLOCKS) * DQ_N
        else:
            mb_first = c * MB_PER_WG
            c0 = 0
        clear_acc(acc_v)
        clear_acc(acc_k)
        if total > 0:
            wait(smem, base0 + KV_FULL, 0)
        for j in range(total):
            gi = j // tiles
            h = hk * group + gi
            m0 = m_begin + (j - gi * tiles) * BLOCK_M
            stage = j % STAGES
            q_at = base0 + STAGE0 + stage * STAGE
            do_at = q_at + Q_TILE
            stats_at = (base0 + STATS0 + stage * STATS_STAGE) // 2 + 4 * t
            ds_j = base0 + DS_OFF + (j % 2) * DS_TILE
            wait(smem, base0 + FULL + 4 * stage, (j // STAGES) & 1)
            kq(s, smem, k_at, q_at)
            kq(dp, smem, v_at, do_at)
            wait_s(s)
            if FUSED:  # P^T and dS^T in one pass once both have landed, packed a k-step at a time
                wait_both(dp)
                fused(s, dp, pw, dw, floats, stats_at, partial(n_wg, m0, key_end, causal, diag_offset),
                      n0 + key_row, m0 + 2 * t, key_end, causal, diag_offset, scale_log2)
                pv(acc_v, pw, smem, do_at)
            else:  # P^T while dP^T still runs
                probs(s, floats, stats_at, partial(n_wg, m0, key_end, causal, diag_offset), n0 + key_row,
                      m0 + 2 * t, key_end, causal, diag_offset, scale_log2)
                pack_a(s, pw)
                pv(acc_v, pw, smem, do_at)
                wait_dp(dp)
                grads(s, dp, floats, stats_at)
                pack_a(dp, dw)
            if ATOMIC_DQ:
                store_ds(words, dw, ds_j, key_row, t)
                fence()
                # every consumer's dS^T is in; both are done with tile j - 1's dQ (dS^T of tile j + 1 goes to the
                # other buffer, so no second barrier)
                bar_sync(1, PAIR)
                for i in range(MB_PER_WG * DQ_PARTS):  # (m-block, column part) pairs of this consumer's dQ
                    mb = mb_first + i // DQ_PARTS
                    cc = c0 + (i % DQ_PARTS) * DQ_W
                    ds_k(acc_q, smem, ds_j + mb * KEYS * BLOCK_N, base0 + K_OFF + (cc // 64) * 64 * BLOCK_N + cc % 64)
                    if i == 0 and DK_SMEM:
                        dk_from_tile(acc_k, smem, ds_j + KEYS * 64 * c, q_at)
                        wait_dq_first(acc_q)
                    elif i == 0:
                        pv(acc_k, dw, smem, q_at)
                        wait_dq_first(acc_q)
                    else:
                        wait_dq(acc_q)
                    if DQ_WRITER:
                        if i == 0:
                            on_buffer(FREE, j % DQ_BUFS, True)  # the copy of tile j - DQ_BUFS has read it
                        stage_dq(floats, (base0 + DQS + (j % DQ_BUFS) * DQS_TILE) // 2, acc_q,
                                 KEYS * mb + 16 * warp_in + g, cc + 2 * t, sm_scale)
                    elif DQ_RED:
                        add_dq(acc_q, dq_acc[b, h], m0 + KEYS * mb + 16 * warp_in + g, seqlen_q, cc + 2 * t,
                               head_dim, sm_scale)
                if DQ_WRITER:
                    fence()  # the staged dQ is read by the bulk copy (async proxy)
                    on_buffer(STAGED, j % DQ_BUFS, False)
            else:
                pv(acc_k, dw, smem, q_at)
            wait_dk(acc_k)
            if lane == 0:
                arrive(smem, base0 + EMPTY + 4 * stage)  # this warp is done with the stage
        wait_dv(acc_v)
        row0 = n0 + key_row
        store(acc_v, dv[b, hk], row0, key_end, 2 * t, head_dim, float32(1.0))
        store(acc_k, dk[b, hk], row0, key_end, 2 * t, head_dim, sm_scale)

    return kernel
