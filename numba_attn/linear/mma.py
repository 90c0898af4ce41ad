"""The register-state chunked causal dot product for float16 / bfloat16 inputs: ``mma.sync.m16n8k16`` products
(float32 inputs take the same walk on tf32 in ``mma_f32``; both launch through ``register_launch``).

The algorithm of ``shared_state`` (its docstring), with the per-chunk work rebuilt around 16-bit tiles::

    out_c = (Q_c K_c^T * tril) V_c  +  Q_c H        H += K_c^T V_c

Per chunk:

* Staging: Q, K and V tiles stay 16-bit in shared memory and arrive by ``cp.async`` (``staging.tile_loader``), two
  stages: chunk ``i + 1`` is in flight while chunk ``i`` is computed. Rows are ``width + 8`` elements (an odd number
  of 16-byte pieces), so ``ldmatrix`` reads hit 8 different bank groups.
* ``S = Q K^T``, ``O = P V`` and ``dH = K^T V`` are f16 (bf16) MMAs with float32 accumulation; their operands come
  from ``ldmatrix`` (``.trans`` for V and for K^T). Warp ``w`` owns chunk rows ``16 w .. 16 w + 15`` and computes
  only the key blocks ``<= 16 w + 15`` of S. The C fragments of S become P's A fragments in registers.
* ``P`` is rounded to the input dtype (as fla does). float16 has a small range: where a warp's ``|S|`` passes 32768
  its P is scaled by a power of two ``2^-k`` and its ``P V`` by ``2^k`` (exact; never taken on ordinary inputs), so
  large scores do not overflow to inf.
* ``Q H`` keeps float32 accuracy and range: tf32 ``m16n8k8`` products with Q (exact in tf32) and ``H`` as
  ``hi + lo`` (two MMAs). ``H`` itself lives in registers of the warp that updates it (warp ``w`` owns the E rows
  ``16 e .. 16 e + 15`` for ``e = w, w + warps, ...``), in float32, each chunk's ``dH`` added with ordinary float32
  adds; after each update it is published to shared memory as 16-byte records ``(hi[e], hi[e + 1], lo[e],
  lo[e + 1])`` of two neighbouring E rows of one column, so that one ``ld.shared.v4`` gives a lane both tf32 B
  registers of both terms (the k-permutation of the ``ptx`` docstring pairs E rows ``2t`` and ``2t + 1``).
* Output rows are stored as 32-bit pairs from a per-row byte offset (``ptx.store_u32_at``): indexing the strided 4-D
  view rebuilt the whole address at every store.

For ``E <= 128`` (``supports``) and the plain product; the normalised layer, the non-causal form and wider heads take
``shared_state``'s kernel. ``docs/design/linear.md`` has the measurements.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, types, uint32

from ..core import ptx
from ..core.staging import device_function, tile_loader
from ..runtime.device import SIMULATOR, kernel_jit
from .arguments import BFLOAT16
from .chunk_plan import CAUSAL, ChunkConfig
from .register_launch import (MIN_BLOCKS, SIMULATOR_CONFIG, RegisterTiles, launch_walk, launch_walks, signature,
                              tile_shape, vector_loads_ok)
from .register_launch import supports  # noqa: F401  (this kernel's: the plain product, E <= MAX_E)
from .state import accumulator_fill, future_mask, stage_loader, walk_kernel

#: |S| above this is scaled before P is rounded to float16 (a power of two under float16's 65504)
F16_SAFE = 32768.0
GPU_CONFIG = ChunkConfig(warps=4, block_cols=64, block_cols_wide=64)


def default_config() -> ChunkConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


@dataclass(frozen=True)
class Tiles(RegisterTiles):
    """Compile-time shape of one specialisation (sizes in 16-bit elements)."""

    @property
    def row_qk(self) -> int:  # 16-bit elements per staged Q / K row
        return self.e_pad + 8

    @property
    def row_v(self) -> int:
        return self.cols + 8

    @property
    def record_stride(self) -> int:
        """16-byte records per (E pair, t) row of the published H: ``cols + 2``, i.e. 2 mod 8, so that the 8 lanes of
        a quarter warp (4 values of t, 2 of g) read 8 different bank groups."""
        return self.cols + 2

    def stage(self, mode: int) -> int:  # 16-bit elements of one stage: (Q,) K, V
        return (2 if mode == CAUSAL else 1) * self.chunk * self.row_qk + self.chunk * self.row_v

    def records_offset(self, mode: int) -> int:  # float32 index of the records, after both stages
        return 2 * self.stage(mode) // 2

    def shared_bytes(self, mode: int) -> int:
        records = self.e_pad // 8 * 4 * self.record_stride * 4 if mode == CAUSAL else 0
        return 4 * (self.records_offset(mode) + records)


def kernel_source(tiles: Tiles, mode: int, bf16: bool, vector: bool, problems: int = 1,
                  borrow: bool = False):
    """The kernel of one specialisation: ``state.walk_kernel`` around this module's chunk arithmetic."""
    NT, C, E_PAD, COLS = 32 * tiles.warps, tiles.chunk, tiles.e_pad, tiles.cols
    ROW_QK, ROW_V, RS = tiles.row_qk, tiles.row_v, tiles.record_stride  # staged row lengths, record stride
    HAS_Q = mode == CAUSAL
    Q_OFF = 0
    K_OFF = C * ROW_QK if HAS_Q else 0
    V_OFF = K_OFF + C * ROW_QK
    R_OFF = tiles.records_offset(mode)
    QK_STEPS = E_PAD // 16  # k16 steps of S = Q K^T
    QH_STEPS = E_PAD // 8  # k8 (tf32) steps of Q H
    S_BLOCKS = C // 8
    O_BLOCKS = COLS // 8
    O_PAIRS = COLS // 16
    KEY_STEPS = C // 16
    ZERO = np.float32(0.0)
    ACC_INIT = np.float32(-0.0)  # see flash_mma: keeps accumulator arrays out of local memory
    CHECK_RANGE = not bf16  # bfloat16 has float32's range
    SAFE = np.float32(F16_SAFE)
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16
    mma_tf32 = ptx.mma_m16n8k8_tf32
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    to_float = ptx.bf16_to_float if bf16 else ptx.half_to_float
    ldmatrix = ptx.ldmatrix_x4
    ldmatrix_trans = ptx.ldmatrix_x4_trans
    load_word = ptx.load_u16x2
    load_record = ptx.load_f32x4_1d
    store_record = ptx.store_f32x4
    to_tf32 = ptx.to_tf32
    float_bits = ptx.float_bits
    bits_float = ptx.bits_float
    shfl_xor = ptx.shfl_xor_f32
    all_lanes = ptx.all_lanes
    low_u16 = ptx.low_u16
    high_u16 = ptx.high_u16
    store2 = ptx.store2
    store_at = ptx.store_u32_at
    commit = ptx.cp_async_commit
    load_qk = tile_loader(NT, ROW_QK, E_PAD, C, np.uint16, vector, whole_tile_path=True)
    load_v = tile_loader(NT, ROW_V, COLS, C, np.uint16, vector, whole_tile_path=True)
    load_stage = stage_loader(load_qk, load_v, commit, K_OFF, V_OFF, HAS_Q)  # Q_OFF is 0
    fill_s = accumulator_fill(S_BLOCKS, ACC_INIT)
    fill_o = accumulator_fill(O_BLOCKS, ACC_INIT)
    mask_future = future_mask(C)

    @device_function
    def mma_pair(acc, n, a0, a1, a2, a3, b0, b1, b2, b3):
        """``acc[n] += A (b0, b1)`` and ``acc[n + 1] += A (b2, b3)``: one A fragment against the two n8 blocks that
        one ``ldmatrix_x4`` delivers."""
        acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma(a0, a1, a2, a3, b0, b1,
                                                         acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
        acc[n + 1, 0], acc[n + 1, 1], acc[n + 1, 2], acc[n + 1, 3] = mma(
            a0, a1, a2, a3, b2, b3, acc[n + 1, 0], acc[n + 1, 1], acc[n + 1, 2], acc[n + 1, 3])

    @device_function
    def store_pair(out, out_head, at, ob, row, col, m_dim, x0, x1):
        """Output columns (col, col + 1) of a row: one 32-bit store from the row's byte offset ``at`` (``vector``),
        else two 16-bit stores."""
        word = pack(x0, x1)
        if vector:
            store_at(out, at + 16 * ob, word)
        else:
            store2(out_head, row, col, low_u16(word))
            if col + 1 < m_dim:
                store2(out_head, row, col + 1, high_u16(word))

    @device_function
    def high_word(word):  # the float value of a word's upper 16-bit element
        return to_float(word >> 16)

    @device_function
    def publish(smem32, e_pair, t_row, col, x_even, x_odd):
        """Record (E rows 2i, 2i + 1 of column ``col``) = (hi, hi, lo, lo); ``lo = x - hi`` stays unrounded: the
        tensor cores read its tf32 bits (error below 2^-21 |x|)."""
        hi_even = to_tf32(x_even)
        hi_odd = to_tf32(x_odd)
        store_record(smem32, R_OFF + ((e_pair * 4 + t_row) * RS + col) * 4, bits_float(hi_even), bits_float(hi_odd),
                     x_even - bits_float(hi_even), x_odd - bits_float(hi_odd))

    @device_function
    def lane_offsets(warp, lane, g, t):
        """ldmatrix row addresses of this lane (lane 8i + r gives row r of matrix i; see ptx / flash_mma): K for S
        and K^T for dH: (keys +0, cols +0), (+0, +8), (+8, +0), (+8, +8); Q (A) and V (.trans, B of P V / dH):
        (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8)."""
        k_lane = (8 * (lane // 16) + lane % 8) * ROW_QK + 8 * ((lane // 8) % 2)
        q_lane = (16 * warp + 8 * ((lane // 8) % 2) + lane % 8) * ROW_QK + 8 * (lane // 16)
        v_lane = (8 * ((lane // 8) % 2) + lane % 8) * ROW_V + 8 * (lane // 16)
        return k_lane, q_lane, v_lane

    @device_function
    def load_chunk(q_head, k_head, v_head, smem, smem32, base, tid, warp, lane, c0, seqlen, e_dim, col0, m_dim,
                   first):
        load_stage(q_head, k_head, v_head, smem, base, tid, c0, seqlen, e_dim, col0, m_dim)

    @device_function
    def chunk_output(smem, smem32, temps, lanes, base, step, n_chunks, c0, warp, lane, g, t, q_head, seqlen, e_dim):
        s, _, o, _, q_frag, _ = temps
        k_lane, q_lane, v_lane = lanes
        # ---- S = Q K^T for key blocks up to this warp's diagonal -----------------------------------------------
        for kk in range(QK_STEPS):
            q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3] = ldmatrix(smem, base + Q_OFF + q_lane + 16 * kk)
        fill_s(s)
        # k-steps outside, key blocks inside: consecutive MMAs feed different accumulators
        for kk in range(QK_STEPS):
            for j in range(KEY_STEPS):
                if j <= warp:
                    b0, b1, b2, b3 = ldmatrix(smem, base + K_OFF + k_lane + 16 * j * ROW_QK + 16 * kk)
                    mma_pair(s, 2 * j, q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3], b0, b1, b2, b3)
        mask_future(s, warp, g, t)  # (blocks past the diagonal pair hold zeros already)
        # ---- float16 range: scale P by 2^-k where |S| is too large for it --------------------------------------
        up = float32(1.0)
        if CHECK_RANGE:
            # a tree of maxima (a chain of 32 would wait on each), blocks past the diagonal hold zeros
            big_even = ZERO
            big_odd = ZERO
            for nb in range(S_BLOCKS):
                block = max(max(abs(s[nb, 0]), abs(s[nb, 1])), max(abs(s[nb, 2]), abs(s[nb, 3])))
                if nb % 2:
                    big_odd = max(big_odd, block)
                else:
                    big_even = max(big_even, block)
            big = max(big_even, big_odd)
            if not all_lanes(big <= SAFE):  # NaN also lands here, and stays NaN
                for mask in (1, 2, 4, 8, 16):
                    big = max(big, shfl_xor(big, mask))
                shift = int((float_bits(big) >> 23) & 0xFF) - 127 - 14  # big * 2^-shift < 2^15
                if shift > 0:
                    shift = min(shift, 126)
                    down = bits_float(uint32((127 - shift) << 23))
                    up = bits_float(uint32((127 + shift) << 23))
                    for nb in range(S_BLOCKS):
                        for x in range(4):
                            s[nb, x] = s[nb, x] * down
        # ---- O = P V (P from S's C fragments), then O += Q H (tf32, H as hi + lo) -------------------------------
        fill_o(o)
        for j in range(KEY_STEPS):
            if j <= warp:
                a0 = pack(s[2 * j, 0], s[2 * j, 1])
                a1 = pack(s[2 * j, 2], s[2 * j, 3])
                a2 = pack(s[2 * j + 1, 0], s[2 * j + 1, 1])
                a3 = pack(s[2 * j + 1, 2], s[2 * j + 1, 3])
                for p in range(O_PAIRS):
                    b0, b1, b2, b3 = ldmatrix_trans(smem, base + V_OFF + v_lane + 16 * j * ROW_V + 16 * p)
                    mma_pair(o, 2 * p, a0, a1, a2, a3, b0, b1, b2, b3)
        if up != float32(1.0):
            for ob in range(O_BLOCKS):
                for x in range(4):
                    o[ob, x] = o[ob, x] * up
        q_row = base + Q_OFF + (16 * warp + g) * ROW_QK + 2 * t
        for kk in range(QH_STEPS):
            # A column t <-> E row 8 kk + 2t, t + 4 <-> 8 kk + 2t + 1: one word holds both
            word_a = load_word(smem, q_row + 8 * kk)
            word_b = load_word(smem, q_row + 8 * ROW_QK + 8 * kk)
            a0 = float_bits(to_float(word_a))
            a2 = float_bits(high_word(word_a))
            a1 = float_bits(to_float(word_b))
            a3 = float_bits(high_word(word_b))
            for ob in range(O_BLOCKS):
                h0, h1, l0, l1 = load_record(smem32, R_OFF + ((kk * 4 + t) * RS + 8 * ob + g) * 4)
                o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3] = mma_tf32(
                    a0, a1, a2, a3, float_bits(l0), float_bits(l1), o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3])
                o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3] = mma_tf32(
                    a0, a1, a2, a3, float_bits(h0), float_bits(h1), o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3])

    @device_function
    def state_increment(smem, smem32, temps, lanes, base, eb, warp, lane, g, t):
        o = temps[2]
        k_lane, _, v_lane = lanes
        fill_o(o)
        for j in range(KEY_STEPS):
            a0, a1, a2, a3 = ldmatrix_trans(smem, base + K_OFF + k_lane + 16 * j * ROW_QK + 16 * eb)
            for p in range(O_PAIRS):
                b0, b1, b2, b3 = ldmatrix_trans(smem, base + V_OFF + v_lane + 16 * j * ROW_V + 16 * p)
                mma_pair(o, 2 * p, a0, a1, a2, a3, b0, b1, b2, b3)

    # publish: lanes g, g ^ 1 swap one column, so that each holds E rows (2i, 2i + 1) of one column and writes
    # (hi, hi, lo, lo) in one 16-byte store
    hooks = (lane_offsets, load_chunk, chunk_output, state_increment, publish, store_pair)
    return walk_kernel(tiles, HAS_Q, tiles.stage(mode), 0, QK_STEPS, hooks, problems, borrow)


SIGNATURE = signature(types.uint16)


@lru_cache(maxsize=None)
def chunk_kernel(tiles: Tiles, mode: int, bf16: bool, vector: bool, problems: int = 1, borrow: bool = False):
    """The compiled kernel of one specialisation (every argument a constant; ``problems``, ``borrow``:
    ``state.walk_kernel``)."""
    source = kernel_source(tiles, mode, bf16, vector, problems, borrow)
    return kernel_jit(launch_bounds=(32 * tiles.warps, tiles.min_blocks),
                      signature=signature(types.uint16, problems))(source)


def tiles_for(config: ChunkConfig, e: int, m: int) -> Tiles:
    e_pad, cols = tile_shape(config, e, m)
    return Tiles(config.warps, e_pad, cols, MIN_BLOCKS)


def launch_causal(q, k, v, out, stream, *, dtype: str, initial_state=None, final_state=None, segments=None,
                  config: ChunkConfig | None = None, scratch=None):
    """Causal dot product on uint16 bit views ``(batch, heads, seqlen, E | M)`` of float16 / bfloat16 data
    (``dtype``), any strides (``register_launch.launch_walk`` has the other arguments)."""
    config = config or default_config()
    tiles = tiles_for(config, q.shape[3], v.shape[3])
    vector = vector_loads_ok(q, k, v, out)
    bf16 = dtype == BFLOAT16
    launch_walk(lambda mode: chunk_kernel(tiles, mode, bf16, vector), tiles, q, k, v, out, stream,
                initial_state=initial_state, final_state=final_state, segments=segments, config=config,
                scratch=scratch)


def launch_causal_walks(walks, stream, *, dtype: str, final_state=None, final_walk: int = -1, borrow: bool = False,
                        segments=None, config: ChunkConfig | None = None, scratch=None):
    """Several causal products of the same sizes in two launches (``register_launch.launch_walks``): ``walks`` a list
    of ``(q, k, v, out, initial_state or None)`` on uint16 bit views of ``dtype`` data."""
    config = config or default_config()
    q, _, v, _, _ = walks[0]
    tiles = tiles_for(config, q.shape[3], v.shape[3])
    vector = all(vector_loads_ok(*w[:4]) for w in walks)
    bf16 = dtype == BFLOAT16
    launch_walks(lambda mode, problems, lends: chunk_kernel(tiles, mode, bf16, vector, problems, lends), tiles, walks,
                 stream, final_state=final_state, final_walk=final_walk, borrow=borrow, segments=segments,
                 config=config, scratch=scratch)
