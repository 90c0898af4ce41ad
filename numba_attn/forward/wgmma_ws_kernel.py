"""The warp-specialised Hopper forward's kernel source (``forward.wgmma_ws``, whose docstring tells the design: the
producer and its TMA ring, the consumers and their ping-pong, the 8-bit form); ``wgmma_ws`` compiles and launches it.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import float32, uint16, uint32

from ..core import fp8 as fp8_blocks
from ..core import warpgroup as wgmma
from ..core.block_info import (QUERY_MAJOR, block_position_of, key_tile_walk, lane_position, persistent_schedule,
                               sequence_bounds_of)
from ..core.epilogue import as_16bit, stage_rows, store_rows
from ..core.mask import UNBOUNDED, narrow_widths, plain_tiles, tile_is_partial, tile_width, visible_keys_in
from ..core.ptx import bulk, tma, warp_uniform
from ..core.softmax import exponent_scale_for, output_rescale, softmax_start, softmax_update
from ..core.staging import device_function, inlined_function, kernel_body
from ..runtime.device import cuda
from .common import PLAIN, Variant
from .wgmma_ws_config import ROWS, WARPGROUP, WsConfig, vt_atoms

#: how the kernel writes its output: "elements" (2-byte stores), "pairs" (4-byte stores: rows in aligned pairs) or
#: "tma" (staged in the consumer's Q tile -- persistent: a staging tile of its own -- then one TMA store per
#: 64-column box: ``out`` needs a tensor map)
STORES = ("elements", "pairs", "tma")


def _kernel_source(config: WsConfig, d_pad: int, bf16: bool, scale_first: bool = False, variant: Variant = PLAIN,
                   fp8: bool = False, per_head: bool = False, probe: str | None = None, store: str = "elements",
                   softmax_under_pv: bool = False, narrow: bool = True):
    """The Python function of one specialisation (not yet jitted). ``fp8``: float8 e4m3 operands (uint8) and a
    bfloat16 (``bf16``) or float16 output, with per-head descale arrays read (``per_head``) or not; the kernel then
    takes four more arguments (``forward.wgmma_ws_fp8.SIGNATURE``). ``probe`` (a timing probe only, wrong results:
    ``scripts/check_fp8.py --part probe``): ``"no_softmax"`` leaves the scores as they are (no max, exp, sums),
    ``"no_pack"`` leaves P's registers unwritten (no conversion to the MMA's A operand). ``store``: one of ``STORES``
    ("tma": the kernel takes the output's tensor map after V's; not for packed sequences, whose rows past a
    sequence's end belong to the next). ``softmax_under_pv``: the softmax of tile j
    held above the wait for P V of tile j - 1, so that it runs under that MMA (ptxas otherwise moves the wait, which
    has no operands, above the exponentials: ``warpgroup.wgmma_wait(after=True)``). ``narrow``: narrow tiles (below;
    False: every tile whole, the code before them, for calls that meet no narrow tile: ``mask.may_narrow``)."""
    if probe not in (None, "no_softmax", "no_pack"):
        raise ValueError(f"probe: expected None, 'no_softmax' or 'no_pack', got {probe!r}")
    if store not in STORES:
        raise ValueError(f"store: expected one of {STORES}, got {store!r}")
    if store == "tma" and variant.packed:
        raise ValueError("wgmma_ws: the TMA store takes dense calls (store='pairs' or 'elements')")
    if variant.packed and config.persistent:
        raise ValueError("wgmma_ws: packed sequences take one block per schedule entry (persistent=False)")
    if fp8 and variant.packed:
        raise ValueError("wgmma_ws fp8: packed sequences are not supported (flash_forward_varlen takes no fp8)")
    if fp8 and (d_pad % 32 or d_pad > 128 or config.block_n % 32):
        raise ValueError(f"wgmma_ws fp8: head_dim_pad (up to 128) and block_n must be multiples of 32, got {d_pad}, "
                         f"{config.block_n}")
    BLOCK_N = config.block_n
    STAGES = config.stages
    PINGPONG = config.pingpong
    ATOMS = 1 if fp8 else wgmma.atom_columns(d_pad)  # (8-bit rows of up to 128 elements: one atom column)
    Q_TILE = ROWS * 64 * ATOMS  # elements (uint16) of one consumer's Q tile
    TILE = BLOCK_N * 64 * ATOMS  # elements of a K or V tile
    VT_ATOMS = vt_atoms(BLOCK_N)
    # 8-bit with ``fp8_sums``: 8 rows of ones under each V^T box, so that P V's 8 more output columns are P's row sums
    SUM_ROWS = fp8_blocks.SUM_ROWS if fp8 and config.fp8_sums else 0
    if config.fp8_sums and not fp8:
        raise ValueError("wgmma_ws: fp8_sums takes 8-bit inputs")
    VT_BOX = (d_pad + SUM_ROWS) * 64  # 8-bit: elements of one box of V^T (d_pad rows of 128 keys, the ones)
    VT_LOAD_BYTES = VT_ATOMS * d_pad * 128  # (what the TMA writes of a V^T tile)
    V_TILE = VT_ATOMS * VT_BOX if fp8 else TILE  # elements of a tile of the V ring (8-bit: V^T)
    CONSUMERS = config.consumers
    BLOCK_M = config.block_m
    Q_BYTES = 2 * CONSUMERS * Q_TILE
    TILE_BYTES = 2 * TILE
    V_TILE_BYTES = VT_LOAD_BYTES if fp8 else 2 * V_TILE
    Q_BOX = 64 * ROWS  # elements of one 64-column box of Q (128-byte box rows; 8-bit: one box)
    OUT_ATOMS = wgmma.atom_columns(d_pad)  # 64-column boxes of a 16-bit output row (8-bit inputs too)
    OUT_TILE = ROWS * 64 * OUT_ATOMS  # elements of one consumer's staged output (16-bit: Q_TILE)
    KV_BOX = 64 * BLOCK_N
    K_STEP = 32 if fp8 else 16  # k of one MMA
    S_BLOCKS = BLOCK_N // 8
    PV_STEPS = BLOCK_N // K_STEP
    P_WORDS = 4 * PV_STEPS
    O_BLOCKS = (d_pad + SUM_ROWS) // 8  # (the accumulator; its stores take the first d_pad // 8)
    OUT_BLOCKS = d_pad // 8
    SCALE_FIRST = scale_first
    TMA_STORE = store == "tma"
    PERSISTENT = config.persistent
    # the persistent kernel stages its output in tiles of its own (``shared_bytes``), so that Q is free as soon as
    # the last S is done: the producer copies the next block's Q during the last P V and the epilogue; so does the
    # 8-bit one, whose Q tile is half the size of its 16-bit output
    STAGING_TILES = PERSISTENT or fp8
    OWN_STAGING = TMA_STORE and STAGING_TILES
    # Q is free again when every consumer warp has arrived -- with the TMA store through Q, once each consumer's
    # store has read its tile (one arrival per consumer)
    Q_EMPTY_ARRIVALS = CONSUMERS if TMA_STORE and not OWN_STAGING else 4 * CONSUMERS
    EMPTY_ARRIVALS = 4 * CONSUMERS  # one per consumer warp
    # the mbarriers, 4 elements (8 bytes) each from ``bars``: Q full, Q empty, then per stage of the ring
    K_FULL, K_EMPTY, V_FULL, V_EMPTY = (4 * (2 + n * STAGES) for n in range(4))
    PAIR = 2 * WARPGROUP  # threads of a ping-pong barrier: the waiting warpgroup and the one arriving
    # Narrow tiles (``wgmma_ws``'s docstring): a tile's first WIDTHS[code] keys (``mask.tile_width``; 0: none). A
    # walk's codes are FULL ... FULL, then at most one narrower one, then 0s.
    NARROW = narrow_widths(BLOCK_N, K_STEP) if narrow else ()
    WIDTHS = (0, *NARROW, BLOCK_N)
    FULL = len(WIDTHS) - 1
    width_code = tile_width(BLOCK_N, NARROW)
    visible = visible_keys_in(variant.window)
    products = {w: wgmma.attention_products(BLOCK_N, d_pad, bf16, fp8, width=w, sum_rows=SUM_ROWS) for w in WIDTHS
                if w}
    q_times_k, p_times_v = products[BLOCK_N]
    wait_s = wgmma.wgmma_wait(BLOCK_N, 0)
    wait_one = wgmma.wgmma_wait(BLOCK_N, 1)
    if softmax_under_pv:
        pv_done = wgmma.wgmma_wait(d_pad, 0, after=True)

        @inlined_function
        def wait_o(acc, l_run):
            """Wait for P V, after the row sums (and so every exponential of the softmax before it)."""
            pv_done(acc, l_run[0] + l_run[1])
    else:
        pv_done = wgmma.wgmma_wait(d_pad, 0)

        @inlined_function
        def wait_o(acc, l_run):
            pv_done(acc)
    shared_address = wgmma.shared_address
    ONE = np.float32(1.0)
    init, arrive, arrive_tx, wait = tma.mbarrier_init, tma.mbarrier_arrive, tma.mbarrier_arrive_expect_tx, \
        tma.mbarrier_wait
    load_box = tma.tma_load_4d
    acquire = tma.tensormap_acquire
    elect_one = tma.elect_one
    bar_sync, bar_arrive = tma.named_barrier_sync, tma.named_barrier_arrive
    fewer_registers = tma.setmaxnreg_dec(config.producer_registers)
    more_registers = tma.setmaxnreg_inc(config.consumer_registers)
    fence_init = tma.fence_mbarrier_init
    position = block_position_of(QUERY_MAJOR, BLOCK_M, variant.packed)
    bounds = sequence_bounds_of(variant.packed)
    exponent = exponent_scale_for(variant.softcap)
    walk_tiles = key_tile_walk(BLOCK_M, BLOCK_N, variant.window)
    partial = tile_is_partial(BLOCK_N, ROWS, variant.window)
    plain = plain_tiles(BLOCK_N, ROWS, variant.window)
    LEFT_SIDE = variant.window[0] != UNBOUNDED
    start = softmax_start(1, O_BLOCKS)

    @device_function
    def no_softmax(s, alpha, m_run, l_run, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2, post):
        alpha[0] = ONE
        alpha[1] = ONE

    @lru_cache(maxsize=None)  # (one device function per width, which the tile bodies of that width share)
    def softmax_of(width):
        """The online softmax of a tile's first ``width`` keys (the "no_softmax" probe: none)."""
        if probe == "no_softmax":
            return no_softmax
        return softmax_update(1, width // 8, O_BLOCKS, SCALE_FIRST, rescale_output=False, window=variant.window,
                              softcap=variant.softcap, precise_tanh=False, row_sums=not SUM_ROWS,
                              p_exponent=fp8_blocks.P_EXPONENT if fp8 else 0)
    rescale = output_rescale(O_BLOCKS)
    if SUM_ROWS:
        write_sum_rows, fold_sums, scale_sums = fp8_blocks.mma_row_sums(d_pad, STAGES * VT_ATOMS, VT_BOX)
    # (the 16-bit kernel's output has no factor: its finish takes one and drops it)
    finish = store_rows(1, OUT_BLOCKS, as_16bit(bf16), scaled=fp8, scale_argument=True, pairs=store == "pairs")
    stage_out = stage_rows(OUT_BLOCKS, bf16, ROWS)
    fence_async = wgmma.fence_proxy_async
    store_box = bulk.tma_store_4d
    commit, wait_read = bulk.bulk_commit, bulk.bulk_wait_read
    # named barriers: 1 + c the ping-pong's (consumer c's and the one before it), EPILOGUE + c consumer c's warps;
    # one id for two uses with different thread counts is undefined (with three consumers, 3 + 0 was the third
    # ping-pong barrier: an illegal instruction now and then)
    EPILOGUE = 1 + CONSUMERS

    if fp8 and per_head:
        descale = fp8_blocks.descaled(True)

        @inlined_function
        def scales(scale_log2, post, out_scale, descale_q, descale_k, descale_v, b, h, heads):
            """A block's (score scale, its exponent scale, output scale): the per-head factors of (b, h) folded in."""
            scale, v_scale = descale(scale_log2, out_scale, descale_q, descale_k, descale_v, b, h, heads)
            return scale, exponent(scale, SCALE_FIRST), v_scale
    else:  # (per tensor: the launch folded the factors into the scalars)
        @inlined_function
        def scales(scale_log2, post, out_scale, descale_q, descale_k, descale_v, b, h, heads):
            return scale_log2, post, out_scale

    @device_function
    def advance(stage, phase):
        """The ring's next slot and its phase bit (one division-free step; the phase flips at each wrap)."""
        stage += 1
        if stage == STAGES:
            return 0, phase ^ 1
        return stage, phase

    @device_function
    def load_kv(smem, base, tmap, stage, phase, n0, hk, b, full, empty):
        """A K or V tile into ring slot ``stage`` (its ``phase``-th use), once the consumers have freed it."""
        wait(smem, empty + 4 * stage, phase ^ 1)  # (the first round passes at once)
        arrive_tx(smem, full + 4 * stage, TILE_BYTES)
        for a in range(ATOMS):
            load_box(smem, base + stage * TILE + a * KV_BOX, tmap, 64 * a, n0, hk, b, full + 4 * stage)

    if fp8:
        @device_function
        def load_v(smem, base, tmap, stage, phase, n0, hk, b, full, empty):
            """8-bit: the V^T tile of keys ``n0 ..`` (all head-dim rows; one box per 128 keys) into ring slot
            ``stage``, once the consumers have freed it."""
            wait(smem, empty + 4 * stage, phase ^ 1)
            arrive_tx(smem, full + 4 * stage, V_TILE_BYTES)
            for a in range(VT_ATOMS):
                load_box(smem, base + stage * V_TILE + a * VT_BOX, tmap, n0 + 128 * a, 0, hk, b, full + 4 * stage)
    else:
        load_v = load_kv

    @device_function
    def produce(smem, q_base, k_base, v_base, bars, q_map, k_map, v_map, m0, h, hk, b, n_first, n_tiles, stage,
                phase, qn):
        """The producer thread, one block of rows: Q (once the consumers are done with the previous block's: its
        ``qn``-th), K of tile 0, then per tile K of the next and V of this one. Tile 0 goes to ring slot ``stage``
        (use ``phase``); returns the slot and phase of the next block's tile 0."""
        wait(smem, bars + 4, (qn & 1) ^ 1)
        arrive_tx(smem, bars, Q_BYTES)
        for c in range(CONSUMERS):
            for a in range(ATOMS):
                load_box(smem, q_base + c * Q_TILE + a * Q_BOX, q_map, 64 * a, m0 + ROWS * c, h, b, bars)
        load_kv(smem, k_base, k_map, stage, phase, n_first, hk, b, bars + K_FULL, bars + K_EMPTY)
        for j in range(n_tiles):
            v_stage, v_phase = stage, phase  # V of tile j goes where K of tile j went
            stage, phase = advance(stage, phase)
            if j + 1 < n_tiles:
                load_kv(smem, k_base, k_map, stage, phase, n_first + (j + 1) * BLOCK_N, hk, b, bars + K_FULL,
                        bars + K_EMPTY)
            load_v(smem, v_base, v_map, v_stage, v_phase, n_first + j * BLOCK_N, hk, b, bars + V_FULL,
                   bars + V_EMPTY)
        return stage, phase

    @device_function
    def no_pack(s, p):
        pass

    @lru_cache(maxsize=None)
    def pack_of(width):
        """P of a tile's first ``width`` keys as the P V MMA's A registers: rounded to e4m3 (the keys permuted:
        ``core.fp8``) or to the input dtype (the "no_pack" probe: left as they are)."""
        if probe == "no_pack":
            return no_pack
        if fp8:
            return fp8_blocks.probabilities(width // K_STEP)
        return wgmma.a_fragments(width // K_STEP, bf16)

    def key_tile(s_width: int, pv_width: int):
        """One key tile after the first: S of its first ``s_width`` keys (K in ring slot ``stage``; 0: none), P V
        of the previous tile's first ``pv_width`` (V in slot ``v_stage``; 0: none) under the softmax; returns the
        next slots and phases. Every tile waits for its K and V and frees them, computed or not. (Called with a
        constant ``needs_mask=False`` for the tiles ``plain`` finds, its inlined copy has no mask code.)"""
        S_W, PV_W = s_width, pv_width
        q_k = products[s_width][0] if s_width else q_times_k
        p_v = products[pv_width][1] if pv_width else p_times_v
        softmax = softmax_of(s_width or BLOCK_N)
        pack = pack_of(s_width or BLOCK_N)
        wait_scores = wait_one if pv_width else wait_s  # (S_j is done; P V may still run)

        @device_function
        def tile(s, acc, p, alpha, m_run, l_run, smem, q_c, k_base, v_base, bars, c, lane, n0, needs_mask, row0, t,
                 key_end, causal, diag_offset, scale_log2, post, stage, phase, v_stage, v_phase):
            wait(smem, bars + K_FULL + 4 * stage, phase)
            if PINGPONG:
                bar_sync(1 + c, PAIR)
            if S_W:
                q_k(s, smem, q_c, k_base + stage * TILE)
            wait(smem, bars + V_FULL + 4 * v_stage, v_phase)
            if PV_W:
                p_v(acc, p, smem, v_base + v_stage * V_TILE)
            if PINGPONG:
                bar_arrive(1 + (c + 1) % CONSUMERS, PAIR)
            if S_W:
                wait_scores(s)
            if lane == 0:
                arrive(smem, bars + K_EMPTY + 4 * stage)  # K of tile j is free
            if S_W:
                softmax(s, alpha, m_run, l_run, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2,
                        post)
            if PV_W:
                wait_o(acc, l_run)
                if SUM_ROWS:
                    fold_sums(acc, l_run)
            if lane == 0:
                arrive(smem, bars + V_EMPTY + 4 * v_stage)  # V of tile j - 1 is free
            if S_W:
                if SUM_ROWS:
                    scale_sums(l_run, alpha)
                rescale(acc, alpha)
                pack(s, p)
            v_stage, v_phase = advance(v_stage, v_phase)
            stage, phase = advance(stage, phase)
            return stage, phase, v_stage, v_phase

        return tile

    def by_code(fns):
        """``dispatch(code, args)``: ``fns[code](*args)`` for a width code (``fns`` indexed by code, the whole width
        last; the branches of codes past ``FULL``, never met, are pruned: ``FULL`` is a constant)."""
        NONE, FIRST, SECOND = (fns[min(x, FULL)] for x in range(3))
        WHOLE = fns[FULL]

        @device_function
        def dispatch(code, args):
            if code == FULL:
                return WHOLE(*args)
            if FULL > 1 and code == 1:
                return FIRST(*args)
            if FULL > 2 and code == 2:
                return SECOND(*args)
            return NONE(*args)

        return dispatch

    # the tiles that need the mask: after a whole tile any width, after a narrower one (or none) only none
    after_whole = by_code([key_tile(w, BLOCK_N) for w in WIDTHS])
    after_narrow = by_code([key_tile(0, w) for w in WIDTHS])
    tile = key_tile(BLOCK_N, BLOCK_N)

    @device_function
    def masked_tile(code_before, code, args):
        """A tile that needs the mask (``args``: ``tile``'s), at the width its ``code`` names, after a tile of
        ``code_before``."""
        if code_before == FULL:
            return after_whole(code, args)
        return after_narrow(code_before, args)

    def first_key_tile(width: int):
        """Tile 0 of a block, once its Q and K have landed: S of its first ``width`` keys (0: none), its softmax
        and P."""
        W = width
        q_k = products[width][0] if width else q_times_k
        softmax = softmax_of(width or BLOCK_N)
        pack = pack_of(width or BLOCK_N)

        @device_function
        def first(s, p, alpha, m_run, l_run, smem, q_c, k_base, bars, c, lane, n0, needs_mask, row0, t, key_end,
                  causal, diag_offset, scale_log2, post, stage, phase):
            if PINGPONG:
                bar_sync(1 + c, PAIR)
            if W:
                q_k(s, smem, q_c, k_base + stage * TILE)
            if PINGPONG:
                bar_arrive(1 + (c + 1) % CONSUMERS, PAIR)
            if W:
                wait_s(s)
            if lane == 0:
                arrive(smem, bars + K_EMPTY + 4 * stage)
            if W:
                softmax(s, alpha, m_run, l_run, needs_mask, n0, row0, t, key_end, causal, diag_offset, scale_log2,
                        post)
                pack(s, p)
            return advance(stage, phase)

        return first

    first_tile = by_code([first_key_tile(w) for w in WIDTHS])

    @device_function
    def no_product(acc, p, smem, v_offset):
        pass

    last_p_times_v = by_code([no_product] + [products[w][1] for w in WIDTHS[1:]])

    @device_function
    def store_staged(acc, m_run, l_run, smem, tile, bars, c, lane, m_c, row0, t, o_map, lse, b, h, seqlen_q,
                     write_lse, post, out_scale):
        """Consumer ``c``'s output through shared ``tile`` and the TMA, one thread storing. ``tile``: its Q tile
        (free: every warp is past its last S = Q K^T), which the storing thread frees for the producer once the
        unit has read it; or (``OWN_STAGING``) its own staging tile, which that thread makes sure the previous
        block's store has read before anyone writes it."""
        storer = lane == 0 and row0 == m_c
        if OWN_STAGING and storer:
            wait_read()
        bar_sync(EPILOGUE + c, WARPGROUP)
        stage_out(acc, m_run, l_run, smem, tile, lse, b, h, row0, row0 - m_c, t, seqlen_q, write_lse, post,
                  out_scale)
        fence_async()  # (the tile's writes, visible to the TMA unit)
        bar_sync(EPILOGUE + c, WARPGROUP)
        if storer:
            for a in range(OUT_ATOMS):
                store_box(smem, tile + a * Q_BOX, o_map, 64 * a, m_c, h, b)
            commit()
            if not OWN_STAGING:
                wait_read()
                arrive(smem, bars + 4)  # Q is free

    @device_function
    def consume(smem, q_c, k_base, v_base, bars, c, lane, m_c, row0, t, n_first, n_tiles, stage, phase, qn, key_end,
                causal, diag_offset, scale_log2, post, out_head, lse, b, h, seqlen_q, head_dim, write_lse, out_scale,
                o_map, o_c):
        """Consumer ``c``'s 64 rows of one block (``qn``: Q copies before; tile 0 in ring slot ``stage``, use
        ``phase``); returns the slot and phase of the next block's tile 0. ``v_base``: the V ring (8-bit: ``V^T``
        tiles); ``out_scale``: the output's factor (8-bit: the V descale); ``o_map``: the output's tensor map (the
        TMA store); ``o_c``: its staging tile (``OWN_STAGING``)."""
        s = cuda.local.array((1, S_BLOCKS, 4), float32)
        acc = cuda.local.array((1, O_BLOCKS, 4), float32)
        p = cuda.local.array(P_WORDS, uint32)
        alpha = cuda.local.array(2, float32)
        m_run = cuda.local.array(2, float32)
        l_run = cuda.local.array(2, float32)
        start(m_run, l_run, acc)
        v_stage = stage  # the slot of the V tile the next P V reads
        v_phase = phase
        limit = visible(m_c + ROWS - 1, key_end, causal, diag_offset)[1]  # (its last row's keys: the width codes)
        code = FULL
        if n_tiles > 0:  # tile 0: S_0, its softmax and P_0
            wait(smem, bars, qn & 1)
            wait(smem, bars + K_FULL + 4 * stage, phase)
            if narrow:
                code = width_code(n_first, limit)
            stage, phase = first_tile(code, (s, p, alpha, m_run, l_run, smem, q_c, k_base, bars, c, lane, n_first,
                                             partial(n_first, m_c, key_end, causal, diag_offset), row0, t, key_end,
                                             causal, diag_offset, scale_log2, post, stage, phase))
        # the tiles no mask touches run in a loop of their own, with no mask code in its softmax (they are whole:
        # a tile narrower than the whole is followed by masked ones only)
        first, end = plain(n_first, n_tiles, m_c, key_end, causal, diag_offset)
        first = max(first, 1)  # (tile 0 is done)
        end = max(end, first)
        if LEFT_SIDE:  # (only a window's left side leaves partial tiles before them)
            for j in range(1, first):
                n0 = n_first + j * BLOCK_N
                before = code
                if narrow:
                    code = width_code(n0, limit)
                stage, phase, v_stage, v_phase = masked_tile(before, code, (
                    s, acc, p, alpha, m_run, l_run, smem, q_c, k_base, v_base, bars, c, lane, n0, True, row0, t,
                    key_end, causal, diag_offset, scale_log2, post, stage, phase, v_stage, v_phase))
        for j in range(first, end):
            stage, phase, v_stage, v_phase = tile(s, acc, p, alpha, m_run, l_run, smem, q_c, k_base, v_base, bars, c,
                                                  lane, n_first + j * BLOCK_N, False, row0, t, key_end, causal,
                                                  diag_offset, scale_log2, post, stage, phase, v_stage, v_phase)
        for j in range(end, n_tiles):
            n0 = n_first + j * BLOCK_N
            before = code
            if narrow:
                code = width_code(n0, limit)
            stage, phase, v_stage, v_phase = masked_tile(before, code, (
                s, acc, p, alpha, m_run, l_run, smem, q_c, k_base, v_base, bars, c, lane, n0, True, row0, t, key_end,
                causal, diag_offset, scale_log2, post, stage, phase, v_stage, v_phase))
        if OWN_STAGING and n_tiles > 0 and lane == 0:
            arrive(smem, bars + 4)  # Q is free: this warp's last S is done
        if n_tiles > 0:
            wait(smem, bars + V_FULL + 4 * v_stage, v_phase)
            last_p_times_v(code, (acc, p, smem, v_base + v_stage * V_TILE))
            wait_o(acc, l_run)
            if SUM_ROWS:  # (column d_pad: the last tile's row sums, in lane t = 0; the other lanes' columns: 0)
                fold_sums(acc, l_run)
            if lane == 0:
                arrive(smem, bars + V_EMPTY + 4 * v_stage)
                if not TMA_STORE:
                    arrive(smem, bars + 4)  # Q is free (the producer copies the next block's over it)
        if fp8:  # (P carried a factor: ``core.fp8.P_EXPONENT``)
            out_scale = fp8_blocks.p_unscaled(l_run, out_scale)
        if TMA_STORE and n_tiles > 0:  # (without a tile Q was not copied: the producer may be writing the next)
            store_staged(acc, m_run, l_run, smem, o_c if OWN_STAGING else q_c, bars, c, lane, m_c, row0, t, o_map,
                         lse, b, h, seqlen_q, write_lse, post, out_scale)
        else:
            finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, 0, seqlen_q, head_dim, write_lse, post, out_scale)
        return stage, phase

    round_tile, tile_of = persistent_schedule(BLOCK_M)

    @device_function
    def produce_block(smem, q_base, k_base, v_base, bars, q_map, k_map, v_map, tile, q, causal, key_start, key_end,
                      diag_offset, group, stage, phase, qn):
        """The producer's part of the persistent loop's ``tile``; returns the ring's slot and phase and Q's count."""
        b, h, m0 = tile_of(tile, q, causal)
        n_first, n_tiles = walk_tiles(m0, key_start, key_end, causal, diag_offset)
        if n_tiles > 0:
            stage, phase = produce(smem, q_base, k_base, v_base, bars, q_map, k_map, v_map, m0, h, h // group, b,
                                   n_first, n_tiles, stage, phase, qn)
            qn += 1
        return stage, phase, qn

    @device_function
    def consume_block(smem, q_c, k_base, v_base, bars, c, lane, row, t, tile, q, causal, key_start, key_end,
                      diag_offset, scale_log2, post, out_scale, descale_q, descale_k, descale_v, out, lse, seqlen_q,
                      head_dim, write_lse, o_map, o_c, stage, phase, qn):
        """Consumer ``c``'s part of the persistent loop's ``tile``; returns the ring's slot and phase and Q's
        count."""
        b, h, m0 = tile_of(tile, q, causal)
        n_first, n_tiles = walk_tiles(m0, key_start, key_end, causal, diag_offset)
        scale, post_b, v_scale = scales(scale_log2, post, out_scale, descale_q, descale_k, descale_v, b, h,
                                        q.shape[1])
        stage, phase = consume(smem, q_c, k_base, v_base, bars, c, lane, m0 + ROWS * c, m0 + row, t, n_first,
                               n_tiles, stage, phase, qn, key_end, causal, diag_offset, scale, post_b, out[b, h], lse,
                               b, h, seqlen_q, head_dim, write_lse, v_scale, o_map, o_c)
        if n_tiles > 0:
            qn += 1
        return stage, phase, qn

    @kernel_body
    def body(q, k, v, out, lse, write_lse, causal, scale_log2, q_map, k_map, v_map, o_map, schedule, out_scale,
             descale_q, descale_k, descale_v):
        tid, warp, lane, g, t = lane_position()
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, 0, schedule)
        group = q.shape[1] // k.shape[1]
        head_dim = q.shape[3]
        smem = cuda.shared.array(0, uint16)
        q_base = ((1024 - shared_address(smem) % 1024) % 1024) // 2
        k_base = q_base + CONSUMERS * Q_TILE
        v_base = k_base + STAGES * TILE
        o_base = v_base + STAGES * V_TILE  # (persistent or 8-bit: the consumers' staging tiles)
        bars = o_base + (CONSUMERS * OUT_TILE if STAGING_TILES else 0)
        # (bars: Q full, Q empty; K full, K empty, V full, V empty per stage)
        if SUM_ROWS:  # (the rows of ones under the V^T boxes: P's row sums from P V)
            write_sum_rows(smem, v_base, tid, cuda.blockDim.x)
            fence_async()
        if tid == 0:
            init(smem, bars, 1)
            init(smem, bars + 4, Q_EMPTY_ARRIVALS)
            for stage in range(STAGES):
                init(smem, bars + K_FULL + 4 * stage, 1)
                init(smem, bars + K_EMPTY + 4 * stage, EMPTY_ARRIVALS)
                init(smem, bars + V_FULL + 4 * stage, 1)
                init(smem, bars + V_EMPTY + 4 * stage, EMPTY_ARRIVALS)
            fence_init()
        cuda.syncthreads()  # (the last block-wide barrier: the producer's idle warps leave)
        # (the block loop of the persistent kernel is its own branch: a one-trip loop around the consumer made
        # ptxas spill 480 bytes at head dim 128)
        blocks = q.shape[0] * q.shape[1] * ((seqlen_q + BLOCK_M - 1) // BLOCK_M)
        # (a shuffle, so that ptxas knows the warpgroup uniform: the Q, K and V descriptors, made from it, then
        # live in uniform registers -- without, ~50 more instructions per key tile)
        role = warp_uniform(tid // 128)
        if role == 0:
            fewer_registers()
            if warp == 0 and elect_one():
                acquire(q_map)
                acquire(k_map)
                acquire(v_map)
                if PERSISTENT:
                    ring = (0, 0, 0)
                    for k in range((blocks + cuda.gridDim.x - 1) // cuda.gridDim.x):
                        tile = round_tile(k, causal)
                        if tile >= blocks:
                            continue
                        ring = produce_block(smem, q_base, k_base, v_base, bars, q_map, k_map, v_map, tile, q, causal,
                                             key_start, key_end, diag_offset, group, ring[0], ring[1], ring[2])
                else:
                    b1, h1, m1, _, _, _, _ = position(q, k, v, out, causal, schedule)
                    n_first1, n_tiles1 = walk_tiles(m1, key_start, key_end, causal, diag_offset)
                    if n_tiles1 > 0:
                        produce(smem, q_base, k_base, v_base, bars, q_map, k_map, v_map, m1, h1, h1 // group, b1,
                                n_first1, n_tiles1, 0, 0, 0)
            return

        more_registers()
        c = role - 1
        row = ROWS * c + 16 * (warp - 4 * role) + g  # this thread's first row in the block
        if TMA_STORE and lane == 0 and row == ROWS * c:
            acquire(o_map)
        if PINGPONG and c == CONSUMERS - 1:
            bar_arrive(1, PAIR)  # consumer 0 issues first
        post = exponent(scale_log2, SCALE_FIRST)
        if PERSISTENT:
            ring = (0, 0, 0)
            for k in range((blocks + cuda.gridDim.x - 1) // cuda.gridDim.x):
                tile = round_tile(k, causal)
                if tile >= blocks:
                    continue
                ring = consume_block(smem, q_base + c * Q_TILE, k_base, v_base, bars, c, lane, row, t, tile, q,
                                     causal, key_start, key_end, diag_offset, scale_log2, post, out_scale, descale_q,
                                     descale_k, descale_v, out, lse, seqlen_q, head_dim, write_lse, o_map,
                                     o_base + c * OUT_TILE, ring[0], ring[1], ring[2])
        else:
            b1, h1, m1, _, _, _, out_head = position(q, k, v, out, causal, schedule)
            n_first1, n_tiles1 = walk_tiles(m1, key_start, key_end, causal, diag_offset)
            scale, post_b, v_scale = scales(scale_log2, post, out_scale, descale_q, descale_k, descale_v, b1, h1,
                                            q.shape[1])
            consume(smem, q_base + c * Q_TILE, k_base, v_base, bars, c, lane, m1 + ROWS * c, m1 + row, t, n_first1,
                    n_tiles1, 0, 0, 0, key_end, causal, diag_offset, scale, post_b, out_head, lse, b1, h1,
                    seqlen_q, head_dim, write_lse, v_scale, o_map, o_base + c * OUT_TILE)
        if OWN_STAGING and lane == 0 and row == ROWS * c:
            wait_read()  # (the last store has read its tile before the block's shared memory goes)
        if PINGPONG and c == 0:
            bar_sync(1, PAIR)  # the last consumer's last arrival: the barriers end as they began

    if fp8:  # (no schedule: unread; o_map: read by the TMA store only)
        def kernel(q, k, v, out, lse, write_lse, causal, scale_log2, q_map, k_map, v_map, o_map, out_scale,
                   descale_q, descale_k, descale_v):
            body(q, k, v, out, lse, write_lse, causal, scale_log2, q_map, k_map, v_map, o_map, lse, out_scale,
                 descale_q, descale_k, descale_v)

        return kernel

    # (16-bit: no factors -- the output's is 1, and lse stands in for the descale arrays nothing reads)
    if variant.packed:  # (no output map: unread)
        def packed_kernel(q, k, v, out, lse, write_lse, causal, scale_log2, q_map, k_map, v_map, schedule):
            body(q, k, v, out, lse, write_lse, causal, scale_log2, q_map, k_map, v_map, q_map, schedule, ONE, lse,
                 lse, lse)

        return packed_kernel

    def kernel(q, k, v, out, lse, write_lse, causal, scale_log2, q_map, k_map, v_map, o_map):
        body(q, k, v, out, lse, write_lse, causal, scale_log2, q_map, k_map, v_map, o_map, lse, ONE, lse, lse,
             lse)  # (no schedule: unread; o_map: read by the TMA store only)

    return kernel
