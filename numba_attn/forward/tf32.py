"""FlashAttention-2 forward for float32 on tensor cores: ``mma.sync.m16n8k8`` with tf32 operands, float32 accumulation.

Same interface and semantics as ``mma.launch`` and ``simt.launch``: float32 views of shape
``(batch, heads, seqlen, headdim)`` with any strides, grouped-query heads (q head ``h`` reads kv head
``h // (heads // kv_heads)``), bottom-right causal mask (query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``), rows
that see no key give 0 and ``lse = -inf``, lse in natural log. The float32 default of ``flash_forward`` on sm_80+.

Accuracy: 3xTF32
    A tf32 operand keeps 10 of float32's 23 mantissa bits (one product good to about 1e-3, far from the package's
    1e-5 for float32). Every operand ``x`` is split into ``hi = tf32(x)`` and ``lo = x - hi`` (exact; the MMA reads
    only its top 19 bits, an error below 2^-21 |x|), and ``a b`` is taken as ``a_lo b_hi + a_hi b_lo + a_hi b_hi``,
    three MMAs into one float32 accumulator, small terms first (CUTLASS's ``OpMultiplyAddFastF32``, as in torch's
    memory-efficient fp32 attention). Errors against float64 on an H100: 3e-7 .. 1.4e-6 (relative Frobenius norm).
    How and where operands are split is ``Tf32Config.split`` (``tf32_split``): by a rounding that keeps +-inf, in
    every warp (``"warp"``, the default) or once per block for the Q tile and / or each K/V tile, or by ``cvt.rna``
    in every warp (``"cvt"``: +-inf inputs give NaN) -- bit for bit the same results on finite inputs. ``allow_tf32=True``
    (``tf32_only``) keeps only ``a_hi b_hi``: a third of the MMAs, about 4e-4 error, ``split`` ignored.
    The tensor cores' float32 accumulation does not round to nearest, so nothing is accumulated across key tiles
    through an MMA's C operand: each tile's ``P V`` starts from zero accumulators and is added to ``O`` with float32
    FMAs. Feeding ``O`` as C gave an error that grew with the number of key tiles (docs/design/forward.md).

Work split
    As in ``mma``: one block = ``warps`` warps x ``m_tiles`` 16-row MMA tiles = ``block_m`` query rows of one
    (batch, head) (default 4 x 2 = 128 rows, two blocks per SM). A row's softmax statistics never leave the 4 lanes
    that hold it, and every K or V fragment feeds the MMAs of all ``m_tiles`` tiles.

Shared memory (dynamic; ``_Tiles``) and pipeline
    The Q tile, then two stages of (K tile, V tile of this pass's columns), float32 words, rows >= the sequence
    length and columns >= headdim zero (padding adds exactly 0, never NaN). Row strides make every fragment load hit
    32 banks and every row start on 16 bytes: Q and K ``8 mod 16`` words (8-byte loads, two phases of 16 lanes
    reading ``g * stride + 2t``), V ``4 mod 8`` (4-byte loads at ``2t * stride + g``). Per K/V tile: wait for the
    ``cp.async`` copies + barrier, start the copy of the next tile (``staging.tile_loader``: 16-byte ``cp.async``
    pieces, or a synchronous element copy when Q, K or V rows are not 16-byte pieces), then ``S = Q K^T``, the online
    softmax, ``O = alpha O + P V``. Split once per block (``split`` "q", "kv", "qkv"): the Q tile lands in the K/V
    area and is split into the Q area (hi and lo: twice the words); K/V tiles land in one raw stage, are split by all
    threads into one split stage between two barriers, then the raw stage takes the next tile's copy.

Fragments (``ptx`` module docstring: m16n8k8 tf32 layout and the k permutation)
    Both products use the permutation "A column ``t`` <-> k ``2t``, column ``t + 4`` <-> k ``2t + 1``":

    * ``S = Q K^T`` (k = head-dim column): the A registers of lane ``(g, t)`` are Q rows ``g`` and ``g + 8``, columns
      ``8 kk + 2t`` and ``8 kk + 2t + 1``; the B registers are K row ``8 nb + g`` at the same two columns -- two
      neighbouring words, read by one 8-byte shared load (``ptx.load_f32x2``; split tiles: one 16-byte load of
      ``(hi, hi, lo, lo)``).
    * ``P V`` (k = key): the C fragment ``(c0, c1, c2, c3)`` of S block ``j`` IS the A fragment of k-step ``j``
      as ``(c0, c2, c1, c3)``, so P never leaves the registers; the B registers are V rows (keys) ``8 j + 2t`` and
      ``8 j + 2t + 1`` of column ``8 ob + g``.

Softmax (``core.softmax``, masks from ``core.mask``, the end from ``core.epilogue``)
    Base 2, the running max kept on the unscaled scores so that ``sm_scale * log2 e`` folds into the exponent's FFMA
    (a scale <= 0 compiles a variant that scales first); masks only on tiles that cross the causal diagonal or the
    end of the keys; a device function called once per m-tile with a constant index (register arrays indexed only by
    compile-time constants stay in registers).

Head dims
    Padded to a multiple of 8 inside the kernel; above ``max_single_pass_dim`` (128) two passes over the keys, each
    accumulating half of the output columns (S is recomputed, identical, so ``m`` and ``l`` agree). The MMA loop
    nests are unrolled completely, and NVVM stops unrolling a nest between 192 and 384 MMAs, so tiles are cut to
    ``max_pv_mmas``. ``gpu_config`` picks the tiles per head dim (measured; ptxas report there).

Specialisations (compiled once each, cached on disk): tiles, padded head dim, ``split``, ``tf32_only``, load width
and the sign of the scale. Causality is a run-time flag.

Under the CUDA simulator the same code runs with the ``ptx`` emulations (``SIMULATOR_CONFIG``: one warp, one m-tile,
8-key tiles, two passes above 32 columns).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np
from numba import float32, uint32

from ..core import ptx
from ..core.block_info import HEAD_MAJOR, block_position_of, key_tile_walk, lane_position, sequence_bounds_of
from ..core.epilogue import as_float32, store_rows
from ..core.mask import tile_is_partial
from ..core.softmax import exponent_scale_for, fragment_clear, softmax_start, softmax_update
from ..core.staging import device_function, kernel_body, tile_loader
from ..runtime.device import SIMULATOR, cuda, kernel_jit
from ..runtime.launch import launch as device_launch
from . import common
from .common import PLAIN, Variant
from .common import vector_loads_ok
from .tf32_split import (SPLITS, a_fragment_splitter, fragment_reads, key_pairs_splitter, row_pairs_splitter,
                         split_rules)


@dataclass(frozen=True)
class Tf32Config(common.WarpTiles):
    """Tuning knobs of the fp32 tensor-core kernel (validated where made)."""

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
    # where the 3xTF32 split happens and by which rule (``tf32_split``): "cvt" (every warp splits what it loads, by
    # cvt.rna: +-inf inputs give NaN), "warp" (every warp, a split that keeps +-inf), "q" / "kv" / "qkv" (those
    # tiles split once per block into shared memory, the rest as "warp"). Ignored by tf32_only. "warp" is the default:
    # as fast as "cvt" on an H100, the others slower at D128 (docs/benchmarks.md, "3xTF32 and inf").
    split: str = "warp"

    def __post_init__(self):
        common.check_fields(self, warps=(1, 32, 1), m_tiles=(1, None, 1), block_n=(8, None, 8),
                            max_pv_mmas=(1, None, 1), max_single_pass_dim=(8, common.MAX_HEAD_DIM, 8),
                            min_warps=(1, None, 1))
        if self.split not in SPLITS:
            raise ValueError(f"Tf32Config.split: expected one of {', '.join(SPLITS)}, got {self.split!r}")

    def replace(self, **changes) -> "Tf32Config":
        names = [field.name for field in fields(self)]
        unknown = set(changes) - set(names)
        if unknown:
            raise ValueError(f"Tf32Config: unknown knob(s) {', '.join(sorted(unknown))}; knobs: {', '.join(names)}")
        return Tf32Config(**{**{name: getattr(self, name) for name in names}, **changes})


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
#: one signature for every layout of the float32 operands
SIGNATURE = common.kernel_signature(float32)


def default_config(head_dim: int = 64, tf32_only: bool = False, split: str = "warp") -> Tf32Config:
    return SIMULATOR_CONFIG.replace(split=split) if SIMULATOR else gpu_config(head_dim, tf32_only, split)


def gpu_config(head_dim: int, tf32_only: bool = False, split: str = "warp") -> Tf32Config:
    """Tiles on a GPU, by padded head dim (both accuracy modes), the fastest measured (docs/design/forward.md):

    * up to 64: 4 warps x 2 m-tiles (128 query rows), 32-key tiles;
    * up to 128: the same with 16-key tiles (32 would need more than 255 registers with two m-tiles);
    * above (two passes over output halves): 4 warps x 1 m-tile, 8-key tiles, the largest shape ptxas keeps free of
      spills there (``scripts/check_tf32.py --compile-only``).

    ``split`` "q", "kv", "qkv" (timed by ``scripts/check_tf32.py --part compare-split``; slower than "warp" at D128): up to
    128 the Q tile or the K/V stages of two m-tiles would leave one block per SM (over 113 KiB), so 1 m-tile (64 query
    rows) there, as in two passes; up to 64 the tiles of "cvt" (all fit two blocks per SM)."""
    d_pad = padded_head_dim(head_dim)
    if d_pad <= 64:
        config = WIDE_KEY_CONFIG
    elif d_pad <= DEFAULT_CONFIG.max_single_pass_dim:
        config = DEFAULT_CONFIG if split in ("cvt", "warp") or tf32_only else DEFAULT_CONFIG.replace(m_tiles=1)
    else:
        config = TWO_PASS_CONFIG
    return config if config.split == split else config.replace(split=split)


def supports(dtype: str, head_dim: int, *arrays) -> bool:
    """True when this kernel takes the call on this device: float32, head dims up to 256, any strides, sm_80+."""
    return dtype in DTYPES and 1 <= head_dim <= common.MAX_HEAD_DIM and common.runs_here(MIN_COMPUTE_CAPABILITY)


def padded_head_dim(head_dim: int, config: Tf32Config = DEFAULT_CONFIG) -> int:
    """Head dim rounded up to the MMA's 8 columns; to 16 where two passes need two halves of whole n8 blocks."""
    return common.padded_head_dim(head_dim, 8, config.max_single_pass_dim)


@dataclass(frozen=True)
class _Tiles(common.PassTiles):
    """Compile-time shape of one specialisation (derived from the config and the padded head dim), and its shared
    memory layout: the Q tile, then the K/V area -- two stages of (K tile, V tile of this pass's columns), or with
    ``split`` "kv" / "qkv" one stage of split K/V tiles and one of raw K/V tiles (``tf32_split``)."""

    split: str = "cvt"

    @property
    def q_split(self) -> bool:  # the Q tile split once per block
        return self.split in ("q", "qkv")

    @property
    def kv_split(self) -> bool:  # each K/V tile split once per block
        return self.split in ("kv", "qkv")

    @property
    def k_stride(self) -> int:
        """Words per raw Q and K row that warps read: = 8 mod 16, so the 8-byte fragment loads (two phases of 16
        lanes reading ``g * stride + 2t``) hit 32 different banks; a multiple of 4, so rows start on 16 bytes for
        ``cp.async``."""
        return self.d_pad if self.d_pad % 16 == 8 else self.d_pad + 8

    @property
    def v_stride(self) -> int:
        """Words per raw V row that warps read: = 4 mod 8, so the 4-byte fragment loads at ``2t * stride + g`` hit
        32 banks."""
        return self.d_pass + 4

    @property
    def q_tile(self) -> int:  # words of the Q tile (split: hi and lo, two words per element)
        return self.block_m * (2 * self.d_pad if self.q_split else self.k_stride)

    @property
    def k_tile(self) -> int:  # words of one K tile as warps read it
        return self.block_n * (2 * self.d_pad if self.kv_split else self.k_stride)

    @property
    def stage(self) -> int:  # words of one stage that warps read: a K tile, then a V tile (this pass's columns)
        return self.k_tile + self.block_n * (2 * self.d_pass if self.kv_split else self.v_stride)

    @property
    def raw_k(self) -> int:
        """Where the raw K tile lands (words from the start; ``kv_split``: behind the split stage, rows of
        ``d_pad`` words, then the raw V tile, rows of ``d_pass``); the raw Q tile of ``q_split`` lands at
        ``q_tile`` (rows of ``d_pad``), before K/V tiles use that memory."""
        return self.q_tile + self.stage

    @property
    def kv_words(self) -> int:  # words of the K/V area
        if self.kv_split:
            return self.stage + self.block_n * (self.d_pad + self.d_pass)
        return 2 * self.stage

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: the Q tile, then the K/V area (at least the raw Q tile of ``q_split``)."""
        return 4 * (self.q_tile + max(self.kv_words, self.block_m * self.d_pad if self.q_split else 0))


@lru_cache(maxsize=None)
def tiles_for(config: Tf32Config, head_dim_pad: int, tf32_only: bool = False) -> _Tiles:
    """The tiles of ``config`` at a padded head dim (whether they fit a device's shared memory is the launch's
    question: ``common.check_shared_memory``). ``tf32_only`` ignores ``config.split`` (no split: "cvt")."""
    if head_dim_pad % 8 or not 8 <= head_dim_pad <= common.MAX_HEAD_DIM:
        raise ValueError(f"head_dim_pad must be a multiple of 8 in [8, 256], got {head_dim_pad}")
    if head_dim_pad > config.max_single_pass_dim:
        if head_dim_pad % 16:
            raise ValueError(f"two passes need a head_dim_pad that is a multiple of 16, got {head_dim_pad}")
        d_pass = head_dim_pad // 2
    else:
        d_pass = head_dim_pad
    terms = 1 if tf32_only else 3
    mmas_per_key = config.m_tiles * max(head_dim_pad, d_pass) * terms / 64  # per key of the larger loop nest
    block_n = min(config.block_n, max(8, int(config.max_pv_mmas / mmas_per_key) // 8 * 8))
    return _Tiles(config.warps, config.m_tiles, block_n, head_dim_pad, d_pass, "cvt" if tf32_only else config.split)


def _kernel_source(tiles: _Tiles, tf32_only: bool, vector_loads: bool = True, scale_first: bool = False,
                   variant: Variant = PLAIN):
    """The Python function of one specialisation (not yet jitted); also what ``compile_ptx`` checks offline.
    ``variant``: the sliding window and soft-capping (``common.Variant``).

    ``scale_first=False`` (for a positive scale) keeps the running max on the unscaled scores, so the scale folds
    into the exponent's one FFMA; a scale <= 0 does not commute with max and multiplies every score first."""
    NT = 32 * tiles.warps
    M_TILES = tiles.m_tiles
    ROW_STATS = 2 * M_TILES  # rows per thread
    BLOCK_M = tiles.block_m
    BLOCK_N = tiles.block_n
    D_PAD = tiles.d_pad
    D_PASS = tiles.d_pass
    PASSES = tiles.passes
    QK_STEPS = tiles.d_pad // 8  # k-steps of S = Q K^T
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S = k-steps of P V
    O_BLOCKS = D_PASS // 8  # n8 blocks of O
    K_STRIDE = tiles.k_stride
    V_STRIDE = tiles.v_stride
    Q_TILE = tiles.q_tile  # shared memory: Q tile, then the K/V area (``_Tiles``)
    K_TILE = tiles.k_tile
    STAGE = tiles.stage
    RAW_K = tiles.raw_k  # kv_split: the raw K tile, then the raw V tile
    RAW_V = RAW_K + BLOCK_N * D_PAD
    Q_SPLIT = tiles.q_split
    KV_SPLIT = tiles.kv_split
    SCALE_FIRST = scale_first
    split, split_p, mma_into = split_rules(tiles.split, tf32_only)
    lane_words, read_q, read_k, read_v = fragment_reads(tiles, split)
    commit = ptx.cp_async_commit
    wait_all = ptx.cp_async_wait_all
    # tiles that warps read raw are padded (k_stride, v_stride); tiles that are split first are not
    load_q_tile = tile_loader(NT, D_PAD if Q_SPLIT else K_STRIDE, D_PAD, BLOCK_M, np.float32, vector_loads)
    load_k_tile = tile_loader(NT, D_PAD if KV_SPLIT else K_STRIDE, D_PAD, BLOCK_N, np.float32, vector_loads)
    load_v_tile = tile_loader(NT, D_PASS if KV_SPLIT else V_STRIDE, D_PASS, BLOCK_N, np.float32, vector_loads)
    split_q_tile = a_fragment_splitter(NT, BLOCK_M, D_PAD, D_PAD, split)
    split_k_tile = row_pairs_splitter(NT, BLOCK_N, D_PAD, D_PAD, split)
    split_v_tile = key_pairs_splitter(NT, BLOCK_N, D_PASS, D_PASS, split)
    position = block_position_of(HEAD_MAJOR, BLOCK_M, variant.packed)
    bounds = sequence_bounds_of(variant.packed)
    exponent = exponent_scale_for(variant.softcap)  # the compile-time c log2 e with a cap
    walk_tiles = key_tile_walk(BLOCK_M, BLOCK_N, variant.window)  # tiles wholly outside a window: skipped
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    clear_s = fragment_clear(M_TILES, S_BLOCKS)
    clear_r = fragment_clear(M_TILES, 1)
    start = softmax_start(M_TILES, O_BLOCKS)
    online_softmax = softmax_update(M_TILES, S_BLOCKS, O_BLOCKS, SCALE_FIRST, rescale_output=False,
                                    window=variant.window, softcap=variant.softcap,
                                    precise_tanh=True)
    finish = store_rows(M_TILES, O_BLOCKS, as_float32)

    @kernel_body
    def body(q, k, v, out, lse, write_lse, causal, scale_log2, schedule):
        tid, warp, lane, g, t = lane_position()
        # causal: the longest (last) query blocks start first
        b, h, m0, q_head, k_head, v_head, out_head = position(q, k, v, out, causal, schedule)
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]
        warp_row = 16 * M_TILES * warp  # this warp's first row in the block; m-tile mt adds 16 mt
        row0 = m0 + warp_row + g  # rows of this thread: row0 + 16 mt and row0 + 16 mt + 8
        q_hi, q_lo, k_lane, v_lane = lane_words(warp_row, g, t)  # this lane's fragment words

        smem = cuda.shared.array(0, float32)  # dynamic: Q tile, K/V area
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

        n_first, n_tiles = walk_tiles(m0, key_start, key_end, causal, diag_offset)  # <= 0: nothing to read
        post = exponent(scale_log2, SCALE_FIRST)

        if Q_SPLIT:  # the raw Q tile lands in the K/V area and is split once; the first barrier below publishes it
            load_q_tile(q_head, smem, Q_TILE, tid, m0, seqlen_q, 0, head_dim)
            commit()
            wait_all()
            cuda.syncthreads()
            split_q_tile(smem, Q_TILE, 0, tid)
        else:
            load_q_tile(q_head, smem, 0, tid, m0, seqlen_q, 0, head_dim)
        for p in range(PASSES):
            d_off = p * D_PASS  # first output column of this pass
            start(m_run, l_run, acc)

            cuda.syncthreads()  # a previous pass (or the Q split) is done reading the K/V area
            if n_tiles > 0:
                load_k_tile(k_head, smem, RAW_K if KV_SPLIT else Q_TILE, tid, n_first, key_end, 0, head_dim)
                load_v_tile(v_head, smem, RAW_V if KV_SPLIT else Q_TILE + K_TILE, tid, n_first, key_end, d_off,
                            head_dim)
            commit()  # (with the Q tile in the first pass)
            for j in range(n_tiles):
                n0 = n_first + j * BLOCK_N
                base = Q_TILE if KV_SPLIT else Q_TILE + (j % 2) * STAGE  # the stage warps read
                wait_all()
                cuda.syncthreads()  # tile j has landed for everyone; everyone is done with tile j - 1's stage
                if KV_SPLIT:  # split tile j into the one split stage; then the raw stage takes tile j + 1
                    split_k_tile(smem, RAW_K, Q_TILE, tid)
                    split_v_tile(smem, RAW_V, Q_TILE + K_TILE, tid)
                    cuda.syncthreads()  # the split tile is ready; the raw tile is read
                    if j + 1 < n_tiles:  # the copy of tile j + 1 runs under this tile's MMAs
                        load_k_tile(k_head, smem, RAW_K, tid, n0 + BLOCK_N, key_end, 0, head_dim)
                        load_v_tile(v_head, smem, RAW_V, tid, n0 + BLOCK_N, key_end, d_off, head_dim)
                        commit()
                elif j + 1 < n_tiles:  # the copy of tile j + 1 runs under this tile's MMAs
                    nxt = Q_TILE + STAGE - (j % 2) * STAGE
                    load_k_tile(k_head, smem, nxt, tid, n0 + BLOCK_N, key_end, 0, head_dim)
                    load_v_tile(v_head, smem, nxt + K_TILE, tid, n0 + BLOCK_N, key_end, d_off, head_dim)
                    commit()

                # ---- S = Q K^T: one split K fragment feeds the MMAs of every m-tile -------------------------------
                clear_s(s)
                for kk in range(QK_STEPS):
                    for mt in range(M_TILES):
                        read_q(smem, q_hi, q_lo, mt, kk, a_hi, a_lo)
                    for nb in range(S_BLOCKS):
                        bh0, bh1, bl0, bl1 = read_k(smem, base + k_lane, nb, kk)
                        for mt in range(M_TILES):
                            mma_into(s, mt, nb, a_hi, a_lo, 0, bh0, bh1, bl0, bl1)

                # ---- online softmax (base 2), masks only on the diagonal / tail tiles --------------------------------
                online_softmax(s, alpha, m_run, l_run, partial(n0, m0, key_end, causal, diag_offset), n0, row0, t,
                               key_end, causal, diag_offset, scale_log2, post)
                # S block j's C fragment (c0, c1, c2, c3) is k-step j's A fragment (c0, c2, c1, c3), split once
                for mt in range(M_TILES):
                    for kj in range(S_BLOCKS):
                        for e in range(4):
                            p_hi[mt, kj, e], p_lo[mt, kj, e] = split_p(s[mt, kj, 2 * (e % 2) + e // 2])

                # ---- O = alpha O + P V, one output block at a time -------------------------------------------------
                # Each tile's P V goes into fresh accumulators and is added to O with float32 FMAs (which also
                # rescale): the tensor cores' float32 accumulation does not round to nearest, and with O itself as
                # the C operand a biased error grew with the number of key tiles (docs/design/forward.md).
                for ob in range(O_BLOCKS):
                    clear_r(r)
                    for kj in range(S_BLOCKS):
                        bh0, bh1, bl0, bl1 = read_v(smem, base + v_lane, kj, ob)
                        for mt in range(M_TILES):
                            mma_into(r, mt, 0, p_hi, p_lo, kj, bh0, bh1, bl0, bl1)
                    for mt in range(M_TILES):
                        acc[mt, ob, 0] = acc[mt, ob, 0] * alpha[2 * mt] + r[mt, 0, 0]
                        acc[mt, ob, 1] = acc[mt, ob, 1] * alpha[2 * mt] + r[mt, 0, 1]
                        acc[mt, ob, 2] = acc[mt, ob, 2] * alpha[2 * mt + 1] + r[mt, 0, 2]
                        acc[mt, ob, 3] = acc[mt, ob, 3] * alpha[2 * mt + 1] + r[mt, 0, 3]

            # ---- epilogue: O / l; lse once (the first pass) -------------------------------------------------------
            finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, d_off, seqlen_q, head_dim, write_lse and p == 0,
                   post)

    return common.entry_kernel(body, variant.packed)


@lru_cache(maxsize=None)
def flash_tf32_kernel(config: Tf32Config, head_dim_pad: int, tf32_only: bool, vector_loads: bool = True,
                      scale_first: bool = False, variant: Variant = PLAIN):
    """The compiled kernel of one specialisation: tiles, padded head dim, accuracy mode, load width, the sign of
    the scale and the ``variant`` (window) are constants (causality is a run-time flag)."""
    source = _kernel_source(tiles_for(config, head_dim_pad, tf32_only), tf32_only, vector_loads, scale_first, variant)
    return kernel_jit(config.launch_bounds(), common.signature(float32, variant))(source)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream, config: Tf32Config | None = None,
           tf32_only: bool = False, window=None,
           softcap: float | None = None, schedule=None):
    """Launch on float32 device views of shape (batch, heads, seqlen, headdim); lse is (batch, heads, seqlen_q).
    ``window``: None or a checked ``(left, right)`` sliding window (``runtime.arguments.check_window``);
    ``softcap``: None or a checked cap ``c > 0`` of the scores (``core.scores``); ``schedule``: None, or the int32
    schedule of packed sequences (``forward.varlen``: the views are then ``(1, heads, total, headdim)``).

    ``tf32_only``: one tf32 product per multiply (about 1e-3 relative error) instead of the 3xTF32 split (float32
    accuracy, three MMAs per product)."""
    config = config or default_config(q.shape[3], tf32_only)
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"{name}: the tf32 tensor-core kernel takes float32, got {np.dtype(x.dtype)}")
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    if not 1 <= head_dim <= common.MAX_HEAD_DIM:
        raise ValueError(f"headdim must be between 1 and 256, got {head_dim}")
    d_pad = padded_head_dim(head_dim, config)
    tiles = tiles_for(config, d_pad, tf32_only)
    common.check_shared_memory(tiles.shared_bytes)
    scale_log2, scale_first = common.scale_args(sm_scale, softcap)
    kernel = flash_tf32_kernel(config, d_pad, bool(tf32_only), vector_loads_ok(q, k, v), scale_first,
                               Variant.of(bool(causal), window, softcap, schedule is not None))
    shape = common.launch_grid(HEAD_MAJOR, batch, heads, seqlen_q, config.block_m, schedule)
    extra = () if schedule is None else (schedule,)
    device_launch(kernel, shape, config.threads, stream, tiles.shared_bytes,
                  q, k, v, out, lse, bool(write_lse), bool(causal), scale_log2, *extra)
