"""The body of the shared-memory-state chunked kernel: one source for its ``CAUSAL``, ``STATES`` and ``APPLY`` passes
(``shared_state`` has the algorithm, the configuration and the launches).

Tensor cores. Every tile is staged in shared memory as float32 (inputs converted on load, ``phi = elu + 1`` applied
there for the layer). The MMA is the tf32 one, whose operands are float32 bit patterns (``ptx`` module docstring has
the fragment layouts); the inputs are split so that the result keeps float32 accuracy where it matters:

* float16 / bfloat16 inputs are exact in tf32; the scores ``P`` are rounded to tf32 once (as fla rounds them to the
  input dtype); the state ``H`` is split ``hi = tf32(H)``, ``lo = tf32(H - hi)`` and multiplied twice, so the
  inter-chunk term keeps float32 accuracy and range (an fp16 state would overflow for long positive sequences).
* float32 inputs ("3xTF32", the CUTLASS fast-fp32 scheme): every operand split in two, ``a b ~ a_lo b_hi + a_hi b_lo
  + a_hi b_hi``, relative error about 1e-6. ``tf32=True`` opts into one term (rounded inputs, ~1e-3, faster).

Work split in a block: ``warps`` warps, chunk ``C = 16 * warps`` rows; warp ``w`` owns rows ``16 w .. 16 w + 15`` of
``S = Q_c K_c^T`` and of ``out_c`` (the M = 16 of an MMA), and the E rows ``16 e`` for ``e = w, w + warps, ...`` of
the state update. With the k-permutation of the ``ptx`` docstring the C fragments of ``S`` are the A fragments of
``P V_c`` (no shuffles), and ``K_c^T`` is read straight from the ``[key][e]`` tile as an A operand.

Shared memory (float32 words): ``Q [C][E + 4]``, ``K [C][E + 4]``, ``V [C][cols + 4]``, ``H [E][cols + pad]``,
strides chosen so that every fragment load of a warp hits 32 different banks (``K[g][t]``: stride = 4 mod 8;
``K[2t][g]`` and ``V[2t][g]``: stride = 4 mod 8 too; ``H[t][g]``: stride = 8 mod 32). Where it fits (E <= 128)
``H``'s tf32 hi and lo parts sit beside it (``presplit``), so the ``Q H`` operand needs no conversion per use. That
is 107 KB at E = M = 64 (dynamic shared memory, attribute raised by ``runtime.launch.launch``).

Staging. Rows arrive in pieces of 4 elements (8-byte loads of 16-bit data, 16-byte loads of float32; ``vector``,
when every row is aligned and contiguous, else element by element), a batch of loads in flight before the first is
converted, and land as one 16-byte shared store per piece (consecutive lanes, consecutive pieces: no bank
conflicts). Shared memory is indexed with 64-bit integers without wraparound (``ptx.load1`` / ``store1``), so that
``base + constant`` folds into an immediate offset. ``docs/design/linear.md`` has the profiles behind these choices.
"""
from __future__ import annotations

import numpy as np
from numba import float32, types

from ..core import ptx
from ..runtime.device import cuda
from .arguments import FLOAT32
from .block import block_position, head_views, lanes
from .chunk_plan import APPLY, CAUSAL, STATES
from .shared_state_parts import (ONE, ZERO, element_functions, mma_terms, operand, state_access,
                                 tile_position)


def kernel_source(tiles, mode: int, dtype: str, split: bool, feature_map: bool, vector: bool):
    """The kernel of one specialisation (``tiles`` a ``shared_state.Tiles``; every argument a constant)."""
    WARPS = tiles.warps
    NT = 32 * WARPS
    C = tiles.chunk
    E_PAD = tiles.e_pad
    COLS = tiles.cols
    VALUE_COLS = tiles.value_cols
    NORM = tiles.normalise
    DEN_BLOCK = VALUE_COLS // 8  # the n8 block whose first column is the ones column (normalise)
    QS, VS, HS = tiles.q_stride, tiles.v_stride, tiles.h_stride
    K_OFF, V_OFF, H_OFF = tiles.k_offset, tiles.v_offset, tiles.h_offset
    E_STEPS = E_PAD // 8  # k8 steps over E
    E_BLOCKS = E_PAD // 16  # m16 blocks of the state
    S_BLOCKS = C // 8  # n8 blocks of S = k8 steps of P V and of K^T V
    O_BLOCKS = COLS // 8
    F32 = dtype == FLOAT32
    RAW = float32 if F32 else types.uint16  # a loaded element before conversion
    RAW_ZERO = np.float32(0.0) if F32 else np.uint16(0)
    QK_PER_THREAD = C * E_PAD // NT  # elements of one Q or K tile per thread (E_PAD / 2)
    V_PER_THREAD = C * COLS // NT
    BATCH = 16  # element loads in flight per thread while staging
    PIECE = 4  # elements per vector load (16 bytes of float32, 8 of 16-bit) and per 16-byte shared store
    QK_PIECES = C * E_PAD // PIECE
    V_PIECES = C * COLS // PIECE
    PIECE_BATCH = 8  # vector loads in flight per thread and tile
    load1 = ptx.load1
    store1 = ptx.store1
    load2 = ptx.load2
    store_f32x4 = ptx.store_f32x4
    to_tf32 = ptx.to_tf32
    bits_float = ptx.bits_float
    shfl_xor = ptx.shfl_xor_f32
    qk_mma = mma_terms(split, split)  # S = Q K^T and K^T V: both inputs
    pv_mma = mma_terms(split, split)  # P V: P is split exactly when the inputs are
    qh_mma = mma_terms(split, True)  # Q H: the float32 state is always split
    input_operand = operand(split)
    p_operand = operand(split)
    p_round = not split  # single-term P: round to tf32 (a plain bit read would truncate)
    _, to_value, store_piece, load_piece, store_out = element_functions(dtype, split)
    store_state, add_state_pair, state_b = state_access(tiles)
    position = block_position(C, VALUE_COLS)
    qk_piece = tile_position(E_PAD // PIECE, PIECE)  # piece -> (row, first column) of a Q / K tile
    v_piece = tile_position(COLS // PIECE, PIECE)
    qk_element = tile_position(E_PAD, 1)
    cols_element = tile_position(COLS, 1)  # (row, column) of a V tile element or a state entry

    def kernel(q, k, v, out, state, final, has_state, write_final, eps, segment_chunks, state_segments, m_tiles):
        tid = cuda.threadIdx.x
        warp, _, g, t = lanes(tid)
        bhm = cuda.blockIdx.x
        seg = cuda.blockIdx.y
        seqlen = k.shape[2] if mode == STATES else q.shape[2]
        b, h, col0, row_begin, row_end = position(bhm, seg, q, seqlen, segment_chunks, m_tiles)
        e_dim = q.shape[3]
        m_dim = v.shape[3]
        state_row = bhm * state_segments + (0 if mode == APPLY else seg)
        q_head, k_head, v_head, out_head = head_views(q, k, v, out, b, h)
        smem = cuda.shared.array(0, float32)
        q_raw = cuda.local.array(BATCH, RAW)
        k_raw = cuda.local.array(BATCH, RAW)
        v_raw = cuda.local.array(BATCH, RAW)
        q_words = cuda.local.array((PIECE_BATCH, 4), RAW if F32 else types.uint32)
        k_words = cuda.local.array((PIECE_BATCH, 4), RAW if F32 else types.uint32)
        s = cuda.local.array((S_BLOCKS, 4), float32)
        o = cuda.local.array((O_BLOCKS, 4), float32)

        # ---- the state this block starts from (zero for STATES: it sums its own segment) ---------------------------
        for idx in range(tid, E_PAD * COLS, NT):
            e, c = cols_element(idx)
            val = ZERO
            if has_state and mode != STATES:
                val = state[state_row, e, c]
            store_state(smem, e * HS + c, val)

        for c0 in range(row_begin, row_end, C):
            cuda.syncthreads()  # the previous chunk's tiles and state are no longer read
            # ---- stage the chunk: rows past the end and padded columns are zeros (they add exactly 0) ------------
            # Loads are issued in batches before any is converted and stored, so that their latencies overlap (a
            # shared store between two global loads would serialise them: LLVM cannot tell the global pointer
            # from the shared one).
            if vector:
                for base in range(0, QK_PIECES, PIECE_BATCH * NT):
                    for i in range(PIECE_BATCH):
                        piece = base + i * NT + tid
                        r, col = qk_piece(piece)
                        if piece < QK_PIECES and c0 + r < seqlen and col < e_dim:
                            if mode != STATES:
                                q_words[i, 0], q_words[i, 1], q_words[i, 2], q_words[i, 3] = load_piece(
                                    q_head, c0 + r, col)
                            if mode != APPLY:
                                k_words[i, 0], k_words[i, 1], k_words[i, 2], k_words[i, 3] = load_piece(
                                    k_head, c0 + r, col)
                    for i in range(PIECE_BATCH):
                        piece = base + i * NT + tid
                        r, col = qk_piece(piece)
                        inside = c0 + r < seqlen and col < e_dim
                        if piece < QK_PIECES:
                            if mode != STATES:
                                store_piece(smem, r * QS + col, inside, q_words[i, 0], q_words[i, 1],
                                            q_words[i, 2], q_words[i, 3], feature_map)
                            if mode != APPLY:
                                store_piece(smem, K_OFF + r * QS + col, inside, k_words[i, 0], k_words[i, 1],
                                            k_words[i, 2], k_words[i, 3], feature_map)
                if mode != APPLY:
                    for base in range(0, V_PIECES, PIECE_BATCH * NT):
                        for i in range(PIECE_BATCH):
                            piece = base + i * NT + tid
                            r, col = v_piece(piece)
                            if piece < V_PIECES and c0 + r < seqlen and col < VALUE_COLS and col0 + col < m_dim:
                                q_words[i, 0], q_words[i, 1], q_words[i, 2], q_words[i, 3] = load_piece(
                                    v_head, c0 + r, col0 + col)
                        for i in range(PIECE_BATCH):
                            piece = base + i * NT + tid
                            r, col = v_piece(piece)
                            if piece < V_PIECES:
                                if col < VALUE_COLS:
                                    inside = c0 + r < seqlen and col0 + col < m_dim
                                    store_piece(smem, V_OFF + r * VS + col, inside, q_words[i, 0], q_words[i, 1],
                                                q_words[i, 2], q_words[i, 3], False)
                                else:  # the normaliser's block: a ones column, then zeros
                                    one = ONE if c0 + r < seqlen and col == VALUE_COLS else ZERO
                                    store_f32x4(smem, V_OFF + r * VS + col, one, ZERO, ZERO, ZERO)
            else:
                for base in range(0, QK_PER_THREAD, BATCH):
                    for i in range(BATCH):
                        if base + i < QK_PER_THREAD:
                            r, e = qk_element(tid + (base + i) * NT)
                            inside = c0 + r < seqlen and e < e_dim
                            if mode != STATES:
                                q_raw[i] = load2(q_head, c0 + r, e) if inside else RAW_ZERO
                            if mode != APPLY:
                                k_raw[i] = load2(k_head, c0 + r, e) if inside else RAW_ZERO
                    for i in range(BATCH):
                        if base + i < QK_PER_THREAD:
                            r, e = qk_element(tid + (base + i) * NT)
                            inside = c0 + r < seqlen and e < e_dim
                            if mode != STATES:
                                store1(smem, r * QS + e, to_value(q_raw[i], feature_map) if inside else ZERO)
                            if mode != APPLY:
                                store1(smem, K_OFF + r * QS + e, to_value(k_raw[i], feature_map) if inside else ZERO)
                if mode != APPLY:
                    for base in range(0, V_PER_THREAD, BATCH):
                        for i in range(BATCH):
                            if base + i < V_PER_THREAD:
                                r, c = cols_element(tid + (base + i) * NT)
                                inside = c0 + r < seqlen and c < VALUE_COLS and col0 + c < m_dim
                                v_raw[i] = load2(v_head, c0 + r, col0 + c) if inside else RAW_ZERO
                        for i in range(BATCH):
                            if base + i < V_PER_THREAD:
                                r, c = cols_element(tid + (base + i) * NT)
                                val = to_value(v_raw[i], False)
                                if c == VALUE_COLS and c0 + r < seqlen:
                                    val = ONE  # the normaliser's column (normalise only: COLS > VALUE_COLS)
                                store1(smem, V_OFF + r * VS + c, val)
            cuda.syncthreads()

            if mode != STATES:
                # ---- S = Q K^T (causal) and O = Q H, sharing the Q fragments ---------------------------------------
                r0 = 16 * warp + g  # this thread's rows r0 and r0 + 8 of the chunk
                for ob in range(O_BLOCKS):
                    for x in range(4):
                        o[ob, x] = ZERO
                for nb in range(S_BLOCKS):
                    for x in range(4):
                        s[nb, x] = ZERO
                for kk in range(E_STEPS):
                    a0, l0 = input_operand(load1(smem, r0 * QS + 8 * kk + t))
                    a1, l1 = input_operand(load1(smem, (r0 + 8) * QS + 8 * kk + t))
                    a2, l2 = input_operand(load1(smem, r0 * QS + 8 * kk + t + 4))
                    a3, l3 = input_operand(load1(smem, (r0 + 8) * QS + 8 * kk + t + 4))
                    if mode == CAUSAL:
                        for nb in range(S_BLOCKS):
                            if 8 * nb <= 16 * warp + 15:  # blocks wholly above the diagonal stay 0
                                b0, m0 = input_operand(load1(smem, K_OFF + (8 * nb + g) * QS + 8 * kk + t))
                                b1, m1 = input_operand(load1(smem, K_OFF + (8 * nb + g) * QS + 8 * kk + t + 4))
                                s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3] = qk_mma(
                                    a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, s[nb, 0], s[nb, 1], s[nb, 2],
                                    s[nb, 3])
                    for ob in range(O_BLOCKS):
                        b0, m0 = state_b(smem, (8 * kk + t) * HS + 8 * ob + g)
                        b1, m1 = state_b(smem, (8 * kk + t + 4) * HS + 8 * ob + g)
                        o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3] = qh_mma(
                            a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3])

                if mode == CAUSAL:
                    # ---- keep keys j <= i, then O += P V with S's C fragments as A (c0, c2, c1, c3) ------------------
                    for nb in range(S_BLOCKS):
                        for x in range(4):
                            key = 8 * nb + 2 * t + x % 2
                            if key > r0 + 8 * (x // 2):
                                s[nb, x] = ZERO
                            elif p_round:
                                s[nb, x] = bits_float(to_tf32(s[nb, x]))
                    for kk in range(S_BLOCKS):
                        if 8 * kk <= 16 * warp + 15:
                            a0, l0 = p_operand(s[kk, 0])
                            a1, l1 = p_operand(s[kk, 2])
                            a2, l2 = p_operand(s[kk, 1])
                            a3, l3 = p_operand(s[kk, 3])
                            for ob in range(O_BLOCKS):
                                b0, m0 = input_operand(load1(smem, V_OFF + (8 * kk + 2 * t) * VS + 8 * ob + g))
                                b1, m1 = input_operand(load1(smem, V_OFF + (8 * kk + 2 * t + 1) * VS + 8 * ob + g))
                                o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3] = pv_mma(
                                    a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, o[ob, 0], o[ob, 1], o[ob, 2],
                                    o[ob, 3])

                # ---- output rows (normalise: numerator / (denominator + eps), 0 where that is 0) -----------------
                row_a = c0 + r0
                row_b = row_a + 8
                scale_a = ONE
                scale_b = ONE
                if NORM:
                    # the ones column is column 0 of DEN_BLOCK, held by t == 0; the other lanes hold zero columns
                    den_a = o[DEN_BLOCK, 0]
                    den_b = o[DEN_BLOCK, 2]
                    den_a += shfl_xor(den_a, 1)
                    den_a += shfl_xor(den_a, 2)
                    den_b += shfl_xor(den_b, 1)
                    den_b += shfl_xor(den_b, 2)
                    den_a += eps
                    den_b += eps
                    scale_a = ONE / den_a if den_a != ZERO else ZERO
                    scale_b = ONE / den_b if den_b != ZERO else ZERO
                for ob in range(VALUE_COLS // 8):
                    col = col0 + 8 * ob + 2 * t
                    if col < m_dim:
                        if row_a < seqlen:
                            store_out(out_head, row_a, col, o[ob, 0] * scale_a, o[ob, 1] * scale_a, vector)
                        if row_b < seqlen:
                            store_out(out_head, row_b, col, o[ob, 2] * scale_b, o[ob, 3] * scale_b, vector)

            if mode != APPLY:
                if mode == CAUSAL:
                    cuda.syncthreads()  # every warp has read H for this chunk's output
                # ---- H += K_c^T V_c: A = K^T read from the [key][e] tile with the permuted k (keys 2t, 2t + 1) ----
                # The chunk's increment starts from zero and is added to H with ordinary float32 adds: the tensor
                # cores' accumulation does not round to nearest, and feeding H itself as C would let that error
                # grow with the number of chunks (measured: 8e-5 after 256 chunks vs 1e-6 this way).
                for eb in range(warp, E_BLOCKS, WARPS):
                    e0 = 16 * eb + g
                    for ob in range(O_BLOCKS):
                        for x in range(4):
                            o[ob, x] = ZERO
                    for kk in range(S_BLOCKS):
                        a0, l0 = input_operand(load1(smem, K_OFF + (8 * kk + 2 * t) * QS + e0))
                        a1, l1 = input_operand(load1(smem, K_OFF + (8 * kk + 2 * t) * QS + e0 + 8))
                        a2, l2 = input_operand(load1(smem, K_OFF + (8 * kk + 2 * t + 1) * QS + e0))
                        a3, l3 = input_operand(load1(smem, K_OFF + (8 * kk + 2 * t + 1) * QS + e0 + 8))
                        for ob in range(O_BLOCKS):
                            b0, m0 = input_operand(load1(smem, V_OFF + (8 * kk + 2 * t) * VS + 8 * ob + g))
                            b1, m1 = input_operand(load1(smem, V_OFF + (8 * kk + 2 * t + 1) * VS + 8 * ob + g))
                            o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3] = qk_mma(
                                a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3])
                    for ob in range(O_BLOCKS):
                        add_state_pair(smem, e0 * HS + 8 * ob + 2 * t, o[ob, 0], o[ob, 1])
                        add_state_pair(smem, (e0 + 8) * HS + 8 * ob + 2 * t, o[ob, 2], o[ob, 3])

        # ---- the segment's increment (STATES), or the final state (last CAUSAL segment) --------------------------
        if mode == STATES or (mode == CAUSAL and write_final and seg == cuda.gridDim.y - 1):
            cuda.syncthreads()
            for idx in range(tid, E_PAD * COLS, NT):
                e, c = cols_element(idx)
                val = load1(smem, H_OFF + e * HS + c)
                if mode == STATES:
                    state[state_row, e, c] = val
                elif e < e_dim and c < VALUE_COLS and col0 + c < m_dim:
                    final[b, h, e, col0 + c] = val

    return kernel


_U16_4D = types.Array(types.uint16, 4, "A")
_F32_4D = types.Array(types.float32, 4, "A")
_F32_3D = types.Array(types.float32, 3, "A")


def signature(dtype: str):
    data = _F32_4D if dtype == FLOAT32 else _U16_4D
    return types.void(data, data, data, data, _F32_3D, _F32_4D, types.boolean, types.boolean, types.float32,
                      types.int64, types.int64, types.int64)
