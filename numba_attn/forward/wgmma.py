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

from ..core import ptx
from ..core import warpgroup as wgmma
from ..core.block_info import QUERY_MAJOR, block_position_of, key_tile_walk, lane_position, sequence_bounds_of
from ..core.epilogue import as_16bit, store_rows
from ..core.mask import tile_is_partial
from ..core.softmax import exponent_scale_for, softmax_start, softmax_update
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


@dataclass(frozen=True)
class WgmmaConfig:
    """Tuning knobs of the warpgroup kernel (validated where made)."""

    block_n: int = 64  # keys per K/V tile (multiple of 16)
    blocks_per_sm: int = 2  # launch bound: resident blocks per SM ptxas must allow (caps the registers)

    def __post_init__(self):
        common.check_fields(self, block_n=(16, 256, 16), blocks_per_sm=(1, None, 1))

    @property
    def block_m(self) -> int:
        return BLOCK_M

    @property
    def threads(self) -> int:
        return THREADS


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


def _kernel_source(config: WgmmaConfig, d_pad: int, bf16: bool, scale_first: bool = False, variant: Variant = PLAIN):
    """The Python function of one specialisation (not yet jitted); ``variant``: the sliding window and
    soft-capping (``common.Variant``)."""
    BLOCK_N = config.block_n
    ATOMS = wgmma.atom_columns(d_pad)
    Q_TILE = BLOCK_M * 64 * ATOMS  # elements; shared memory: Q tile, then per stage a K tile and a V tile
    TILE = BLOCK_N * 64 * ATOMS
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S
    PV_STEPS = BLOCK_N // 16  # k-steps of O += P V
    P_WORDS = 4 * PV_STEPS  # P as the A operand: four 32-bit words per k-step
    O_BLOCKS = d_pad // 8  # n8 blocks of O
    SCALE_FIRST = scale_first
    QK_STEPS = d_pad // 16
    q_times_k = wgmma.wgmma_ss(BLOCK_N, QK_STEPS, bf16, wgmma.k_major(BLOCK_M, QK_STEPS),
                               wgmma.k_major(BLOCK_N, QK_STEPS), wait=False)
    p_times_v = wgmma.wgmma_rs(d_pad, PV_STEPS, bf16, wgmma.mn_major(BLOCK_N, PV_STEPS), True, wait=False)
    wait_s = wgmma.wgmma_wait(BLOCK_N, 0)
    wait_one = wgmma.wgmma_wait(BLOCK_N, 1)
    wait_o = wgmma.wgmma_wait(d_pad, 0)
    all_lanes = ptx.all_lanes
    ONE = np.float32(1.0)
    shared_address = wgmma.shared_address
    fence_proxy_async = wgmma.fence_proxy_async
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    commit = ptx.cp_async_commit
    wait_all = ptx.cp_async_wait_all
    load_q_tile = tile_loader(BLOCK_M, d_pad)
    load_tile = tile_loader(BLOCK_N, d_pad)
    position = block_position_of(QUERY_MAJOR, BLOCK_M, variant.packed)
    bounds = sequence_bounds_of(variant.packed)
    exponent = exponent_scale_for(variant.softcap)  # the compile-time c log2 e with a cap
    walk_tiles = key_tile_walk(BLOCK_M, BLOCK_N, variant.window)  # tiles wholly outside a window: skipped
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    start = softmax_start(1, O_BLOCKS)
    online_softmax = softmax_update(1, S_BLOCKS, O_BLOCKS, SCALE_FIRST, rescale_output=False,
                                    window=variant.window, softcap=variant.softcap,
                                    precise_tanh=False)
    finish = store_rows(1, O_BLOCKS, as_16bit(bf16))

    @device_function
    def arrive():
        """This thread's copies have landed; after the barrier everyone's are there, visible to the tensor cores
        (and everyone is done with K of tile j - 1 and V of tile j - 2)."""
        wait_all()
        fence_proxy_async()  # the landed copies are read through the async proxy
        cuda.syncthreads()

    @device_function
    def prefetch(k_head, v_head, smem, k_base, v_base, tid, j, n_tiles, n_first, key_end, head_dim):
        """Start copying tile ``j + 1`` over K of tile ``j - 1`` and V of tile ``j - 2``."""
        if j + 1 < n_tiles:
            n1 = n_first + (j + 1) * BLOCK_N
            load_tile(k_head, smem, k_base + ((j + 1) % 2) * TILE, tid, n1, key_end, head_dim)
            load_tile(v_head, smem, v_base + ((j + 1) % 3) * TILE, tid, n1, key_end, head_dim)
            commit()

    @device_function
    def probabilities(s, p):
        """P rounded to the input dtype as the A operand: the C fragments of n8 blocks 2kk, 2kk + 1 are the A
        fragment of k-step kk."""
        for kk in range(PV_STEPS):
            p[4 * kk] = pack(s[0, 2 * kk, 0], s[0, 2 * kk, 1])
            p[4 * kk + 1] = pack(s[0, 2 * kk, 2], s[0, 2 * kk, 3])
            p[4 * kk + 2] = pack(s[0, 2 * kk + 1, 0], s[0, 2 * kk + 1, 1])
            p[4 * kk + 3] = pack(s[0, 2 * kk + 1, 2], s[0, 2 * kk + 1, 3])

    @kernel_body
    def body(q, k, v, out, lse, write_lse, causal, scale_log2, schedule):
        tid, warp, lane, g, t = lane_position()  # warp w holds rows 16 w + g and 16 w + g + 8 of the block
        # causal: the longest (last) query blocks start first
        b, h, m0, q_head, k_head, v_head, out_head = position(q, k, v, out, causal, schedule)
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]
        row0 = m0 + 16 * warp + g  # rows of this thread: row0 and row0 + 8

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
        post = exponent(scale_log2, SCALE_FIRST)

        k_base = q_base + Q_TILE  # K: two stages; V: three (V of tile j - 1 is still read during tile j)
        v_base = k_base + 2 * TILE
        load_q_tile(q_head, smem, q_base, tid, m0, seqlen_q, head_dim)
        if n_tiles > 0:
            load_tile(k_head, smem, k_base, tid, n_first, key_end, head_dim)
            load_tile(v_head, smem, v_base, tid, n_first, key_end, head_dim)
        commit()
        if n_tiles > 0:  # tile 0: S_0, its softmax and P_0; O += P_0 V_0 overlaps tile 1's softmax
            arrive()
            q_times_k(s, smem, q_base, k_base)
            prefetch(k_head, v_head, smem, k_base, v_base, tid, 0, n_tiles, n_first, key_end, head_dim)
            wait_s(s)
            online_softmax(s, alpha, m_run, l_run, partial(n_first, m0, key_end, causal, diag_offset), n_first,
                           row0, t, key_end, causal, diag_offset, scale_log2, post)
            probabilities(s, p)  # O is still zero: nothing to rescale
        for j in range(1, n_tiles):
            n0 = n_first + j * BLOCK_N
            arrive()
            # S_j = Q K_j^T, and behind it O += P_{j-1} V_{j-1}, whose MMAs run under the softmax of S_j; the
            # next tile's copies are issued while the MMAs run
            q_times_k(s, smem, q_base, k_base + (j % 2) * TILE)
            p_times_v(acc, p, smem, v_base + ((j - 1) % 3) * TILE)
            prefetch(k_head, v_head, smem, k_base, v_base, tid, j, n_tiles, n_first, key_end, head_dim)
            wait_one(s)  # groups complete in order: S_j is done, P V may still run
            online_softmax(s, alpha, m_run, l_run, partial(n0, m0, key_end, causal, diag_offset), n0, row0, t,
                           key_end, causal, diag_offset, scale_log2, post)
            wait_o(acc)
            if not all_lanes(alpha[0] == ONE and alpha[1] == ONE):  # warp-uniform; mostly skipped after a while
                for ob in range(O_BLOCKS):
                    acc[0, ob, 0] *= alpha[0]
                    acc[0, ob, 1] *= alpha[0]
                    acc[0, ob, 2] *= alpha[1]
                    acc[0, ob, 3] *= alpha[1]
            probabilities(s, p)
        if n_tiles > 0:
            p_times_v(acc, p, smem, v_base + ((n_tiles - 1) % 3) * TILE)
            wait_o(acc)
        else:
            wait_all()  # no key to see: only the Q copies are in flight; let them land before the block ends

        # ---- epilogue: O / l in the input dtype, and lse --------------------------------------------------------
        finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, 0, seqlen_q, head_dim, write_lse, post)

    return common.entry_kernel(body, variant.packed)


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
