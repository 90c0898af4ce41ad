"""Device code shared by the register-state chunked walks of ``mma`` (16-bit inputs) and ``mma_f32`` (float32): block
position, the register-resident state (start, publish, end), accumulators, the causal mask and the output rows. The
same grid, segments and state layout in both, so the code lives here once.

A block is ``(head, M tile)`` along grid x and a segment along grid y. Warp ``w`` holds the E rows
``16 e .. 16 e + 15`` of H for ``e = w, w + warps, ...`` as m16n8 C fragments ``hm[i, ob, x]``: E row
``16 e + g + 8 (x // 2)``, column ``8 ob + 2 t + x % 2`` of the block's M tile (``g = lane // 4``, ``t = lane % 4``).
The increments of the segments (``STATES``) are a contiguous float32 scratch ``(rows, e_pad, cols)``, one row per
(head, M tile, segment but the last).
"""
from __future__ import annotations

import numpy as np
from numba import float32, uint16, uint32

from ..core import ptx
from ..core.staging import device_function, kernel_body
from ..runtime.device import cuda
from .block import block_position, head_views, lanes

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
    """``(position, start_state, borrowed_start, end_state)`` device functions for one specialisation (``has_q``: the CAUSAL walk;
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

    block = block_position(chunk, cols)

    @device_function
    def position(tid, bhm, seg, k, out, segment_chunks, state_segments, m_tiles, slot):
        """Thread ``tid`` of block ``(bhm, seg)`` -> (warp, lane, g, t, b, h, col0, row_begin, n_chunks, first_row,
        out_base): its lanes (``block.lanes``), head, first value column, first row, chunks to walk (<= 0: none),
        first row of increments (``slot``: the blocks of the problems before this one) and the byte offset of its
        first output column pair in ``out``."""
        warp, lane, g, t = lanes(tid)
        b, h, col0, row_begin, row_end = block(bhm, seg, k, k.shape[2], segment_chunks, m_tiles)
        out_base = b * out.strides[0] + h * out.strides[1] + (col0 + 2 * t) * out.strides[3]
        return (warp, lane, g, t, b, h, col0, row_begin, (row_end - row_begin + C - 1) // C,
                (slot + bhm) * state_segments, out_base)

    @device_function
    def start_state(hm, init, increments, has_init, b, h, e_dim, m_dim, col0, first_row, seg, warp, g, t):
        """The state this block starts from: the initial state plus the increments of the segments before it
        (STATES: zero, it sums its own segment). ``borrowed_start`` replaces the increments by those of another
        problem, transposed."""
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
    def borrowed_start(hm, increments, src_first, state_segments, e_dim, m_dim, col0, seg, warp, g, t):
        """Add to ``hm`` the transposed increments of the segments before this one from another problem of the same
        tiles whose E and M are this one's M and E (the ``dv`` walk's ``sum q_j g_j^T`` for the ``dk`` walk, whose
        STATES pass would compute ``sum g_j q_j^T``). Element (e, c) of this block's state is element (c, e) of
        the source: row ``src_first + (e // COLS) * state_segments + r`` (``src_first``: the source's first row of
        this head), E row c, column ``e % COLS``."""
        for first in range(0, seg, SUM_GROUP):
            for i in range(E_PER_WARP):
                e_block = 16 * (warp + i * WARPS)
                if e_block < E_PAD:
                    for ob in range(O_BLOCKS):
                        for x in range(4):
                            e = e_block + g + 8 * (x // 2)
                            c = col0 + 8 * ob + 2 * t + x % 2
                            if e < e_dim and c < m_dim:
                                row = src_first + (e // COLS) * state_segments + first
                                cell = ((row * E_PAD + c) * COLS + e % COLS) * 4
                                total = ZERO
                                for r in range(SUM_GROUP):
                                    if first + r < seg:
                                        total += load_at(increments, cell + r * ROW_BYTES)
                                hm[i, ob, x] += total

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

    return position, start_state, borrowed_start, end_state


def state_publisher(warps: int, e_pad: int, cols: int, side_bit: int, publish):
    """``publish_state(hm, smem32, warp, g, t)``: hand this warp's rows of H to the kernel's ``publish(smem32, e_pair,
    row, col, x_low, x_high)``, which writes one record of two E rows of column ``col``. Lanes whose ``g`` differ in
    bit ``side_bit`` (lane mask ``4 << side_bit``) swap one column of their C fragments first, so that each holds
    both E rows of one column: ``side_bit`` 0 pairs E rows ``(2i, 2i + 1)`` (``mma``), 2 pairs ``(e, e + 4)``
    (``mma_f32``)."""
    WARPS = warps
    E_BLOCKS = e_pad // 16
    E_PER_WARP = -(-E_BLOCKS // warps)
    O_BLOCKS = cols // 8
    SIDE_BIT = side_bit
    MASK = 4 << side_bit
    shfl_xor = ptx.shfl_xor_f32

    @device_function
    def publish_state(hm, smem32, warp, g, t):
        if SIDE_BIT == 0:  # column 2t + side, E rows 2 (g // 2) + (0, 1) of the m16 block
            side = g % 2
            row = g // 2
        else:  # column 2t + side, E rows g % 4 + (0, 4)
            side = g // 4
            row = g % 4
        for i in range(E_PER_WARP):
            eb = warp + i * WARPS
            if eb < E_BLOCKS:
                for ob in range(O_BLOCKS):
                    send_a = hm[i, ob, 0] if side else hm[i, ob, 1]
                    send_b = hm[i, ob, 2] if side else hm[i, ob, 3]
                    got_a = shfl_xor(send_a, MASK)
                    got_b = shfl_xor(send_b, MASK)
                    col = 8 * ob + 2 * t + side
                    publish(smem32, 2 * eb, row, col, got_a if side else hm[i, ob, 0],
                            hm[i, ob, 1] if side else got_a)
                    publish(smem32, 2 * eb + 1, row, col, got_b if side else hm[i, ob, 2],
                            hm[i, ob, 3] if side else got_b)

    return publish_state


def accumulator_fill(blocks: int, value):
    """``fill(acc)``: ``blocks`` n8 accumulator fragments ``acc[n, 0..3]`` set to ``value``."""
    BLOCKS = blocks
    VALUE = value

    @device_function
    def fill(acc):
        for n in range(BLOCKS):
            for x in range(4):
                acc[n, x] = VALUE

    return fill


def future_mask(chunk: int):
    """``mask_future(s, warp, g, t)``: zero the scores of keys after their row in this warp's ``S`` fragments of a
    chunk (warp ``w`` holds rows ``16 w ..``; fragment ``(nb, x)`` is key ``8 nb + 2t + x % 2`` of row
    ``g + 8 (x // 2)``)."""
    S_BLOCKS = chunk // 8
    ZERO = np.float32(0.0)

    @device_function
    def mask_future(s, warp, g, t):
        for nb in range(S_BLOCKS):
            for x in range(4):
                if 8 * nb + 2 * t + x % 2 > 16 * warp + g + 8 * (x // 2):
                    s[nb, x] = ZERO

    return mask_future


def row_writer(blocks: int, store_pair):
    """``write_rows(out, out_head, o, out_base, row_a, seqlen, col0, m_dim, t)``: the output rows ``row_a`` and
    ``row_a + 8`` of this lane from ``blocks`` n8 C fragments ``o``, each column pair handed to the kernel's
    ``store_pair(out, out_head, at, ob, row, col, m_dim, x0, x1)`` (``at``: the byte offset of the lane's first pair
    in the row)."""
    BLOCKS = blocks

    @device_function
    def write_rows(out, out_head, o, out_base, row_a, seqlen, col0, m_dim, t):
        for half in range(2):
            row = row_a + 8 * half
            if row < seqlen:
                at = out_base + row * out.strides[2]  # bytes; the columns of a row are contiguous
                for ob in range(BLOCKS):
                    col = col0 + 8 * ob + 2 * t
                    if col < m_dim:
                        store_pair(out, out_head, at, ob, row, col, m_dim, o[ob, 2 * half], o[ob, 2 * half + 1])

    return write_rows


def walk_kernel(tiles, has_q: bool, stage: int, side_bit: int, frag_steps: int, hooks, problems: int = 1,
                borrow: bool = False):
    """The kernel of one register-state specialisation (``has_q``: the CAUSAL walk, else the STATES pass): the walk
    over a segment's chunks that ``mma`` and ``mma_f32`` share, around their own device functions ``hooks =
    (lane_offsets, load_chunk, chunk_output, state_increment, publish, store_pair)``:

    * ``lane_offsets(warp, lane, g, t)`` -> three offsets of this lane's operands in a stage (``lanes``), once;
    * ``load_chunk(q_head, k_head, v_head, smem, smem32, base, tid, warp, lane, c0, seqlen, e_dim, col0, m_dim,
      first)`` starts the copies of the chunk at ``c0`` to the stage at ``base`` (``stage`` apart);
    * ``chunk_output(smem, smem32, temps, lanes, base, step, n_chunks, c0, warp, lane, g, t, q_head, seqlen, e_dim)``
      computes the chunk's output fragments ``o`` (CAUSAL), written by ``store_pair`` (``row_writer``);
    * ``state_increment(smem, smem32, temps, lanes, base, eb, warp, lane, g, t)`` computes the m16 block ``eb`` of
      ``dH = K_c^T V_c`` into ``o``, added to H with float32 adds;
    * ``publish`` writes H's records for the next chunk (``state_publisher`` with ``side_bit``).

    ``temps = (s, s_small, o, o_small, frag_hi, frag_lo)``: the kernel's scratch fragments (S, O and their small
    3xTF32 terms; ``frag_steps`` rows of uint32 fragments). Those a kernel does not use cost nothing on a GPU.

    ``problems`` > 1 (``problem_kernels``): that many walks of the same tiles on their own operands in one launch,
    grid z the problem, their increments one after the other (``problems * grid x`` blocks' rows). ``borrow``
    (CAUSAL): the last problem takes the increments of the one before it, transposed (``borrowed_start``), instead
    of its own, which the STATES pass then leaves out (the backward's ``dk`` walk, from the ``dv`` walk's).
    """
    lane_offsets, load_chunk, chunk_output, state_increment, publish, store_pair = hooks
    WARPS = tiles.warps
    C = tiles.chunk
    E_PAD = tiles.e_pad
    COLS = tiles.cols
    HAS_Q = has_q
    BORROW = borrow and has_q
    STAGE = stage
    E_BLOCKS = E_PAD // 16
    E_PER_WARP = -(-E_BLOCKS // WARPS)  # m16 blocks of H a warp owns
    S_BLOCKS = C // 8
    O_BLOCKS = COLS // 8
    FRAG_STEPS = frag_steps
    wait_all = ptx.cp_async_wait_all
    position, start_state, borrowed_start, end_state = state_functions(WARPS, E_PAD, COLS, C, HAS_Q)
    publish_state = state_publisher(WARPS, E_PAD, COLS, side_bit, publish)
    write_rows = row_writer(O_BLOCKS, store_pair)

    @kernel_body
    def walk(q, k, v, out, increments, init, final, has_init, write_final, segment_chunks, state_segments, m_tiles,
             slot, borrowed, src_slot):
        """One block's walk. ``slot``: grid-x blocks of the problems before this one (its increments come after
        theirs); ``borrowed``: start from problem ``src_slot / grid x``'s increments, transposed."""
        tid = cuda.threadIdx.x
        bhm = cuda.blockIdx.x
        seg = cuda.blockIdx.y
        warp, lane, g, t, b, h, col0, row_begin, n_chunks, first_row, out_base = position(
            tid, bhm, seg, k, out, segment_chunks, state_segments, m_tiles, slot)
        e_dim, m_dim, seqlen = k.shape[3], v.shape[3], k.shape[2]
        q_head, k_head, v_head, out_head = head_views(q, k, v, out, b, h)
        smem = cuda.shared.array(0, uint16)  # the stages as 16-bit elements (ldmatrix's view)
        smem32 = cuda.shared.array(0, float32)  # the same memory as float32: float32 tiles, H's records
        s = cuda.local.array((S_BLOCKS, 4), float32)
        s_small = cuda.local.array((S_BLOCKS, 4), float32)
        o = cuda.local.array((O_BLOCKS, 4), float32)  # the chunk's output, then blocks of dH
        o_small = cuda.local.array((O_BLOCKS, 4), float32)
        hm = cuda.local.array((E_PER_WARP, O_BLOCKS, 4), float32)  # this warp's rows of H
        frag_hi = cuda.local.array((FRAG_STEPS, 4), uint32)
        frag_lo = cuda.local.array((FRAG_STEPS, 4), uint32)
        temps = (s, s_small, o, o_small, frag_hi, frag_lo)
        lanes = lane_offsets(warp, lane, g, t)

        if n_chunks > 0:
            load_chunk(q_head, k_head, v_head, smem, smem32, 0, tid, warp, lane, row_begin, seqlen, e_dim, col0, m_dim,
                       True)

        if BORROW and borrowed:
            start_state(hm, init, increments, has_init, b, h, e_dim, m_dim, col0, first_row, 0, warp, g, t)
            borrowed_start(hm, increments, (src_slot + bhm - col0 // COLS) * state_segments, state_segments, e_dim,
                           m_dim, col0, seg, warp, g, t)
        else:
            start_state(hm, init, increments, has_init, b, h, e_dim, m_dim, col0, first_row, seg, warp, g, t)

        for step in range(-1 if HAS_Q else 0, n_chunks):
            if step >= 0:
                c0 = row_begin + step * C
                base = (step % 2) * STAGE
                wait_all()
                cuda.syncthreads()  # chunk `step` has landed; everyone is done with chunk step - 1 and the records
                if step + 1 < n_chunks:
                    load_chunk(q_head, k_head, v_head, smem, smem32, STAGE - base, tid, warp, lane, c0 + C, seqlen,
                               e_dim, col0, m_dim, False)
                if HAS_Q:
                    chunk_output(smem, smem32, temps, lanes, base, step, n_chunks, c0, warp, lane, g, t, q_head,
                                 seqlen, e_dim)
                    write_rows(out, out_head, o, out_base, c0 + 16 * warp + g, seqlen, col0, m_dim, t)
                    cuda.syncthreads()  # every warp has read the records of H for this chunk

                # ---- H += K_c^T V_c: fresh float32 accumulators, then float32 adds (see shared_state_body) --------
                for i in range(E_PER_WARP):
                    eb = warp + i * WARPS
                    if eb < E_BLOCKS:
                        state_increment(smem, smem32, temps, lanes, base, eb, warp, lane, g, t)
                        for ob in range(O_BLOCKS):
                            for x in range(4):
                                hm[i, ob, x] += o[ob, x]

            if HAS_Q and step + 1 < n_chunks:
                publish_state(hm, smem32, warp, g, t)  # H for the next chunk

        end_state(hm, increments, final, write_final, seg == cuda.gridDim.y - 1, b, h, e_dim, m_dim, col0, first_row,
                  seg, warp, g, t)

    if problems == 1:
        def kernel(q, k, v, out, increments, init, final, has_init, write_final, segment_chunks, state_segments,
                   m_tiles):
            walk(q, k, v, out, increments, init, final, has_init, write_final, segment_chunks, state_segments, m_tiles,
                 0, BORROW, 0)

        return kernel
    return problem_kernels(walk, problems, BORROW)


def problem_kernels(walk, problems: int, borrow: bool):
    """The kernel of ``problems`` (2 or 3) walks in one launch (``walk_kernel``): ``kernel(q0, k0, v0, out0, q1, ...,
    increments, init0, init1, ..., final, has_init0, has_init1, ..., final_problem, segment_chunks, state_segments,
    m_tiles)``; block z runs problem z; ``final_problem`` (-1: none) writes ``final``. Each block picks its problem's
    arrays and runs the one walk."""
    BORROW = borrow
    if problems == 2:
        def kernel2(q0, k0, v0, out0, q1, k1, v1, out1, increments, init0, init1, final, has_init0, has_init1,
                    final_problem, segment_chunks, state_segments, m_tiles):
            p = cuda.blockIdx.z
            q, k, v, out, init, has_init = q0, k0, v0, out0, init0, has_init0
            if p == 1:
                q, k, v, out, init, has_init = q1, k1, v1, out1, init1, has_init1
            walk(q, k, v, out, increments, init, final, has_init, p == final_problem, segment_chunks, state_segments,
                 m_tiles, p * cuda.gridDim.x, BORROW and p == 1, 0)

        return kernel2
    if problems != 3:
        raise ValueError(f"problems: expected 1, 2 or 3, got {problems}")

    def kernel3(q0, k0, v0, out0, q1, k1, v1, out1, q2, k2, v2, out2, increments, init0, init1, init2, final,
                has_init0, has_init1, has_init2, final_problem, segment_chunks, state_segments, m_tiles):
        p = cuda.blockIdx.z
        q, k, v, out, init, has_init = q0, k0, v0, out0, init0, has_init0
        if p == 1:
            q, k, v, out, init, has_init = q1, k1, v1, out1, init1, has_init1
        elif p == 2:
            q, k, v, out, init, has_init = q2, k2, v2, out2, init2, has_init2
        walk(q, k, v, out, increments, init, final, has_init, p == final_problem, segment_chunks, state_segments,
             m_tiles, p * cuda.gridDim.x, BORROW and p == 2, cuda.gridDim.x)

    return kernel3
