"""FlashAttention-2 forward for float32 on tensor cores: ``mma.sync.m16n8k8`` with tf32 operands, float32 accumulation.

Same interface and semantics as ``flash_mma.launch`` and ``flash_simt.launch``: float32 views of shape
``(batch, heads, seqlen, headdim)`` with any strides, grouped-query heads (q head ``h`` reads kv head
``h // (heads // kv_heads)``), bottom-right causal mask (query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``), rows
that see no key give 0 and ``lse = -inf``, lse in natural log.

Accuracy: 3xTF32
    A tf32 operand keeps 10 of float32's 23 mantissa bits, so one tf32 product is good to about 1e-3 -- far from the
    1e-5 this package promises for float32. Every operand ``x`` is therefore split into ``hi = tf32(x)`` and
    ``lo = tf32(x - hi)`` (``x - hi`` is exact in float32), and a product ``a b`` is taken as
    ``a_lo b_hi + a_hi b_lo + a_hi b_hi`` -- three MMAs into the same float32 accumulator, small terms first so they
    are not lost against the big one. The dropped ``a_lo b_lo`` is below 2^-22 of ``a b``: the attention output
    then agrees with a float64 reference to about 2e-7 under the simulator (relative Frobenius norm), 1.3e-6 ..
    1.7e-6 on an H100.
    ``allow_tf32=True`` (``tf32_only``) keeps only ``a_hi b_hi``: a third of the MMAs and about 5e-4 error.
    (This is CUTLASS's ``OpMultiplyAddFastF32``, which torch's memory-efficient fp32 attention uses.)
    The tensor cores' float32 accumulation does not round to nearest, so nothing is accumulated across key tiles
    through an MMA's C operand: each tile's ``P V`` starts from zero accumulators and is added to ``O`` with float32
    FMAs (``O = alpha O + P V``). Feeding ``O`` as C instead gave an error that grew with the number of key tiles
    (H100, 2026-11-22, D = 128 non-causal: 1.5e-5 at 2k keys, 3.0e-5 at 4k, over the 1e-5 bound). ``S = Q K^T``
    starts from zero on every tile.

Work split
    As in ``flash_mma``: one block = ``warps`` warps = ``16 * warps`` query rows of one (batch, head); warp ``w`` owns
    rows ``16 w .. 16 w + 15``, the M of one MMA, so a row's softmax statistics stay in the 4 lanes that hold it. The
    block walks the keys in tiles of ``block_n``.

Fragments (``ptx`` module docstring: m16n8k8 tf32 layout and the k permutation)
    Both products use the permutation "A column ``t`` <-> k ``2t``, column ``t + 4`` <-> k ``2t + 1``":

    * ``S = Q K^T`` (k = head-dim column): the A registers of lane ``(g, t)`` are Q rows ``g`` and ``g + 8``, columns
      ``8 kk + 2t`` and ``8 kk + 2t + 1``; the B registers are K row ``8 nb + g`` at the same two columns -- two
      neighbouring words, read by one 8-byte shared load (``ptx.load_f32x2``).
    * ``P V`` (k = key): the C fragment ``(c0, c1, c2, c3)`` of S block ``j`` IS the A fragment of k-step ``j``
      as ``(c0, c2, c1, c3)``, so P never leaves the registers; the B registers are V rows (keys) ``8 j + 2t`` and
      ``8 j + 2t + 1`` of column ``8 ob + g``.

Per K/V tile
    All threads copy K ``[key][d]`` and V ``[key][d]`` (float32, not pre-split: the split costs three ALU
    instructions per element where the MMA unit is the bottleneck, and keeping raw floats halves the shared memory)
    into dynamic shared memory, zero for keys >= seqlen_k and columns >= headdim (padding adds exactly 0, never NaN).
    Row strides are chosen so the fragment loads hit 32 banks: K (8-byte loads, two phases of 16 lanes reading
    ``g * stride + 2t``) needs ``stride = 8 mod 16``; V (4-byte loads at ``2t * stride + g``) needs ``stride = 4 mod 8``.
    Then ``S = Q K^T``, the online softmax on the C fragments (base 2, two butterfly shuffles per row statistic,
    masks only on tiles that cross the diagonal or the end of the keys), ``P`` split once into hi / lo A fragments,
    then per output n8 block ``r = P V`` from zero (its k-steps chained through C within the tile) and
    ``O = alpha O + r``; one division by ``l`` at the end.

Q and head dims
    The head dim is padded to a multiple of 8 inside the kernel. Q sits in shared memory for the whole kernel and a
    warp reads its A fragments per k-step (two 8-byte loads, split into hi / lo in 12 ALU instructions shared by
    ``block_n / 8`` MMA triples). Keeping them in registers instead (``max_q_regs_dim``, off by default) costs more
    than it looks: NVVM hoists the tile-invariant split out of the key loop, so hi and lo both stay live
    (``head_dim_pad`` registers) and the kernel spills at D = 64. Above ``max_single_pass_dim`` (128) the kernel makes
    two passes over the keys, each accumulating half of the output columns (S is recomputed, identical, so ``m`` and
    ``l`` agree): one pass of 256 columns needs 128 accumulator registers and spills even with 16-key tiles.
    ``P V`` is unrolled completely, and NVVM stops unrolling a nest between 192 and 384 MMAs, so the key tile is
    cut to ``max_pv_mmas``. ``gpu_config``: 8 warps and 16-key tiles for every head dim (measured faster than the
    earlier 4-warp tiles; spill-free everywhere).

Specialisations (compiled once each, cached on disk): tiles, padded head dim and ``tf32_only``. Causality is a run-time
flag. Register arrays are indexed only inside loops over compile-time constants (fully unrolled by NVVM, so they
stay in registers); shared-memory offsets are unsigned (no negative-index wraparound code).

Under the CUDA simulator the same code runs with the ``ptx`` emulations (``SIMULATOR_CONFIG``: one warp, tiny tiles
that still take the Q-in-shared-memory and two-pass branches at small head dims).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, types, uint32
from numba import uint32 as index  # unsigned shared-memory offsets: no negative-index wraparound code

from .._device import SIMULATOR, cuda
from .._device import launch as device_launch
from . import ptx

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

#: dynamic shared memory one block may use on sm_80 / sm_90 (227 KB on an H100; an A100 allows 163 KB, where the
#: launch reports the device's own limit)
MAX_SHARED_BYTES = 227 * 1024


@dataclass(frozen=True)
class Tf32Config:
    """Tuning knobs of the fp32 tensor-core kernel."""

    warps: int = 8  # warps per block; each owns 16 query rows, so block_m = 16 * warps
    block_n: int = 16  # keys per K/V tile (multiple of 8); max_pv_mmas may cut it for large head dims
    # the P V loop nest must be unrolled completely (P and O are register arrays indexed by its counters), and
    # NVVM stops unrolling a nest somewhere between 192 and 384 MMAs (ptxas -v then shows a stack frame): tiles are
    # cut to block_n * d_pass * terms / 64 <= max_pv_mmas (terms: 3, or 1 for plain tf32)
    max_pv_mmas: int = 192
    # padded head dims up to this keep Q's fragments in registers (raw float32, head_dim_pad / 2 registers); larger
    # ones read them from shared memory per k-step. 0 by default: NVVM hoists the tile-invariant hi / lo split out of
    # the key loop, which doubles those registers, and the kernel spills at D = 64 already
    max_q_regs_dim: int = 0
    max_single_pass_dim: int = 128  # padded head dims above this take two passes over output halves
    # launch bound, as warps per SM to keep resident: min blocks per SM = min_warps // warps (at least 1), which
    # caps the registers at 64K / (32 * warps * blocks)
    min_warps: int = 8

    @property
    def block_m(self) -> int:
        return 16 * self.warps

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
#: tiles for the CUDA simulator, where every thread is a Python thread and every MMA a block-wide barrier: one warp,
#: 16-key tiles; Q's fragments in registers up to 16 columns, in shared memory above, two passes above 32
SIMULATOR_CONFIG = Tf32Config(warps=1, block_n=16, max_q_regs_dim=16, max_single_pass_dim=32)
#: mma.sync.m16n8k8 with tf32 operands and cvt.rna.tf32.f32 need sm_80 or newer
MIN_COMPUTE_CAPABILITY = (8, 0)
DTYPES = ("float32",)


def default_config(head_dim: int = 64, tf32_only: bool = False) -> Tf32Config:
    return SIMULATOR_CONFIG if SIMULATOR else gpu_config(head_dim, tf32_only)


def gpu_config(head_dim: int, tf32_only: bool = False) -> Tf32Config:
    """Tiles on a GPU: 8 warps (128 query rows) and 16-key tiles for every head dim and both accuracy modes.

    Measured on an H100, 2026-11-22 (``scripts/check_tf32.py --config warps=8,block_n=16 --lengths 2048,4096``,
    B = 4; D = 64 H = 48 and D = 128 H = 32, causal or not): the earlier per-head-dim tiles (4 warps; 64 keys up to
    D = 64, 24 / 32 keys up to D = 128, 32 / 24 above) ran at 9.3-9.8 TFLOP/s (3xTF32) and 10.1-10.6 (plain tf32);
    warps=8, block_n=16 at 12.3-13.8 (3xTF32). For comparison, same runs: the SIMT fp32 kernel 16.6-20.2, torch SDPA
    fp32 33.3-48.0 -- so this kernel is not the float32 default (``api._flash_backend``). Re-timed with these tiles
    after the per-tile accumulator fix (``--part timing``): 3xTF32 11.7-13.4, plain tf32 14.7-17.3, SIMT 16.3-20.2. Only 3xTF32 at D = 64 and
    128 was timed with these tiles; plain tf32 and D > 128 (two passes of 128 columns, per pass the shape of D = 128)
    take them because ptxas is clean there too. ``scripts/check_tf32.py --compile-only`` (ptxas 13, sm_90, 255-register
    cap under the launch bound), with the per-tile P V accumulators: no spills at any head dim. Registers (3xTF32 /
    tf32) at padded D = 8: 89 / 79, 40: 183 / 158, 64: 201 / 204, 80: 227 / 236, 112: 255 / 230, 128: 255 / 255,
    160: 249 / 230, 208: 255 / 246, 256: 255 / 255. (The earlier 4-warp tiles spilled at 208 and 256 with 32-key
    tiles once P V got its own accumulators.) Shared memory: 87 KB at D = 128, 102-161 KB above, more than the
    99 KB a block may use on sm_86 / sm_89 (the launch then reports the device's limit)."""
    return DEFAULT_CONFIG


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
    block_n: int
    d_pad: int
    d_pass: int
    q_shared: bool

    @property
    def passes(self) -> int:
        return self.d_pad // self.d_pass

    @property
    def block_m(self) -> int:
        return 16 * self.warps

    @property
    def k_stride(self) -> int:  # words per K (and Q) row: = 8 mod 16 so that 8-byte fragment loads are conflict-free
        return self.d_pad if self.d_pad % 16 == 8 else self.d_pad + 8

    @property
    def v_stride(self) -> int:  # words per V row: = 4 mod 8 so that 4-byte fragment loads are conflict-free
        return self.d_pass + 4

    @property
    def v_offset(self) -> int:
        return self.block_n * self.k_stride

    @property
    def q_offset(self) -> int:
        return self.v_offset + self.block_n * self.v_stride

    @property
    def shared_bytes(self) -> int:
        return 4 * (self.q_offset + (self.block_m * self.k_stride if self.q_shared else 0))


def tiles_for(config: Tf32Config, head_dim_pad: int, tf32_only: bool = False) -> _Tiles:
    if head_dim_pad % 8 or not 8 <= head_dim_pad <= 256:
        raise ValueError(f"head_dim_pad must be a multiple of 8 in [8, 256], got {head_dim_pad}")
    if config.warps < 1 or config.min_warps < 1:
        raise ValueError(f"warps and min_warps must be >= 1, got {config.warps} and {config.min_warps}")
    if config.block_n % 8 or config.block_n < 8:
        raise ValueError(f"block_n must be a positive multiple of 8, got {config.block_n}")
    if head_dim_pad > config.max_single_pass_dim:
        if head_dim_pad % 16:
            raise ValueError(f"two passes need a head_dim_pad that is a multiple of 16, got {head_dim_pad}")
        d_pass = head_dim_pad // 2
    else:
        d_pass = head_dim_pad
    terms = 1 if tf32_only else 3
    block_n = min(config.block_n, max(8, config.max_pv_mmas * 64 // (d_pass * terms) // 8 * 8))
    tiles = _Tiles(config.warps, block_n, head_dim_pad, d_pass, head_dim_pad > config.max_q_regs_dim)
    if tiles.shared_bytes > MAX_SHARED_BYTES:
        raise ValueError(f"tiles need {tiles.shared_bytes} bytes of shared memory, more than the {MAX_SHARED_BYTES} "
                         f"a block may use (fewer warps or keys per tile)")
    return tiles


_F32_4D = types.Array(types.float32, 4, "A")
_F32_3D = types.Array(types.float32, 3, "A")
#: one signature for every layout (layout 'A' takes contiguous and strided views alike: one compile per shape)
SIGNATURE = types.void(_F32_4D, _F32_4D, _F32_4D, _F32_4D, _F32_3D, types.boolean, types.boolean, types.float32)


def _jit(launch_bounds):
    if SIMULATOR:
        return cuda.jit
    return cuda.jit(SIGNATURE, launch_bounds=launch_bounds, cache=True)


def _device_function(fn):
    """A device function NVVM always inlines (a plain function under the simulator)."""
    if SIMULATOR:
        return fn
    return cuda.jit(device=True, forceinline=True)(fn)


def _split_and_mma(tf32_only: bool):
    """``(split, mma_acc)`` for one accuracy mode.

    ``split(x) -> (hi, lo)``: tf32 bit patterns with ``hi + lo = x`` to about 2^-22 (``lo`` unused, 0, when
    ``tf32_only``). ``mma_acc(a hi x4, a lo x4, b hi x2, b lo x2, c x4) -> d x4``: ``c + A B`` as three MMAs
    (lo * hi, hi * lo, hi * hi: the small terms first) or one (hi * hi)."""
    to_tf32 = ptx.to_tf32
    bits_float = ptx.bits_float
    mma = ptx.mma_m16n8k8_tf32

    def split3(x):
        hi = to_tf32(x)
        return hi, to_tf32(x - bits_float(hi))

    def split1(x):
        return to_tf32(x), 0

    def mma3(ah0, ah1, ah2, ah3, al0, al1, al2, al3, bh0, bh1, bl0, bl1, c0, c1, c2, c3):
        c0, c1, c2, c3 = mma(al0, al1, al2, al3, bh0, bh1, c0, c1, c2, c3)
        c0, c1, c2, c3 = mma(ah0, ah1, ah2, ah3, bl0, bl1, c0, c1, c2, c3)
        return mma(ah0, ah1, ah2, ah3, bh0, bh1, c0, c1, c2, c3)

    def mma1(ah0, ah1, ah2, ah3, al0, al1, al2, al3, bh0, bh1, bl0, bl1, c0, c1, c2, c3):
        return mma(ah0, ah1, ah2, ah3, bh0, bh1, c0, c1, c2, c3)

    if tf32_only:
        return _device_function(split1), _device_function(mma1)
    return _device_function(split3), _device_function(mma3)


def _kernel_source(tiles: _Tiles, tf32_only: bool):
    """The Python function of one specialisation (not yet jitted); also what ``compile_ptx`` checks offline."""
    WARPS = tiles.warps
    NT = 32 * WARPS
    BLOCK_M = tiles.block_m
    BLOCK_N = tiles.block_n
    D_PAD = tiles.d_pad
    D_PASS = tiles.d_pass
    PASSES = tiles.passes
    Q_SHARED = tiles.q_shared
    QK_STEPS = D_PAD // 8  # k-steps of S = Q K^T
    S_BLOCKS = BLOCK_N // 8  # n8 blocks of S = k-steps of P V
    O_BLOCKS = D_PASS // 8  # n8 blocks of O
    Q_REGS = 1 if Q_SHARED else QK_STEPS  # register Q fragments (a dummy array when Q is in shared memory)
    K_STRIDE = tiles.k_stride
    V_STRIDE = tiles.v_stride
    V_OFF = tiles.v_offset
    Q_OFF = tiles.q_offset
    # copy loops with compile-time trip counts (unrolled: all loads of a thread can be in flight together)
    K_COPIES = -(-BLOCK_N * D_PAD // NT)
    K_EXACT = BLOCK_N * D_PAD % NT == 0
    V_COPIES = -(-BLOCK_N * D_PASS // NT)
    V_EXACT = BLOCK_N * D_PASS % NT == 0
    Q_COPIES = -(-BLOCK_M * D_PAD // NT)
    Q_EXACT = BLOCK_M * D_PAD % NT == 0
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    split, mma_acc = _split_and_mma(tf32_only)
    exp2 = ptx.exp2_approx
    shfl_xor = ptx.shfl_xor_f32
    load2 = ptx.load2
    store2 = ptx.store2
    load_f32x2 = ptx.load_f32x2

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
        row0 = m0 + 16 * warp + g
        row1 = row0 + 8

        # [K: block_n x K_STRIDE][V: block_n x V_STRIDE][Q: block_m x K_STRIDE, only when Q_SHARED], float32 words
        smem = cuda.shared.array(0, float32)
        q_frag = cuda.local.array((Q_REGS, 4), float32)
        s = cuda.local.array((S_BLOCKS, 4), float32)
        acc = cuda.local.array((O_BLOCKS, 4), float32)
        p_hi = cuda.local.array((S_BLOCKS, 4), uint32)  # P's A fragments (tf32 bit patterns), per key tile
        p_lo = cuda.local.array((S_BLOCKS, 4), uint32)  # their low parts (unused, 0, when tf32_only)

        # ---- Q: fragments in registers, or the block's rows in shared memory (published by the first tile's barrier)
        if Q_SHARED:
            for i in range(Q_COPIES):
                idx = tid + NT * i
                if Q_EXACT or idx < BLOCK_M * D_PAD:
                    r = idx // D_PAD
                    c = idx - r * D_PAD
                    val = ZERO
                    if m0 + r < seqlen_q and c < head_dim:
                        val = load2(q_head, m0 + r, c)
                    smem[index(Q_OFF + r * K_STRIDE + c)] = val
        else:
            for kk in range(QK_STEPS):
                for e in range(4):  # (a0, a1, a2, a3) = rows (g, g + 8, g, g + 8), columns (2t, 2t, 2t + 1, 2t + 1)
                    row = row0 + 8 * (e % 2)
                    col = 8 * kk + 2 * t + e // 2
                    val = ZERO
                    if row < seqlen_q and col < head_dim:
                        val = load2(q_head, row, col)
                    q_frag[kk, e] = val

        n_end = seqlen_k
        if causal:
            n_end = min(seqlen_k, max(0, m0 + BLOCK_M + diag_offset))
        q_row0 = Q_OFF + (16 * warp + g) * K_STRIDE + 2 * t  # this lane's Q words in shared memory (Q_SHARED)
        q_row1 = q_row0 + 8 * K_STRIDE
        k_lane = g * K_STRIDE + 2 * t  # this lane's K words within a (key block, k-step)
        v_lane = V_OFF + 2 * t * V_STRIDE + g  # this lane's V word within a (k-step, output block)

        for p in range(PASSES):
            d_off = p * D_PASS  # first output column of this pass
            m_0 = NEG_INF  # running row maxima (base 2) of rows row0, row1
            m_1 = NEG_INF
            l_0 = ZERO  # this thread's part of the row sums
            l_1 = ZERO
            for ob in range(O_BLOCKS):
                for e in range(4):
                    acc[ob, e] = ZERO

            for n0 in range(0, n_end, BLOCK_N):
                cuda.syncthreads()  # everyone is done with the previous tile
                for i in range(K_COPIES):  # consecutive threads: consecutive columns of one key row
                    idx = tid + NT * i
                    if K_EXACT or idx < BLOCK_N * D_PAD:
                        c = idx // D_PAD
                        col = idx - c * D_PAD
                        val = ZERO
                        if n0 + c < seqlen_k and col < head_dim:
                            val = load2(k_head, n0 + c, col)
                        smem[index(c * K_STRIDE + col)] = val
                for i in range(V_COPIES):
                    idx = tid + NT * i
                    if V_EXACT or idx < BLOCK_N * D_PASS:
                        c = idx // D_PASS
                        col = idx - c * D_PASS
                        val = ZERO
                        if n0 + c < seqlen_k and d_off + col < head_dim:
                            val = load2(v_head, n0 + c, d_off + col)
                        smem[index(V_OFF + c * V_STRIDE + col)] = val
                cuda.syncthreads()

                # ---- S = Q K^T --------------------------------------------------------------------------------------
                for nb in range(S_BLOCKS):
                    for e in range(4):
                        s[nb, e] = ZERO
                for kk in range(QK_STEPS):
                    if Q_SHARED:
                        x0, x2 = load_f32x2(smem, index(q_row0 + 8 * kk))
                        x1, x3 = load_f32x2(smem, index(q_row1 + 8 * kk))
                    else:
                        x0 = q_frag[kk, 0]
                        x1 = q_frag[kk, 1]
                        x2 = q_frag[kk, 2]
                        x3 = q_frag[kk, 3]
                    ah0, al0 = split(x0)
                    ah1, al1 = split(x1)
                    ah2, al2 = split(x2)
                    ah3, al3 = split(x3)
                    for nb in range(S_BLOCKS):
                        y0, y1 = load_f32x2(smem, index(k_lane + 8 * nb * K_STRIDE + 8 * kk))
                        bh0, bl0 = split(y0)
                        bh1, bl1 = split(y1)
                        r0, r1, r2, r3 = mma_acc(ah0, ah1, ah2, ah3, al0, al1, al2, al3, bh0, bh1, bl0, bl1,
                                                 s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3])
                        s[nb, 0] = r0
                        s[nb, 1] = r1
                        s[nb, 2] = r2
                        s[nb, 3] = r3

                # ---- online softmax (base 2), masks only on the diagonal / tail tiles ------------------------------
                needs_mask = n0 + BLOCK_N > seqlen_k
                if causal:
                    needs_mask = needs_mask or (n0 + BLOCK_N - 1 > m0 + diag_offset)
                mx_0 = NEG_INF
                mx_1 = NEG_INF
                for nb in range(S_BLOCKS):
                    for e in range(4):  # C fragment: rows (g, g, g + 8, g + 8), keys (2t, 2t + 1, 2t, 2t + 1)
                        x = s[nb, e] * scale_log2
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
                alpha_0 = exp2(m_0 - use_0)
                alpha_1 = exp2(m_1 - use_1)
                m_0 = new_0
                m_1 = new_1
                sum_0 = ZERO
                sum_1 = ZERO
                for nb in range(S_BLOCKS):
                    s[nb, 0] = exp2(s[nb, 0] - use_0)
                    s[nb, 1] = exp2(s[nb, 1] - use_0)
                    s[nb, 2] = exp2(s[nb, 2] - use_1)
                    s[nb, 3] = exp2(s[nb, 3] - use_1)
                    sum_0 += s[nb, 0] + s[nb, 1]
                    sum_1 += s[nb, 2] + s[nb, 3]
                l_0 = l_0 * alpha_0 + sum_0
                l_1 = l_1 * alpha_1 + sum_1
                # ---- O = alpha O + P V. S block j's C fragment (c0, c1, c2, c3) is k-step j's A fragment
                # (c0, c2, c1, c3); split once per tile, it replaces S in the registers.
                for j in range(S_BLOCKS):
                    for e in range(4):
                        hi, lo = split(s[j, 2 * (e % 2) + e // 2])
                        p_hi[j, e] = hi
                        p_lo[j, e] = lo
                # The tile's P V goes into fresh zero accumulators, one output block at a time, and is added to O
                # with ordinary (round-to-nearest) float32 FMAs, which also apply the rescale alpha. The tensor
                # cores' float32 accumulation does not round to nearest: feeding O itself as the C operand of every
                # tile's MMAs let a biased error grow with the number of key tiles (H100, D = 128, non-causal:
                # 1.5e-5 at 2k keys, 3.0e-5 at 4k, over the 1e-5 bound; the linear-attention chunked kernel had
                # the same bug). Block by block, only 4 accumulators more are live than with O as C (plus P's hi /
                # lo for the whole tile instead of one k-step).
                for ob in range(O_BLOCKS):
                    r0 = ZERO
                    r1 = ZERO
                    r2 = ZERO
                    r3 = ZERO
                    for j in range(S_BLOCKS):
                        # V rows (keys) 8j + 2t and 8j + 2t + 1, column 8 ob + g
                        y0 = smem[index(v_lane + 8 * j * V_STRIDE + 8 * ob)]
                        y1 = smem[index(v_lane + (8 * j + 1) * V_STRIDE + 8 * ob)]
                        bh0, bl0 = split(y0)
                        bh1, bl1 = split(y1)
                        r0, r1, r2, r3 = mma_acc(p_hi[j, 0], p_hi[j, 1], p_hi[j, 2], p_hi[j, 3],
                                                 p_lo[j, 0], p_lo[j, 1], p_lo[j, 2], p_lo[j, 3],
                                                 bh0, bh1, bl0, bl1, r0, r1, r2, r3)
                    acc[ob, 0] = acc[ob, 0] * alpha_0 + r0
                    acc[ob, 1] = acc[ob, 1] * alpha_0 + r1
                    acc[ob, 2] = acc[ob, 2] * alpha_1 + r2
                    acc[ob, 3] = acc[ob, 3] * alpha_1 + r3

            # ---- epilogue: full row sums, one division per row -------------------------------------------------------
            l_0 += shfl_xor(l_0, 1)
            l_0 += shfl_xor(l_0, 2)
            l_1 += shfl_xor(l_1, 1)
            l_1 += shfl_xor(l_1, 2)
            # rows that see no key (causal, Lq > Lk) give 0 and lse = -inf, as in the reference
            inv_0 = float32(1.0) / l_0 if l_0 > ZERO else ZERO
            inv_1 = float32(1.0) / l_1 if l_1 > ZERO else ZERO
            for ob in range(O_BLOCKS):
                col = d_off + 8 * ob + 2 * t
                if row0 < seqlen_q:
                    if col < head_dim:
                        store2(out_head, row0, col, acc[ob, 0] * inv_0)
                    if col + 1 < head_dim:
                        store2(out_head, row0, col + 1, acc[ob, 1] * inv_0)
                if row1 < seqlen_q:
                    if col < head_dim:
                        store2(out_head, row1, col, acc[ob, 2] * inv_1)
                    if col + 1 < head_dim:
                        store2(out_head, row1, col + 1, acc[ob, 3] * inv_1)
            if write_lse and p == 0 and t == 0:
                if row0 < seqlen_q:
                    lse[b, h, row0] = (m_0 + math.log2(l_0)) * LN2 if l_0 > ZERO else NEG_INF
                if row1 < seqlen_q:
                    lse[b, h, row1] = (m_1 + math.log2(l_1)) * LN2 if l_1 > ZERO else NEG_INF

    return kernel


@lru_cache(maxsize=None)
def flash_tf32_kernel(config: Tf32Config, head_dim_pad: int, tf32_only: bool):
    """The compiled kernel of one specialisation: tiles, padded head dim and accuracy mode are constants."""
    tiles = tiles_for(config, head_dim_pad, tf32_only)
    return _jit(config.launch_bounds())(_kernel_source(tiles, tf32_only))


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
    kernel = flash_tf32_kernel(config, d_pad, bool(tf32_only))
    grid = (batch * heads, -(-seqlen_q // config.block_m))
    device_launch(kernel, grid, config.threads, stream, tiles_for(config, d_pad, tf32_only).shared_bytes,
                  q, k, v, out, lse, bool(write_lse), bool(causal), np.float32(sm_scale * LOG2E))
