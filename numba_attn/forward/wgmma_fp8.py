"""The float8 (e4m3) flash forward on Hopper's warpgroup MMAs (``wgmma.mma_async ... k32.f32.e4m3.e4m3``, sm_90a).

Inputs: Q, K, V as e4m3 bit patterns (uint8 views; ``flash_forward`` takes torch ``float8_e4m3fn`` tensors) with
their descale factors -- per tensor (folded into the launch's scalars) or per (batch, head) (float32 arrays read
once per block): the scores are ``sm_scale * descale_q * descale_k * q.k`` of the e4m3 values, the output is
``descale_v * softmax(...) v`` in bfloat16 or float16. Same semantics as ``wgmma.launch`` otherwise (shapes
``(batch, heads, seqlen, headdim)``, GQA, bottom-right causal mask, sliding window and soft-capping as compile-time
variants, rows that see no key give 0 and ``lse = -inf``, natural-log lse).

The kernel is ``forward.wgmma``'s with 8-bit operands (one warpgroup = 64 query rows per block; the softmax of tile
``j`` runs under the MMAs ``O += P_(j-1) V_(j-1)``; ``core.softmax`` and ``core.epilogue`` unchanged). The
differences, all from the 8-bit MMA (``core.warpgroup``, ``core.fp8``):

* k = 32 per MMA: ``d_pad / 32`` MMAs for S, ``block_n / 32`` for P V; a 128-byte atom row holds 128 elements, so a
  tile of up to 128 head-dim columns is one atom column.
* P is rounded to e4m3 for the P V product (``core.fp8.probabilities``; FlashAttention-3 does the same), packed
  straight from the S accumulators thanks to a fixed permutation of the keys inside each 16-key group.
* V must be K-major (keys contiguous) for the B operand and 8-bit MMAs cannot transpose: each V tile is copied to a
  staging tile and transposed in the kernel into a ``V^T`` tile (``core.fp8.v_transposer``: 32-bit loads, byte
  permutes, 16-byte stores) while the MMAs of the tile run; the stores are published with ``fence.proxy.async`` and
  read by the tile's P V, issued after the next barrier.

Shared memory (uint16 units, 1024-byte aligned tiles): Q (64 rows of 128 bytes), two stages each of K (``block_n``
rows), V staging (``block_n`` rows) and ``V^T`` (``d_pad`` rows). Per tile ``j`` (tile 0 peeled, as in ``wgmma``):

    1. ``cp_async_wait_all`` + ``fence.proxy.async`` + barrier: K_j and the staged V_j have landed; ``V^T_(j-1)``
       (stored last iteration) is visible to the tensor cores; everyone is done with K_(j-1), staging j - 1 and
       ``V^T_(j-2)``.
    2. Issue ``S_j = Q K_j^T`` and ``O += P_(j-1) V_(j-1)``; start the copies of tile ``j + 1``.
    3. Transpose staging ``j`` into ``V^T_j`` (under the MMAs); ``fence.proxy.async``.
    4. ``wait_group 1``; the online softmax of ``S_j``; ``wait_group 0``; rescale O; pack ``P_j``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, types, uint16, uint32

from ..core import fp8
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
from ..runtime.views import restride
from . import common
from .common import PLAIN, Variant

MIN_COMPUTE_CAPABILITY = (9, 0)
#: head dims up to this (padded to a multiple of 32): one 128-byte atom column per row, O beside S in registers
MAX_HEAD_DIM = 128
BLOCK_M = wgmma.ROWS
THREADS = wgmma.WARPGROUP_THREADS
DTYPE = "float8_e4m3fn"
OUT_DTYPES = ("bfloat16", "float16")


V_TRANSPOSES = ("staging", "ldmatrix")


@dataclass(frozen=True)
class Fp8Config:
    """Tuning knobs of the fp8 kernel (validated where made)."""

    block_n: int = 128  # keys per K/V tile (a multiple of 32, at most 128: one atom row of V^T)
    blocks_per_sm: int = 2  # launch bound: resident blocks per SM ptxas must allow (caps the registers)
    #: how V becomes V^T: "staging" (V copied in ``core.fp8``'s staging layout, 32-bit loads, ``v_transposer``) or
    #: "ldmatrix" (V in the hardware's 128-byte swizzle, as the TMA would write it; ``v_transposer_swizzled``)
    v_transpose: str = "staging"

    def __post_init__(self):
        common.check_fields(self, block_n=(32, 128, 32), blocks_per_sm=(1, None, 1))
        if self.v_transpose not in V_TRANSPOSES:
            raise ValueError(f"Fp8Config.v_transpose: expected one of {V_TRANSPOSES}, got {self.v_transpose!r}")

    @property
    def block_m(self) -> int:
        return BLOCK_M

    @property
    def threads(self) -> int:
        return THREADS


DEFAULT_CONFIG = Fp8Config()
SIMULATOR_CONFIG = Fp8Config(block_n=32, blocks_per_sm=1)
#: a sliding window and soft-capping together: with 128-key tiles NVVM keeps the 64 scores of a lane in local memory
#: (a 256-byte stack frame, ptxas -v); 64-key tiles stay in registers
WINDOW_SOFTCAP_CONFIG = Fp8Config(block_n=64, blocks_per_sm=2)
TUNING_CANDIDATES = (DEFAULT_CONFIG, Fp8Config(block_n=64, blocks_per_sm=2), Fp8Config(v_transpose="ldmatrix"))


def default_config(window=None, softcap=None) -> Fp8Config:
    if SIMULATOR:
        return SIMULATOR_CONFIG
    return WINDOW_SOFTCAP_CONFIG if window is not None and softcap is not None else DEFAULT_CONFIG


def padded_head_dim(head_dim: int) -> int:
    return common.padded_head_dim(head_dim, 32)


def shared_bytes(config: Fp8Config, d_pad: int) -> int:
    """Q, two stages of K, of staged V and of V^T, rows of 128 bytes, plus 1 KB to align the first tile."""
    return 128 * (BLOCK_M + 4 * config.block_n + 2 * d_pad) + 1024


def supports(head_dim: int, *arrays) -> bool:
    """True when this kernel takes the call: a head dim that is a multiple of 16 (whole 16-byte pieces) up to
    ``MAX_HEAD_DIM``, rows that copy in aligned 16-byte pieces, sm_90 (the simulator runs it too)."""
    return (head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM and common.runs_here(MIN_COMPUTE_CAPABILITY)
            and common.vector_loads_ok(*arrays))


def _kernel_source(config: Fp8Config, d_pad: int, bf16_out: bool, scale_first: bool = False,
                   per_head: bool = False, variant: Variant = PLAIN, transpose: bool = True):
    """The Python function of one specialisation (not yet jitted): tiles, padded head dim, output dtype, sign of
    the scale, per-head descale arrays read or not, and the variant (window, soft-capping; not packed).
    ``transpose=False`` is a timing probe only (``scripts/check_fp8.py --part share``): V^T is never written, the
    results are wrong."""
    TRANSPOSE = transpose
    if variant.packed:
        raise ValueError("the fp8 kernel takes no packed sequences")
    BLOCK_N = config.block_n
    ROW = 64  # uint16 elements of a 128-byte tile row
    Q_TILE = BLOCK_M * ROW
    KV_TILE = BLOCK_N * ROW
    VT_TILE = d_pad * ROW
    S_BLOCKS = BLOCK_N // 8
    PV_STEPS = BLOCK_N // 32
    P_WORDS = 4 * PV_STEPS
    O_BLOCKS = d_pad // 8
    QK_STEPS = d_pad // 32
    SCALE_FIRST = scale_first
    q_times_k = wgmma.wgmma_ss_e4m3(BLOCK_N, QK_STEPS, wgmma.k_major(BLOCK_M, QK_STEPS),
                                    wgmma.k_major(BLOCK_N, QK_STEPS), wait=False)
    p_times_v = wgmma.wgmma_rs_e4m3(d_pad, PV_STEPS, wgmma.k_major(d_pad, PV_STEPS), wait=False)
    wait_one = wgmma.wgmma_wait(BLOCK_N, 1)
    wait_s = wgmma.wgmma_wait(BLOCK_N, 0)
    wait_o = wgmma.wgmma_wait(d_pad, 0)
    all_lanes = ptx.all_lanes
    ONE = np.float32(1.0)
    shared_address = wgmma.shared_address
    fence_proxy_async = wgmma.fence_proxy_async
    commit = ptx.cp_async_commit
    wait_all = ptx.cp_async_wait_all
    load_q_tile = swizzled_tile_loader(BLOCK_M, d_pad, THREADS, 1)
    load_k_tile = swizzled_tile_loader(BLOCK_N, d_pad, THREADS, 1)
    if config.v_transpose == "staging":
        load_v_tile = fp8.staging_loader(BLOCK_N, d_pad, THREADS)
        transpose_v = fp8.v_transposer(BLOCK_N, d_pad, THREADS)
    else:
        load_v_tile = swizzled_tile_loader(BLOCK_N, d_pad, THREADS, 1)
        transpose_v = fp8.v_transposer_swizzled(BLOCK_N, d_pad, THREADS)
    probabilities = fp8.probabilities(PV_STEPS)
    scales = fp8.descaled(per_head)
    position = block_position_of(QUERY_MAJOR, BLOCK_M, False)
    bounds = sequence_bounds_of(False)
    exponent = exponent_scale_for(variant.softcap)
    walk_tiles = key_tile_walk(BLOCK_M, BLOCK_N, variant.window)
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    start = softmax_start(1, O_BLOCKS)
    online_softmax = softmax_update(1, S_BLOCKS, O_BLOCKS, SCALE_FIRST, rescale_output=False,
                                    window=variant.window, softcap=variant.softcap, precise_tanh=False)
    finish = store_rows(1, O_BLOCKS, as_16bit(bf16_out), scaled=True)

    @device_function
    def arrive():
        """This thread's copies and V^T stores are done; after the barrier everyone's are, visible to the tensor
        cores."""
        wait_all()
        fence_proxy_async()
        cuda.syncthreads()

    @device_function
    def prefetch(k_head, v_head, smem, k_base, s_base, tid, j, n_tiles, n_first, key_end, head_dim):
        """Start copying tile ``j + 1`` over K of tile ``j - 1`` and the staging of tile ``j - 1``."""
        if j + 1 < n_tiles:
            n1 = n_first + (j + 1) * BLOCK_N
            load_k_tile(k_head, smem, k_base + ((j + 1) % 2) * KV_TILE, tid, n1, key_end, head_dim)
            load_v_tile(v_head, smem, s_base + ((j + 1) % 2) * KV_TILE, tid, n1, key_end, head_dim)
            commit()

    @kernel_body
    def body(q, k, v, out, lse, write_lse, causal, scale_log2, out_scale, descale_q, descale_k, descale_v):
        tid, warp, lane, g, t = lane_position()
        b, h, m0, q_head, k_head, v_head, out_head = position(q, k, v, out, causal, lse)
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, b, lse)
        head_dim = q.shape[3]
        row0 = m0 + 16 * warp + g
        scale, v_scale = scales(scale_log2, out_scale, descale_q, descale_k, descale_v, b, h, q.shape[1])

        smem = cuda.shared.array(0, uint16)
        q_base = ((1024 - shared_address(smem) % 1024) % 1024) // 2
        s = cuda.local.array((1, S_BLOCKS, 4), float32)
        acc = cuda.local.array((1, O_BLOCKS, 4), float32)
        p = cuda.local.array(P_WORDS, uint32)
        alpha = cuda.local.array(2, float32)
        m_run = cuda.local.array(2, float32)
        l_run = cuda.local.array(2, float32)
        start(m_run, l_run, acc)

        n_first, n_tiles = walk_tiles(m0, key_start, key_end, causal, diag_offset)
        post = exponent(scale, SCALE_FIRST)

        k_base = q_base + Q_TILE  # then two stages each of K, V staging and V^T
        s_base = k_base + 2 * KV_TILE
        vt_base = s_base + 2 * KV_TILE
        load_q_tile(q_head, smem, q_base, tid, m0, seqlen_q, head_dim)
        if n_tiles > 0:
            load_k_tile(k_head, smem, k_base, tid, n_first, key_end, head_dim)
            load_v_tile(v_head, smem, s_base, tid, n_first, key_end, head_dim)
        commit()
        if n_tiles > 0:  # tile 0: S_0, V^T_0, its softmax and P_0
            arrive()
            q_times_k(s, smem, q_base, k_base)
            prefetch(k_head, v_head, smem, k_base, s_base, tid, 0, n_tiles, n_first, key_end, head_dim)
            if TRANSPOSE:
                transpose_v(smem, s_base, vt_base, tid)
            wait_s(s)
            online_softmax(s, alpha, m_run, l_run, partial(n_first, m0, key_end, causal, diag_offset), n_first,
                           row0, t, key_end, causal, diag_offset, scale, post)
            probabilities(s, p)
        for j in range(1, n_tiles):
            n0 = n_first + j * BLOCK_N
            arrive()
            q_times_k(s, smem, q_base, k_base + (j % 2) * KV_TILE)
            p_times_v(acc, p, smem, vt_base + ((j - 1) % 2) * VT_TILE)
            prefetch(k_head, v_head, smem, k_base, s_base, tid, j, n_tiles, n_first, key_end, head_dim)
            if TRANSPOSE:
                transpose_v(smem, s_base + (j % 2) * KV_TILE, vt_base + (j % 2) * VT_TILE, tid)
            wait_one(s)
            online_softmax(s, alpha, m_run, l_run, partial(n0, m0, key_end, causal, diag_offset), n0, row0, t,
                           key_end, causal, diag_offset, scale, post)
            wait_o(acc)
            if not all_lanes(alpha[0] == ONE and alpha[1] == ONE):
                for ob in range(O_BLOCKS):
                    acc[0, ob, 0] *= alpha[0]
                    acc[0, ob, 1] *= alpha[0]
                    acc[0, ob, 2] *= alpha[1]
                    acc[0, ob, 3] *= alpha[1]
            probabilities(s, p)
        if n_tiles > 0:
            arrive()  # the last V^T tile's stores, visible to the tensor cores
            p_times_v(acc, p, smem, vt_base + ((n_tiles - 1) % 2) * VT_TILE)
            wait_o(acc)
        else:
            wait_all()

        finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, 0, seqlen_q, head_dim, write_lse, post, v_scale)

    def kernel(q, k, v, out, lse, write_lse, causal, scale_log2, out_scale, descale_q, descale_k, descale_v):
        body(q, k, v, out, lse, write_lse, causal, scale_log2, out_scale, descale_q, descale_k, descale_v)

    return kernel


def _signature() -> types.Signature:
    operand = types.Array(types.uint8, 4, "A")
    descale = types.Array(types.float32, 2, "A")
    return types.void(operand, operand, operand, types.Array(types.uint16, 4, "A"),
                      types.Array(types.float32, 3, "A"), types.boolean, types.boolean, types.float32, types.float32,
                      descale, descale, descale)


SIGNATURE = _signature()


@lru_cache(maxsize=None)
def flash_fp8_kernel(config: Fp8Config, head_dim_pad: int, bf16_out: bool, scale_first: bool = False,
                     per_head: bool = False, variant: Variant = PLAIN, transpose: bool = True):
    """The compiled kernel of one specialisation (``transpose=False``: the timing probe of ``_kernel_source``)."""
    if head_dim_pad % 32 or not 32 <= head_dim_pad <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim_pad must be a multiple of 32 in [32, {MAX_HEAD_DIM}], got {head_dim_pad}")
    source = _kernel_source(config, head_dim_pad, bf16_out, scale_first, per_head, variant, transpose)
    return kernel_jit((THREADS, config.blocks_per_sm), SIGNATURE)(source)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream, descale=None,
           config: Fp8Config | None = None, out_dtype: str = "bfloat16", window=None, softcap: float | None = None,
           _transpose: bool = True):
    """Launch on device views of shape (batch, heads, seqlen, headdim): ``q``, ``k``, ``v`` e4m3 bit patterns
    (uint8), ``out`` 16-bit bit patterns of ``out_dtype`` (bfloat16 or float16), ``lse`` (batch, heads, seqlen_q)
    float32. ``descale``: None (all 1), ``(dq, dk, dv)`` floats (per tensor), or three float32 2-D device views
    ``(batch, heads)`` / ``(batch, kv_heads)`` (per head; any strides, zero strides broadcast one value), the
    factors that take the e4m3 values back to the quantised tensors'. ``window``, ``softcap``: as
    ``wgmma.launch``."""
    config = config or default_config(window, softcap)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype!r}")
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if np.dtype(x.dtype) != np.uint8:
            raise TypeError(f"{name}: expected float8 e4m3 bit patterns (uint8), got {np.dtype(x.dtype)}")
    out = common.bits(out, "out")
    if not supports(head_dim, q, k, v):
        raise ValueError("q, k, v: the fp8 kernel needs headdim % 16 == 0 up to 128, a unit-stride last axis and "
                         f"16-byte aligned rows, on sm_90; got headdim {head_dim}")
    per_head = descale is not None and not all(isinstance(x, (int, float)) for x in descale)
    scalars = (1.0, 1.0, 1.0) if descale is None or per_head else tuple(float(x) for x in descale)
    d_pad = padded_head_dim(head_dim)
    nbytes = shared_bytes(config, d_pad)
    common.check_shared_memory(nbytes)
    scale_log2, scale_first = common.scale_args(sm_scale * scalars[0] * scalars[1], softcap)
    kernel = flash_fp8_kernel(config, d_pad, out_dtype == "bfloat16", scale_first, per_head,
                              Variant.of(bool(causal), window, softcap, False), _transpose)
    arrays = descale if per_head else (_placeholder(lse),) * 3
    shape = common.launch_grid(QUERY_MAJOR, batch, heads, seqlen_q, BLOCK_M)
    device_launch(kernel, shape, THREADS, stream, nbytes, q, k, v, out, lse, bool(write_lse), bool(causal),
                  scale_log2, float(np.float32(scalars[2])), *arrays)


def _placeholder(lse):
    """A float32 2-D view that per-tensor launches never read: ``lse``'s memory seen as one element (under the
    simulator a small array)."""
    if SIMULATOR:
        return np.zeros((1, 1), np.float32)
    return restride(lse, (1, 1), (0, 0))
