"""FlashAttention-2 forward on tensor cores (``mma.sync.m16n8k16``, float32 accumulation) for float16 and bfloat16.

Same interface and semantics as ``simt.launch``: shapes ``(batch, heads, seqlen, headdim)``, any strides,
grouped-query heads (q head ``h`` reads kv head ``h // (heads // kv_heads)``), bottom-right causal mask (query ``i``
sees keys ``j <= i + seqlen_k - seqlen_q``), rows that see no key give 0 and ``lse = -inf``, lse in natural log,
float32. The inputs travel as their 16-bit patterns (uint16 views); the dtype picks the MMA and the conversions.

Work split
    One thread block = ``warps`` warps x ``m_tiles`` 16-row MMA tiles = ``block_m`` query rows of one (batch, head)
    (default 4 x 2 = 128 rows, two blocks per SM). Warp ``w`` owns rows ``16 m_tiles w ..``; a row's softmax
    statistics never leave the 4 lanes that hold it, and every K or V fragment read from shared memory feeds the MMAs
    of all ``m_tiles`` tiles. The block walks the keys in tiles of ``block_n``.

Shared memory (dynamic; ``_Tiles.shared_bytes``)
    The Q tile, then ``stages`` (2 by default) stages of (K tile, V tile), all stored ``[row][d]`` with rows of ``d_pad + 8`` 16-bit
    elements: an odd number of 16-byte pieces, so the 8 row addresses of one ``ldmatrix`` matrix fall in 8 different
    bank groups. Rows >= the sequence length and columns >= headdim are zeros (they add exactly 0, never NaN).

Pipeline per K/V tile
    1. ``cp_async_wait_group(stages - 2)`` + barrier: tile ``j`` has landed for everyone, and everyone is done with
       the stage that tile ``j + stages - 1`` goes to. Then the 16-byte ``cp.async`` copies of that tile start (one
       commit group), and run under the MMAs of tile ``j`` (and of the tiles before it lands). When rows cannot be
       read in aligned 16-byte pieces (``vector_loads_ok``: headdim % 8, a strided last axis, unaligned rows) the
       copy is element by element and synchronous, into the same layout.
    2. ``S = Q K^T``: A fragments of Q and B fragments of K by ``ldmatrix.x4`` (``ptx`` module docstring).
    3. Online softmax on the C fragments (``core.softmax``, once per m-tile): row maxima finished with two butterfly
       shuffles (lane masks 1 and 2); base 2, with the maximum kept on the UNSCALED scores so that
       ``sm_scale * log2 e`` folds into the exponent's FFMA (a scale <= 0 compiles a variant that scales first);
       masks (``core.mask``) only on tiles that cross the causal diagonal or the end of the keys; ``O`` is rescaled
       by ``exp2(m_old - m_new)`` unless no row maximum of the warp moved (a warp vote).
    4. ``O += P V``: the probabilities are rounded to the input dtype IN REGISTERS and used directly as the A
       operand (C fragments of n8 blocks ``2j, 2j + 1`` = A fragment of k-step ``j``); ``ldmatrix.x4.trans`` reads
       V's B fragments from the ``[key][d]`` tile, so V needs no transposed copy. One division by ``l`` at the end
       (``core.epilogue``).

Head dims
    Padded to a multiple of 16 inside the kernel (``padded_head_dim``). Up to ``max_single_pass_dim`` (128) the whole
    output row is accumulated at once. Above, two passes over the keys each accumulate half of the output columns
    (recomputing ``S``, which is the first pass's exactly, so ``m`` and ``l`` agree), with ``block_n_wide``-key
    tiles; the head dim is then padded to 32 so each half is whole ``ldmatrix.x4`` column pairs.

Specialisations (compiled once each, cached on disk): tiles, padded head dim, dtype, load width and the sign of the
scale. Causality is a run-time flag (it only changes the loop bound, the block order and the diagonal tiles' masks).

Register arrays (``cuda.local.array``) are indexed only inside loops over compile-time constants that NVVM unrolls
fully, so they live in registers; the softmax is a device function called once per m-tile with a constant index
because, as a loop over m-tiles, its body was too large to unroll and the accumulators went to local memory.
``scripts/check_mma.py --part correctness --compile-only`` reports registers and spills (docs/design/forward.md).

The kernel also runs under the CUDA simulator, with the ``ptx`` emulations (tiny shapes only: every thread is a
Python thread and every MMA a block-wide barrier).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, uint16, uint32

from ..core import ptx
from ..core.block_info import QUERY_MAJOR, block_position_of, key_tile_walk, lane_position, sequence_bounds_of
from ..core.epilogue import as_16bit, store_rows
from ..core.mask import tile_is_partial
from ..core.softmax import exponent_scale_for, fragment_clear, softmax_start, softmax_update
from ..core.staging import device_function, kernel_body, tile_loader
from ..runtime.device import SIMULATOR, cuda, kernel_jit
from ..runtime.launch import launch as device_launch
from . import common
from .common import PLAIN, Variant
# re-exported: decode.mma and older callers import these from here
from .common import bits as _bits  # noqa: F401
from .common import check_grid, vector_loads_ok  # noqa: F401


@dataclass(frozen=True)
class MmaConfig(common.WarpTiles):
    """Tuning knobs of the tensor-core kernel (validated where made)."""

    warps: int = 4  # warps per block
    m_tiles: int = 2  # 16-row MMA tiles per warp: block_m = 16 * m_tiles * warps; each K/V fragment feeds m_tiles MMAs
    block_n: int = 64  # keys per K/V tile for head dims <= max_single_pass_dim (multiple of 16)
    block_n_wide: int = 32  # keys per tile for larger head dims (two passes over output halves)
    max_single_pass_dim: int = 128  # padded head dims above this take two passes
    # launch bound, as warps per SM to keep resident: min blocks per SM = min_warps // warps (at least 1), which caps
    # the registers at 64K / (32 * warps * blocks): 8 warps = 2 blocks of 4 warps, 255 registers
    min_warps: int = 8
    # cp.async stages of (K tile, V tile): the copies of the next ``stages - 1`` tiles run under each tile's MMAs
    stages: int = 2

    def __post_init__(self):
        common.check_fields(self, warps=(1, 32, 1), m_tiles=(1, None, 1), block_n=(16, None, 16),
                            block_n_wide=(16, None, 16), max_single_pass_dim=(16, common.MAX_HEAD_DIM, 16),
                            min_warps=(1, None, 1), stages=(2, None, 1))



DEFAULT_CONFIG = MmaConfig()
#: tiles for the CUDA simulator, where every thread is a Python thread: one warp, 16-key tiles, two passes above 32
SIMULATOR_CONFIG = MmaConfig(warps=1, m_tiles=1, block_n=16, block_n_wide=16, max_single_pass_dim=32)
#: what ``flash_forward``'s autotuner (``runtime.autotune``) times per (device, dtype, head dim, causal, size
#: class): the default, 8 warps x 1 m-tile (same 128 rows, half the registers per warp for the accumulators), and
#: 64-row blocks (twice the blocks: fills the GPU when batch * heads * seqlen_q is small)
TUNING_CANDIDATES = (DEFAULT_CONFIG, MmaConfig(warps=8, m_tiles=1), MmaConfig(warps=4, m_tiles=1))
#: mma.sync.m16n8k16 with f16 / bf16 operands and cvt.rn.bf16x2 need sm_80 or newer
MIN_COMPUTE_CAPABILITY = (8, 0)
#: dtype names the kernel takes (bfloat16 arrives as a uint16 bit view, float16 may too).
DTYPES = ("float16", "bfloat16")
#: one signature for every layout of the 16-bit operands
SIGNATURE = common.kernel_signature(uint16)


def default_config(head_dim: int = 64) -> MmaConfig:
    """4 warps x 2 m-tiles (128 query rows), 64-key tiles, 2 blocks per SM: the fastest at head dims 64 and 128
    against 8 warps x 1 m-tile and 128 / 32-key tiles (``scripts/tune_flash.py --kernel mma``, docs/design/forward.md)."""
    return SIMULATOR_CONFIG if SIMULATOR else DEFAULT_CONFIG


def supports(dtype: str, head_dim: int, *arrays) -> bool:
    """True when this kernel takes the call on this device: float16 / bfloat16, head dims up to 256, any strides
    (rows that cannot be copied in 16-byte pieces take the element loader), sm_80 or newer."""
    return dtype in DTYPES and 1 <= head_dim <= common.MAX_HEAD_DIM and common.runs_here(MIN_COMPUTE_CAPABILITY)


def padded_head_dim(head_dim: int, config: MmaConfig | None = None) -> int:
    """The head dim the kernel computes with: a multiple of 16 (one MMA k-step), and of 32 when it takes two passes
    (each pass's half is then a whole number of ``ldmatrix.x4`` column pairs)."""
    return common.padded_head_dim(head_dim, 16, (config or DEFAULT_CONFIG).max_single_pass_dim)


@dataclass(frozen=True)
class _Tiles(common.PassTiles):
    """Compile-time shape of one specialisation (derived from the config and the padded head dim)."""

    stages: int = 2

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
        """Dynamic shared memory: the Q tile, then ``stages`` stages of (K tile, V tile)."""
        return 2 * (self.block_m * self.row + self.stages * 2 * self.tile)


@lru_cache(maxsize=None)
def tiles_for(config: MmaConfig, head_dim_pad: int) -> _Tiles:
    """The tiles of ``config`` at a padded head dim (whether they fit a device's shared memory is the launch's
    question: ``common.check_shared_memory``)."""
    if head_dim_pad % 16 or not 16 <= head_dim_pad <= common.MAX_HEAD_DIM:
        raise ValueError(f"head_dim_pad must be a multiple of 16 in [16, 256], got {head_dim_pad}")
    if head_dim_pad <= config.max_single_pass_dim:
        return _Tiles(config.warps, config.m_tiles, config.block_n, head_dim_pad, head_dim_pad, config.stages)
    if head_dim_pad % 32:
        raise ValueError(f"head_dim_pad above {config.max_single_pass_dim} must be a multiple of 32, got {head_dim_pad}")
    return _Tiles(config.warps, config.m_tiles, config.block_n_wide, head_dim_pad, head_dim_pad // 2, config.stages)


def _kernel_source(tiles: _Tiles, bf16: bool, vector_loads: bool, scale_first: bool = False,
                   variant: Variant = PLAIN):
    """The Python function of one specialisation (not yet jitted); also what ``compile_ptx`` checks offline.
    ``variant``: the sliding window and soft-capping (``common.Variant``).

    ``scale_first=False`` (for a positive scale) keeps the running max on the unscaled scores, so the scale folds
    into the exponent's one FFMA (``exp2(s * scale - m * scale)``); a scale <= 0 does not commute with max and
    multiplies every score first."""
    M_TILES = tiles.m_tiles
    ROW_STATS = 2 * M_TILES  # rows per thread
    BLOCK_M = tiles.block_m
    BLOCK_N = tiles.block_n
    D_PASS = tiles.d_pass
    PASSES = tiles.passes
    ROW = tiles.row
    Q_TILE = BLOCK_M * ROW  # shared memory: Q tile, then per stage a K tile and a V tile
    TILE = tiles.tile
    STAGE = 2 * TILE
    STAGES = tiles.stages
    QK_STEPS = tiles.d_pad // 16  # k-steps of S = Q K^T
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S
    PV_STEPS = BLOCK_N // 16  # k-steps of O += P V
    O_BLOCKS = D_PASS // 8  # n8 blocks of O
    SCALE_FIRST = scale_first
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    ldmatrix = ptx.ldmatrix_x4
    ldmatrix_trans = ptx.ldmatrix_x4_trans
    commit = ptx.cp_async_commit
    wait_tile = ptx.cp_async_wait_group(STAGES - 2)  # the oldest group in flight (tile j's) has landed
    load_q_tile = tile_loader(32 * tiles.warps, ROW, tiles.d_pad, BLOCK_M, np.uint16, vector_loads)
    load_tile = tile_loader(32 * tiles.warps, ROW, tiles.d_pad, BLOCK_N, np.uint16, vector_loads)
    position = block_position_of(QUERY_MAJOR, BLOCK_M, variant.packed)
    bounds = sequence_bounds_of(variant.packed)
    exponent = exponent_scale_for(variant.softcap)  # the compile-time c log2 e with a cap
    walk_tiles = key_tile_walk(BLOCK_M, BLOCK_N, variant.window)  # tiles wholly outside a window: skipped
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    clear_s = fragment_clear(M_TILES, S_BLOCKS)
    start = softmax_start(M_TILES, O_BLOCKS)
    online_softmax = softmax_update(M_TILES, S_BLOCKS, O_BLOCKS, SCALE_FIRST, rescale_output=True,
                                    window=variant.window, softcap=variant.softcap,
                                    precise_tanh=False)
    finish = store_rows(M_TILES, O_BLOCKS, as_16bit(bf16))

    @device_function
    def mma_into(c, mt, n, a0, a1, a2, a3, b0, b1):
        """``c[mt, n, :] += A B``: one MMA accumulating into the C fragment held in a register array."""
        c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3] = mma(a0, a1, a2, a3, b0, b1,
                                                                 c[mt, n, 0], c[mt, n, 1], c[mt, n, 2], c[mt, n, 3])

    @kernel_body
    def body(q, k, v, out, lse, write_lse, causal, scale_log2, schedule):
        tid, warp, lane, g, t = lane_position()
        # causal: the longest (last) query blocks start first
        b, h, m0, q_head, k_head, v_head, out_head = position(q, k, v, out, causal, schedule)
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]
        warp_row = 16 * M_TILES * warp  # this warp's first row in the block; m-tile mt adds 16 mt
        row0 = m0 + warp_row + g  # rows of this thread: row0 + 16 mt and row0 + 16 mt + 8
        # ldmatrix row addresses of this lane (lane 8i + r: row r of matrix i). K, for S = Q K^T: matrices (keys
        # +0, cols +0), (+0, +8), (+8, +0), (+8, +8) = b0, b1 of two n8 blocks. Q (A fragment) and V (transposed,
        # for O += P V): (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8) = a0..a3 / b0, b1 of two n8 blocks.
        k_lane = (8 * (lane // 16) + lane % 8) * ROW + 8 * ((lane // 8) % 2)
        v_lane = (8 * ((lane // 8) % 2) + lane % 8) * ROW + 8 * (lane // 16)
        q_lane = warp_row * ROW + v_lane

        smem = cuda.shared.array(0, uint16)  # dynamic: Q tile, STAGES x (K tile, V tile), rows of ROW elements
        q_frag = cuda.local.array((M_TILES, 4), uint32)
        s = cuda.local.array((M_TILES, S_BLOCKS, 4), float32)
        acc = cuda.local.array((M_TILES, O_BLOCKS, 4), float32)
        m_run = cuda.local.array(ROW_STATS, float32)  # running row max (score units) of rows 2mt, 2mt + 1
        l_run = cuda.local.array(ROW_STATS, float32)  # this thread's part of the row sums

        n_first, n_tiles = walk_tiles(m0, key_start, key_end, causal, diag_offset)  # <= 0: nothing to read
        post = exponent(scale_log2, SCALE_FIRST)

        load_q_tile(q_head, smem, 0, tid, m0, seqlen_q, 0, head_dim)
        for p in range(PASSES):
            d_off = p * D_PASS  # first output column of this pass
            start(m_run, l_run, acc)

            cuda.syncthreads()  # a previous pass is done reading its stages
            for ahead in range(STAGES - 1):  # tiles 0 .. STAGES - 2, one commit group each (the Q tile in the first)
                if ahead < n_tiles:
                    n_ahead = n_first + ahead * BLOCK_N
                    load_tile(k_head, smem, Q_TILE + ahead * STAGE, tid, n_ahead, key_end, 0, head_dim)
                    load_tile(v_head, smem, Q_TILE + ahead * STAGE + TILE, tid, n_ahead, key_end, 0, head_dim)
                commit()
            for j in range(n_tiles):
                n0 = n_first + j * BLOCK_N
                base = Q_TILE + (j % STAGES) * STAGE
                wait_tile()
                cuda.syncthreads()  # tile j has landed for everyone; everyone is done with tile j - 1's stage
                if j + STAGES - 1 < n_tiles:  # tile j + STAGES - 1 goes to tile j - 1's stage, under these MMAs
                    nxt = Q_TILE + ((j + STAGES - 1) % STAGES) * STAGE
                    n_next = n0 + (STAGES - 1) * BLOCK_N
                    load_tile(k_head, smem, nxt, tid, n_next, key_end, 0, head_dim)
                    load_tile(v_head, smem, nxt + TILE, tid, n_next, key_end, 0, head_dim)
                commit()  # an empty group past the last tile keeps "oldest group = tile j" true

                # ---- S = Q K^T: one K fragment feeds the MMAs of every m-tile ----------------------------------------
                clear_s(s)
                for kk in range(QK_STEPS):
                    for mt in range(M_TILES):
                        q_frag[mt, 0], q_frag[mt, 1], q_frag[mt, 2], q_frag[mt, 3] = ldmatrix(
                            smem, q_lane + 16 * mt * ROW + 16 * kk)
                    for nb in range(0, S_BLOCKS, 2):
                        b0, b1, b2, b3 = ldmatrix(smem, base + k_lane + 8 * nb * ROW + 16 * kk)
                        for mt in range(M_TILES):
                            x0, x1, x2, x3 = q_frag[mt, 0], q_frag[mt, 1], q_frag[mt, 2], q_frag[mt, 3]
                            mma_into(s, mt, nb, x0, x1, x2, x3, b0, b1)
                            mma_into(s, mt, nb + 1, x0, x1, x2, x3, b2, b3)

                # ---- online softmax (base 2), masks only on the diagonal / tail tiles ----------------------------
                online_softmax(s, acc, m_run, l_run, partial(n0, m0, key_end, causal, diag_offset), n0, row0, t,
                               key_end, causal, diag_offset, scale_log2, post)

                # ---- O += P V: P's C fragments of n8 blocks 2kk, 2kk + 1 are the A fragment of k-step kk ----------
                for kk in range(PV_STEPS):
                    for ob in range(0, O_BLOCKS, 2):
                        b0, b1, b2, b3 = ldmatrix_trans(smem, base + TILE + v_lane + 16 * kk * ROW + d_off + 8 * ob)
                        for mt in range(M_TILES):
                            a0 = pack(s[mt, 2 * kk, 0], s[mt, 2 * kk, 1])
                            a1 = pack(s[mt, 2 * kk, 2], s[mt, 2 * kk, 3])
                            a2 = pack(s[mt, 2 * kk + 1, 0], s[mt, 2 * kk + 1, 1])
                            a3 = pack(s[mt, 2 * kk + 1, 2], s[mt, 2 * kk + 1, 3])
                            mma_into(acc, mt, ob, a0, a1, a2, a3, b0, b1)
                            mma_into(acc, mt, ob + 1, a0, a1, a2, a3, b2, b3)

            # ---- epilogue: O / l in the input dtype; lse once (the first pass) -----------------------------------
            finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, d_off, seqlen_q, head_dim, write_lse and p == 0,
                   post)

    return common.entry_kernel(body, variant.packed)


@lru_cache(maxsize=None)
def flash_mma_kernel(config: MmaConfig, head_dim_pad: int, bf16: bool, vector_loads: bool, scale_first: bool = False,
                     variant: Variant = PLAIN):
    """The compiled kernel of one specialisation: tiles, padded head dim, dtype, load width, the sign of the scale
    and the ``variant`` (window) are constants (causality is a run-time flag: it only changes the loop bound and the
    diagonal tiles' masks)."""
    source = _kernel_source(tiles_for(config, head_dim_pad), bf16, vector_loads, scale_first, variant)
    return kernel_jit(config.launch_bounds(), common.signature(uint16, variant))(source)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream, config: MmaConfig | None = None,
           dtype: str | None = None, window=None,
           softcap: float | None = None, schedule=None):
    """Launch on device views of shape (batch, heads, seqlen, headdim); lse is (batch, heads, seqlen_q) float32.
    ``window``: None or a checked ``(left, right)`` sliding window (``runtime.arguments.check_window``);
    ``softcap``: None or a checked cap ``c > 0`` of the scores (``core.scores``); ``schedule``: None, or the int32
    schedule of packed sequences (``forward.varlen``: the views are then ``(1, heads, total, headdim)``).

    ``dtype`` is ``"float16"`` or ``"bfloat16"``; None means float16 for float16 arrays and bfloat16 for uint16 /
    int16 bit views (the way this package carries bfloat16). ``out`` has q's shape and receives the input dtype
    (a float16 array or a 16-bit bit view).
    """
    config = config or default_config(q.shape[3])
    dtype = common.sixteen_bit_dtype(q, dtype)
    if dtype not in DTYPES:
        raise TypeError(f"dtype: the tensor-core kernel takes float16 or bfloat16, got {dtype}")
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    q, k, v, out = _bits(q, "q"), _bits(k, "k"), _bits(v, "v"), _bits(out, "out")
    head_dim_pad = padded_head_dim(head_dim, config)
    tiles = tiles_for(config, head_dim_pad)
    common.check_shared_memory(tiles.shared_bytes)
    scale_log2, scale_first = common.scale_args(sm_scale, softcap)
    kernel = flash_mma_kernel(config, head_dim_pad, dtype == "bfloat16", vector_loads_ok(q, k, v), scale_first,
                              Variant.of(bool(causal), window, softcap, schedule is not None))
    shape = common.launch_grid(QUERY_MAJOR, batch, heads, seqlen_q, config.block_m, schedule)
    extra = () if schedule is None else (schedule,)
    device_launch(kernel, shape, config.threads, stream, tiles.shared_bytes,
                  q, k, v, out, lse, bool(write_lse), bool(causal), scale_log2, *extra)
