"""FlashAttention-2 forward on tensor cores (``mma.sync.m16n8k16``, float32 accumulation) for float16 and bfloat16.

Same interface and semantics as ``flash_simt.launch``: shapes ``(batch, heads, seqlen, headdim)``, any strides,
grouped-query heads (q head ``h`` reads kv head ``h // (heads // kv_heads)``), bottom-right causal mask (query ``i``
sees keys ``j <= i + seqlen_k - seqlen_q``), rows that see no key give 0 and ``lse = -inf``, lse in natural log,
float32. The inputs travel as their 16-bit patterns (uint16 views); the dtype picks the MMA and the conversions.

Work split
    One thread block = ``warps`` warps = ``block_m = 16 * warps`` query rows of one (batch, head); warp ``w`` owns
    rows ``16 w .. 16 w + 15`` of the block, which is exactly the M = 16 of one MMA, so the softmax statistics of a
    row never leave the 4 lanes that hold it. The block walks the keys in tiles of ``block_n``.

Per K/V tile
    1. All threads copy K ``[key][d]`` and V transposed ``[d][key]`` into shared memory as 32-bit words of two
       16-bit elements (K: ``d = 2w, 2w + 1``; V^T: ``key = 2j, 2j + 1``), zero for keys >= seqlen_k and columns
       >= headdim (so padded columns and tail keys contribute exactly 0, never NaN). Row strides are padded to 4
       mod 8 words: the fragment loads of a warp (8 rows x 4 consecutive words) then hit 32 different banks.
       When K and V rows are 16-byte aligned with a contiguous last axis and headdim % 8 == 0 (``launch`` checks:
       ``vector_loads_ok``), rows are read in 16-byte pieces and V is transposed in registers (half-word
       interleaves of two key rows); otherwise element by element, for any strides and head dims. The copy is
       synchronous (load, ``syncthreads``, compute): several blocks per SM overlap one's copy with another's MMAs.
    2. ``S = Q K^T``: Q's A fragments were loaded from global memory once and stay in registers; a B fragment of K
       is two 32-bit shared loads (``ptx`` module docstring has the layouts).
    3. Online softmax on the C fragments: a thread holds rows ``g = lane // 4`` and ``g + 8`` of its warp's 16,
       columns ``2 (lane % 4) + {0, 1}`` of every n8 block; row maxima are finished with two butterfly shuffles
       (lane masks 1 and 2). Scores are in base 2 (``sm_scale * log2 e`` folded into one multiply), masks are
       applied only on tiles that cross the causal diagonal or the end of the keys.
    4. ``O += P V``: the probabilities are rounded to the input dtype IN REGISTERS and used directly as the A
       operand (C fragments of n8 blocks ``2j, 2j + 1`` = A fragment of k-step ``j``); V^T gives the B fragments.
       ``O`` is rescaled by ``exp2(m_old - m_new)`` first. One division by ``l`` at the end.

Head dims
    The head dim is padded to a multiple of 16 inside the kernel (``head_dim_pad``). Up to ``max_single_pass_dim``
    (128) the whole output row is accumulated at once: Q fragments ``head_dim_pad / 4`` and O accumulators
    ``head_dim_pad / 2`` registers per thread (32 + 64 at D = 128). Above that (up to 256) the same kernel makes
    TWO passes over the keys, each accumulating one half of the output columns (recomputing ``S`` in the second
    pass, which is exactly the first pass's, so ``m`` and ``l`` agree), with tiles of ``block_n_wide`` keys so that
    the shared tiles stay under 48 KB: 64 Q registers + 64 O registers instead of 64 + 128. That costs 1.5x the
    MMA work at D = 256 but keeps the kernel simple, spill-free and static-shared-memory only.

Specialisations (compiled once each, cached on disk): padded head dim, dtype and load width. Causality is a run-time
flag (it only changes the loop bound, the block order and the masks of diagonal tiles).

Register arrays (``cuda.local.array``) are indexed only inside loops over compile-time constants, which NVVM unrolls
fully, so they live in registers. Shared-memory fragment loads go through ``ptx.load2`` (no negative-index
wraparound), so the unrolled addresses fold into one base register plus immediate offsets. ``ptxas -v`` (sm_90,
CUDA 13): no stack frame and no spills for every dtype and head dim; 168 registers at D = 64 (3 blocks of 4 warps
per SM), 220 at D = 128 (2 blocks per SM), 253 at D = 256.

The kernel also runs under the CUDA simulator, with the ``ptx`` emulations (tiny shapes only: every thread is a
Python thread and every MMA a block-wide barrier).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, types, uint16, uint32

from .._arrays import rows_in_pieces
from .._device import SIMULATOR, cuda
from .._device import launch as device_launch
from . import ptx

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class MmaConfig:
    """Tuning knobs of the tensor-core kernel."""

    warps: int = 4  # warps per block; each owns 16 query rows, so block_m = 16 * warps
    block_n: int = 64  # keys per K/V tile for head dims <= max_single_pass_dim (multiple of 16)
    block_n_wide: int = 32  # keys per tile for larger head dims (two passes over output halves)
    max_single_pass_dim: int = 128  # padded head dims above this take two passes
    # launch bound, as warps per SM to keep resident (min blocks per SM = these // warps, at least 1; registers are
    # capped at 64K / (32 * warps * blocks)): 12 warps for padded head dims <= 64 with 16-byte loads (168
    # registers, no spills with ptxas 13 / sm_90), else 8 (a cap the kernels stay under without spilling)
    min_warps_small: int = 12
    min_warps: int = 8

    @property
    def block_m(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def launch_bounds(self, head_dim_pad: int, vector_loads: bool = True) -> tuple[int, int]:
        """(max threads per block, min blocks per SM) for ``cuda.jit(launch_bounds=...)``."""
        warps = self.min_warps_small if head_dim_pad <= 64 and vector_loads else self.min_warps
        return self.threads, max(1, warps // self.warps)


DEFAULT_CONFIG = MmaConfig()
#: tiles for the CUDA simulator, where every thread is a Python thread: one warp, 16-key tiles, two passes above 32
SIMULATOR_CONFIG = MmaConfig(warps=1, block_n=16, block_n_wide=16, max_single_pass_dim=32)
#: mma.sync.m16n8k16 with f16 / bf16 operands and cvt.rn.bf16x2 need sm_80 or newer
MIN_COMPUTE_CAPABILITY = (8, 0)


#: 8 warps (128 query rows a block) for head dims 65..128: 100 vs 74 TFLOP/s at D = 128 on an H100 (scripts/check_mma.py,
#: 2026-11-22); at D = 64 four warps were faster (94 vs 91).
WIDE_CONFIG = MmaConfig(warps=8)


def default_config(head_dim: int = 64) -> MmaConfig:
    if SIMULATOR:
        return SIMULATOR_CONFIG
    return WIDE_CONFIG if 64 < padded_head_dim(head_dim) <= DEFAULT_CONFIG.max_single_pass_dim else DEFAULT_CONFIG


#: dtype names the kernel takes (bfloat16 arrives as a uint16 bit view, float16 may too).
DTYPES = ("float16", "bfloat16")


def padded_head_dim(head_dim: int, config: MmaConfig | None = None) -> int:
    """The head dim the kernel computes with: a multiple of 16 (one MMA k-step), and of 32 when it takes two passes
    (each pass's half is then a whole number of ``ldmatrix.x4`` column pairs)."""
    config = config or DEFAULT_CONFIG
    pad = -(-head_dim // 16) * 16
    return pad if pad <= config.max_single_pass_dim else -(-head_dim // 32) * 32


@dataclass(frozen=True)
class _Tiles:
    """Compile-time shape of one specialisation (derived from the config and the padded head dim)."""

    warps: int
    block_n: int
    d_pad: int
    d_pass: int

    @property
    def passes(self) -> int:
        return self.d_pad // self.d_pass

    @property
    def row(self) -> int:
        """16-bit elements per K or V row in shared memory: ``d_pad + 8``. The row is then an odd number of 16-byte
        pieces, so the 8 rows an ``ldmatrix`` matrix reads sit in 8 different 16-byte bank groups."""
        return self.d_pad + 8

    @property
    def tile(self) -> int:  # elements of one K (or V) tile
        return self.block_n * self.row

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: two stages of (K tile, V tile)."""
        return 2 * 2 * self.tile * 2


#: the H100's (and A100's) opt-in limit of shared memory per block
MAX_SHARED_BYTES = 227 * 1024


def tiles_for(config: MmaConfig, head_dim_pad: int) -> _Tiles:
    if head_dim_pad % 16 or not 16 <= head_dim_pad <= 256:
        raise ValueError(f"head_dim_pad must be a multiple of 16 in [16, 256], got {head_dim_pad}")
    if head_dim_pad <= config.max_single_pass_dim:
        tiles = _Tiles(config.warps, config.block_n, head_dim_pad, head_dim_pad)
    elif head_dim_pad % 32:
        raise ValueError(f"head_dim_pad above {config.max_single_pass_dim} must be a multiple of 32, got {head_dim_pad}")
    else:
        tiles = _Tiles(config.warps, config.block_n_wide, head_dim_pad, head_dim_pad // 2)
    if tiles.block_n % 16:
        raise ValueError(f"block_n must be a multiple of 16, got {tiles.block_n}")
    if tiles.shared_bytes > MAX_SHARED_BYTES:
        raise ValueError(f"tiles need {tiles.shared_bytes} bytes of shared memory, more than {MAX_SHARED_BYTES}")
    return tiles


_U16_4D = types.Array(types.uint16, 4, "A")
_F32_3D = types.Array(types.float32, 3, "A")
#: one signature for every layout (layout 'A' takes contiguous and strided views alike: one compile per shape)
SIGNATURE = types.void(_U16_4D, _U16_4D, _U16_4D, _U16_4D, _F32_3D, types.boolean, types.boolean, types.float32)


def _jit(launch_bounds):
    if SIMULATOR:
        return cuda.jit
    return cuda.jit(SIGNATURE, launch_bounds=launch_bounds, cache=True)


def _device_function(fn):
    """A device function NVVM always inlines (a plain function under the simulator)."""
    if SIMULATOR:
        return fn
    return cuda.jit(device=True, forceinline=True)(fn)


def _tile_loader(tiles: _Tiles, vector_loads: bool):
    """``load_tile(head, smem, base, tid, n0, seqlen_k, head_dim)``: start the copy of keys ``n0 .. n0 + block_n``
    of one head's K or V (``[key][d]`` in global memory) to ``smem[base:]`` as ``[key][d]`` rows of ``tiles.row``
    elements, every thread of the block taking part. Keys >= seqlen_k and columns >= headdim become zeros (they add
    exactly 0 to S and O, never NaN).

    ``vector_loads``: asynchronous 16-byte copies (``cp.async``, zero-filling what lies outside), which land by the
    next ``cp_async_wait_all`` + barrier; needs headdim % 8 == 0, a contiguous last axis and 16-byte aligned rows
    (``launch`` checks). Otherwise element by element, synchronously (any strides, any headdim). Chosen here, in
    Python, so that each kernel compiles only the loader it uses."""
    NT = 32 * tiles.warps
    ROW = tiles.row
    D_PAD = tiles.d_pad
    BLOCK_N = tiles.block_n
    PIECES = D_PAD // 8  # 16-byte pieces per row
    # the pieces of a tile in steps of NT: thread tid takes piece column tid % PIECES of rows tid // PIECES + k ROWS
    # (when PIECES divides NT, so that the column and the global offset within a row stay fixed per thread)
    ROWS = NT // PIECES if NT % PIECES == 0 else 0
    STEPS = -(-BLOCK_N // ROWS) if ROWS else 0
    ROWS_GUARD = ROWS and BLOCK_N % ROWS != 0
    cp_async_16 = ptx.cp_async_16
    load2 = ptx.load2
    store1 = ptx.store1

    def load_vector(head, smem, base, tid, n0, seqlen_k, head_dim):
        key_stride = head.strides[0]
        r = tid // PIECES
        col = 8 * (tid - r * PIECES)
        inside_cols = col < head_dim
        offset = (n0 + r) * key_stride + col * head.strides[1]
        for step in range(STEPS):
            row = r + step * ROWS
            if not ROWS_GUARD or row < BLOCK_N:
                inside = inside_cols and n0 + row < seqlen_k
                # outside: read nothing, fill zeros (from the head's first element: a valid address)
                cp_async_16(smem, base + row * ROW + col, head, offset + step * ROWS * key_stride if inside else 0,
                            16 if inside else 0)

    def load_vector_any(head, smem, base, tid, n0, seqlen_k, head_dim):  # PIECES does not divide NT
        for idx in range(tid, BLOCK_N * PIECES, NT):
            r = idx // PIECES
            col = 8 * (idx - r * PIECES)
            inside = n0 + r < seqlen_k and col < head_dim
            offset = (n0 + r) * head.strides[0] + col * head.strides[1]
            cp_async_16(smem, base + r * ROW + col, head, offset if inside else 0, 16 if inside else 0)

    def load_elements(head, smem, base, tid, n0, seqlen_k, head_dim):
        for idx in range(tid, BLOCK_N * D_PAD, NT):
            r = idx // D_PAD
            col = idx - r * D_PAD
            key = n0 + r
            x = 0
            if key < seqlen_k and col < head_dim:
                x = load2(head, key, col)
            store1(smem, base + r * ROW + col, x)

    if vector_loads:
        return _device_function(load_vector if ROWS else load_vector_any)
    return _device_function(load_elements)


def _kernel_source(tiles: _Tiles, bf16: bool, vector_loads: bool, scale_first: bool = False):
    """The Python function of one specialisation (not yet jitted); also what ``compile_ptx`` checks offline.

    ``scale_first=False`` (for a positive scale) keeps the running max on the unscaled scores, so the scale folds
    into the exponent's one FFMA (``exp2(s * scale - m * scale)``); a scale <= 0 does not commute with max and
    multiplies every score first."""
    WARPS = tiles.warps
    BLOCK_M = 16 * WARPS
    BLOCK_N = tiles.block_n
    D_PASS = tiles.d_pass
    PASSES = tiles.passes
    ROW = tiles.row
    TILE = tiles.tile  # K tile at stage base, V tile right after it
    STAGE = 2 * TILE
    QK_STEPS = tiles.d_pad // 16  # k-steps of S = Q K^T
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S
    PV_STEPS = BLOCK_N // 16  # k-steps of O += P V
    O_BLOCKS = D_PASS // 8  # n8 blocks of O
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    pack_u16x2 = ptx.pack_u16x2
    low_u16 = ptx.low_u16
    high_u16 = ptx.high_u16
    exp2 = ptx.exp2_approx
    shfl_xor = ptx.shfl_xor_f32
    load2 = ptx.load2
    store2 = ptx.store2
    ldmatrix = ptx.ldmatrix_x4
    ldmatrix_trans = ptx.ldmatrix_x4_trans
    commit = ptx.cp_async_commit
    wait_all = ptx.cp_async_wait_all
    load_tile = _tile_loader(tiles, vector_loads)
    SCALE_FIRST = scale_first

    def kernel(q, k, v, out, lse, write_lse, causal, scale_log2):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # MMA groupID: fragment rows g and g + 8
        t = lane % 4  # MMA threadID_in_group: fragment columns 2t, 2t + 1
        bh = cuda.blockIdx.x
        m_block = cuda.blockIdx.y
        if causal:
            m_block = cuda.gridDim.y - 1 - m_block  # the longest (last) query blocks start first
        m0 = m_block * BLOCK_M
        heads = q.shape[1]
        b = bh // heads
        h = bh % heads
        hk = h // (heads // k.shape[1])
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        head_dim = q.shape[3]
        diag_offset = seqlen_k - seqlen_q  # query i sees keys j <= i + diag_offset
        q_head = q[b, h]
        k_head = k[b, hk]
        v_head = v[b, hk]
        out_head = out[b, h]
        row0 = m0 + 16 * warp + g
        row1 = row0 + 8
        # ldmatrix row addresses of this lane (lane 8m + r: row r of matrix m). K, for S = Q K^T: matrices (keys
        # +0, cols +0), (+0, +8), (+8, +0), (+8, +8) = b0, b1 of two n8 blocks. V (transposed), for O += P V:
        # (keys +0, cols +0), (+8, +0), (+0, +8), (+8, +8) = b0, b1 of two n8 blocks of output columns.
        k_lane = (8 * (lane // 16) + lane % 8) * ROW + 8 * ((lane // 8) % 2)
        v_lane = (8 * ((lane // 8) % 2) + lane % 8) * ROW + 8 * (lane // 16)

        smem = cuda.shared.array(0, uint16)  # dynamic: 2 stages x (K tile, V tile), rows of ROW elements
        q_frag = cuda.local.array((QK_STEPS, 4), uint32)
        s = cuda.local.array((S_BLOCKS, 4), float32)
        acc = cuda.local.array((O_BLOCKS, 4), float32)

        # ---- Q A-fragments, straight from global memory, kept in registers ------------------------------------
        for kk in range(QK_STEPS):
            for r in range(4):
                row = row0 + 8 * (r % 2)
                col = 16 * kk + 2 * t + 8 * (r // 2)
                lo = 0
                hi = 0
                if row < seqlen_q:
                    if col < head_dim:
                        lo = load2(q_head, row, col)
                    if col + 1 < head_dim:
                        hi = load2(q_head, row, col + 1)
                q_frag[kk, r] = pack_u16x2(lo, hi)

        n_end = seqlen_k
        if causal:
            n_end = min(seqlen_k, max(0, m0 + BLOCK_M + diag_offset))
        n_tiles = (n_end + BLOCK_N - 1) // BLOCK_N
        # scores are multiplied by ``post`` inside the exponent (1 when they were scaled first); m is in their units
        post = scale_log2
        if SCALE_FIRST:
            post = float32(1.0)

        for p in range(PASSES):
            d_off = p * D_PASS  # first output column of this pass
            m_0 = NEG_INF  # running row maxima (base 2) of rows row0, row1
            m_1 = NEG_INF
            l_0 = ZERO  # this thread's part of the row sums
            l_1 = ZERO
            for ob in range(O_BLOCKS):
                for e in range(4):
                    acc[ob, e] = ZERO

            cuda.syncthreads()  # a previous pass is done reading stage 0
            if n_tiles > 0:
                load_tile(k_head, smem, 0, tid, 0, seqlen_k, head_dim)
                load_tile(v_head, smem, TILE, tid, 0, seqlen_k, head_dim)
                commit()
            for j in range(n_tiles):
                n0 = j * BLOCK_N
                base = (j % 2) * STAGE
                wait_all()
                cuda.syncthreads()  # tile j has landed for everyone; everyone is done with tile j - 1's stage
                if j + 1 < n_tiles:  # the copy of tile j + 1 runs under this tile's MMAs
                    load_tile(k_head, smem, STAGE - base, tid, n0 + BLOCK_N, seqlen_k, head_dim)
                    load_tile(v_head, smem, STAGE - base + TILE, tid, n0 + BLOCK_N, seqlen_k, head_dim)
                    commit()

                # ---- S = Q K^T ------------------------------------------------------------------------------------
                for nb in range(S_BLOCKS):
                    for e in range(4):
                        s[nb, e] = ZERO
                for kk in range(QK_STEPS):
                    for nb in range(0, S_BLOCKS, 2):
                        b0, b1, b2, b3 = ldmatrix(smem, base + k_lane + 8 * nb * ROW + 16 * kk)
                        r0, r1, r2, r3 = mma(q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3], b0, b1,
                                             s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3])
                        s[nb, 0] = r0
                        s[nb, 1] = r1
                        s[nb, 2] = r2
                        s[nb, 3] = r3
                        r0, r1, r2, r3 = mma(q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3], b2, b3,
                                             s[nb + 1, 0], s[nb + 1, 1], s[nb + 1, 2], s[nb + 1, 3])
                        s[nb + 1, 0] = r0
                        s[nb + 1, 1] = r1
                        s[nb + 1, 2] = r2
                        s[nb + 1, 3] = r3

                # ---- online softmax (base 2), masks only on the diagonal / tail tiles ----------------------------
                needs_mask = n0 + BLOCK_N > seqlen_k
                if causal:
                    needs_mask = needs_mask or (n0 + BLOCK_N - 1 > m0 + diag_offset)
                mx_0 = NEG_INF
                mx_1 = NEG_INF
                for nb in range(S_BLOCKS):
                    for e in range(4):
                        x = s[nb, e]
                        if SCALE_FIRST:
                            x *= scale_log2
                        if needs_mask:
                            key = n0 + 8 * nb + 2 * t + e % 2
                            row = row0 + 8 * (e // 2)
                            if key >= seqlen_k or (causal and key > row + diag_offset):
                                x = NEG_INF
                        s[nb, e] = x
                    mx_0 = max(mx_0, max(s[nb, 0], s[nb, 1]))
                    mx_1 = max(mx_1, max(s[nb, 2], s[nb, 3]))
                # the 4 lanes of a row differ in the two low lane bits
                mx_0 = max(mx_0, shfl_xor(mx_0, 1))
                mx_0 = max(mx_0, shfl_xor(mx_0, 2))
                mx_1 = max(mx_1, shfl_xor(mx_1, 1))
                mx_1 = max(mx_1, shfl_xor(mx_1, 2))
                new_0 = max(m_0, mx_0)
                new_1 = max(m_1, mx_1)
                # a row that has seen no key yet keeps m = -inf: subtract 0 instead, so exp2 gives 0, not NaN
                use_0 = new_0 if new_0 != NEG_INF else ZERO
                use_1 = new_1 if new_1 != NEG_INF else ZERO
                alpha_0 = exp2((m_0 - use_0) * post)
                alpha_1 = exp2((m_1 - use_1) * post)
                m_0 = new_0
                m_1 = new_1
                shift_0 = use_0 * post
                shift_1 = use_1 * post
                sum_0 = ZERO
                sum_1 = ZERO
                for nb in range(S_BLOCKS):
                    s[nb, 0] = exp2(s[nb, 0] * post - shift_0)
                    s[nb, 1] = exp2(s[nb, 1] * post - shift_0)
                    s[nb, 2] = exp2(s[nb, 2] * post - shift_1)
                    s[nb, 3] = exp2(s[nb, 3] * post - shift_1)
                    sum_0 += s[nb, 0] + s[nb, 1]
                    sum_1 += s[nb, 2] + s[nb, 3]
                l_0 = l_0 * alpha_0 + sum_0
                l_1 = l_1 * alpha_1 + sum_1
                for ob in range(O_BLOCKS):
                    acc[ob, 0] *= alpha_0
                    acc[ob, 1] *= alpha_0
                    acc[ob, 2] *= alpha_1
                    acc[ob, 3] *= alpha_1

                # ---- O += P V: P's C fragments of n8 blocks 2kk, 2kk + 1 are the A fragment of k-step kk ----------
                for kk in range(PV_STEPS):
                    a0 = pack(s[2 * kk, 0], s[2 * kk, 1])
                    a1 = pack(s[2 * kk, 2], s[2 * kk, 3])
                    a2 = pack(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                    a3 = pack(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
                    for ob in range(0, O_BLOCKS, 2):
                        b0, b1, b2, b3 = ldmatrix_trans(smem, base + TILE + v_lane + 16 * kk * ROW + d_off + 8 * ob)
                        r0, r1, r2, r3 = mma(a0, a1, a2, a3, b0, b1, acc[ob, 0], acc[ob, 1], acc[ob, 2], acc[ob, 3])
                        acc[ob, 0] = r0
                        acc[ob, 1] = r1
                        acc[ob, 2] = r2
                        acc[ob, 3] = r3
                        r0, r1, r2, r3 = mma(a0, a1, a2, a3, b2, b3,
                                             acc[ob + 1, 0], acc[ob + 1, 1], acc[ob + 1, 2], acc[ob + 1, 3])
                        acc[ob + 1, 0] = r0
                        acc[ob + 1, 1] = r1
                        acc[ob + 1, 2] = r2
                        acc[ob + 1, 3] = r3

            # ---- epilogue: full row sums, one division per row, output in the input dtype -------------------------
            l_0 += shfl_xor(l_0, 1)
            l_0 += shfl_xor(l_0, 2)
            l_1 += shfl_xor(l_1, 1)
            l_1 += shfl_xor(l_1, 2)
            # rows that see no key (causal, Lq > Lk) give 0 and lse = -inf, as in the reference
            inv_0 = float32(1.0) / l_0 if l_0 > ZERO else ZERO
            inv_1 = float32(1.0) / l_1 if l_1 > ZERO else ZERO
            for ob in range(O_BLOCKS):
                col = d_off + 8 * ob + 2 * t
                w0 = pack(acc[ob, 0] * inv_0, acc[ob, 1] * inv_0)
                w1 = pack(acc[ob, 2] * inv_1, acc[ob, 3] * inv_1)
                if row0 < seqlen_q:
                    if col < head_dim:
                        store2(out_head, row0, col, low_u16(w0))
                    if col + 1 < head_dim:
                        store2(out_head, row0, col + 1, high_u16(w0))
                if row1 < seqlen_q:
                    if col < head_dim:
                        store2(out_head, row1, col, low_u16(w1))
                    if col + 1 < head_dim:
                        store2(out_head, row1, col + 1, high_u16(w1))
            if write_lse and p == 0 and t == 0:
                if row0 < seqlen_q:
                    lse[b, h, row0] = (m_0 * post + math.log2(l_0)) * LN2 if l_0 > ZERO else NEG_INF
                if row1 < seqlen_q:
                    lse[b, h, row1] = (m_1 * post + math.log2(l_1)) * LN2 if l_1 > ZERO else NEG_INF

    return kernel


@lru_cache(maxsize=None)
def flash_mma_kernel(config: MmaConfig, head_dim_pad: int, bf16: bool, vector_loads: bool, scale_first: bool = False):
    """The compiled kernel of one specialisation: tiles, padded head dim, dtype, load width and the sign of the
    scale are constants (causality is a run-time flag: it only changes the loop bound and the diagonal tiles' masks)."""
    tiles = tiles_for(config, head_dim_pad)
    return _jit(config.launch_bounds(head_dim_pad, vector_loads))(
        _kernel_source(tiles, bf16, vector_loads, scale_first))


def _bits(x, name: str):
    """The uint16 bit view of a float16 / bfloat16 (uint16 or int16 bits) device or simulator array; no copy."""
    dtype = np.dtype(x.dtype)
    if dtype.itemsize != 2 or dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected 16-bit elements (float16, or bfloat16 as uint16 / int16 bits), got {dtype}")
    return x if dtype == np.uint16 else x.view(np.uint16)


def vector_loads_ok(*arrays) -> bool:
    """True when K and V rows can be read in aligned 16-byte pieces: headdim % 8 == 0, unit stride along headdim,
    and every row start 16-byte aligned (base address and the other strides multiples of 16 bytes)."""
    return all(rows_in_pieces(x, 8) for x in arrays)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream, config: MmaConfig | None = None,
           dtype: str | None = None):
    """Launch on device views of shape (batch, heads, seqlen, headdim); lse is (batch, heads, seqlen_q) float32.

    ``dtype`` is ``"float16"`` or ``"bfloat16"``; None means float16 for float16 arrays and bfloat16 for uint16 /
    int16 bit views (the way this package carries bfloat16). ``out`` has q's shape and receives the input dtype
    (a float16 array or a 16-bit bit view).
    """
    config = config or default_config(q.shape[3])
    if dtype is None:
        dtype = "float16" if np.dtype(q.dtype) == np.float16 else "bfloat16"
    if dtype not in DTYPES:
        raise TypeError(f"dtype: the tensor-core kernel takes float16 or bfloat16, got {dtype}")
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    q, k, v, out = _bits(q, "q"), _bits(k, "k"), _bits(v, "v"), _bits(out, "out")
    head_dim_pad = padded_head_dim(head_dim, config)
    kernel = flash_mma_kernel(config, head_dim_pad, dtype == "bfloat16", vector_loads_ok(k, v), not sm_scale > 0)
    grid = (batch * heads, -(-seqlen_q // config.block_m))
    args = (q, k, v, out, lse, bool(write_lse), bool(causal), np.float32(sm_scale * LOG2E))
    device_launch(kernel, grid, config.threads, stream, tiles_for(config, head_dim_pad).shared_bytes, *args)
