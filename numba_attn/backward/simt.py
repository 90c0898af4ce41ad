"""FlashAttention-2 backward on CUDA cores, float32 arithmetic, float16 / float32 inputs (``reference.
flash_attention_v2_backward`` is its float64 twin).

Nothing of size ``seqlen_q x seqlen_k`` is kept: ``P = exp2(sm_scale log2(e) q.k - lse log2(e))`` is recomputed
from the forward's natural-log ``lse`` (rows with ``lse = -inf`` see no key: ``P = 0``), ``dP = dout v^T`` and
``dS = P (dP - D)`` with ``D`` from ``preprocess``.

* ``dkdv_kernel``: grid ``(batch * kv_heads, key blocks)``. A block keeps ``K^T`` and ``V^T`` of its ``block_n``
  keys in shared memory and ``dK``, ``dV`` of them in registers while it streams the query tiles that see them
  (causal: from the first tile holding a row on or below the diagonal, ``block_info.query_tiles_start``), for every
  query head of the kv head's group, so the group's sum needs no second pass. Per tile: ``Q^T``, ``dO^T`` to
  shared memory; ``S^T`` and ``dP^T`` in registers; ``P^T``, ``dS^T`` through shared memory; ``dV += P^T dO``, ``dK
  += dS^T Q``; and, unless deterministic, ``dQ += dS K`` with float32 atomics (one per element and key block).
  Thread ``(ty, tx)`` owns keys ``ty + threads_y i``, query rows ``tx + threads_x j`` of a tile and head-dim
  columns ``tx + threads_x j`` of ``dK``, ``dV``.
* ``dq_kernel`` (``deterministic=True``): grid ``(batch * heads, query blocks)``, the forward's walk: ``Q^T``,
  ``dO^T`` resident, key tiles up to the diagonal (``mask.visible_end``), ``dQ`` in registers, written once: the
  same sums in the same order on every call. Thread ``(ty, tx)`` owns rows ``ty + threads_y i``, keys ``tx +
  threads_x j`` and columns ``tx + threads_x j``.

Masks (``core.mask``): only tiles that cross the diagonal, a window's edges or hold the last key evaluate the
element test; rows past ``seqlen_q`` load as zeros with ``P = 0``. Transposed tiles have one word of padding per
row, as in the forward. The compile-time ``forward.common.Variant`` of the call is the forward's: a sliding window
(the key blocks walk only the query tiles that see them, ``block_info.query_tile_range``; the query blocks only the
key tiles, ``block_info.key_tile_range``), soft-capping (``core.gradients.weight_and_gradient`` with ``math.tanh``,
the forward's) and packed sequences (the key blocks over a key schedule, ``backward.varlen``, the query blocks over
the forward's). Runs under the CUDA simulator (no shuffles, no tensor cores) with tiny tiles.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32
from numba import uint32 as index  # unsigned shared-memory indices: Numba skips its negative-index wraparound code

from ..core.block_info import (HEAD_MAJOR, block_position_of, key_block_bounds_of, key_tile_range,
                               query_tile_range, sequence_bounds_of)
from ..core.constants import LOG2E
from ..core.gradients import weight_and_gradient
from ..core.mask import hidden_in, tile_is_partial
from ..core.staging import float32_tile_copy, inlined_function, kernel_body
from ..forward import common
from ..forward.common import PLAIN, Variant
from ..runtime.device import SIMULATOR, cuda, kernel_jit, max_shared_per_block
from ..runtime.launch import launch as device_launch
from ..runtime.views import with_unit_axes

#: float16 and float32 (bfloat16 waits for the tensor-core backward)
DTYPES = ("float16", "float32")

_NEG_INF = np.float32(-np.inf)


@dataclass(frozen=True)
class SimtBackwardConfig:
    """Tile shape of both backward kernels: ``threads_x * threads_y`` threads; a thread holds ``keys_per_thread``
    keys and ``rows_per_thread`` query rows of each tile of scores. ``dkdv_kernel``: ``block_n = threads_y *
    keys_per_thread`` keys per block, query tiles of ``block_m = threads_x * rows_per_thread``; ``dq_kernel``: the
    other way round (``dq_block_m = threads_y * rows_per_thread``, ``dq_block_n = threads_x * keys_per_thread``)."""

    threads_x: int = 16
    threads_y: int = 16
    rows_per_thread: int = 4
    keys_per_thread: int = 4
    blocks_per_sm: int = 1  # launch bound: caps registers at 64K / (threads * blocks_per_sm)

    def __post_init__(self):
        common.check_fields(self, threads_x=(1, 1024, 1), threads_y=(1, 1024, 1), rows_per_thread=(1, None, 1),
                            keys_per_thread=(1, None, 1), blocks_per_sm=(1, None, 1))
        if self.threads > 1024:
            raise ValueError(f"SimtBackwardConfig: threads_x * threads_y must be at most 1024, got {self.threads}")

    @property
    def threads(self) -> int:
        return self.threads_x * self.threads_y

    @property
    def block_n(self) -> int:
        """Keys per block of ``dkdv_kernel``."""
        return self.threads_y * self.keys_per_thread

    @property
    def block_m(self) -> int:
        """Query rows per tile of ``dkdv_kernel``."""
        return self.threads_x * self.rows_per_thread

    @property
    def dq_block_m(self) -> int:
        """Query rows per block of ``dq_kernel``."""
        return self.threads_y * self.rows_per_thread

    @property
    def dq_block_n(self) -> int:
        """Keys per tile of ``dq_kernel``."""
        return self.threads_x * self.keys_per_thread

    def shared_words(self, head_dim_pad: int) -> int:
        """float32 words of dynamic shared memory of ``dkdv_kernel``: K^T, V^T, Q^T, dO^T, P^T, dS^T."""
        return 2 * head_dim_pad * (self.block_n + self.block_m + 2) + 2 * self.block_n * (self.block_m + 1)

    def dq_shared_words(self, head_dim_pad: int) -> int:
        """float32 words of dynamic shared memory of ``dq_kernel``: Q^T, dO^T, K^T, V^T, dS^T."""
        return 2 * head_dim_pad * (self.dq_block_m + self.dq_block_n + 2) + self.dq_block_n * (self.dq_block_m + 1)


#: GPU tiles (not yet timed on a GPU), the first that fits the device's shared memory per block: 64-key blocks and
#: 64-row tiles (166 KB at head dim 128), 32 x 32 (144 KB at head dim 256), 16 x 16 on 8 x 8 threads (37 KB at 128,
#: for GPUs with less shared memory). Simulator: tiny blocks, each thread a Python thread.
GPU_CONFIG = SimtBackwardConfig()
GPU_CONFIG_LARGE_D = SimtBackwardConfig(rows_per_thread=2, keys_per_thread=2)
GPU_CONFIG_SMALL = SimtBackwardConfig(threads_x=8, threads_y=8, rows_per_thread=2, keys_per_thread=2)
GPU_CONFIGS = (GPU_CONFIG, GPU_CONFIG_LARGE_D, GPU_CONFIG_SMALL)
SIMULATOR_CONFIG = SimtBackwardConfig(threads_x=4, threads_y=4, rows_per_thread=2, keys_per_thread=2)


def default_config(head_dim: int = 128) -> SimtBackwardConfig:
    """The simulator's tiles, or the first GPU tiles whose two kernels fit a block's shared memory (the last
    otherwise: its launch then says how much it needs)."""
    if SIMULATOR:
        return SIMULATOR_CONFIG
    limit = max_shared_per_block()
    for config in GPU_CONFIGS:
        pad = padded_head_dim(head_dim, config)
        if 4 * max(config.shared_words(pad), config.dq_shared_words(pad)) <= limit:
            return config
    return GPU_CONFIGS[-1]


def supports(dtype: str, head_dim: int) -> bool:
    """True when these kernels take the call: float16 / float32, head dims up to 256, any strides, any GPU."""
    return dtype in DTYPES and 1 <= head_dim <= common.MAX_HEAD_DIM


def padded_head_dim(head_dim: int, config: SimtBackwardConfig) -> int:
    """Head dim rounded up to a whole number of columns per thread (``threads_x`` threads share a row)."""
    return common.padded_head_dim(head_dim, config.threads_x)


def tile_products(rows: int, cols: int, threads_y: int, threads_x: int, depth: int, a_s: int, a_dp: int,
                  a_stride: int, b_s: int, b_dp: int, b_stride: int):
    """``products(s, dp, smem, ty, tx)``: the thread's ``rows x cols`` register tiles of two products over ``depth``
    transposed shared-memory operands, ``s = A_s B_s^T`` and ``dp = A_dp B_dp^T`` (row ``ty + threads_y i`` of A at
    ``a + d * a_stride``, column ``tx + threads_x j`` of B at ``b + d * b_stride``). Both kernels need S and dP
    side by side, the key kernel as ``K Q^T`` / ``V dO^T``, the query kernel as ``Q K^T`` / ``dO V^T``."""

    def products(s, dp, smem, ty, tx):
        for i in range(rows):
            for j in range(cols):
                s[i, j] = 0.0
                dp[i, j] = 0.0
        for dd in range(depth):
            for i in range(rows):
                x_s = smem[index(a_s + dd * a_stride + ty + threads_y * i)]
                x_dp = smem[index(a_dp + dd * a_stride + ty + threads_y * i)]
                for j in range(cols):
                    s[i, j] += x_s * smem[index(b_s + dd * b_stride + tx + threads_x * j)]
                    dp[i, j] += x_dp * smem[index(b_dp + dd * b_stride + tx + threads_x * j)]

    return inlined_function(products)


def _entry(body, packed: bool):
    """The kernel running ``body(q, k, v, dout, lse, delta, dq, scale_log2, sm_scale, schedule)``: without
    ``packed`` its ``schedule`` is ``lse`` (never read), with it a last argument."""
    if packed:
        def packed_kernel(q, k, v, dout, lse, delta, dq, scale_log2, sm_scale, schedule):
            body(q, k, v, dout, lse, delta, dq, scale_log2, sm_scale, schedule)

        return packed_kernel

    def kernel(q, k, v, dout, lse, delta, dq, scale_log2, sm_scale):
        body(q, k, v, dout, lse, delta, dq, scale_log2, sm_scale, lse)

    return kernel


@lru_cache(maxsize=None)
def dkdv_kernel(config: SimtBackwardConfig, head_dim_pad: int, causal: bool, atomic_dq: bool,
                variant: Variant = PLAIN):
    """``kernel(q, k, v, dout, lse, delta, dq_acc, dk, dv, scale_log2, sm_scale[, schedule])``; ``atomic_dq``: also
    add each key block's ``sm_scale dS K`` to ``dq_acc`` (float32, q's shape, zeroed before); ``variant``: the
    window, the cap (``scale_log2`` is then ``sm_scale / c``) and packed sequences (a key schedule)."""
    TX, TY = config.threads_x, config.threads_y
    RN, RM = config.keys_per_thread, config.rows_per_thread
    BLOCK_N, BLOCK_M = config.block_n, config.block_m
    NT = TX * TY
    D_PAD = head_dim_pad
    RD = D_PAD // TX  # head-dim columns of dK, dV per thread
    CAUSAL = causal
    ATOMIC_DQ = atomic_dq
    N_STRIDE = BLOCK_N + 1
    M_STRIDE = BLOCK_M + 1
    # offsets into the one dynamic buffer (float32 words)
    K_T = 0  # K^T[d * N_STRIDE + c], resident
    V_T = K_T + D_PAD * N_STRIDE  # V^T, resident
    Q_T = V_T + D_PAD * N_STRIDE  # Q^T[d * M_STRIDE + r] of the current query tile
    DO_T = Q_T + D_PAD * M_STRIDE  # dO^T
    P_T = DO_T + D_PAD * M_STRIDE  # P^T[c * M_STRIDE + r]
    DS_T = P_T + BLOCK_N * M_STRIDE  # dS^T
    DQ_ELEMENTS = BLOCK_M * D_PAD
    NEG_INF = _NEG_INF
    LOG2E_F32 = np.float32(LOG2E)
    position = block_position_of(HEAD_MAJOR, BLOCK_N, variant.packed)
    bounds = key_block_bounds_of(variant.packed)
    query_range = query_tile_range(BLOCK_M, BLOCK_N, variant.window)
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    hidden = hidden_in(variant.window)
    element = weight_and_gradient(variant.softcap, precise=True)
    copy_keys_t = float32_tile_copy(TX, TY, BLOCK_N, D_PAD, 1, N_STRIDE)
    copy_rows_t = float32_tile_copy(TX, TY, BLOCK_M, D_PAD, 1, M_STRIDE)
    key_products = tile_products(RN, RM, TY, TX, D_PAD, K_T, V_T, N_STRIDE, Q_T, DO_T, M_STRIDE)

    @kernel_body
    def body(q, k, v, dout, lse, delta, dq_acc, dk, dv, scale_log2, sm_scale, schedule):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * TX + tx
        # a block per (batch, kv head, key block): k in the place of q gives the kv head and its views
        b, hk, n0, k_head, _, v_head, dk_head = position(k, k, v, dk, False, schedule)
        dv_head = dv[b, hk]
        row_start, seqlen_q, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]
        group = q.shape[1] // k.shape[1]

        smem = cuda.shared.array(0, float32)
        copy_keys_t(k_head, smem, K_T, n0, key_end, head_dim, ty, tx)
        copy_keys_t(v_head, smem, V_T, n0, key_end, head_dim, ty, tx)

        dk_acc = cuda.local.array((RN, RD), float32)
        dv_acc = cuda.local.array((RN, RD), float32)
        s = cuda.local.array((RN, RM), float32)
        dp = cuda.local.array((RN, RM), float32)
        lse_r = cuda.local.array(RM, float32)
        d_r = cuda.local.array(RM, float32)
        for i in range(RN):
            for j in range(RD):
                dk_acc[i, j] = 0.0
                dv_acc[i, j] = 0.0

        # the query tiles that see these keys: from the diagonal (causal) or a window's right edge to its left edge
        m_begin, m_end = query_range(n0, row_start, seqlen_q, key_end, CAUSAL, diag_offset)
        for g in range(group):
            h = hk * group + g
            q_head = q[b, h]
            do_head = dout[b, h]
            for m0 in range(m_begin, m_end, BLOCK_M):
                # ---- Q^T, dO^T of the tile -> shared (after every thread is done with the previous tile's) ------
                cuda.syncthreads()
                copy_rows_t(q_head, smem, Q_T, m0, seqlen_q, head_dim, ty, tx)
                copy_rows_t(do_head, smem, DO_T, m0, seqlen_q, head_dim, ty, tx)
                for j in range(RM):
                    row = m0 + tx + TX * j
                    lse_r[j] = NEG_INF  # rows past the sequence: P = 0
                    d_r[j] = 0.0
                    if row < seqlen_q:
                        lse_r[j] = lse[b, h, row] * LOG2E_F32
                        d_r[j] = delta[b, h, row]
                cuda.syncthreads()  # (the first time also publishes K^T, V^T)

                # ---- S^T = K Q^T and dP^T = V dO^T in registers ---------------------------------------------------
                key_products(s, dp, smem, ty, tx)

                # ---- P^T, dS^T -> shared; masks only where the tile crosses the diagonal, a window edge or the end -
                needs_mask = partial(n0, m0, key_end, CAUSAL, diag_offset)
                for i in range(RN):
                    c = ty + TY * i
                    for j in range(RM):
                        r = tx + TX * j
                        p = float32(0.0)
                        ds = float32(0.0)
                        if lse_r[j] != NEG_INF:  # a row that sees no key contributes nothing
                            masked = False
                            if needs_mask:
                                masked = hidden(n0 + c, m0 + r, key_end, CAUSAL, diag_offset)
                            p, ds = element(s[i, j], dp[i, j], lse_r[j], d_r[j], masked, scale_log2)
                        smem[index(P_T + c * M_STRIDE + r)] = p
                        smem[index(DS_T + c * M_STRIDE + r)] = ds
                cuda.syncthreads()

                # ---- dV += P^T dO, dK += dS^T Q ------------------------------------------------------------------
                for r in range(BLOCK_M):
                    for i in range(RN):
                        c = ty + TY * i
                        p = smem[index(P_T + c * M_STRIDE + r)]
                        ds = smem[index(DS_T + c * M_STRIDE + r)]
                        for j in range(RD):
                            dd = tx + TX * j
                            dv_acc[i, j] += p * smem[index(DO_T + dd * M_STRIDE + r)]
                            dk_acc[i, j] += ds * smem[index(Q_T + dd * M_STRIDE + r)]

                # ---- dQ += sm_scale dS K: one float32 atomic per element of the tile ------------------------------
                if ATOMIC_DQ:
                    for e in range(tid, DQ_ELEMENTS, NT):
                        r = e // D_PAD
                        dd = e % D_PAD
                        row = m0 + r
                        if row < seqlen_q and dd < head_dim:
                            acc = float32(0.0)
                            for c in range(BLOCK_N):
                                acc += smem[index(DS_T + c * M_STRIDE + r)] * smem[index(K_T + dd * N_STRIDE + c)]
                            cuda.atomic.add(dq_acc, (b, h, row, dd), acc * sm_scale)

        # ---- every key of the block is written, 0 where no row sees it ---------------------------------------------
        for i in range(RN):
            key = n0 + ty + TY * i
            if key < key_end:
                for j in range(RD):
                    dd = tx + TX * j
                    if dd < head_dim:
                        dk_head[key, dd] = dk_acc[i, j] * sm_scale
                        dv_head[key, dd] = dv_acc[i, j]

    if variant.packed:
        def kernel(q, k, v, dout, lse, delta, dq_acc, dk, dv, scale_log2, sm_scale, schedule):
            body(q, k, v, dout, lse, delta, dq_acc, dk, dv, scale_log2, sm_scale, schedule)
    else:
        def kernel(q, k, v, dout, lse, delta, dq_acc, dk, dv, scale_log2, sm_scale):
            body(q, k, v, dout, lse, delta, dq_acc, dk, dv, scale_log2, sm_scale, lse)
    return kernel_jit(launch_bounds=(NT, config.blocks_per_sm))(kernel)


@lru_cache(maxsize=None)
def dq_kernel(config: SimtBackwardConfig, head_dim_pad: int, causal: bool, variant: Variant = PLAIN):
    """``kernel(q, k, v, dout, lse, delta, dq, scale_log2, sm_scale[, schedule])``: ``dq`` of each query block, in a
    fixed order (bitwise repeatable); ``variant`` as ``dkdv_kernel``'s (packed: the forward's schedule)."""
    TX, TY = config.threads_x, config.threads_y
    RM, RN = config.rows_per_thread, config.keys_per_thread
    BLOCK_M, BLOCK_N = config.dq_block_m, config.dq_block_n
    NT = TX * TY
    D_PAD = head_dim_pad
    RD = D_PAD // TX
    CAUSAL = causal
    M_STRIDE = BLOCK_M + 1
    N_STRIDE = BLOCK_N + 1
    Q_T = 0  # Q^T[d * M_STRIDE + r], resident
    DO_T = Q_T + D_PAD * M_STRIDE  # dO^T, resident
    K_T = DO_T + D_PAD * M_STRIDE  # K^T[d * N_STRIDE + c] of the current key tile
    V_T = K_T + D_PAD * N_STRIDE  # V^T
    DS_T = V_T + D_PAD * N_STRIDE  # dS^T[c * M_STRIDE + r]
    NEG_INF = _NEG_INF
    LOG2E_F32 = np.float32(LOG2E)
    position = block_position_of(HEAD_MAJOR, BLOCK_M, variant.packed)
    bounds = sequence_bounds_of(variant.packed)
    key_range = key_tile_range(BLOCK_M, BLOCK_N, variant.window)
    partial = tile_is_partial(BLOCK_N, BLOCK_M, variant.window)
    hidden = hidden_in(variant.window)
    element = weight_and_gradient(variant.softcap, precise=True)
    copy_rows_t = float32_tile_copy(TX, TY, BLOCK_M, D_PAD, 1, M_STRIDE)
    copy_keys_t = float32_tile_copy(TX, TY, BLOCK_N, D_PAD, 1, N_STRIDE)
    query_products = tile_products(RM, RN, TY, TX, D_PAD, Q_T, DO_T, M_STRIDE, K_T, V_T, N_STRIDE)

    @kernel_body
    def body(q, k, v, dout, lse, delta, dq, scale_log2, sm_scale, schedule):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        b, h, m0, q_head, k_head, v_head, dq_head = position(q, k, v, dq, False, schedule)
        do_head = dout[b, h]
        seqlen_q, key_start, key_end, diag_offset = bounds(q, k, b, schedule)
        head_dim = q.shape[3]

        smem = cuda.shared.array(0, float32)
        copy_rows_t(q_head, smem, Q_T, m0, seqlen_q, head_dim, ty, tx)
        copy_rows_t(do_head, smem, DO_T, m0, seqlen_q, head_dim, ty, tx)

        acc = cuda.local.array((RM, RD), float32)
        s = cuda.local.array((RM, RN), float32)
        dp = cuda.local.array((RM, RN), float32)
        lse_r = cuda.local.array(RM, float32)
        d_r = cuda.local.array(RM, float32)
        for i in range(RM):
            row = m0 + ty + TY * i
            lse_r[i] = NEG_INF
            d_r[i] = 0.0
            if row < seqlen_q:
                lse_r[i] = lse[b, h, row] * LOG2E_F32
                d_r[i] = delta[b, h, row]
            for j in range(RD):
                acc[i, j] = 0.0

        n_begin, n_end = key_range(m0, key_start, key_end, CAUSAL, diag_offset)  # (tiles outside a window: none)
        for n0 in range(n_begin, n_end, BLOCK_N):
            # ---- K^T, V^T of the tile -> shared (the first barrier also publishes Q^T, dO^T) ------------------------
            copy_keys_t(k_head, smem, K_T, n0, key_end, head_dim, ty, tx)
            copy_keys_t(v_head, smem, V_T, n0, key_end, head_dim, ty, tx)
            cuda.syncthreads()

            # ---- S = Q K^T, dP = dO V^T in registers ---------------------------------------------------------------
            query_products(s, dp, smem, ty, tx)

            # ---- dS^T -> shared ------------------------------------------------------------------------------------
            needs_mask = partial(n0, m0, key_end, CAUSAL, diag_offset)
            for i in range(RM):
                r = ty + TY * i
                for j in range(RN):
                    c = tx + TX * j
                    ds = float32(0.0)
                    if lse_r[i] != NEG_INF:
                        masked = False
                        if needs_mask:
                            masked = hidden(n0 + c, m0 + r, key_end, CAUSAL, diag_offset)
                        _, ds = element(s[i, j], dp[i, j], lse_r[i], d_r[i], masked, scale_log2)
                    smem[index(DS_T + c * M_STRIDE + r)] = ds
            cuda.syncthreads()

            # ---- dQ += dS K -----------------------------------------------------------------------------------------
            for c in range(BLOCK_N):
                for i in range(RM):
                    ds = smem[index(DS_T + c * M_STRIDE + ty + TY * i)]
                    for j in range(RD):
                        acc[i, j] += ds * smem[index(K_T + (tx + TX * j) * N_STRIDE + c)]
            cuda.syncthreads()  # K^T, V^T and dS^T free for the next tile

        for i in range(RM):
            row = m0 + ty + TY * i
            if row < seqlen_q:
                for j in range(RD):
                    dd = tx + TX * j
                    if dd < head_dim:
                        dq_head[row, dd] = acc[i, j] * sm_scale

    return kernel_jit(launch_bounds=(NT, config.blocks_per_sm))(_entry(body, variant.packed))


def launch_dkdv(q, k, v, dout, lse, delta, dq_acc, dk, dv, sm_scale: float, causal: bool, stream,
                config: SimtBackwardConfig | None = None, window=None, softcap: float | None = None,
                schedule=None) -> None:
    """``dk``, ``dv`` (and, unless ``dq_acc`` is None, ``sm_scale dS K`` added to ``dq_acc``) from views of shape
    ``(batch, heads, seqlen, headdim)``; ``lse``, ``delta``: ``(batch, heads, seqlen_q)`` float32. ``window``,
    ``softcap``: checked, as the forward's; ``schedule``: None, or the key schedule of packed sequences
    (``backward.varlen``; the views are then ``(1, heads, total, headdim)``)."""
    batch, kv_heads, seqlen_k, head_dim = k.shape
    config = config or default_config(head_dim)
    head_dim_pad = padded_head_dim(head_dim, config)
    shared_bytes = 4 * config.shared_words(head_dim_pad)
    common.check_shared_memory(shared_bytes)
    atomic = dq_acc is not None
    kernel = dkdv_kernel(config, head_dim_pad, bool(causal), atomic,
                         Variant.of(bool(causal), window, softcap, schedule is not None))
    shape = common.launch_grid(HEAD_MAJOR, batch, kv_heads, seqlen_k, config.block_n, schedule)
    # without atomics the kernel never touches dq_acc: a float32 view of delta stands in (one compiled type)
    placeholder = dq_acc if atomic else with_unit_axes(delta, 3, 1)
    scale, _ = common.scale_args(sm_scale, softcap)
    extra = () if schedule is None else (schedule,)
    device_launch(kernel, shape, (config.threads_x, config.threads_y), stream, shared_bytes, q, k, v, dout, lse,
                  delta, placeholder, dk, dv, scale, np.float32(sm_scale), *extra)


def launch_dq(q, k, v, dout, lse, delta, dq, sm_scale: float, causal: bool, stream,
              config: SimtBackwardConfig | None = None, window=None, softcap: float | None = None,
              schedule=None) -> None:
    """``dq`` (any dtype of ``DTYPES``, any strides) written by ``dq_kernel``; arguments as ``launch_dkdv``
    (``schedule``: the forward's schedule of packed sequences, ``forward.varlen``, over ``dq_block_m``-row blocks)."""
    batch, heads, seqlen_q, head_dim = q.shape
    config = config or default_config(head_dim)
    head_dim_pad = padded_head_dim(head_dim, config)
    shared_bytes = 4 * config.dq_shared_words(head_dim_pad)
    common.check_shared_memory(shared_bytes)
    kernel = dq_kernel(config, head_dim_pad, bool(causal), Variant.of(bool(causal), window, softcap,
                                                                       schedule is not None))
    shape = common.launch_grid(HEAD_MAJOR, batch, heads, seqlen_q, config.dq_block_m, schedule)
    scale, _ = common.scale_args(sm_scale, softcap)
    extra = () if schedule is None else (schedule,)
    device_launch(kernel, shape, (config.threads_x, config.threads_y), stream, shared_bytes, q, k, v, dout, lse,
                  delta, dq, scale, np.float32(sm_scale), *extra)
