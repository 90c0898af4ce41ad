"""The register-state chunked causal dot product for float32 inputs: tf32 ``mma.m16n8k8`` products.

Same two launches (``register_launch``), same chunk walk, same register-resident state ``H`` as ``mma`` (read its
docstring first);
what changes is the operand type:

* Q, K and V tiles are float32 in shared memory (``cp.async``; K and V in two stages, Q in one: each warp reads only
  its own 16 rows of Q and copies the next chunk's over them once it holds their fragments). Q and K rows of a whole
  number of 32 floats are swizzled (piece ``p`` of row ``r`` at ``p ^ (r % 8)``); other rows, and V's, are padded to
  ``width + 4`` floats, an odd number of 16-byte pieces. Either way ``ldmatrix`` rows and the scalar reads of two
  rows ``2t`` apart spread over the banks.
* ``ldmatrix`` moves 16-bit pairs, i.e. one float32 per lane: ``ldmatrix_x4`` of a ``[row][E]`` tile gives the tf32
  A fragment of a 16 x 8 block of Q directly (lane ``(g, t)`` gets row ``g``, column ``t`` of each 8 x 4 matrix), and
  of K the B fragments of two n8 key blocks of ``S = Q K^T``.
* ``P V`` and ``dH = K^T V`` use the k-permutation of the ``ptx`` docstring (A column ``t`` <-> key ``2t``, ``t + 4``
  <-> ``2t + 1``): S's C fragment is P's A fragment in registers, and V (and K^T for dH) are read as single floats
  from rows ``2t`` and ``2t + 1`` (no transposing ``ldmatrix`` exists for 32-bit elements).
* ``Q H`` takes Q's A fragments of ``S`` unchanged, so the published records pair E rows ``e`` and ``e + 4``:
  lanes ``g`` and ``g + 4`` (lane mask 16) swap one column before the 16-byte store (8 bytes with one term: no
  ``lo`` halves). It runs first, into the accumulators ``P V`` adds to, so that Q's fragments are dead before
  ``P V``: fewer live registers (the walk is latency bound at two blocks per SM).
* ``terms = 3`` (the default: float32 accuracy) splits every operand ``x = hi + lo`` with ``hi = tf32(x)`` and adds
  ``lo_a hi_b + hi_a lo_b + hi_a hi_b`` (3xTF32, small terms first). ``terms = 1`` (``allow_tf32``): one product of
  the rounded operands, ~4e-4 relative error, a third of the MMAs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import types, uint32

from ..core import ptx
from ..core.staging import device_function, tile_loader
from ..runtime.device import SIMULATOR, kernel_jit
from .chunk_plan import CAUSAL, ChunkConfig
from .register_launch import (MIN_BLOCKS, SIMULATOR_CONFIG, RegisterTiles, launch_walk, launch_walks, signature,
                              tile_shape, vector_loads_ok)
from .register_launch import supports  # noqa: F401  (this kernel's: the plain product, E <= MAX_E)
from .state import accumulator_fill, future_mask, stage_loader, walk_kernel

#: float32 tiles are twice as wide in bytes: 32-column M tiles keep two blocks per SM at E = 64. Each segment costs
#: its walking blocks a sum over the increments before them (``segment_cost``, docs/design/linear.md)
GPU_CONFIG = ChunkConfig(warps=4, block_cols=32, block_cols_wide=32, segment_cost=0.1)
#: ``allow_tf32`` rounds an operand by one multiply with ``1 + ln(2) / 2 * 2^-10`` before the tensor cores truncate its
#: low 13 bits: a mantissa ``m`` (1 <= m < 2) gains ``m ln(2) / 2`` tf32 ulps, half an ulp on average over the
#: log-uniform mantissas of typical data (mean ``m = 1 / ln 2``), so the rounding is unbiased on average. numpy
#: emulation, causal product of random normal data: 4.4e-4 relative error (round to nearest: 4.1e-4, truncation
#: alone: 1.5e-3, every operand shrunk). NaN and inf stay as they are; an integer add of half an ulp carried the
#: GPU's own NaN, 0x7FFFFFFF, into the sign bit (read as zero), and making the add NaN-safe took two more
#: instructions per element: 0.45 instead of 0.38 ms at 16k rows.
ROUND_SCALE = np.float32(1.0 + math.log(2.0) / 2.0 * 2.0 ** -10)


@dataclass(frozen=True)
class Tiles(RegisterTiles):
    """Compile-time shape of one float32 specialisation (sizes in float32 elements)."""

    terms: int = 3  # tf32 products per operand pair (3: 3xTF32, 1: allow_tf32)

    def __post_init__(self):
        super().__post_init__()
        if self.terms not in (1, 3):
            raise ValueError(f"Tiles.terms: expected 1 or 3, got {self.terms}")

    @property
    def swizzle(self) -> bool:  # Q and K rows of whole 8-piece groups are swizzled (staging.tile_loader), else padded
        return self.e_pad % 32 == 0

    @property
    def row_qk(self) -> int:
        return self.e_pad if self.swizzle else self.e_pad + 4

    @property
    def row_v(self) -> int:
        return self.cols + 4

    @property
    def record_words(self) -> int:  # a record: (hi, hi, lo, lo) of two E rows, or (hi, hi) with one term
        return 4 if self.terms == 3 else 2

    @property
    def record_stride(self) -> int:
        """Records per record row, chosen so that a quarter warp's 16-byte record reads (2 mod 8) or a half warp's
        8-byte reads (4 mod 16) hit every bank once."""
        return self.cols + (2 if self.terms == 3 else 4)

    def q_size(self, mode: int) -> int:  # one stage of Q: each warp copies its own 16 rows after reading them
        return self.chunk * self.row_qk if mode == CAUSAL else 0

    def stage(self) -> int:  # K and V of one chunk; two stages
        return self.chunk * (self.row_qk + self.row_v)

    def records_offset(self, mode: int) -> int:
        return self.q_size(mode) + 2 * self.stage()

    def shared_bytes(self, mode: int) -> int:
        records = self.e_pad // 8 * 4 * self.record_stride * self.record_words if mode == CAUSAL else 0
        return 4 * (self.records_offset(mode) + records)


def kernel_source(tiles: Tiles, mode: int, vector: bool, problems: int = 1,
                  borrow: bool = False):
    """The kernel of one specialisation: ``state.walk_kernel`` around this module's chunk arithmetic."""
    NT, C, E_PAD, COLS = 32 * tiles.warps, tiles.chunk, tiles.e_pad, tiles.cols
    ROW_QK, ROW_V, RS = tiles.row_qk, tiles.row_v, tiles.record_stride  # staged row lengths, record stride
    RW, SWZ = tiles.record_words, tiles.swizzle
    HAS_Q = mode == CAUSAL
    # shared memory (floats): Q (one stage, CAUSAL), then two stages of K and V (at stage base + K_OFF, + V_OFF),
    # then the records of H (CAUSAL)
    K_OFF = tiles.q_size(mode)
    V_OFF = K_OFF + C * ROW_QK
    R_OFF = tiles.records_offset(mode)
    K8_STEPS = E_PAD // 8  # k8 steps of S = Q K^T and of Q H
    S_BLOCKS = C // 8
    O_BLOCKS = COLS // 8
    KEY_PAIRS = C // 16
    SPLIT = tiles.terms == 3
    ACC_INIT = np.float32(-0.0)  # see flash_mma: keeps accumulator arrays out of local memory
    mma = ptx.mma_m16n8k8_tf32
    float_bits = ptx.float_bits
    bits_float = ptx.bits_float
    ldmatrix = ptx.ldmatrix_x4
    load1 = ptx.load1
    load_record = ptx.load_f32x4_1d
    store_record = ptx.store_f32x4
    load_hi_record = ptx.load_f32x2
    store_hi_record = ptx.store_f32x2
    warp_sync = ptx.warp_sync
    store_pair_at = ptx.store_f32x2_at
    commit = ptx.cp_async_commit
    load_k = tile_loader(NT, ROW_QK, E_PAD, C, np.float32, vector, whole_tile_path=True, swizzle=SWZ)
    load_q = tile_loader(32, ROW_QK, E_PAD, 16, np.float32, vector, whole_tile_path=True, swizzle=SWZ)
    load_v = tile_loader(NT, ROW_V, COLS, C, np.float32, vector, whole_tile_path=True)
    load_stage = stage_loader(load_k, load_v, commit, K_OFF, V_OFF, False)

    @device_function
    def load_warp_q(q_head, smem32, warp, lane, c0, seqlen, e_dim):
        """This warp's 16 rows of Q for the chunk at ``c0``; a warp reads only its own rows of Q, so one stage
        suffices: the copy for the next chunk starts once the warp holds this chunk's fragments."""
        load_q(q_head, smem32, 16 * warp * ROW_QK, lane, c0 + 16 * warp, seqlen, 0, e_dim)
        commit()

    @device_function
    def fragment_col(lane_col, kk):
        """Float offset of the 16-byte piece a lane's ``ldmatrix`` row reads at k8 step ``kk`` (``lane_col``: its
        offset at ``kk = 0``). Swizzled: piece ``2 kk + x`` of row ``r`` lies at ``(2 kk + x) ^ (r % 8)``, i.e. at
        ``32 (kk // 4) + (4 (x ^ r % 8) ^ 8 (kk % 4))``: the lane's part is fixed and ``kk`` flips bits."""
        if SWZ:
            return (lane_col ^ (8 * (kk % 4))) + 32 * (kk // 4)
        return lane_col + 8 * kk

    @device_function
    def hi_lo(x):
        """float32 -> tf32 bit patterns: SPLIT: ``hi`` = x truncated to tf32 and ``lo = x - hi`` (exact; the tensor
        cores read its top 19 bits); else ``hi`` = x times ``ROUND_SCALE``, which the tensor cores' truncation of the
        low 13 bits turns into a rounding of x (see ``ROUND_SCALE``). Not ``cvt.rna.tf32``: ptxas expands that into
        ~5 instructions with inf / NaN checks, and it runs once per operand element."""
        bits = float_bits(x)
        if SPLIT:
            hi = bits & uint32(0xFFFFE000)
            return hi, float_bits(x - bits_float(hi))
        return float_bits(x * ROUND_SCALE), bits

    @device_function
    def word_hi_lo(word):  # the same from float32 bits
        return hi_lo(bits_float(word))

    @device_function
    def small_terms(a0, a1, a2, a3, al0, al1, al2, al3, b0, b1, bl0, bl1, c0, c1, c2, c3):
        """``C += a_lo b_hi + a_hi b_lo``, the small terms of 3xTF32. They go to accumulators of their own: with two
        warps per scheduler the MMAs are latency bound, and one chain of three MMAs per k-step would triple it."""
        c0, c1, c2, c3 = mma(al0, al1, al2, al3, b0, b1, c0, c1, c2, c3)
        return mma(a0, a1, a2, a3, bl0, bl1, c0, c1, c2, c3)

    @device_function
    def accumulate(acc, acc_small, n, a0, a1, a2, a3, al0, al1, al2, al3, b0, b1, bl0, bl1):
        """n8 block ``n``: ``acc[n] += a_hi b_hi`` and, with SPLIT, ``acc_small[n] += `` the small terms."""
        if SPLIT:
            acc_small[n, 0], acc_small[n, 1], acc_small[n, 2], acc_small[n, 3] = small_terms(
                a0, a1, a2, a3, al0, al1, al2, al3, b0, b1, bl0, bl1,
                acc_small[n, 0], acc_small[n, 1], acc_small[n, 2], acc_small[n, 3])
        acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma(a0, a1, a2, a3, b0, b1,
                                                         acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])

    @device_function
    def times_v(o, o_small, smem32, v_row, a0, a1, a2, a3, al0, al1, al2, al3):
        """``O += A V_k`` for every n8 block of O: A (hi, lo) against V rows 2t, 2t + 1 of the key step at ``v_row``
        (the lane's column g)."""
        for ob in range(O_BLOCKS):
            b0, bl0 = hi_lo(load1(smem32, v_row + 8 * ob))
            b1, bl1 = hi_lo(load1(smem32, v_row + ROW_V + 8 * ob))
            accumulate(o, o_small, ob, a0, a1, a2, a3, al0, al1, al2, al3, b0, b1, bl0, bl1)

    @device_function
    def merge_small(o, o_small):
        """With SPLIT: the small terms' accumulators added to the big ones."""
        if SPLIT:
            for ob in range(O_BLOCKS):
                for x in range(4):
                    o[ob, x] = o_small[ob, x] + o[ob, x]

    @device_function
    def publish(smem32, e8, t_row, col, x_low, x_high):
        """Record (E rows ``8 e8 + t_row`` and ``+ 4`` of column ``col``) = (hi, hi, lo, lo), or (hi, hi) with one
        term (``Q H`` reads no ``lo``)."""
        hi_low, lo_low = hi_lo(x_low)
        hi_high, lo_high = hi_lo(x_high)
        at = R_OFF + ((e8 * 4 + t_row) * RS + col) * RW
        if SPLIT:
            store_record(smem32, at, bits_float(hi_low), bits_float(hi_high), bits_float(lo_low), bits_float(lo_high))
        else:
            store_hi_record(smem32, at, bits_float(hi_low), bits_float(hi_high))

    @device_function
    def store_pair(out, out_head, at, ob, row, col, m_dim, x0, x1):
        """Output columns (col, col + 1) of a row: one 8-byte store from the row's byte offset ``at`` (``vector``),
        else two element stores."""
        if vector:
            store_pair_at(out, at + 32 * ob, x0, x1)
        else:
            out_head[row, col] = x0
            if col + 1 < m_dim:
                out_head[row, col + 1] = x1

    fill_s = accumulator_fill(S_BLOCKS, ACC_INIT)
    fill_o = accumulator_fill(O_BLOCKS, ACC_INIT)
    mask_future = future_mask(C)

    @device_function
    def lane_offsets(warp, lane, g, t):
        """ldmatrix rows (in floats): Q (A of S and of Q H): matrices (rows +0, cols +0), (+8, +0), (+0, +4),
        (+8, +4); K (B of two key blocks): (keys +0, cols +0), (+0, +4), (+8, +0), (+8, +4) (8 * (lane // 16) and
        8 * ((lane // 8) % 2) are multiples of 8 rows: a lane's row % 8 is lane % 8); V rows 2t, 2t + 1 of a key
        block, column g of an n8 block (P V and dH)."""
        x_q = lane // 16
        x_k = (lane // 8) % 2
        q_lane = (16 * warp + 8 * x_k + lane % 8) * ROW_QK + 4 * ((x_q ^ (lane % 8)) if SWZ else x_q)
        k_lane = (8 * x_q + lane % 8) * ROW_QK + 4 * ((x_k ^ (lane % 8)) if SWZ else x_k)
        return q_lane, k_lane, 2 * t * ROW_V + g

    @device_function
    def load_chunk(q_head, k_head, v_head, smem, smem32, base, tid, warp, lane, c0, seqlen, e_dim, col0, m_dim,
                   first):
        """K and V of the chunk at ``c0`` to the stage at ``base``; the first time also this warp's rows of Q (later
        copies of Q start in ``chunk_output``)."""
        load_stage(q_head, k_head, v_head, smem32, base, tid, c0, seqlen, e_dim, col0, m_dim)
        if HAS_Q and first:
            load_warp_q(q_head, smem32, warp, lane, c0, seqlen, e_dim)

    @device_function
    def chunk_output(smem, smem32, temps, lanes, base, step, n_chunks, c0, warp, lane, g, t, q_head, seqlen, e_dim):
        s, s_small, o, o_small, q_hi, q_lo = temps
        q_lane, k_lane, pair_v = lanes
        for kk in range(K8_STEPS):
            w0, w1, w2, w3 = ldmatrix(smem, 2 * fragment_col(q_lane, kk))
            q_hi[kk, 0], q_lo[kk, 0] = word_hi_lo(w0)
            q_hi[kk, 1], q_lo[kk, 1] = word_hi_lo(w1)
            q_hi[kk, 2], q_lo[kk, 2] = word_hi_lo(w2)
            q_hi[kk, 3], q_lo[kk, 3] = word_hi_lo(w3)
        if step + 1 < n_chunks:
            warp_sync()  # every lane's ldmatrix has read the rows the copy overwrites
            load_warp_q(q_head, smem32, warp, lane, c0 + C, seqlen, e_dim)
        # ---- O = Q H first, so that Q's fragments are dead before P V: records hold E rows (8 kk + t, + 4) of
        # column 8 ob + g. P V then goes into the same accumulators. -------------------------------------------------
        fill_o(o)
        fill_o(o_small)
        for kk in range(K8_STEPS):
            for ob in range(O_BLOCKS):
                at = R_OFF + ((kk * 4 + t) * RS + 8 * ob + g) * RW
                if SPLIT:
                    h0, h1, l0, l1 = load_record(smem32, at)
                else:
                    h0, h1 = load_hi_record(smem32, at)
                    l0, l1 = h0, h1  # unused
                accumulate(o, o_small, ob, q_hi[kk, 0], q_hi[kk, 1], q_hi[kk, 2], q_hi[kk, 3],
                           q_lo[kk, 0], q_lo[kk, 1], q_lo[kk, 2], q_lo[kk, 3],
                           float_bits(h0), float_bits(h1), float_bits(l0), float_bits(l1))
        # ---- S = Q K^T for key blocks up to this warp's diagonal -----------------------------------------------
        fill_s(s)
        fill_s(s_small)
        for kk in range(K8_STEPS):
            k_col = base + K_OFF + fragment_col(k_lane, kk)
            for j in range(KEY_PAIRS):
                if j <= warp:
                    w0, w1, w2, w3 = ldmatrix(smem, 2 * (k_col + 16 * j * ROW_QK))
                    b0, bl0 = word_hi_lo(w0)
                    b1, bl1 = word_hi_lo(w1)
                    b2, bl2 = word_hi_lo(w2)
                    b3, bl3 = word_hi_lo(w3)
                    accumulate(s, s_small, 2 * j, q_hi[kk, 0], q_hi[kk, 1], q_hi[kk, 2], q_hi[kk, 3],
                               q_lo[kk, 0], q_lo[kk, 1], q_lo[kk, 2], q_lo[kk, 3], b0, b1, bl0, bl1)
                    accumulate(s, s_small, 2 * j + 1, q_hi[kk, 0], q_hi[kk, 1], q_hi[kk, 2], q_hi[kk, 3],
                               q_lo[kk, 0], q_lo[kk, 1], q_lo[kk, 2], q_lo[kk, 3], b2, b3, bl2, bl3)
        if SPLIT:
            for nb in range(S_BLOCKS):
                for x in range(4):
                    s[nb, x] += s_small[nb, x]
        mask_future(s, warp, g, t)
        # ---- O += P V: n8 block nb of S is the A fragment (c0, c2, c1, c3) of key step nb -----------------------
        for nb in range(S_BLOCKS):
            if nb // 2 <= warp:
                a0, al0 = hi_lo(s[nb, 0])
                a1, al1 = hi_lo(s[nb, 2])
                a2, al2 = hi_lo(s[nb, 1])
                a3, al3 = hi_lo(s[nb, 3])
                times_v(o, o_small, smem32, base + V_OFF + 8 * nb * ROW_V + pair_v, a0, a1, a2, a3, al0, al1, al2, al3)
        merge_small(o, o_small)

    @device_function
    def state_increment(smem, smem32, temps, lanes, base, eb, warp, lane, g, t):
        """dH block ``eb``: A = K^T (rows 2t, 2t + 1 of a key step), B = V."""
        o = temps[2]
        o_small = temps[3]
        pair_v = lanes[2]
        fill_o(o)
        fill_o(o_small)
        # K^T as A of dH: K rows 2t, 2t + 1 of a key step, columns g and g + 8 of E block eb; swizzled, row 2t's
        # piece 4 eb + g // 4 lies at (4 eb + g // 4) ^ 2t (row 2t + 1: ^ 1 more)
        if SWZ:
            k0 = 2 * t * ROW_QK + ((16 * eb + 4 * (g // 4)) ^ (8 * t)) + g % 4
            k1 = k0 ^ 8
            k2 = (k0 ^ 4) + ROW_QK
            k3 = (k0 ^ 12) + ROW_QK
        else:
            k0 = 2 * t * ROW_QK + 16 * eb + g
            k1 = k0 + 8
            k2 = k0 + ROW_QK
            k3 = k0 + ROW_QK + 8
        for j in range(S_BLOCKS):
            k_row = base + K_OFF + 8 * j * ROW_QK
            a0, al0 = hi_lo(load1(smem32, k_row + k0))
            a1, al1 = hi_lo(load1(smem32, k_row + k1))
            a2, al2 = hi_lo(load1(smem32, k_row + k2))
            a3, al3 = hi_lo(load1(smem32, k_row + k3))
            times_v(o, o_small, smem32, base + V_OFF + 8 * j * ROW_V + pair_v, a0, a1, a2, a3, al0, al1, al2, al3)
        merge_small(o, o_small)

    # publish: lanes g < 4 and g + 4 swap one column, so that each holds E rows (e, e + 4) of one column (g < 4:
    # column 2t, rows g, g + 4; g >= 4: column 2t + 1, rows g - 4, g)
    hooks = (lane_offsets, load_chunk, chunk_output, state_increment, publish, store_pair)
    return walk_kernel(tiles, HAS_Q, tiles.stage(), 2, K8_STEPS, hooks, problems, borrow)


SIGNATURE = signature(types.float32)


def default_config() -> ChunkConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


@lru_cache(maxsize=None)
def chunk_kernel(tiles: Tiles, mode: int, vector: bool, problems: int = 1, borrow: bool = False):
    """The compiled kernel of one specialisation (every argument a constant; ``problems``, ``borrow``:
    ``state.walk_kernel``)."""
    source = kernel_source(tiles, mode, vector, problems, borrow)
    return kernel_jit(launch_bounds=(32 * tiles.warps, tiles.min_blocks),
                      signature=signature(types.float32, problems))(source)


def tiles_for(config: ChunkConfig, e: int, m: int, terms: int = 3) -> Tiles:
    e_pad, cols = tile_shape(config, e, m)
    return Tiles(config.warps, e_pad, cols, MIN_BLOCKS, terms)


def launch_causal(q, k, v, out, stream, *, terms: int = 3, initial_state=None, final_state=None, segments=None,
                  config: ChunkConfig | None = None, scratch=None):
    """Causal dot product on float32 views ``(batch, heads, seqlen, E | M)``, any strides; ``terms``: tf32 products
    per operand pair, 3 for float32 accuracy, 1 for ``allow_tf32`` (``register_launch.launch_walk`` has the other
    arguments)."""
    config = config or default_config()
    tiles = tiles_for(config, q.shape[3], v.shape[3], terms)
    vector = vector_loads_ok(q, k, v, out)
    launch_walk(lambda mode: chunk_kernel(tiles, mode, vector), tiles, q, k, v, out, stream,
                initial_state=initial_state, final_state=final_state, segments=segments, config=config,
                scratch=scratch)


def launch_causal_walks(walks, stream, *, terms: int = 3, final_state=None, final_walk: int = -1, borrow: bool = False,
                        segments=None, config: ChunkConfig | None = None, scratch=None, split: bool = False):
    """Several causal products of the same sizes in two launches (``register_launch.launch_walks``, ``split``: one
    walking launch each): ``walks`` a list of ``(q, k, v, out, initial_state or None)`` on float32 views; ``terms``
    as ``launch_causal``."""
    config = config or default_config()
    q, _, v, _, _ = walks[0]
    tiles = tiles_for(config, q.shape[3], v.shape[3], terms)
    vector = all(vector_loads_ok(*w[:4]) for w in walks)
    launch_walks(lambda mode, problems, lends: chunk_kernel(tiles, mode, vector, problems, lends), tiles, walks,
                 stream, final_state=final_state, final_walk=final_walk, borrow=borrow, segments=segments,
                 config=config, scratch=scratch, split=split)
