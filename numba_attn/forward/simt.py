"""Portable tiled online-softmax attention forward (FlashAttention-2 loop order), plain CUDA cores.

One thread block owns ``block_m`` query rows of one (batch, head) and walks the key/value sequence in tiles of
``block_n`` keys. The scores of a tile never leave the chip: ``S = Q K^T`` is accumulated in registers, the running
row max ``m`` and the sum ``l`` are updated (online softmax), ``P = exp2(S - m)`` goes through shared memory once to
meet ``V``, and the un-normalised output accumulator ``O`` is rescaled by ``exp2(m_old - m_new)``. ``O / l`` is
written once at the end. Scores are kept in base 2: ``sm_scale * log2(e)`` is folded into one multiply.

Thread layout: ``threads_x * threads_y`` threads; thread ``(ty, tx)`` owns rows ``ty + threads_y * i`` of the tile,
keys ``tx + threads_x * j`` of ``S`` and head-dim columns ``tx + threads_x * j`` of ``O``. The interleaving makes the
shared-memory reads of a warp hit consecutive words (no bank conflicts) and the output stores coalesce. ``Q^T`` stays
in shared memory for the whole kernel; each key tile brings ``K^T``, then ``V`` into the same words, and ``P^T``:
four barriers per tile. The buffer is dynamic shared memory (over 48 KB for large head dims, so the launch raises
the kernel's limit).

Masks come from ``core.mask`` / ``core.block_info``: causal, and a sliding window (a compile-time pair of sides, part
of the kernel's cache key) whose key tiles wholly outside the window are skipped; soft-capping of the scores
(``core.scores``) is a compile-time variant too.

Everything here also runs under ``NUMBA_ENABLE_CUDASIM=1`` (no warp shuffles: row reductions go through shared
memory), so the tile shape is a parameter and the tests use tiny tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32
from numba import uint32 as index  # unsigned shared-memory indices: Numba skips its negative-index wraparound code

from ..core.block_info import HEAD_MAJOR, block_position_of, key_tile_range, sequence_bounds_of
from ..core.mask import hidden_in, tile_is_partial
from ..core.scores import cap_post, score_cap
from ..core.softmax import log_sum_exp
from ..core.staging import float32_tile_copy, kernel_body
from ..runtime.device import SIMULATOR, cuda, kernel_jit
from ..runtime.launch import launch as device_launch
from . import common
from .common import PLAIN, Variant


@dataclass(frozen=True)
class SimtConfig:
    """Tuning knobs of the portable kernel."""

    threads_x: int = 16  # threads along keys / head dim
    threads_y: int = 8  # threads along query rows
    rows_per_thread: int = 8  # block_m = threads_y * rows_per_thread
    keys_per_thread: int = 4  # block_n = threads_x * keys_per_thread
    blocks_per_sm: int = 2  # launch bound: caps registers at 64K / (threads * blocks_per_sm)

    def __post_init__(self):
        common.check_fields(self, threads_x=(1, 1024, 1), threads_y=(1, 1024, 1), rows_per_thread=(1, None, 1),
                            keys_per_thread=(1, None, 1), blocks_per_sm=(1, None, 1))
        if self.threads > 1024:
            raise ValueError(f"SimtConfig: threads_x * threads_y must be at most 1024, got {self.threads}")

    @property
    def block_m(self) -> int:
        return self.threads_y * self.rows_per_thread

    @property
    def block_n(self) -> int:
        return self.threads_x * self.keys_per_thread

    @property
    def threads(self) -> int:
        return self.threads_x * self.threads_y

    def shared_words(self, head_dim_pad: int) -> int:
        """float32 words of dynamic shared memory: resident Q^T, one K^T-or-V tile, P^T, row partials."""
        q_t = head_dim_pad * (self.block_m + 1)
        kv = max(head_dim_pad * (self.block_n + 1), self.block_n * head_dim_pad)
        p_t = self.block_n * (self.block_m + 1)
        return q_t + kv + p_t + self.block_m * self.threads_x


#: Default tiles on a GPU by head dim (fastest of scripts/tune_flash.py on an H100: each thread keeps about 8 output
#: columns), and under the simulator, where every thread is a Python thread: keep blocks tiny.
GPU_CONFIG_SMALL_D = SimtConfig(threads_x=8, threads_y=16, rows_per_thread=8, keys_per_thread=8, blocks_per_sm=1)
GPU_CONFIG = SimtConfig(threads_x=16, threads_y=16, rows_per_thread=8, keys_per_thread=8, blocks_per_sm=1)
# head dims above 128: half the rows, so that the resident Q^T (and the rest) fit the 227 KB a block may have
GPU_CONFIG_LARGE_D = SimtConfig(threads_x=16, threads_y=8, rows_per_thread=8, keys_per_thread=4, blocks_per_sm=1)
SIMULATOR_CONFIG = SimtConfig(threads_x=4, threads_y=4, rows_per_thread=2, keys_per_thread=2)


#: float16 and float32 (bfloat16 needs the tensor-core kernels)
DTYPES = ("float16", "float32")


def default_config(head_dim: int = 128) -> SimtConfig:
    if SIMULATOR:
        return SIMULATOR_CONFIG
    if head_dim <= 64:
        return GPU_CONFIG_SMALL_D
    return GPU_CONFIG if head_dim <= 128 else GPU_CONFIG_LARGE_D


def supports(dtype: str, head_dim: int, *arrays) -> bool:
    """True when this kernel takes the call: float16 / float32, head dims up to 256, any strides, any GPU."""
    return dtype in DTYPES and 1 <= head_dim <= common.MAX_HEAD_DIM


def padded_head_dim(head_dim: int, config: SimtConfig) -> int:
    """Head dim rounded up to a whole number of columns per thread (``threads_x`` threads share a row)."""
    return common.padded_head_dim(head_dim, config.threads_x)


@lru_cache(maxsize=None)
def flash_forward_kernel(config: SimtConfig, head_dim_pad: int, causal: bool, variant: Variant = PLAIN):
    """Compile-time specialised kernel: tile shape, padded head dim, causality and the ``variant`` (the sliding
    window's sides, ``mask.window_sides``; the cap of the scores; ``PLAIN``: the causal-only code) are constants.
    With a cap ``c`` the kernel's ``scale_log2`` argument is ``sm_scale / c`` and a score is ``c log2 e tanh(s *
    scale_log2)`` (``core.scores``; ``math.tanh``: this kernel computes in float32 for float32 inputs)."""
    window = variant.window
    CAPPED = variant.softcap is not None
    CAP_POST = cap_post(variant.softcap) if CAPPED else np.float32(1.0)
    cap = score_cap(variant.softcap, precise=True)
    TX, TY = config.threads_x, config.threads_y
    RM, RN = config.rows_per_thread, config.keys_per_thread
    BLOCK_M, BLOCK_N = config.block_m, config.block_n
    NT = TX * TY
    RD = head_dim_pad // TX  # head-dim columns of O per thread
    D_PAD = head_dim_pad
    CAUSAL = causal
    # Transposed tiles get one word of padding per row so that the transposed stores spread over the banks.
    M_STRIDE = BLOCK_M + 1
    N_STRIDE = BLOCK_N + 1
    # Offsets into the one dynamic shared buffer (float32 words)
    KV_OFFSET = D_PAD * M_STRIDE
    P_OFFSET = KV_OFFSET + max(D_PAD * N_STRIDE, BLOCK_N * D_PAD)
    ROW_OFFSET = P_OFFSET + BLOCK_N * M_STRIDE
    NEG_INF = np.float32(-np.inf)  # a float32 constant keeps the softmax arithmetic in float32
    position = block_position_of(HEAD_MAJOR, BLOCK_M, variant.packed)
    bounds = sequence_bounds_of(variant.packed)
    partial = tile_is_partial(BLOCK_N, BLOCK_M, window)
    hidden = hidden_in(window)
    key_range = key_tile_range(BLOCK_M, BLOCK_N, window)
    copy_q_t = float32_tile_copy(TX, TY, BLOCK_M, D_PAD, 1, M_STRIDE)  # Q^T
    copy_k_t = float32_tile_copy(TX, TY, BLOCK_N, D_PAD, 1, N_STRIDE)  # K^T
    copy_v = float32_tile_copy(TX, TY, BLOCK_N, D_PAD, D_PAD, 1)  # V

    @kernel_body
    def body(q, k, v, out, lse, write_lse, scale_log2, schedule):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        # batch * heads on x, query tiles on y, in launch order (the causal kernels' longest-first order is not
        # used here)
        b, h, m0, q_head, k_head, v_head, out_head = position(q, k, v, out, False, schedule)
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]

        # One dynamic buffer, carved by hand:
        #   q_t[d * M_STRIDE + r]     Q^T of the block's rows, resident for the whole kernel
        #   kv[d * N_STRIDE + c]      K^T of the current tile, then (same words) kv[c * D_PAD + d] = V
        #   p_t[c * M_STRIDE + r]     P^T of the current tile
        #   row_part[r * TX + t]      per-thread partial row max / sum
        smem = cuda.shared.array(0, float32)
        copy_q_t(q_head, smem, 0, m0, seqlen_q, head_dim, ty, tx)

        acc = cuda.local.array((RM, RD), float32)
        s = cuda.local.array((RM, RN), float32)
        m_i = cuda.local.array(RM, float32)
        l_part = cuda.local.array(RM, float32)  # this thread's share of l; summed over the row at the end
        for i in range(RM):
            m_i[i] = NEG_INF
            l_part[i] = 0.0
            for j in range(RD):
                acc[i, j] = 0.0

        # the key tiles these rows see: to the diagonal when causal; tiles wholly outside a window are skipped
        n_begin, n_end = key_range(m0, key_start, key_end, CAUSAL, diag_offset)
        for n0 in range(n_begin, n_end, BLOCK_N):
            # ---- K^T tile -> shared (barrier A also publishes Q^T on the first tile) ------------------------------
            copy_k_t(k_head, smem, KV_OFFSET, n0, key_end, head_dim, ty, tx)
            cuda.syncthreads()

            # ---- S = Q K^T in registers ------------------------------------------------------------------------
            for i in range(RM):
                for j in range(RN):
                    s[i, j] = 0.0
            for dd in range(D_PAD):
                for i in range(RM):
                    qv = smem[index(dd * M_STRIDE + ty + TY * i)]
                    for j in range(RN):
                        s[i, j] += qv * smem[index(KV_OFFSET + dd * N_STRIDE + tx + TX * j)]

            # ---- online softmax: masks only on the tail tile and tiles that cross the diagonal or window edges ---
            needs_mask = partial(n0, m0, key_end, CAUSAL, diag_offset)
            for i in range(RM):
                row = m0 + ty + TY * i
                tile_max = NEG_INF
                for j in range(RN):
                    if CAPPED:
                        x = CAP_POST * cap(s[i, j], scale_log2)
                    else:
                        x = s[i, j] * scale_log2
                    if needs_mask:
                        if hidden(n0 + tx + TX * j, row, key_end, CAUSAL, diag_offset):
                            x = NEG_INF
                    s[i, j] = x
                    tile_max = max(tile_max, x)
                smem[index(ROW_OFFSET + (ty + TY * i) * TX + tx)] = tile_max
            cuda.syncthreads()  # barrier B: row maxima visible, and every thread is done reading K^T

            # ---- V tile -> shared, into the words K^T used; P^T -> shared; rescale O -----------------------------
            copy_v(v_head, smem, KV_OFFSET, n0, key_end, head_dim, ty, tx)
            for i in range(RM):
                r = ty + TY * i
                m_new = m_i[i]
                for t in range(TX):
                    m_new = max(m_new, smem[index(ROW_OFFSET + r * TX + t)])
                # a row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
                m_use = m_new if m_new != NEG_INF else float32(0.0)
                alpha = math.exp2(m_i[i] - m_use)
                m_i[i] = m_new
                row_sum = float32(0.0)
                for j in range(RN):
                    p = math.exp2(s[i, j] - m_use)
                    row_sum += p
                    smem[index(P_OFFSET + (tx + TX * j) * M_STRIDE + r)] = p
                l_part[i] = l_part[i] * alpha + row_sum
                for j in range(RD):
                    acc[i, j] *= alpha
            cuda.syncthreads()  # barrier C: P^T and V complete

            # ---- O += P V ------------------------------------------------------------------------------------------
            for c in range(BLOCK_N):
                for i in range(RM):
                    p = smem[index(P_OFFSET + c * M_STRIDE + ty + TY * i)]
                    for j in range(RD):
                        acc[i, j] += p * smem[index(KV_OFFSET + c * D_PAD + tx + TX * j)]
            cuda.syncthreads()  # barrier D: V, P^T and row partials free for the next tile

        # ---- epilogue: one division per row, lse in natural log ----------------------------------------------
        for i in range(RM):
            smem[index(ROW_OFFSET + (ty + TY * i) * TX + tx)] = l_part[i]
        cuda.syncthreads()
        for i in range(RM):
            r = ty + TY * i
            row = m0 + r
            if row < seqlen_q:
                l = float32(0.0)
                for t in range(TX):
                    l += smem[index(ROW_OFFSET + r * TX + t)]
                # rows that see no key (causal, Lq > Lk; an empty window) give 0 and lse = -inf, as in the reference
                inv_l = float32(1.0) / l if l > 0.0 else float32(0.0)
                for j in range(RD):
                    d = tx + TX * j
                    if d < head_dim:
                        out_head[row, d] = acc[i, j] * inv_l
                if write_lse and tx == 0:
                    lse[b, h, row] = log_sum_exp(m_i[i], l, float32(1.0))  # m is in scaled units already

    return kernel_jit(launch_bounds=(NT, config.blocks_per_sm))(
        common.entry_kernel(body, variant.packed, causal_argument=False))


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream, config: SimtConfig | None = None,
           window=None, softcap: float | None = None, schedule=None):
    """Launch on device views of shape (batch, heads, seqlen, headdim); lse is (batch, heads, seqlen_q). ``window``:
    None or a checked ``(left, right)`` sliding window (``runtime.arguments.check_window``); ``softcap``: None or a
    checked cap ``c > 0`` of the scores (``core.scores``); ``schedule``: None, or the int32 schedule of packed
    sequences (``forward.varlen``: the views are then ``(1, heads, total, headdim)``, lse ``(1, heads, total_q)``)."""
    batch, heads, seqlen_q, head_dim = q.shape
    config = config or default_config(head_dim)
    head_dim_pad = padded_head_dim(head_dim, config)
    shared_bytes = 4 * config.shared_words(head_dim_pad)
    common.check_shared_memory(shared_bytes)
    kernel = flash_forward_kernel(config, head_dim_pad, bool(causal),
                                  Variant.of(bool(causal), window, softcap, schedule is not None))
    shape = common.launch_grid(HEAD_MAJOR, batch, heads, seqlen_q, config.block_m, schedule)
    block = (config.threads_x, config.threads_y)
    scale_log2, _ = common.scale_args(sm_scale, softcap)  # scores are scaled before the max here, whatever the sign
    extra = () if schedule is None else (schedule,)
    device_launch(kernel, shape, block, stream, shared_bytes, q, k, v, out, lse, write_lse, scale_log2, *extra)
