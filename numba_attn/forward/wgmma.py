"""FlashAttention-2 forward on Hopper's warpgroup MMAs (``wgmma.mma_async``, sm_90a) for float16 and bfloat16.

Same interface and semantics as ``mma.launch`` (shapes ``(batch, heads, seqlen, headdim)``, GQA, bottom-right
causal mask, rows that see no key give 0 and ``lse = -inf``, natural-log lse); it takes the inputs whose rows copy
in aligned 16-byte pieces (``common.vector_loads_ok``) and padded head dims up to ``MAX_HEAD_DIM`` (``supports``),
and ``mma`` keeps the rest.

Work split
    One thread block = one warpgroup (4 warps, 128 threads) = 64 query rows of one (batch, head): each
    ``wgmma`` computes a 64-row product for the whole block, and warp ``w``'s accumulators hold rows ``16 w ..
    16 w + 15`` in the ``mma.sync`` C-fragment layout (``wgmma`` module docstring), so the online softmax of the
    ``mma.sync`` kernels runs on them unchanged. Several blocks share an SM (``blocks_per_sm``); they are not tied
    together by barriers, so one block's softmax runs under another's MMAs.

Shared memory (dynamic)
    The Q tile, two stages of K and three of V, each in the 128-byte swizzled layout the tensor cores read directly
    (``wgmma`` module docstring), from a 1024-byte aligned start. Q and K are read as K-major operands of ``S = Q
    K^T``; V, stored the same way, as the N-major B operand of ``O += P V`` (``imm-trans-b = 1``): no transposed
    copy. Rows past the sequence and columns past headdim are zero-filled.

Pipeline per K/V tile ``j`` (tile 0 is peeled off the loop: see below)
    1. ``cp_async_wait_all`` + ``fence.proxy.async`` + barrier: tile ``j`` has landed and is visible to the tensor
       cores; everyone is done with K of tile ``j - 1`` and V of tile ``j - 2``.
    2. Issue ``S_j = Q K_j^T`` (``d_pad / 16`` MMAs ``m64 n(block_n) k16``, A and B from shared memory) and behind
       it ``O += P_(j-1) V_(j-1)`` (``block_n / 16`` MMAs ``m64 n(d_pad) k16``, A = P in registers), then the
       ``cp.async`` copies of tile ``j + 1``, all without waiting.
    3. ``wait_group 1``: S_j is done (groups complete in order). The online softmax of S_j (``core.softmax``;
       masks only on tiles crossing the diagonal or the end of the keys; base 2 with the scale folded into the
       exponent) runs while the P V MMAs still run.
    4. ``wait_group 0``; rescale O by this tile's ``alpha`` (skipped when no row max of the warp moved); round P_j
       to the input dtype into the A registers of the next P V.
    Each group of MMAs is one inline-asm block (``wgmma.wgmma_ss`` / ``wgmma_rs`` with ``wait=False``); the waits
    pass the accumulators through as operands (``wgmma_wait``). With the first tile's issue inside an ``if`` in the
    loop, the copies LLVM placed between issue and wait made ptxas serialise every MMA (warning C7513), hence the
    peeled tile 0. Measured steps: docs/design/forward.md and docs/benchmarks.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, uint16, uint32

from ..core import fp8 as fp8_blocks
from ..core import ptx
from ..core import warpgroup as wgmma
from ..core.block_info import QUERY_MAJOR, block_position_of, key_tile_walk, lane_position, sequence_bounds_of
from ..core.epilogue import as_16bit, store_rows
from ..core.mask import tile_is_partial
from ..core.softmax import exponent_scale_for, output_rescale, softmax_start, softmax_update
from ..core.staging import device_function, kernel_body
from ..core.swizzled_tiles import swizzled_tile_loader
from ..runtime.device import SIMULATOR, cuda, kernel_jit
from ..runtime.launch import launch as device_launch
from . import common
from .common import PLAIN, Variant

#: wgmma needs sm_90a (numba-cuda compiles Hopper kernels for it)
MIN_COMPUTE_CAPABILITY = (9, 0)
#: padded head dims above this stay on ``flash_mma`` (the accumulators would not fit beside S)
MAX_HEAD_DIM = 128
BLOCK_M = wgmma.ROWS
THREADS = wgmma.WARPGROUP_THREADS
ONE = np.float32(1.0)


class OneWarpgroup:
    """What the configurations of this kernel's blocks (16-bit and fp8: one warpgroup each) share."""

    @property
    def block_m(self) -> int:
        return BLOCK_M

    @property
    def threads(self) -> int:
        return THREADS


@dataclass(frozen=True)
class WgmmaConfig(OneWarpgroup):
    """Tuning knobs of the warpgroup kernel (validated where made)."""

    block_n: int = 64  # keys per K/V tile (multiple of 16)
    blocks_per_sm: int = 2  # launch bound: resident blocks per SM ptxas must allow (caps the registers)

    def __post_init__(self):
        common.check_fields(self, block_n=(16, 256, 16), blocks_per_sm=(1, None, 1))


#: 64-key tiles, two blocks per SM (99 KB of shared memory each at head dim 128): the fastest at head dims 64 and
#: 128 against 128-key tiles and three blocks per SM (docs/benchmarks.md)
DEFAULT_CONFIG = WgmmaConfig()
SIMULATOR_CONFIG = WgmmaConfig(block_n=16, blocks_per_sm=1)
#: what ``flash_forward``'s autotuner times per key: 64-key tiles with two blocks per SM and 128-key tiles with two
#: (one where they do not fit)
TUNING_CANDIDATES = (DEFAULT_CONFIG, WgmmaConfig(block_n=128, blocks_per_sm=2))
DTYPES = ("float16", "bfloat16")
SIGNATURE = common.kernel_signature(uint16)


def default_config() -> WgmmaConfig:
    return SIMULATOR_CONFIG if SIMULATOR else DEFAULT_CONFIG


def shared_bytes(config: WgmmaConfig, head_dim_pad: int) -> int:
    """The Q tile, two stages of K and three of V, rows of 128-byte atom columns, plus 1 KB to align the first
    tile to 1024 bytes (the swizzle pattern's period)."""
    return 128 * wgmma.atom_columns(head_dim_pad) * (BLOCK_M + 5 * config.block_n) + 1024


def padded_head_dim(head_dim: int) -> int:
    return common.padded_head_dim(head_dim, 16)


def supports(dtype: str, head_dim: int, *arrays) -> bool:
    """True when this kernel takes the call on this device: float16 / bfloat16, a padded head dim up to
    ``MAX_HEAD_DIM``, rows that copy in aligned 16-byte pieces (otherwise ``mma`` does, with its element-wise
    loader), sm_90 (the simulator runs it too)."""
    return (dtype in DTYPES and padded_head_dim(head_dim) <= MAX_HEAD_DIM
            and common.runs_here(MIN_COMPUTE_CAPABILITY) and common.vector_loads_ok(*arrays))


def tile_loader(rows: int, d_pad: int, threads: int = THREADS):
    """``load(head, smem, base, tid, n0, seqlen, head_dim)``: start the ``cp.async`` copy of rows ``n0 .. n0 +
    rows`` of a 16-bit ``head`` to the swizzled tile at element ``base`` of ``smem`` (``wgmma`` module docstring;
    zeros outside the sequence and past headdim), by a block of ``threads`` threads (the backward's has several
    warpgroups): ``core.swizzled_tiles.swizzled_tile_loader``."""
    return swizzled_tile_loader(rows, d_pad, threads)


def _kernel_source(config, d_pad: int, bf16: bool, scale_first: bool = False, variant: Variant = PLAIN,
                   fp8: bool = False, per_head: bool = False, transpose: bool = True):
    """The Python function of one specialisation (not yet jitted); ``variant``: the sliding window and
    soft-capping (``common.Variant``). ``fp8``: float8 e4m3 operands (uint8; ``config`` a ``wgmma_fp8.Fp8Config``,
    not packed) and a bfloat16 (``bf16``) or float16 output, per-head descale arrays read (``per_head``) or not; the
    kernel then takes ``wgmma_fp8.SIGNATURE`` (``wgmma_fp8``'s docstring: the 8-bit differences). ``transpose=False``
    (8-bit) is a timing probe only (``scripts/check_fp8.py --part share``): V^T is never written, the results are
    wrong."""
    if fp8 and variant.packed:
        raise ValueError("the fp8 kernel takes no packed sequences")
    FP8 = fp8
    TRANSPOSE = fp8 and transpose
    BLOCK_N = config.block_n
    ATOMS = 1 if fp8 else wgmma.atom_columns(d_pad)  # (8-bit rows of up to 128 elements: one atom column)
    Q_TILE = BLOCK_M * 64 * ATOMS  # elements (uint16); shared memory: Q tile, K tiles, V tiles (8-bit: staged V)
    TILE = BLOCK_N * 64 * ATOMS  # a K or V tile
    # stages of V (16-bit: V of tile j - 1 is still read during tile j); 8-bit: of staged V, and of the V^T tiles
    # P V reads (after the staged ones)
    V_STAGES = 2 if fp8 else 3
    PV_OFFSET = V_STAGES * TILE if fp8 else 0
    PV_TILE = d_pad * 64 if fp8 else TILE
    K_STEP = 32 if fp8 else 16  # k of one MMA
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S
    PV_STEPS = BLOCK_N // K_STEP  # k-steps of O += P V
    P_WORDS = 4 * PV_STEPS  # P as the A operand: four 32-bit words per k-step
    O_BLOCKS = d_pad // 8  # n8 blocks of O
    SCALE_FIRST = scale_first
    q_times_k, p_times_v = wgmma.attention_products(BLOCK_N, d_pad, bf16, fp8)
    wait_s = wgmma.wgmma_wait(BLOCK_N, 0)
    wait_one = wgmma.wgmma_wait(BLOCK_N, 1)
    wait_o = wgmma.wgmma_wait(d_pad, 0)
    shared_address = wgmma.shared_address
    fence_proxy_async = wgmma.fence_proxy_async
    commit = ptx.cp_async_commit
    wait_all = ptx.cp_async_wait_all
    if fp8:
        load_q_tile = swizzled_tile_loader(BLOCK_M, d_pad, THREADS, 1)
        load_k_tile = swizzled_tile_loader(BLOCK_N, d_pad, THREADS, 1)
        if config.v_transpose == "staging":
            load_v_tile = fp8_blocks.staging_loader(BLOCK_N, d_pad, THREADS)
            transpose_v = fp8_blocks.v_transposer(BLOCK_N, d_pad, THREADS)
        else:
            load_v_tile = swizzled_tile_loader(BLOCK_N, d_pad, THREADS, 1)
            transpose_v = fp8_blocks.v_transposer_swizzled(BLOCK_N, d_pad, THREADS)
        probabilities = fp8_blocks.probabilities(PV_STEPS)  # P rounded to e4m3 (the keys permuted: ``core.fp8``)
        scales = fp8_blocks.descaled(per_head)
    else:
        load_q_tile = tile_loader(BLOCK_M, d_pad)
        load_k_tile = load_v_tile = tile_loader(BLOCK_N, d_pad)
        transpose_v = None  # (never called)
        probabilities = wgmma.a_fragments(PV_STEPS, bf16)  # P rounded to the input dtype as the A operand
        scales = fp8_blocks.no_descale
    position = block_position_of(QUERY_MAJOR, BLOCK_M, variant.packed)
    bounds = sequence_bounds_of(variant.packed)
    exponent = exponent_scale_for(variant.softcap)  # the compile-time c log2 e with a cap
    walk_tiles = key_tile_walk(BLOCK_M, BLOCK_N, variant.window)  # tiles wholly outside a window: skipped
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    start = softmax_start(1, O_BLOCKS)
    online_softmax = softmax_update(1, S_BLOCKS, O_BLOCKS, SCALE_FIRST, rescale_output=False,
                                    window=variant.window, softcap=variant.softcap,
                                    precise_tanh=False, p_exponent=fp8_blocks.P_EXPONENT if fp8 else 0)
    rescale = output_rescale(O_BLOCKS)
    finish = store_rows(1, O_BLOCKS, as_16bit(bf16), scaled=fp8, scale_argument=True)

    @device_function
    def arrive():
        """This thread's copies (and 8-bit: V^T stores) are done; after the barrier everyone's are, visible to the
        tensor cores (and everyone is done with K of tile j - 1 and V of tile j - 2; 8-bit: the staging of tile j - 1
        and V^T of tile j - 2)."""
        wait_all()
        fence_proxy_async()  # the landed copies are read through the async proxy
        cuda.syncthreads()

    @device_function
    def prefetch(k_head, v_head, smem, k_base, v_base, tid, j, n_tiles, n_first, key_end, head_dim):
        """Start copying tile ``j + 1`` over K of tile ``j - 1`` and V of tile ``j - 2`` (8-bit: the staging of tile
        ``j - 1``)."""
        if j + 1 < n_tiles:
            n1 = n_first + (j + 1) * BLOCK_N
            load_k_tile(k_head, smem, k_base + ((j + 1) % 2) * TILE, tid, n1, key_end, head_dim)
            load_v_tile(v_head, smem, v_base + ((j + 1) % V_STAGES) * TILE, tid, n1, key_end, head_dim)
            commit()

    @kernel_body
    def body(q, k, v, out, lse, write_lse, causal, scale_log2, schedule, out_scale, descale_q, descale_k, descale_v):
        tid, warp, lane, g, t = lane_position()  # warp w holds rows 16 w + g and 16 w + g + 8 of the block
        # causal: the longest (last) query blocks start first
        b, h, m0, q_head, k_head, v_head, out_head = position(q, k, v, out, causal, schedule)
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]
        row0 = m0 + 16 * warp + g  # rows of this thread: row0 and row0 + 8
        # (8-bit: the score scale and the output's factor with a block's per-head descales; else as they came)
        scale, v_scale = scales(scale_log2, out_scale, descale_q, descale_k, descale_v, b, h, q.shape[1])

        smem = cuda.shared.array(0, uint16)
        q_base = ((1024 - shared_address(smem) % 1024) % 1024) // 2  # tiles start 1024-byte aligned
        s = cuda.local.array((1, S_BLOCKS, 4), float32)
        acc = cuda.local.array((1, O_BLOCKS, 4), float32)
        p = cuda.local.array(P_WORDS, uint32)
        alpha = cuda.local.array(2, float32)  # this tile's rescale of O's two rows
        m_run = cuda.local.array(2, float32)
        l_run = cuda.local.array(2, float32)
        start(m_run, l_run, acc)

        n_first, n_tiles = walk_tiles(m0, key_start, key_end, causal, diag_offset)
        post = exponent(scale, SCALE_FIRST)

        k_base = q_base + Q_TILE  # K: two stages; V: three (8-bit: two of staged V, then two of V^T)
        v_base = k_base + 2 * TILE
        pv_base = v_base + PV_OFFSET
        load_q_tile(q_head, smem, q_base, tid, m0, seqlen_q, head_dim)
        if n_tiles > 0:
            load_k_tile(k_head, smem, k_base, tid, n_first, key_end, head_dim)
            load_v_tile(v_head, smem, v_base, tid, n_first, key_end, head_dim)
        commit()
        if n_tiles > 0:  # tile 0: S_0 (8-bit: and V^T_0), its softmax and P_0; O += P_0 V_0 overlaps tile 1's softmax
            arrive()
            q_times_k(s, smem, q_base, k_base)
            prefetch(k_head, v_head, smem, k_base, v_base, tid, 0, n_tiles, n_first, key_end, head_dim)
            if TRANSPOSE:
                transpose_v(smem, v_base, pv_base, tid)
            wait_s(s)
            online_softmax(s, alpha, m_run, l_run, partial(n_first, m0, key_end, causal, diag_offset), n_first,
                           row0, t, key_end, causal, diag_offset, scale, post)
            probabilities(s, p)  # O is still zero: nothing to rescale
        for j in range(1, n_tiles):
            n0 = n_first + j * BLOCK_N
            arrive()
            # S_j = Q K_j^T, and behind it O += P_{j-1} V_{j-1}, whose MMAs run under the softmax of S_j; the
            # next tile's copies (8-bit: and the transpose of V_j) are issued while the MMAs run
            q_times_k(s, smem, q_base, k_base + (j % 2) * TILE)
            p_times_v(acc, p, smem, pv_base + ((j - 1) % V_STAGES) * PV_TILE)
            prefetch(k_head, v_head, smem, k_base, v_base, tid, j, n_tiles, n_first, key_end, head_dim)
            if TRANSPOSE:
                transpose_v(smem, v_base + (j % V_STAGES) * TILE, pv_base + (j % V_STAGES) * PV_TILE, tid)
            wait_one(s)  # groups complete in order: S_j is done, P V may still run
            online_softmax(s, alpha, m_run, l_run, partial(n0, m0, key_end, causal, diag_offset), n0, row0, t,
                           key_end, causal, diag_offset, scale, post)
            wait_o(acc)
            rescale(acc, alpha)
            probabilities(s, p)
        if n_tiles > 0:
            if FP8:
                arrive()  # the last V^T tile's stores, visible to the tensor cores
            p_times_v(acc, p, smem, pv_base + ((n_tiles - 1) % V_STAGES) * PV_TILE)
            wait_o(acc)
        else:
            wait_all()  # no key to see: only the Q copies are in flight; let them land before the block ends

        # ---- epilogue: O / l (8-bit: times the V descale) in the output dtype, and lse ---------------------------
        if FP8:  # (P carried a factor: ``core.fp8.P_EXPONENT``)
            v_scale = fp8_blocks.p_unscaled(l_run, v_scale)
        finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, 0, seqlen_q, head_dim, write_lse, post, v_scale)

    if fp8:  # (no schedule: lse stands in, unread)
        def fp8_kernel(q, k, v, out, lse, write_lse, causal, scale_log2, out_scale, descale_q, descale_k, descale_v):
            body(q, k, v, out, lse, write_lse, causal, scale_log2, lse, out_scale, descale_q, descale_k, descale_v)

        return fp8_kernel

    # (16-bit: the output's factor is 1, and lse stands in for the descale arrays nothing reads)
    @kernel_body
    def sixteen_bit_body(q, k, v, out, lse, write_lse, causal, scale_log2, schedule):
        body(q, k, v, out, lse, write_lse, causal, scale_log2, schedule, ONE, lse, lse, lse)

    return common.entry_kernel(sixteen_bit_body, variant.packed)


@lru_cache(maxsize=None)
def flash_wgmma_kernel(config: WgmmaConfig, head_dim_pad: int, bf16: bool, scale_first: bool = False,
                       variant: Variant = PLAIN):
    """The compiled kernel of one specialisation (tiles, padded head dim, dtype, sign of the scale, variant)."""
    if head_dim_pad % 16 or not 16 <= head_dim_pad <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim_pad must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {head_dim_pad}")
    source = _kernel_source(config, head_dim_pad, bf16, scale_first, variant)
    return kernel_jit((THREADS, config.blocks_per_sm), common.signature(uint16, variant))(source)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream,
           config: WgmmaConfig | None = None, dtype: str | None = None, window=None,
           softcap: float | None = None, schedule=None):
    """Launch on device views of shape (batch, heads, seqlen, headdim) that ``supports`` accepts; lse is (batch,
    heads, seqlen_q) float32. ``dtype``: ``"float16"`` or ``"bfloat16"`` (None: float16 for float16 arrays,
    bfloat16 for 16-bit bit views). ``window``: None or a checked ``(left, right)`` sliding window; ``softcap``: None
    or a checked cap ``c > 0`` of the scores; ``schedule``: None, or the int32 schedule of packed sequences
    (``forward.varlen``)."""
    config = config or default_config()
    dtype = common.sixteen_bit_dtype(q, dtype)
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    q, k, v, out = (common.bits(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
    if not supports(dtype, head_dim, q, k, v):
        raise ValueError("q, k, v: the wgmma kernel needs float16 / bfloat16, 16-byte aligned rows with a "
                         f"unit-stride last axis, headdim % 8 == 0 and a padded headdim <= {MAX_HEAD_DIM} on sm_90; "
                         f"got {dtype}, headdim {head_dim}")
    d_pad = padded_head_dim(head_dim)
    nbytes = shared_bytes(config, d_pad)
    common.check_shared_memory(nbytes)
    scale_log2, scale_first = common.scale_args(sm_scale, softcap)
    kernel = flash_wgmma_kernel(config, d_pad, dtype == "bfloat16", scale_first,
                                Variant.of(bool(causal), window, softcap, schedule is not None))
    shape = common.launch_grid(QUERY_MAJOR, batch, heads, seqlen_q, BLOCK_M, schedule)
    extra = () if schedule is None else (schedule,)
    device_launch(kernel, shape, THREADS, stream, nbytes, q, k, v, out, lse, bool(write_lse), bool(causal),
                  scale_log2, *extra)
