"""Split-KV decoding on tensor cores: the split kernel, a block of several warps sharing every key tile.

The kernel takes the query rows of a GQA group as one sequence (``decode.launch.grouped_views``), a 16-row tile per
block of the grid ``(batch * kv_heads, row tiles, num_splits)``, and the key ranges of a ``decode.plan.SplitPlan``:
lead ranges, then either tail ranges or, in a pooled plan, a pool per row tile whose tiles the row tile's blocks take
one by one after their own range through an atomic counter (``decode.pool``). Each block writes its normalised
float32 part and its lse; in a pooled plan the row tile's last block to finish merges the parts into the output
itself (an arrival count; ``decode.combine.tile_merger``); otherwise ``decode.combine``'s kernel merges them.

Work split inside a block
    All ``warps`` warps hold the same 16 query rows. The block copies K/V tiles of ``block_n`` keys into shared
    memory (``cp.async``, ``stages`` tiles in flight, all threads issuing); warp ``w`` takes keys
    ``w * block_n / warps ..`` of every tile (a multiple of 16: whole n8 pairs for ``S`` and whole k-steps for
    ``P V``) and keeps its own online softmax (``m``, ``l``, un-normalised ``O``) over them. After the range the warps
    merge through shared memory exactly as splits merge: ``m = max_w m_w``, weights ``2^(m_w - m)``, one division by
    ``l``. Why several warps: the split variant of the forward kernel that decoding used before had one warp per
    block, which issued every copy, every MMA and the softmax of a tile in sequence (docs/design/decode.md, "Where the fixed cost
    of a GQA step goes", and "Decoding with four warps per split block").

Per tile, warp ``w``: ``S = Q K_w^T`` (Q's A fragments stay in registers for head dims <= 128, read once;
``ldmatrix.x4`` for K), the online softmax of ``online_softmax.softmax_step`` on its ``block_n / warps`` keys (masks
only on tiles that cross the end of the range), ``O += P V_w`` with P packed in registers and V through
``ldmatrix.x4.trans``. Shared memory and fragment layouts are those of ``flash_mma`` (rows of ``d_pad + 8`` 16-bit
elements: the 8 row addresses of an ``ldmatrix`` fall in 8 different bank groups).

No mask but the end of the keys: one query row sees every key under the bottom-right causal mask, and several rows
come here only without one (``decode.launch.grouped_views``). Rows that see no key (an empty split) give 0 and
``lse = -inf``. KV-cache options (``decode.kvcache``; ``_kernel_source``): per-row lengths, pages
(``staging.paged_kv_loader``), a window's left side (the one query position's), soft-capped scores
(``softmax_step(softcap=True)``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, types, uint16, uint32

from ..runtime.device import SIMULATOR, compute_capability, cuda, kernel_jit, max_grid
from . import combine as _combine
from .combine import LN2
from ..core import ptx
from ..core.softmax import softmax_step
from ..forward import common
from ..core.block_info import cache_length
from ..core.mask import visible_start
from ..core.staging import device_function, inlined_function, paged_kv_loader, tile_loader
from .kvcache import KvOptions


@dataclass(frozen=True)
class DecodeMmaConfig:
    """Tuning knobs of the decode split kernel."""

    warps: int = 4  # warps per block; each takes block_n / warps keys (a multiple of 16) of every tile
    block_n: int = 64  # keys per K/V tile in shared memory
    stages: int = 2  # K/V tiles in shared memory: the copies of the next stages - 1 run under each tile's MMAs
    blocks_per_sm: int = 2  # launch bound (registers) and what plan_splits aims for
    l2_prefetch: bool = True  # the K/V copies ask L2 for 256-byte groups (ptx.cp_async_16_prefetch)
    # pooled plans: after its own range a block takes tiles of its row tile's key pool (``plan_splits``) ...
    key_pool: bool = True
    # ... and the row tile's last block to finish merges the parts into the output (no combine kernel)
    merge_in_kernel: bool = True
    merge_loads: int = 32  # the in-kernel merge: 16-byte part loads in flight per thread ...
    merge_weight_parts: int = 32  # ... and the parts per row whose weights sit in shared memory at a time

    def __post_init__(self):
        warp_keys, rest = divmod(self.block_n, self.warps) if self.warps > 0 else (0, 1)
        if rest or warp_keys % 16 or warp_keys == 0:
            raise ValueError(f"block_n ({self.block_n}) must give every one of {self.warps} warps a multiple of 16 "
                             "keys")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2, got {self.stages}")
        if self.key_pool and self.stages != 2:
            raise ValueError(f"key_pool takes tiles one ahead: it needs 2 stages, got {self.stages}")
        if self.key_pool and self.merge_in_kernel and (self.warps & (self.warps - 1) or self.warps > 16):
            raise ValueError(f"the in-kernel merge reduces a row's lse over 2 * warps lanes of one warp: warps must be "
                             f"a power of two <= 16, got {self.warps}")
        if self.blocks_per_sm < 1 or self.merge_loads < 1:
            raise ValueError(f"blocks_per_sm ({self.blocks_per_sm}) and merge_loads ({self.merge_loads}) must be at "
                             "least 1")
        if self.merge_weight_parts < 1 or self.merge_weight_parts & (self.merge_weight_parts - 1):
            raise ValueError(f"merge_weight_parts must be a power of two, got {self.merge_weight_parts}")

    @property
    def threads(self) -> int:
        return 32 * self.warps


#: head dims up to 128 (padded): 4 warps x 16 keys of 64-key tiles, 74 KB of shared memory at 128
DEFAULT_CONFIG = DecodeMmaConfig()
#: above 128: 2 warps x 16 keys of 32-key tiles (76 KB at 256), the accumulators of 256 columns need the registers
WIDE_CONFIG = DecodeMmaConfig(warps=2, block_n=32)
#: the CUDA simulator runs every thread as a Python thread: 2 warps x 16 keys
SIMULATOR_CONFIG = DecodeMmaConfig(warps=2, block_n=32)
#: mma.sync.m16n8k16 with f16 / bf16 operands and cvt.rn.bf16x2 need sm_80 or newer
MIN_COMPUTE_CAPABILITY = (8, 0)
#: ``pool_first`` of a plan without a pool (``decode.plan.SplitPlan``)
NO_POOL = 1 << 62


def config_for(head_dim: int) -> DecodeMmaConfig:
    if SIMULATOR:
        return SIMULATOR_CONFIG
    return DEFAULT_CONFIG if padded_head_dim(head_dim) <= 128 else WIDE_CONFIG


def supports(dtype: str, batch: int, kv_heads: int, rows: int) -> bool:
    """Whether the split kernel takes ``rows`` regrouped query rows of each (batch, kv head) of ``dtype``: 16-bit
    inputs on sm_80+ (or the simulator), and a grid ``(batch * kv_heads, row tiles, splits)`` that the device takes
    (the splits are planned within its z limit)."""
    if dtype not in ("float16", "bfloat16") or not (SIMULATOR or compute_capability() >= MIN_COMPUTE_CAPABILITY):
        return False
    return batch * kv_heads <= max_grid(0) and -(-rows // 16) <= max_grid(1)


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernel computes with: a multiple of 16 (one MMA k-step)."""
    return common.padded_head_dim(head_dim, 16)


@dataclass(frozen=True)
class _Layout:
    """Shared memory of one specialisation, in 16-bit elements: the 16-row Q tile, then ``stages`` x (K tile,
    V tile); after the keys, the stages' memory holds the warps' float32 merge."""

    config: DecodeMmaConfig
    d_pad: int

    @property
    def row(self) -> int:
        return self.d_pad + 8

    @property
    def q_tile(self) -> int:
        return 16 * self.row

    @property
    def tile(self) -> int:
        return self.config.block_n * self.row

    @property
    def merge_row(self) -> int:
        """float32s per row of a warp's output in the merge: rows ``g .. g + 3`` then start 8 banks apart, so the
        8-byte stores of a fragment take the two wavefronts that its 256 bytes need."""
        return self.d_pad + 8

    @property
    def shared_bytes(self) -> int:
        stages = self.config.stages * 2 * self.tile * 2
        merge = 4 * self.config.warps * 16 * (self.merge_row + 2)
        return 2 * self.q_tile + max(stages, merge)


def layout_for(config: DecodeMmaConfig, d_pad: int) -> _Layout:
    """The shared memory of ``config`` at head dim ``d_pad`` (what the configuration alone decides is checked when
    it is made)."""
    if d_pad % 16 or not 16 <= d_pad <= 256:
        raise ValueError(f"d_pad must be a multiple of 16 in [16, 256], got {d_pad}")
    if 16 * config.merge_weight_parts > config.stages * config.block_n * (d_pad + 8):
        raise ValueError(f"merge_weight_parts ({config.merge_weight_parts}): 16 rows of that many float32 weights "
                         "must fit in the stages' memory")
    return _Layout(config, d_pad)


_U16_4D = types.Array(types.uint16, 4, "A")
_F32_5D = types.Array(types.float32, 5, "A")
_F32_4D = types.Array(types.float32, 4, "A")
_F32_3D = types.Array(types.float32, 3, "A")
_U32_1D = types.Array(types.uint32, 1, "A")
#: q rows, k, v (16-bit patterns), float32 parts (num_splits, batch, kv_heads, rows, headdim or more) and their lse,
#: the scale times log2(e), the key ranges (``SplitPlan.params``: lead ranges, keys per lead range, per tail range,
#: the pool's first key), the pool's counters (``PoolCounters``), then for the in-kernel merge of pooled plans the
#: output rows (16-bit patterns), their lse and what to write (``FINISH_*``)
SIGNATURE = types.void(_U16_4D, _U16_4D, _U16_4D, _F32_5D, _F32_4D, types.float32, types.int64, types.int64,
                       types.int64, types.int64, _U32_1D, _U16_4D, _F32_3D, types.int64)
#: the kernel's ``finish``: parts only (the combine kernel or the caller merges them), or, for a pooled plan, the
#: output merged in the kernel, with or without its lse
FINISH_PARTS, FINISH_OUT, FINISH_OUT_LSE = 0, 1, 2
#: KV-cache options (``decode.kvcache``) add ``cache_seqlens`` ``(batch,)``, the block table ``(batch, max_pages)``
#: and the softcap's ``post`` (the scale is then ``pre``)
KV_SIGNATURE = types.void(*SIGNATURE.args, types.Array(types.int32, 1, "A"), types.Array(types.int32, 2, "A"),
                          types.float32)


def signature_for(kv: KvOptions | None):
    return SIGNATURE if kv is None else KV_SIGNATURE


def _kernel_source(layout: _Layout, bf16: bool, vector_loads: bool, scale_first: bool, kv: KvOptions | None = None):
    """The Python function of one specialisation (not yet jitted). ``scale_first``: for a scale <= 0, which does
    not commute with max, the scores are scaled before the softmax (``online_softmax.softmax_step``). ``kv``: the
    KV-cache options (``decode.kvcache``; None: none, and the kernel of before they existed, of ``SIGNATURE``).

    With options the key ranges of the plan count from the first key a row sees (a window's left side, for the one
    query position the regrouped rows share: ``decode.launch.grouped_views`` lets no other masks through) and end at
    the row's length (``block_info.cache_length``); a pooled plan's blocks all arrive and merge whether or not their
    row has keys in the pool."""
    config = layout.config
    WARPS = config.warps
    THREADS = config.threads
    BLOCK_N = config.block_n
    WARP_KEYS = BLOCK_N // WARPS
    STAGES = config.stages
    D_PAD = layout.d_pad
    ROW = layout.row
    Q_TILE = layout.q_tile
    TILE = layout.tile
    STAGE = 2 * TILE
    QK_STEPS = D_PAD // 16
    S_BLOCKS = WARP_KEYS // 8
    PV_STEPS = WARP_KEYS // 16
    O_BLOCKS = D_PAD // 8
    # Q's A fragments stay in registers up to 128 columns (32 registers); wider, they are read per tile
    Q_IN_REGISTERS = QK_STEPS <= 8
    Q_REGS = QK_STEPS if Q_IN_REGISTERS else 1
    # the merge (float32 indices into the same dynamic shared memory, from where the stages begin)
    MERGE_ROW = layout.merge_row
    MERGE = Q_TILE // 2  # warp w's 16 rows at MERGE + w * MERGE_WARP
    MERGE_WARP = 16 * MERGE_ROW
    STATS = MERGE + WARPS * MERGE_WARP  # m of (warp, row) at STATS + 16 w + r, l at STATS + 16 WARPS + 16 w + r
    QUADS = D_PAD // 4  # 4-column groups of an output row
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    ACC_INIT = np.float32(-0.0)  # not 0.0: LLVM turns zero stores into a memset, which keeps the array in local memory
    SCALE_FIRST = scale_first
    KEY_POOL = config.key_pool
    # the in-kernel merge of pooled plans: the weights of the parts in the stages' memory, from MERGE on
    MERGE_IN_KERNEL = KEY_POOL and config.merge_in_kernel
    merge_parts = _combine.tile_merger(THREADS, D_PAD, MERGE, config.merge_weight_parts, config.merge_loads, bf16)
    mma = ptx.mma_m16n8k16_bf16 if bf16 else ptx.mma_m16n8k16_f16
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    exp2 = ptx.exp2_approx
    shfl_xor = ptx.shfl_xor_f32
    ldmatrix = ptx.ldmatrix_x4
    ldmatrix_trans = ptx.ldmatrix_x4_trans
    load_f32x4 = ptx.load_f32x4_1d
    store_f32x2 = ptx.store_f32x2
    store2 = ptx.store2
    commit = ptx.cp_async_commit
    wait_q = ptx.cp_async_wait_group(STAGES - 1)  # the oldest group (Q) has landed
    wait_tile = ptx.cp_async_wait_group(STAGES - 2)  # the oldest group still in flight (tile j's) has landed
    load_q_tile = tile_loader(THREADS, ROW, D_PAD, 16, np.uint16, vector_loads)
    # long runs of cache rows read once: L2 fetches 256-byte groups ahead
    load_tile = tile_loader(THREADS, ROW, D_PAD, BLOCK_N, np.uint16, vector_loads, l2_prefetch=config.l2_prefetch,
                            whole_tile_path=True)
    KV = kv is not None
    kv = kv or KvOptions()
    PAGED = kv.paged
    SOFTCAP = kv.softcap
    HAS_LEFT = kv.has_left
    row_length = cache_length(kv.ragged, kv.paged)
    first_visible = visible_start(kv.window)
    load_paged = paged_kv_loader(THREADS, ROW, D_PAD, BLOCK_N, np.uint16, vector_loads, l2_prefetch=config.l2_prefetch)
    online_softmax = softmax_step(S_BLOCKS, O_BLOCKS, SCALE_FIRST, rescale_output=True, softcap=SOFTCAP)

    @device_function
    def mma_into(c, n, a0, a1, a2, a3, b0, b1):
        c[0, n, 0], c[0, n, 1], c[0, n, 2], c[0, n, 3] = mma(a0, a1, a2, a3, b0, b1,
                                                             c[0, n, 0], c[0, n, 1], c[0, n, 2], c[0, n, 3])

    @device_function
    def tile_step(smem, base, n0, key_end, q_frag, s, acc, m_run, l_run, warp_key, k_lane, v_lane, q_lane, g, t, m0,
                  scale_log2, post):
        """The tile in stage ``base`` (keys ``n0 ..``) into this warp's online softmax and ``O``."""
        # ---- S = Q K_w^T on this warp's keys ----------------------------------------------------------------
        for nb in range(S_BLOCKS):
            for e in range(4):
                s[0, nb, e] = ACC_INIT
        for kk in range(QK_STEPS):
            if Q_IN_REGISTERS:
                a0, a1, a2, a3 = q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3]
            else:
                a0, a1, a2, a3 = ldmatrix(smem, q_lane + 16 * kk)
            for nb in range(0, S_BLOCKS, 2):
                b0, b1, b2, b3 = ldmatrix(smem, base + k_lane + 8 * nb * ROW + 16 * kk)
                mma_into(s, nb, a0, a1, a2, a3, b0, b1)
                mma_into(s, nb + 1, a0, a1, a2, a3, b2, b3)

        # ---- online softmax over the warp's keys; the mask only where they cross the end of the range -------
        warp_n0 = n0 + warp_key
        online_softmax(s, acc, m_run, l_run, 0, warp_n0 + WARP_KEYS > key_end, warp_n0, m0 + g, t, key_end,
                       False, 0, scale_log2, post)

        # ---- O += P V_w: P's C fragments of n8 blocks 2kk, 2kk + 1 are the A fragment of k-step kk ----------
        for kk in range(PV_STEPS):
            a0 = pack(s[0, 2 * kk, 0], s[0, 2 * kk, 1])
            a1 = pack(s[0, 2 * kk, 2], s[0, 2 * kk, 3])
            a2 = pack(s[0, 2 * kk + 1, 0], s[0, 2 * kk + 1, 1])
            a3 = pack(s[0, 2 * kk + 1, 2], s[0, 2 * kk + 1, 3])
            for ob in range(0, O_BLOCKS, 2):
                b0, b1, b2, b3 = ldmatrix_trans(smem, base + TILE + v_lane + 16 * kk * ROW + 8 * ob)
                mma_into(acc, ob, a0, a1, a2, a3, b0, b1)
                mma_into(acc, ob + 1, a0, a1, a2, a3, b2, b3)

    @inlined_function
    def body(q, k, v, o_parts, lse_parts, scale_log2, lead_splits, lead_keys, tail_keys, pool_first, counters,
             out_rows, lse_rows, finish, seqlens, table, cap_log2):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # MMA groupID: fragment rows g and g + 8
        t = lane % 4  # MMA threadID_in_group: fragment columns 2t, 2t + 1
        heads = q.shape[1]
        b = cuda.blockIdx.x // heads
        h = cuda.blockIdx.x % heads
        split = cuda.blockIdx.z
        m0 = cuda.blockIdx.y * 16
        hk = h // (heads // k.shape[1])
        rows = q.shape[2]
        if KV:
            seqlen_k = row_length(seqlens, table, k, b)
        else:
            seqlen_k = k.shape[2]
        head_dim = q.shape[3]
        if split < lead_splits:  # SplitPlan: the lead ranges, then the tail ranges the scheduler hands out last
            key_start = split * lead_keys
            key_end = min(seqlen_k, key_start + lead_keys)
        else:
            key_start = lead_splits * lead_keys + (split - lead_splits) * tail_keys
            key_end = min(seqlen_k, key_start + tail_keys)
        pool_start = pool_first
        if HAS_LEFT:  # the ranges count from the row's first visible key (its one query position: seqlen_k - 1)
            lo = first_visible(0, 0, seqlen_k, seqlen_k - 1)
            key_start += lo
            key_end = min(seqlen_k, key_end + lo)  # (the same as adding lo before the min: lo >= 0)
            pool_start = pool_first + lo
        n_tiles = (key_end - key_start + BLOCK_N - 1) // BLOCK_N  # <= 0: an empty split
        if PAGED:
            k_head = k[0, hk]  # (unread: the paged loader looks keys up page by page)
            v_head = v[0, hk]
        else:
            k_head = k[b, hk]
            v_head = v[b, hk]
        warp_key = WARP_KEYS * warp  # this warp's first key in a tile
        # ldmatrix row addresses (flash_mma's): K as two n8 B blocks, Q as the A fragment, V transposed
        k_lane = (warp_key + 8 * (lane // 16) + lane % 8) * ROW + 8 * ((lane // 8) % 2)
        v_lane = (warp_key + 8 * ((lane // 8) % 2) + lane % 8) * ROW + 8 * (lane // 16)
        q_lane = (8 * ((lane // 8) % 2) + lane % 8) * ROW + 8 * (lane // 16)
        post = scale_log2  # multiplies the scores inside the exponent; 1 when they were scaled first
        if SCALE_FIRST:
            post = float32(1.0)
        if SOFTCAP:  # the scores are tanh(pre q.k): the scale was pre, the exponent takes softcap * log2(e)
            post = cap_log2

        smem = cuda.shared.array(0, uint16)
        merge = cuda.shared.array(0, float32)  # the same memory, for the merge after the keys
        q_frag = cuda.local.array((Q_REGS, 4), uint32)
        s = cuda.local.array((1, S_BLOCKS, 4), float32)
        acc = cuda.local.array((1, O_BLOCKS, 4), float32)
        m_run = cuda.local.array(2, float32)  # running max (score units) of rows g, g + 8 over this warp's keys
        l_run = cuda.local.array(2, float32)
        for i in range(2):
            m_run[i] = NEG_INF
            l_run[i] = ZERO
        for ob in range(O_BLOCKS):
            for e in range(4):
                acc[0, ob, e] = ACC_INIT

        load_q_tile(q[b, h], smem, 0, tid, m0, rows, 0, head_dim)
        commit()
        for ahead in range(STAGES - 1):  # tiles 0 .. STAGES - 2, one commit group each
            if ahead < n_tiles:
                n_ahead = key_start + ahead * BLOCK_N
                if PAGED:
                    load_paged(k, v, table, b, hk, smem, Q_TILE + ahead * STAGE, Q_TILE + ahead * STAGE + TILE, tid,
                               n_ahead, key_end, 0, head_dim)
                else:
                    load_tile(k_head, smem, Q_TILE + ahead * STAGE, tid, n_ahead, key_end, 0, head_dim)
                    load_tile(v_head, smem, Q_TILE + ahead * STAGE + TILE, tid, n_ahead, key_end, 0, head_dim)
            commit()
        if Q_IN_REGISTERS:
            wait_q()
            cuda.syncthreads()
            for kk in range(QK_STEPS):
                q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3] = ldmatrix(smem, q_lane + 16 * kk)

        if KEY_POOL:
            # own range, then tiles of the row tile's pool [pool_first, seqlen_k), one at a time: thread 0 asks the
            # row tile's counter for the tile after next and publishes the key (-1: the pool is empty) before the
            # next barrier, so the atomic's round trip hides under a whole tile
            pool_tiles = (seqlen_k - pool_start + BLOCK_N - 1) // BLOCK_N  # <= 0: no pool
            takes = pool_tiles > 0 and n_tiles >= 2  # (a block with fewer own tiles could not ask in time)
            # a pooled plan: its blocks count their arrivals (with per-row lengths, rows may have no pool tile)
            pooled = pool_tiles > 0
            if KV:
                pooled = pool_first < NO_POOL
            row_tile = cuda.blockIdx.x * cuda.gridDim.y + cuda.blockIdx.y
            if pool_tiles > 0:
                key_end = seqlen_k  # own ranges are whole tiles below pool_first
            next_keys = cuda.shared.array(2, types.int64)
            ticket = uint32(0)
            i = 0
            n0 = key_start if n_tiles > 0 else -1
            while n0 >= 0:  # tile i of this block, at key n0
                base = Q_TILE + (i % 2) * STAGE
                if takes and tid == 0 and i >= 1 and i + 1 >= n_tiles:  # the answer asked for in tile i - 1
                    next_keys[(i + 1) % 2] = pool_start + ticket * BLOCK_N if ticket < pool_tiles else -1
                wait_tile()
                cuda.syncthreads()  # tile i has landed for everyone; everyone is done with tile i - 1's stage
                if i + 1 < n_tiles:
                    n_next = n0 + BLOCK_N
                elif takes:
                    n_next = next_keys[(i + 1) % 2]
                else:
                    n_next = -1
                if takes and tid == 0 and i + 2 >= n_tiles and n_next >= 0:
                    ticket = cuda.atomic.add(counters, row_tile, uint32(1))
                if n_next >= 0:
                    nxt = Q_TILE + ((i + 1) % 2) * STAGE
                    if PAGED:
                        load_paged(k, v, table, b, hk, smem, nxt, nxt + TILE, tid, n_next, key_end, 0, head_dim)
                    else:
                        load_tile(k_head, smem, nxt, tid, n_next, key_end, 0, head_dim)
                        load_tile(v_head, smem, nxt + TILE, tid, n_next, key_end, 0, head_dim)
                commit()
                tile_step(smem, base, n0, key_end, q_frag, s, acc, m_run, l_run, warp_key, k_lane, v_lane, q_lane, g,
                          t, m0, scale_log2, post)
                n0 = n_next
                i += 1
            if pooled and tid == 0 and not MERGE_IN_KERNEL:
                # the last of the row tile's blocks to get here (all their tickets are drawn) zeroes its counter,
                # so that the next launch on this stream finds it at 0; the arrival count wraps to 0 by itself
                cuda.threadfence()
                arrivals = cuda.gridDim.x * cuda.gridDim.y + row_tile
                last = uint32(cuda.gridDim.z - 1)
                if cuda.atomic.inc(counters, arrivals, last) == last:
                    cuda.atomic.exch(counters, row_tile, uint32(0))
        else:
            for j in range(n_tiles):
                n0 = key_start + j * BLOCK_N
                base = Q_TILE + (j % STAGES) * STAGE
                wait_tile()
                cuda.syncthreads()  # tile j has landed for everyone; everyone is done with tile j - 1's stage
                if j + STAGES - 1 < n_tiles:
                    nxt = Q_TILE + ((j + STAGES - 1) % STAGES) * STAGE
                    n_next = n0 + (STAGES - 1) * BLOCK_N
                    if PAGED:
                        load_paged(k, v, table, b, hk, smem, nxt, nxt + TILE, tid, n_next, key_end, 0, head_dim)
                    else:
                        load_tile(k_head, smem, nxt, tid, n_next, key_end, 0, head_dim)
                        load_tile(v_head, smem, nxt + TILE, tid, n_next, key_end, 0, head_dim)
                commit()  # an empty group past the last tile keeps "oldest group in flight = tile j" true
                tile_step(smem, base, n0, key_end, q_frag, s, acc, m_run, l_run, warp_key, k_lane, v_lane, q_lane, g,
                          t, m0, scale_log2, post)

        # ---- merge the warps as splits merge: m = max m_w, O = sum 2^(m_w - m) O_w / sum 2^(m_w - m) l_w ---------
        for half in range(2):
            l_row = l_run[half]
            l_row += shfl_xor(l_row, 1)
            l_run[half] = l_row + shfl_xor(l_row, 2)
        ptx.cp_async_wait_all()  # (the groups after the last tile are empty; this keeps it true for any stages)
        cuda.syncthreads()  # every warp is done with the stages
        if t == 0:
            for half in range(2):
                merge[STATS + 16 * warp + g + 8 * half] = m_run[half]
                merge[STATS + 16 * WARPS + 16 * warp + g + 8 * half] = l_run[half]
        cuda.syncthreads()
        for half in range(2):
            r = g + 8 * half
            if m0 + r < rows:
                m_all = NEG_INF
                for w in range(WARPS):
                    m_all = max(m_all, merge[STATS + 16 * w + r])
                shift = m_all if m_all != NEG_INF else ZERO  # no key at all: every weight is exp2(-inf) = 0
                l_all = ZERO
                for w in range(WARPS):
                    l_all += merge[STATS + 16 * WARPS + 16 * w + r] * exp2((merge[STATS + 16 * w + r] - shift) * post)
                weight = exp2((m_run[half] - shift) * post)
                weight = weight / l_all if l_all > ZERO else ZERO
                at = MERGE + warp * MERGE_WARP + r * MERGE_ROW + 2 * t
                for ob in range(O_BLOCKS):
                    store_f32x2(merge, at + 8 * ob, acc[0, ob, 2 * half] * weight, acc[0, ob, 2 * half + 1] * weight)
                if warp == 0 and t == 0:
                    lse_row = NEG_INF if l_all == ZERO else (m_all * post + math.log2(l_all)) * LN2
                    lse_parts[split, b, h, m0 + r] = lse_row
        cuda.syncthreads()
        for i in range(tid, 16 * QUADS, THREADS):
            r = i // QUADS
            c = 4 * (i - r * QUADS)
            if m0 + r < rows:
                x0, x1, x2, x3 = load_f32x4(merge, MERGE + r * MERGE_ROW + c)
                for w in range(1, WARPS):
                    y0, y1, y2, y3 = load_f32x4(merge, MERGE + w * MERGE_WARP + r * MERGE_ROW + c)
                    x0 += y0
                    x1 += y1
                    x2 += y2
                    x3 += y3
                part = o_parts[split, b, h]
                width = part.shape[1]  # headdim, or d_pad for parts the in-kernel merge reads 16 bytes at a time
                if c < width:
                    store2(part, m0 + r, c, x0)
                if c + 1 < width:
                    store2(part, m0 + r, c + 1, x1)
                if c + 2 < width:
                    store2(part, m0 + r, c + 2, x2)
                if c + 3 < width:
                    store2(part, m0 + r, c + 3, x3)

        if MERGE_IN_KERNEL and pooled:
            # the row tile's last block to finish (its arrival count wraps to 0 by itself) zeroes the tile counter
            # for the next launch on this stream and, unless only the parts are asked for, merges them. The arrival
            # is a release (the barrier puts every thread's part before it) and an acquire (the last block sees the
            # others' parts): one atom.acq_rel, about 0.5 us faster at the end of a step than fence, atomic, fence
            cuda.syncthreads()
            if tid == 0:
                arrivals = cuda.gridDim.x * cuda.gridDim.y + row_tile
                last = uint32(cuda.gridDim.z - 1)
                arrived_last = ptx.atomic_inc_acq_rel(counters, arrivals, last) == last
                if arrived_last:
                    cuda.atomic.exch(counters, row_tile, uint32(0))
                next_keys[0] = 1 if arrived_last and finish != FINISH_PARTS else 0
            cuda.syncthreads()
            if next_keys[0] == 1:
                merge_parts(o_parts, lse_parts, out_rows, lse_rows, finish == FINISH_OUT_LSE, merge, b, h, m0,
                            min(16, rows - m0), tid)

    if not KV:
        def kernel(q, k, v, o_parts, lse_parts, scale_log2, lead_splits, lead_keys, tail_keys, pool_first, counters,
                   out_rows, lse_rows, finish):
            body(q, k, v, o_parts, lse_parts, scale_log2, lead_splits, lead_keys, tail_keys, pool_first, counters,
                 out_rows, lse_rows, finish, 0, 0, scale_log2)

        return kernel

    def kv_kernel(q, k, v, o_parts, lse_parts, scale_log2, lead_splits, lead_keys, tail_keys, pool_first, counters,
                  out_rows, lse_rows, finish, seqlens, table, cap_log2):
        body(q, k, v, o_parts, lse_parts, scale_log2, lead_splits, lead_keys, tail_keys, pool_first, counters,
             out_rows, lse_rows, finish, seqlens, table, cap_log2)

    return kv_kernel


@lru_cache(maxsize=None)
def split_kernel(config: DecodeMmaConfig, d_pad: int, bf16: bool, vector_loads: bool, scale_first: bool,
                 kv: KvOptions | None = None):
    """The compiled split kernel of one specialisation (cached on disk)."""
    source = _kernel_source(layout_for(config, d_pad), bf16, vector_loads, scale_first, kv)
    return kernel_jit((config.threads, config.blocks_per_sm), signature_for(kv))(source)
