"""FlashAttention-2 forward for float32 on tensor cores: ``mma.sync.m16n8k8`` with tf32 operands, float32 accumulation.

Same interface and semantics as ``flash_mma.launch`` and ``flash_simt.launch``: float32 views of shape
``(batch, heads, seqlen, headdim)`` with any strides, grouped-query heads (q head ``h`` reads kv head
``h // (heads // kv_heads)``), bottom-right causal mask (query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``), rows
that see no key give 0 and ``lse = -inf``, lse in natural log. The float32 default of ``flash_forward`` on sm_80+.

Accuracy: 3xTF32
    A tf32 operand keeps 10 of float32's 23 mantissa bits, so one tf32 product is good to about 1e-3 -- far from the
    1e-5 this package promises for float32. Every operand ``x`` is split into ``hi = tf32(x)`` (``cvt.rna``) and
    ``lo = x - hi`` (exact in float32), and a product ``a b`` is taken as ``a_lo b_hi + a_hi b_lo + a_hi b_hi`` --
    three MMAs into one float32 accumulator, small terms first. ``lo`` goes to the MMA unrounded: the tensor cores
    read only its tf32 bits (at worst truncating), an error below 2^-21 |x|, one conversion less per operand. Errors
    against a float64 reference on an H100: 3e-7 .. 1.4e-6 (relative Frobenius norm).
    ``allow_tf32=True`` (``tf32_only``) keeps only ``a_hi b_hi``: a third of the MMAs and about 4e-4 error.
    (This is CUTLASS's ``OpMultiplyAddFastF32``, which torch's memory-efficient fp32 attention uses.)
    The tensor cores' float32 accumulation does not round to nearest, so nothing is accumulated across key tiles
    through an MMA's C operand: each tile's ``P V`` starts from zero accumulators and is added to ``O`` with float32
    FMAs (``O = alpha O + P V``). Feeding ``O`` as C instead gave an error that grew with the number of key tiles
    (H100, 2026-11-22, D = 128 non-causal: 1.5e-5 at 2k keys, 3.0e-5 at 4k, over the 1e-5 bound).

Work split
    As in ``flash_mma``: one block = ``warps`` warps x ``m_tiles`` 16-row MMA tiles = ``block_m`` query rows of one
    (batch, head) (default 4 x 2 = 128 rows, two blocks per SM). A row's softmax statistics never leave the 4 lanes
    that hold it, and every split K or V fragment feeds the MMAs of all ``m_tiles`` tiles.

Shared memory (dynamic; ``_Tiles.shared_bytes``) and pipeline
    The Q tile, then two stages of (K tile, V tile of this pass's columns), float32 words, rows >= the sequence
    length and columns >= headdim zero (padding adds exactly 0, never NaN). Row strides make every fragment load hit
    32 banks and every row start on 16 bytes: Q and K ``8 mod 16`` words (8-byte loads, two phases of 16 lanes
    reading ``g * stride + 2t``), V ``4 mod 8`` (4-byte loads at ``2t * stride + g``). Per K/V tile: wait for the
    ``cp.async`` copies + barrier, start the copy of the next tile (``staging.tile_loader``: 16-byte ``cp.async``
    pieces, or a synchronous element copy when Q, K or V rows are not 16-byte pieces), then ``S = Q K^T``, the online
    softmax, ``O = alpha O + P V``. Operands stay float32 in shared memory and are split in registers where used.

Fragments (``ptx`` module docstring: m16n8k8 tf32 layout and the k permutation)
    Both products use the permutation "A column ``t`` <-> k ``2t``, column ``t + 4`` <-> k ``2t + 1``":

    * ``S = Q K^T`` (k = head-dim column): the A registers of lane ``(g, t)`` are Q rows ``g`` and ``g + 8``, columns
      ``8 kk + 2t`` and ``8 kk + 2t + 1``; the B registers are K row ``8 nb + g`` at the same two columns -- two
      neighbouring words, read by one 8-byte shared load (``ptx.load_f32x2``).
    * ``P V`` (k = key): the C fragment ``(c0, c1, c2, c3)`` of S block ``j`` IS the A fragment of k-step ``j``
      as ``(c0, c2, c1, c3)``, so P never leaves the registers; the B registers are V rows (keys) ``8 j + 2t`` and
      ``8 j + 2t + 1`` of column ``8 ob + g``.

Softmax
    Base 2, the running max kept on the unscaled scores so that ``sm_scale * log2 e`` folds into the exponent's FFMA
    (a scale <= 0 compiles a variant that scales first); masks only on tiles that cross the causal diagonal or the
    end of the keys; a device function called once per m-tile with a constant index (register arrays indexed only by
    compile-time constants stay in registers).

Head dims
    Padded to a multiple of 8 inside the kernel; above ``max_single_pass_dim`` (128) two passes over the keys, each
    accumulating half of the output columns (S is recomputed, identical, so ``m`` and ``l`` agree). The MMA loop
    nests are unrolled completely, and NVVM stops unrolling a nest between 192 and 384 MMAs, so tiles are cut to
    ``max_pv_mmas``. ``gpu_config`` picks the tiles per head dim (measured; ptxas report there).

Specialisations (compiled once each, cached on disk): tiles, padded head dim, ``tf32_only``, load width and the sign
of the scale. Causality is a run-time flag.

Under the CUDA simulator the same code runs with the ``ptx`` emulations (``SIMULATOR_CONFIG``: one warp, one m-tile,
8-key tiles, two passes above 32 columns).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, types, uint32

from ..runtime.views import rows_in_pieces
from ..runtime.device import SIMULATOR, cuda
from ..runtime.launch import launch as device_launch
from ..core import ptx
from ..core.softmax import softmax_step
from ..core.staging import device_function as _device_function
from ..core.staging import tile_loader

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

#: dynamic shared memory one block may use on sm_80 / sm_90 (227 KB on an H100; an A100 allows 163 KB, where the
#: launch reports the device's own limit)
MAX_SHARED_BYTES = 227 * 1024


@dataclass(frozen=True)
class Tf32Config:
    """Tuning knobs of the fp32 tensor-core kernel."""

    warps: int = 4  # warps per block
    m_tiles: int = 2  # 16-row MMA tiles per warp: block_m = 16 * m_tiles * warps; each K/V fragment feeds m_tiles MMAs
    block_n: int = 16  # keys per K/V tile (multiple of 8); max_pv_mmas may cut it for large head dims
    # the MMA loop nests must be unrolled completely (S, P and O are register arrays indexed by their counters), and
    # NVVM stops unrolling a nest somewhere between 192 and 384 MMAs (ptxas -v then shows a stack frame): tiles are
    # cut to m_tiles * block_n * d * terms / 64 <= max_pv_mmas (d: the larger of the padded head dim and the pass
    # width; terms: 3, or 1 for plain tf32)
    max_pv_mmas: int = 192
    max_single_pass_dim: int = 128  # padded head dims above this take two passes over output halves
    # launch bound, as warps per SM to keep resident: min blocks per SM = min_warps // warps (at least 1), which
    # caps the registers at 64K / (32 * warps * blocks)
    min_warps: int = 8

    @property
    def block_m(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def launch_bounds(self) -> tuple[int, int]:
        """(max threads per block, min blocks per SM) for ``cuda.jit(launch_bounds=...)``."""
        return self.threads, max(1, self.min_warps // self.warps)

    def replace(self, **changes) -> "Tf32Config":
        fields = dict(self.__dict__)
        unknown = set(changes) - set(fields)
        if unknown:
            raise ValueError(f"Tf32Config: unknown knob(s) {', '.join(sorted(unknown))}; knobs: {', '.join(fields)}")
        fields.update(changes)
        return Tf32Config(**fields)


DEFAULT_CONFIG = Tf32Config()
#: head dims up to 64: twice the keys per tile (half the per-tile softmax and Q-split work per key)
WIDE_KEY_CONFIG = Tf32Config(block_n=32)
#: head dims above 128 (two passes): one m-tile and 8-key tiles keep the kernel free of spills
TWO_PASS_CONFIG = Tf32Config(m_tiles=1, block_n=8)
#: tiles for the CUDA simulator, where every thread is a Python thread and every MMA a block-wide barrier: one warp,
#: one m-tile, 8-key tiles, two passes above 32 columns
SIMULATOR_CONFIG = Tf32Config(warps=1, m_tiles=1, block_n=8, max_single_pass_dim=32)
#: mma.sync.m16n8k8 with tf32 operands and cvt.rna.tf32.f32 need sm_80 or newer
MIN_COMPUTE_CAPABILITY = (8, 0)
DTYPES = ("float32",)


def default_config(head_dim: int = 64, tf32_only: bool = False) -> Tf32Config:
    return SIMULATOR_CONFIG if SIMULATOR else gpu_config(head_dim, tf32_only)


def gpu_config(head_dim: int, tf32_only: bool = False) -> Tf32Config:
    """Tiles on a GPU, by padded head dim (both accuracy modes):

    * up to 64: 4 warps x 2 m-tiles (128 query rows), 32-key tiles;
    * up to 128: the same with 16-key tiles (32 would need more than 255 registers with two m-tiles);
    * above (two passes over output halves): 4 warps x 1 m-tile, 8-key tiles, the largest shape ptxas keeps free of
      spills there (``scripts/check_tf32.py --compile-only``).

    Measured on an H100, 2026-11-22 (``scripts/check_tf32.py --part timing``, B = 4, N = 1k..4k, causal or not,
    3xTF32): at D = 64 (H = 48) 32-key tiles ran at 40-56 TFLOP/s against 36-48 with 16; at D = 128 (H = 32) 16-key
    tiles with 2 m-tiles at 44-48, against 37-42 for 1 m-tile with 8 or 16 warps per SM. Torch SDPA float32 in the
    same runs: 28-35 (D = 64) and 37-48 (D = 128). Head dims above 128 were not timed."""
    d_pad = padded_head_dim(head_dim)
    if d_pad <= 64:
        return WIDE_KEY_CONFIG
    if d_pad <= DEFAULT_CONFIG.max_single_pass_dim:
        return DEFAULT_CONFIG
    return TWO_PASS_CONFIG


def padded_head_dim(head_dim: int, config: Tf32Config = DEFAULT_CONFIG) -> int:
    """Head dim rounded up to the MMA's 8 columns; to 16 where two passes need two halves of whole n8 blocks."""
    d_pad = -(-head_dim // 8) * 8
    if d_pad > config.max_single_pass_dim:
        d_pad = -(-head_dim // 16) * 16
    return d_pad


@dataclass(frozen=True)
class _Tiles:
    """Compile-time shape of one specialisation (derived from the config and the padded head dim)."""

    warps: int
    m_tiles: int
    block_n: int
    d_pad: int
    d_pass: int

    @property
    def passes(self) -> int:
        return self.d_pad // self.d_pass

    @property
    def block_m(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def k_stride(self) -> int:
        """Words per Q and K row: = 8 mod 16, so the 8-byte fragment loads (two phases of 16 lanes reading
        ``g * stride + 2t``) hit 32 different banks; a multiple of 4, so rows start on 16 bytes for ``cp.async``."""
        return self.d_pad if self.d_pad % 16 == 8 else self.d_pad + 8

    @property
    def v_stride(self) -> int:
        """Words per V row: = 4 mod 8, so the 4-byte fragment loads at ``2t * stride + g`` hit 32 banks."""
        return self.d_pass + 4

    @property
    def q_tile(self) -> int:  # words of the Q tile
        return self.block_m * self.k_stride

    @property
    def k_tile(self) -> int:  # words of one K tile
        return self.block_n * self.k_stride

    @property
    def stage(self) -> int:  # words of one pipeline stage: a K tile, then a V tile (this pass's columns)
        return self.k_tile + self.block_n * self.v_stride

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: the Q tile, then two stages."""
        return 4 * (self.q_tile + 2 * self.stage)


@lru_cache(maxsize=None)
def tiles_for(config: Tf32Config, head_dim_pad: int, tf32_only: bool = False) -> _Tiles:
    if head_dim_pad % 8 or not 8 <= head_dim_pad <= 256:
        raise ValueError(f"head_dim_pad must be a multiple of 8 in [8, 256], got {head_dim_pad}")
    if config.warps < 1 or config.m_tiles < 1 or config.min_warps < 1:
        raise ValueError(f"warps, m_tiles and min_warps must be >= 1, got {config.warps}, {config.m_tiles} and "
                         f"{config.min_warps}")
    if config.block_n % 8 or config.block_n < 8:
        raise ValueError(f"block_n must be a positive multiple of 8, got {config.block_n}")
    if head_dim_pad > config.max_single_pass_dim:
        if head_dim_pad % 16:
            raise ValueError(f"two passes need a head_dim_pad that is a multiple of 16, got {head_dim_pad}")
        d_pass = head_dim_pad // 2
    else:
        d_pass = head_dim_pad
    terms = 1 if tf32_only else 3
    mmas_per_key = config.m_tiles * max(head_dim_pad, d_pass) * terms / 64  # per key of the larger loop nest
    block_n = min(config.block_n, max(8, int(config.max_pv_mmas / mmas_per_key) // 8 * 8))
    tiles = _Tiles(config.warps, config.m_tiles, block_n, head_dim_pad, d_pass)
    if tiles.shared_bytes > MAX_SHARED_BYTES:
        raise ValueError(f"tiles need {tiles.shared_bytes} bytes of shared memory, more than the {MAX_SHARED_BYTES} "
                         f"a block may use (fewer warps, m-tiles or keys per tile)")
    return tiles


_F32_4D = types.Array(types.float32, 4, "A")
_F32_3D = types.Array(types.float32, 3, "A")
#: one signature for every layout (layout 'A' takes contiguous and strided views alike: one compile per shape)
SIGNATURE = types.void(_F32_4D, _F32_4D, _F32_4D, _F32_4D, _F32_3D, types.boolean, types.boolean, types.float32)


def _jit(launch_bounds):
    if SIMULATOR:
        return cuda.jit
    return cuda.jit(SIGNATURE, launch_bounds=launch_bounds, cache=True)


def _split_and_mma(tf32_only: bool):
    """``(split, mma_into)`` for one accuracy mode.

    ``split(x) -> (hi, lo)``: tf32 bit patterns with ``hi + lo = x`` to about 2^-22 (``lo`` unused, 0, when
    ``tf32_only``). ``mma_into(c, mt, n, a_hi, a_lo, i, bh0, bh1, bl0, bl1)``: ``c[mt, n] += A B`` with A the
    fragment ``a_hi[mt, i]`` / ``a_lo[mt, i]`` (register arrays), as three MMAs (lo * hi, hi * lo, hi * hi: the small
    terms first) or one (hi * hi)."""
    to_tf32 = ptx.to_tf32
    bits_float = ptx.bits_float
    float_bits = ptx.float_bits
    mma = ptx.mma_m16n8k8_tf32

    def split3(x):
        # lo = x - hi is exact in float32 and goes to the MMA unrounded: the tensor cores read only its tf32 bits
        # (at worst truncating the low 13), an error below 2^-21 |x| -- and one cvt per operand less
        hi = to_tf32(x)
        return hi, float_bits(x - bits_float(hi))

    def split1(x):
        return to_tf32(x), 0

    def mma3(c, mt, n, a_hi, a_lo, i, bh0, bh1, bl0, bl1):
        c0, c1, c2, c3 = mma(a_lo[mt, i, 0], a_lo[mt, i, 1], a_lo[mt, i, 2], a_lo[mt, i, 3], bh0, bh1,
                             c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3])
        c0, c1, c2, c3 = mma(a_hi[mt, i, 0], a_hi[mt, i, 1], a_hi[mt, i, 2], a_hi[mt, i, 3], bl0, bl1,
                             c0, c1, c2, c3)
        c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3] = mma(
            a_hi[mt, i, 0], a_hi[mt, i, 1], a_hi[mt, i, 2], a_hi[mt, i, 3], bh0, bh1, c0, c1, c2, c3)

    def mma1(c, mt, n, a_hi, a_lo, i, bh0, bh1, bl0, bl1):
        c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3] = mma(
            a_hi[mt, i, 0], a_hi[mt, i, 1], a_hi[mt, i, 2], a_hi[mt, i, 3], bh0, bh1,
            c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3])

    if tf32_only:
        return _device_function(split1), _device_function(mma1)
    return _device_function(split3), _device_function(mma3)


def _kernel_source(tiles: _Tiles, tf32_only: bool, vector_loads: bool = True, scale_first: bool = False):
    """The Python function of one specialisation (not yet jitted); also what ``compile_ptx`` checks offline.

    ``scale_first=False`` (for a positive scale) keeps the running max on the unscaled scores, so the scale folds
    into the exponent's one FFMA; a scale <= 0 does not commute with max and multiplies every score first."""
    WARPS = tiles.warps
    NT = 32 * WARPS
    M_TILES = tiles.m_tiles
    ROW_STATS = 2 * M_TILES  # rows per thread
    BLOCK_M = tiles.block_m
    BLOCK_N = tiles.block_n
    D_PASS = tiles.d_pass
    PASSES = tiles.passes
    QK_STEPS = tiles.d_pad // 8  # k-steps of S = Q K^T
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S = k-steps of P V
    O_BLOCKS = D_PASS // 8  # n8 blocks of O
    K_STRIDE = tiles.k_stride
    V_STRIDE = tiles.v_stride
    Q_TILE = tiles.q_tile  # shared memory: Q tile, then per stage a K tile and a V tile
    K_TILE = tiles.k_tile
    STAGE = tiles.stage
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    # register accumulators start at -0.0, not 0.0: LLVM turns a loop of zero stores into a memset, which keeps the
    # array in local memory (adding to -0.0 is exact)
    ACC_INIT = np.float32(-0.0)
    SCALE_FIRST = scale_first
    split, mma_into = _split_and_mma(tf32_only)
    shfl_xor = ptx.shfl_xor_f32
    load1 = ptx.load1
    load_f32x2 = ptx.load_f32x2
    store2 = ptx.store2
    commit = ptx.cp_async_commit
    wait_all = ptx.cp_async_wait_all
    load_q_tile = tile_loader(NT, K_STRIDE, tiles.d_pad, BLOCK_M, np.float32, vector_loads)
    load_k_tile = tile_loader(NT, K_STRIDE, tiles.d_pad, BLOCK_N, np.float32, vector_loads)
    load_v_tile = tile_loader(NT, V_STRIDE, D_PASS, BLOCK_N, np.float32, vector_loads)

    online_softmax = softmax_step(S_BLOCKS, O_BLOCKS, SCALE_FIRST, rescale_output=False)

    def kernel(q, k, v, out, lse, write_lse, causal, scale_log2):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # MMA groupID: fragment rows g and g + 8
        t = lane % 4  # MMA threadID_in_group
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
        warp_row = 16 * M_TILES * warp  # this warp's first row in the block; m-tile mt adds 16 mt
        row0 = m0 + warp_row + g  # rows of this thread: row0 + 16 mt and row0 + 16 mt + 8
        q_lane = (warp_row + g) * K_STRIDE + 2 * t  # this lane's Q words (row g, columns 2t, 2t + 1 of a k-step)
        k_lane = g * K_STRIDE + 2 * t  # this lane's K words within a (key block, k-step)
        v_lane = K_TILE + 2 * t * V_STRIDE + g  # this lane's V word within a (k-step, output block), past the K tile

        smem = cuda.shared.array(0, float32)  # dynamic: Q tile, 2 stages x (K tile, V tile)
        a_hi = cuda.local.array((M_TILES, 1, 4), uint32)  # Q's A fragments of one k-step, tf32 hi / lo
        a_lo = cuda.local.array((M_TILES, 1, 4), uint32)
        s = cuda.local.array((M_TILES, S_BLOCKS, 4), float32)
        p_hi = cuda.local.array((M_TILES, S_BLOCKS, 4), uint32)  # P's A fragments (tf32 bit patterns), per key tile
        p_lo = cuda.local.array((M_TILES, S_BLOCKS, 4), uint32)  # their low parts (unused, 0, when tf32_only)
        r = cuda.local.array((M_TILES, 1, 4), float32)  # one output block's P V of this tile
        acc = cuda.local.array((M_TILES, O_BLOCKS, 4), float32)
        m_run = cuda.local.array(ROW_STATS, float32)  # running row max (score units) of rows 2mt, 2mt + 1
        l_run = cuda.local.array(ROW_STATS, float32)  # this thread's part of the row sums
        alpha = cuda.local.array(ROW_STATS, float32)  # this tile's rescale factors

        n_end = seqlen_k
        if causal:
            n_end = min(seqlen_k, max(0, m0 + BLOCK_M + diag_offset))
        n_tiles = (n_end + BLOCK_N - 1) // BLOCK_N
        # scores are multiplied by ``post`` inside the exponent (1 when they were scaled first); m is in their units
        post = scale_log2
        if SCALE_FIRST:
            post = float32(1.0)

        load_q_tile(q_head, smem, 0, tid, m0, seqlen_q, 0, head_dim)
        for p in range(PASSES):
            d_off = p * D_PASS  # first output column of this pass
            for i in range(2 * M_TILES):
                m_run[i] = NEG_INF
                l_run[i] = ZERO
            for mt in range(M_TILES):
                for ob in range(O_BLOCKS):
                    for e in range(4):
                        acc[mt, ob, e] = ACC_INIT

            cuda.syncthreads()  # a previous pass is done reading stage 0
            if n_tiles > 0:
                load_k_tile(k_head, smem, Q_TILE, tid, 0, seqlen_k, 0, head_dim)
                load_v_tile(v_head, smem, Q_TILE + K_TILE, tid, 0, seqlen_k, d_off, head_dim)
            commit()  # (with the Q tile in the first pass)
            for j in range(n_tiles):
                n0 = j * BLOCK_N
                base = Q_TILE + (j % 2) * STAGE
                wait_all()
                cuda.syncthreads()  # tile j has landed for everyone; everyone is done with tile j - 1's stage
                if j + 1 < n_tiles:  # the copy of tile j + 1 runs under this tile's MMAs
                    nxt = Q_TILE + STAGE - (j % 2) * STAGE
                    load_k_tile(k_head, smem, nxt, tid, n0 + BLOCK_N, seqlen_k, 0, head_dim)
                    load_v_tile(v_head, smem, nxt + K_TILE, tid, n0 + BLOCK_N, seqlen_k, d_off, head_dim)
                    commit()

                # ---- S = Q K^T: one split K fragment feeds the MMAs of every m-tile -------------------------------
                for mt in range(M_TILES):
                    for nb in range(S_BLOCKS):
                        for e in range(4):
                            s[mt, nb, e] = ACC_INIT
                for kk in range(QK_STEPS):
                    for mt in range(M_TILES):
                        # (a0, a2): row g, columns 2t, 2t + 1; (a1, a3): row g + 8 (A column t <-> k 2t, t + 4 <-> 2t + 1)
                        x0, x2 = load_f32x2(smem, q_lane + 16 * mt * K_STRIDE + 8 * kk)
                        x1, x3 = load_f32x2(smem, q_lane + (16 * mt + 8) * K_STRIDE + 8 * kk)
                        a_hi[mt, 0, 0], a_lo[mt, 0, 0] = split(x0)
                        a_hi[mt, 0, 1], a_lo[mt, 0, 1] = split(x1)
                        a_hi[mt, 0, 2], a_lo[mt, 0, 2] = split(x2)
                        a_hi[mt, 0, 3], a_lo[mt, 0, 3] = split(x3)
                    for nb in range(S_BLOCKS):
                        y0, y1 = load_f32x2(smem, base + k_lane + 8 * nb * K_STRIDE + 8 * kk)
                        bh0, bl0 = split(y0)
                        bh1, bl1 = split(y1)
                        for mt in range(M_TILES):
                            mma_into(s, mt, nb, a_hi, a_lo, 0, bh0, bh1, bl0, bl1)

                # ---- online softmax (base 2), masks only on the diagonal / tail tiles --------------------------------
                needs_mask = n0 + BLOCK_N > seqlen_k
                if causal:
                    needs_mask = needs_mask or (n0 + BLOCK_N - 1 > m0 + diag_offset)
                online_softmax(s, alpha, m_run, l_run, 0, needs_mask, n0, row0, t, seqlen_k, causal, diag_offset,
                               scale_log2, post)
                if M_TILES > 1:  # one call per m-tile, with a constant index: loops over them may stay loops
                    online_softmax(s, alpha, m_run, l_run, 1, needs_mask, n0, row0, t, seqlen_k, causal, diag_offset,
                                   scale_log2, post)
                # S block j's C fragment (c0, c1, c2, c3) is k-step j's A fragment (c0, c2, c1, c3), split once
                for mt in range(M_TILES):
                    for kj in range(S_BLOCKS):
                        for e in range(4):
                            p_hi[mt, kj, e], p_lo[mt, kj, e] = split(s[mt, kj, 2 * (e % 2) + e // 2])

                # ---- O = alpha O + P V, one output block at a time -------------------------------------------------
                # Each tile's P V goes into fresh accumulators and is added to O with float32 FMAs (which also
                # rescale): the tensor cores' float32 accumulation does not round to nearest, and with O itself as
                # the C operand a biased error grew with the number of key tiles (H100, D = 128 non-causal: 1.5e-5
                # at 2k keys, 3.0e-5 at 4k, over the 1e-5 bound).
                for ob in range(O_BLOCKS):
                    for mt in range(M_TILES):
                        for e in range(4):
                            r[mt, 0, e] = ACC_INIT
                    for kj in range(S_BLOCKS):
                        # B fragment: V rows (keys) 8 kj + 2t and 8 kj + 2t + 1, column 8 ob + g
                        y0 = load1(smem, base + v_lane + 8 * kj * V_STRIDE + 8 * ob)
                        y1 = load1(smem, base + v_lane + (8 * kj + 1) * V_STRIDE + 8 * ob)
                        bh0, bl0 = split(y0)
                        bh1, bl1 = split(y1)
                        for mt in range(M_TILES):
                            mma_into(r, mt, 0, p_hi, p_lo, kj, bh0, bh1, bl0, bl1)
                    for mt in range(M_TILES):
                        acc[mt, ob, 0] = acc[mt, ob, 0] * alpha[2 * mt] + r[mt, 0, 0]
                        acc[mt, ob, 1] = acc[mt, ob, 1] * alpha[2 * mt] + r[mt, 0, 1]
                        acc[mt, ob, 2] = acc[mt, ob, 2] * alpha[2 * mt + 1] + r[mt, 0, 2]
                        acc[mt, ob, 3] = acc[mt, ob, 3] * alpha[2 * mt + 1] + r[mt, 0, 3]

            # ---- epilogue: full row sums, one division per row -----------------------------------------------------
            for mt in range(M_TILES):
                for half in range(2):
                    row = row0 + 16 * mt + 8 * half
                    l_row = l_run[2 * mt + half]
                    l_row += shfl_xor(l_row, 1)
                    l_row += shfl_xor(l_row, 2)
                    # rows that see no key (causal, Lq > Lk) give 0 and lse = -inf, as in the reference
                    inv = float32(1.0) / l_row if l_row > ZERO else ZERO
                    if row < seqlen_q:
                        for ob in range(O_BLOCKS):
                            col = d_off + 8 * ob + 2 * t
                            if col < head_dim:
                                store2(out_head, row, col, acc[mt, ob, 2 * half] * inv)
                            if col + 1 < head_dim:
                                store2(out_head, row, col + 1, acc[mt, ob, 2 * half + 1] * inv)
                    if write_lse and p == 0 and t == 0 and row < seqlen_q:
                        m_row = m_run[2 * mt + half]
                        lse[b, h, row] = (m_row * post + math.log2(l_row)) * LN2 if l_row > ZERO else NEG_INF

    return kernel


@lru_cache(maxsize=None)
def flash_tf32_kernel(config: Tf32Config, head_dim_pad: int, tf32_only: bool, vector_loads: bool = True,
                      scale_first: bool = False):
    """The compiled kernel of one specialisation: tiles, padded head dim, accuracy mode, load width and the sign of
    the scale are constants (causality is a run-time flag)."""
    tiles = tiles_for(config, head_dim_pad, tf32_only)
    return _jit(config.launch_bounds())(_kernel_source(tiles, tf32_only, vector_loads, scale_first))


def vector_loads_ok(*arrays) -> bool:
    """True when the rows of every array can be read in aligned 16-byte pieces (4 floats): headdim % 4 == 0, unit
    stride along headdim, every row start 16-byte aligned."""
    return all(rows_in_pieces(x, 4) for x in arrays)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream, config: Tf32Config | None = None,
           tf32_only: bool = False):
    """Launch on float32 device views of shape (batch, heads, seqlen, headdim); lse is (batch, heads, seqlen_q).

    ``tf32_only``: one tf32 product per multiply (about 1e-3 relative error) instead of the 3xTF32 split (float32
    accuracy, three MMAs per product)."""
    config = config or default_config(q.shape[3], tf32_only)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"{name}: the tf32 tensor-core kernel takes float32, got {np.dtype(x.dtype)}")
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    if not 1 <= head_dim <= 256:
        raise ValueError(f"headdim must be between 1 and 256, got {head_dim}")
    d_pad = padded_head_dim(head_dim, config)
    kernel = flash_tf32_kernel(config, d_pad, bool(tf32_only), vector_loads_ok(q, k, v), not sm_scale > 0)
    grid = (batch * heads, -(-seqlen_q // config.block_m))
    device_launch(kernel, grid, config.threads, stream, tiles_for(config, d_pad, tf32_only).shared_bytes,
                  q, k, v, out, lse, bool(write_lse), bool(causal), np.float32(sm_scale * LOG2E))
