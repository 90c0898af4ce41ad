"""Split-KV decoding (flash-decoding) on plain CUDA cores: the split kernel and its launch.

Decoding attends a handful of query rows (``seqlen_q`` new tokens times the ``group = heads // kv_heads`` query heads
that share a key/value head) to a long KV cache. There are only ``2 * group * seqlen_q`` flops per K/V element, so the
job is streaming the cache at memory bandwidth: many thread blocks, every K/V element read once.

**Split kernel.** One thread block per ``(batch, kv_head, split)`` (grid ``(batch * kv_heads, num_splits)``). The
keys are cut into ``num_splits`` contiguous ranges with the partition of ``reference.split_boundaries`` (sizes differ
by at most one, larger first; trailing splits are empty when there are more splits than keys). The block takes ALL
query rows of its GQA group (``group * seqlen_q`` rows; ``rows`` of them per pass, kept in registers), so each K/V
element is loaded once per kv head and reused for every row from registers: this is what makes GQA decoding cheap.

Thread layout: the threads form key groups of ``G`` lanes, ``G`` a power of two <= 32 chosen per head dim so that a
lane owns ``DPL = ceil(headdim / G) <= cols_per_lane`` columns (d = 128 -> 16 lanes x 8 columns, d = 64 -> 8 x 8,
d = 256 -> 32 x 8). Lane ``g`` owns columns ``g + G * j``: one load instruction of a warp reads ``G`` consecutive
elements of each of ``32 / G`` key rows, whole rows coalesced, any strides. Each iteration a key group loads
``keys_per_lane`` K rows and V rows (``2 * keys_per_lane * DPL`` independent loads in flight per lane, unpredicated:
keys past the range are clamped to the last one and masked, the column padding is clamped and meets q = 0), forms
partial dot products with its register copy of ``q`` (pre-scaled by ``sm_scale * log2(e)``: softmax is ``exp2``),
completes them over the ``G`` lanes with a ``shfl_xor`` butterfly (every lane ends with the same bits), and updates
its OWN online-softmax state ``m, l`` and un-normalised accumulator for its columns; the accumulator is rescaled only
when the running max grows. Key groups never talk to each other inside the key loop. At the end of the range the
block merges the groups like splits (rescale by ``exp2(m_group - m_block)`` and sum: shuffles inside a warp, shared
memory across warps), divides by ``l`` once and writes the normalised part and its natural-log lse with coalesced
stores. With one split that part IS the output (written in out's dtype, no combine).

More rows than ``rows`` (long ``seqlen_q``): the block loops over passes of ``rows`` rows, re-reading its key range
(mostly from L2). Causal (bottom-right, row ``i`` sees ``j <= i + seqlen_k - seqlen_q``): a pass stops at the last
key its largest query index sees and masks per element with one compare against each row's last key. Rows that see
no key in a range (causal, empty split, ``seqlen_k == 0``) give 0 and ``lse = -inf``, never ``-inf - (-inf)``.
Registers: q and the accumulator are ``2 * rows * DPL`` (up to 128) per thread; launch bounds ask ptxas for 4 / 3 / 2
resident blocks per SM for up to 2 / 4 / 8 rows, which it meets without spilling.

Several splits write float32 parts, which ``combine``'s kernel merges by their lse.

KV-cache options (``decode.kvcache.KvOptions``, compile-time): a row's length is read at run time
(``block_info.cache_length``) and its keys from the first one its queries see are cut into the splits; paged caches
look each key's page up (``core.paging``); a window bounds each pass and each row by ``mask.visible_start`` /
``visible_end_in``; soft-capped scores ``softcap * tanh(sm_scale q.k / softcap)`` come from q scaled by ``sm_scale /
softcap``, then ``tanh`` times ``softcap * log2(e)`` (base 2). Without options the kernel takes the parameters it
always took and compiles to the same code.

Everything also runs under ``NUMBA_ENABLE_CUDASIM=1``, which has no warp shuffles: there the butterfly and the
in-warp merge go through shared memory instead (``USE_SHUFFLES``), and ``SIMULATOR_CONFIG`` keeps blocks tiny.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, int64, types, uint64

from ..core.block_info import cache_length
from ..core.mask import NO_WINDOW, visible_end_in, visible_start
from ..core.paging import page_of
from ..core.staging import inlined_function
from ..runtime.device import SIMULATOR, cuda, kernel_jit, max_grid
from ..runtime.launch import launch as device_launch
from . import combine as _combine
from .combine import FULL_MASK, LN2, LOG2E, USE_SHUFFLES, WARP, converters, kernel_arg
from .combine import launch_combine  # noqa: F401  (api.combine_lse launches it from here)
from .kvcache import KvCache, KvOptions

#: Splits that ``launch`` takes at most (more would only waste scratch memory; the grid's y limit is far above).
MAX_SPLITS = 1024
#: ``choose_num_splits``: keys a split keeps at least, and how many blocks per SM it aims for.
MIN_KEYS_PER_SPLIT = 256
TARGET_BLOCKS_PER_SM = 4


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of the split kernel."""

    threads: int = 128  # split kernel block size (a multiple of 32 on a GPU)
    cols_per_lane: int = 8  # target head-dim columns per lane; sets the key-group width G
    rows: int = 8  # query rows held in registers per pass (q and the accumulator are rows * DPL each)
    keys_per_lane: int = 2  # keys each key group loads per iteration: loads in flight

    def __post_init__(self):
        if min(self.threads, self.cols_per_lane, self.rows, self.keys_per_lane) < 1:
            raise ValueError(f"threads, cols_per_lane, rows and keys_per_lane must be at least 1, got {self}")


#: Default configuration on a GPU, and a tiny one for the simulator (every thread is a Python thread there).
GPU_CONFIG = DecodeConfig()
SIMULATOR_CONFIG = DecodeConfig(threads=8, cols_per_lane=2, rows=2, keys_per_lane=2)


def default_config() -> DecodeConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


def supports(batch: int, kv_heads: int) -> bool:
    """Whether one launch takes these blocks per split (any query rows: a block loops over them)."""
    return batch * kv_heads <= max_grid(0)


def key_group_layout(config: DecodeConfig, head_dim: int) -> tuple[int, int]:
    """``(G, DPL)``: lanes per key (a power of two <= 32 and <= threads) and head-dim columns per lane."""
    limit = min(WARP, config.threads)
    lanes = 1
    while lanes < limit and lanes * config.cols_per_lane < head_dim:
        lanes *= 2
    return lanes, -(-head_dim // lanes)


#: Registers per thread the split kernel may use, by rows per pass (q and the accumulator are 2 * rows * DPL of
#: them, DPL <= 8): ptxas fits these without spilling. More resident warps = more loads in flight.
_REGISTER_BUDGET = {1: 128, 2: 128, 4: 168}


def min_blocks_per_sm(threads: int, rows: int) -> int:
    """Residency asked of ptxas through launch bounds (128 threads: 4 blocks for <= 2 rows, 3 for 4, 2 for 8)."""
    return max(1, 65536 // (threads * _REGISTER_BUDGET.get(rows, 255)))


def kv_argument_types(kv: KvOptions | None) -> tuple:
    """The types of the split kernel's parameters after the scale: none without KV-cache options; with them
    ``cache_seqlens`` ``(batch,)``, the block table ``(batch, max_pages)`` (int32) and the softcap's ``post``."""
    if kv is None:
        return ()
    return (types.Array(types.int32, 1, "A"), types.Array(types.int32, 2, "A"), types.float32)


@lru_cache(maxsize=None)
def split_kernel(config: DecodeConfig, lanes: int, cols: int, rows: int, causal: bool, bf16: bool = False,
                 bf16_out: bool = False, kv: KvOptions | None = None):
    """Split kernel specialised on the key-group layout ``(lanes, cols)``, the rows per pass, causality,
    bfloat16 inputs (``bf16``: q, k, v are uint16 bit views) / output (``bf16_out``: o_dst is one) and the KV-cache
    options (``decode.kvcache.KvOptions``; None: none, and the kernel of before they existed, whose parameters end
    at the scale)."""
    to_float, to_output = converters(bf16, bf16_out)
    NT = config.threads
    G = lanes  # lanes per key group
    DPL = cols  # head-dim columns per lane
    D_PAD = G * DPL
    NG = NT // G  # key groups per block
    R = rows
    KPL = config.keys_per_lane
    STEP = NG * KPL  # keys per iteration of the block
    LOG_G = G.bit_length() - 1
    NW = -(-NT // WARP)
    GROUPS_PERWARP = max(1, WARP // G)
    LOG_GPW = GROUPS_PERWARP.bit_length() - 1
    CAUSAL = causal
    SHUFFLES = USE_SHUFFLES
    # with shuffles the groups of a warp merge in registers and one slot per warp goes through shared memory;
    # without, every group gets a slot
    NSLOT = NW if SHUFFLES else NG
    RED_T = 1 if SHUFFLES else NT  # the simulator's stand-in for the dot-product butterfly
    # float32 constants: a Python float would pull the softmax into (slow, software) float64
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    LN2_F = float32(LN2)
    # KV-cache options: every use sits under ``if`` on one of these constants, which Numba prunes
    KV = kv is not None
    kv = kv or KvOptions()
    RAGGED_OR_PAGED = kv.ragged or kv.paged
    PAGED = kv.paged
    SOFTCAP = kv.softcap
    WINDOWED = kv.window != NO_WINDOW
    HAS_LEFT = kv.has_left
    row_length = cache_length(kv.ragged, kv.paged)
    first_visible = visible_start(kv.window)
    end_visible = visible_end_in(kv.window)

    @inlined_function
    def body(q, k, v, o_dst, lse_dst, write_lse, scale_log2, seqlens, table, cap_log2):
        tid = cuda.threadIdx.x
        lane_g = tid % G
        grp = tid // G
        warp = tid // WARP
        kv_heads = k.shape[1]
        b = cuda.blockIdx.x // kv_heads
        hk = cuda.blockIdx.x % kv_heads
        split = cuda.blockIdx.y
        num_splits = o_dst.shape[0]
        heads = q.shape[1]
        group = heads // kv_heads
        seqlen_q = q.shape[2]
        if RAGGED_OR_PAGED:
            seqlen_k = row_length(seqlens, table, k, b)
        else:
            seqlen_k = k.shape[2]
        head_dim = q.shape[3]
        diag = seqlen_k - seqlen_q
        total_rows = group * seqlen_q

        if HAS_LEFT:
            # the splits cut the keys the row's queries see: from the first query's first key on
            lo = first_visible(0, 0, seqlen_k, diag)
            base = (seqlen_k - lo) // num_splits
            rem = (seqlen_k - lo) % num_splits
            start = lo + split * base + min(split, rem)
        else:
            base = seqlen_k // num_splits
            rem = seqlen_k % num_splits
            start = split * base + min(split, rem)
        end = start + base + (1 if split < rem else 0)

        if PAGED:
            kb = k[0, hk]  # (unread: keys are looked up page by page)
            vb = v[0, hk]
        else:
            kb = k[b, hk]
            vb = v[b, hk]
        # only the last column slot of a lane can pass head_dim (the layout has G * (DPL - 1) < head_dim)
        c_last = uint64(min(lane_g + G * (DPL - 1), head_dim - 1))

        m_red = cuda.shared.array((NSLOT, R), float32)
        l_red = cuda.shared.array((NSLOT, R), float32)
        o_red = cuda.shared.array((NSLOT, R, D_PAD), float32)
        dot_red = cuda.shared.array((RED_T, R, KPL), float32)

        qreg = cuda.local.array((R, DPL), float32)
        acc = cuda.local.array((R, DPL), float32)
        m_i = cuda.local.array(R, float32)
        l_i = cuda.local.array(R, float32)
        last_key = cuda.local.array(R, int64)  # last key each row may see in this pass; -1: padding row
        first_key = cuda.local.array(R, int64)  # (a window's left side) first key each row may see
        kreg = cuda.local.array((KPL, DPL), float32)
        vreg = cuda.local.array((KPL, DPL), float32)
        s = cuda.local.array((R, KPL), float32)
        m_blk = cuda.local.array(R, float32)

        for r0 in range(0, total_rows, R):
            # ---- this pass's rows: q in registers (scaled to base 2), fresh softmax state --------------------------
            # row rr of the group is q head hk * group + rr // seqlen_q, query rr % seqlen_q
            r_last = min(r0 + R, total_rows) - 1
            n_begin = start
            n_stop = end
            if WINDOWED:
                # the pass takes the keys from the first one its smallest query index sees to the last one its
                # largest sees (the rows may wrap from one head's last query to the next head's first)
                spans_heads = r0 // seqlen_q != r_last // seqlen_q
                i_max = seqlen_q - 1 if spans_heads else r_last % seqlen_q
                n_stop = end_visible(i_max + 1, start, end, CAUSAL, diag)
                n_begin = first_visible(0 if spans_heads else r0 % seqlen_q, start, n_stop, diag)
            elif CAUSAL:
                # the pass stops at the last key its largest query index sees
                i_max = seqlen_q - 1 if r0 // seqlen_q != r_last // seqlen_q else r_last % seqlen_q
                n_stop = min(end, max(start, i_max + diag + 1))
            # (stepped without divisions so that the loop over R unrolls and these arrays stay in registers)
            g = r0 // seqlen_q
            i = r0 - g * seqlen_q
            for r in range(R):
                valid = r0 + r < total_rows
                # the last key row r may see: one compare masks both the range end and the causal diagonal
                if WINDOWED:
                    last_key[r] = end_visible(i + 1, n_begin, n_stop, CAUSAL, diag) - 1 if valid else -1
                    first_key[r] = first_visible(i, n_begin, n_stop, diag)
                else:
                    last_key[r] = (min(i + diag, n_stop - 1) if CAUSAL else n_stop - 1) if valid else -1
                for j in range(DPL):
                    c = lane_g + G * j
                    val = ZERO
                    if valid and c < head_dim:
                        val = to_float(q[b, hk * group + g, i, c]) * scale_log2
                    qreg[r, j] = val
                i += 1
                if i == seqlen_q:
                    i = 0
                    g += 1
            for r in range(R):
                for j in range(DPL):
                    acc[r, j] = 0.0
                m_i[r] = NEG_INF
                l_i[r] = 0.0

            # ---- stream this split's keys; every key group keeps its own online-softmax state --------------------
            for n0 in range(n_begin, n_stop, STEP):
                # all loads of the iteration first: 2 * KPL * DPL of them in flight per lane. They need no
                # predicates: a key past the range is clamped to the last one (its score is masked to -inf below,
                # so p = 0), and only the last column slot can pass head_dim (clamped too; q is 0 there). Unsigned
                # indices spare the negative-index wraparound on every load.
                for kk in range(KPL):
                    key = uint64(min(n0 + kk * NG + grp, n_stop - 1))
                    if PAGED:
                        page, at = page_of(table, b, key, k.shape[2])
                        kp = k[page, hk]
                        vp = v[page, hk]
                        for j in range(DPL):
                            c = uint64(lane_g + G * j) if j < DPL - 1 else c_last
                            kreg[kk, j] = to_float(kp[at, c])
                            vreg[kk, j] = to_float(vp[at, c])
                    else:
                        for j in range(DPL):
                            c = uint64(lane_g + G * j) if j < DPL - 1 else c_last
                            kreg[kk, j] = to_float(kb[key, c])
                            vreg[kk, j] = to_float(vb[key, c])
                if n0 + STEP > n_stop:
                    # the last step (a uniform branch): keys past the range are copies of the range's last key,
                    # which the row may see; their p = 0 times a +-inf value there would make the row NaN
                    for kk in range(KPL):
                        if n0 + kk * NG + grp >= n_stop:
                            for j in range(DPL):
                                vreg[kk, j] = ZERO
                for r in range(R):
                    for kk in range(KPL):
                        dot = ZERO
                        for j in range(DPL):
                            dot += qreg[r, j] * kreg[kk, j]
                        s[r, kk] = dot
                if G > 1:
                    if SHUFFLES:
                        # butterfly over the G lanes of the group: all lanes end with the same full sum
                        offset = 1
                        for _ in range(LOG_G):
                            for r in range(R):
                                for kk in range(KPL):
                                    s[r, kk] += cuda.shfl_xor_sync(FULL_MASK, s[r, kk], offset)
                            offset *= 2
                    else:
                        for r in range(R):
                            for kk in range(KPL):
                                dot_red[tid, r, kk] = s[r, kk]
                        cuda.syncthreads()
                        first = grp * G
                        for r in range(R):
                            for kk in range(KPL):
                                dot = ZERO
                                for t in range(G):  # same order in every lane, like the butterfly
                                    dot += dot_red[first + t, r, kk]
                                s[r, kk] = dot
                        cuda.syncthreads()
                for r in range(R):
                    m_new = m_i[r]
                    for kk in range(KPL):
                        key = n0 + kk * NG + grp
                        x = s[r, kk]
                        if SOFTCAP:  # q was scaled by sm_scale / softcap: the capped score in base 2
                            x = math.tanh(x) * cap_log2
                        if key > last_key[r]:
                            x = NEG_INF
                        if HAS_LEFT:
                            if key < first_key[r]:
                                x = NEG_INF
                        s[r, kk] = x
                        m_new = max(m_new, x)
                    if m_new > m_i[r]:
                        # the running max grew: rescale (rare once the first keys are in, so it is skipped
                        # rather than multiplying by exp2(0) = 1 every time; m = -inf before gives 0)
                        alpha = math.exp2(m_i[r] - m_new)
                        l_i[r] *= alpha
                        for j in range(DPL):
                            acc[r, j] *= alpha
                        m_i[r] = m_new
                    # a row that has seen no key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN
                    m_use = m_i[r] if m_i[r] != NEG_INF else ZERO
                    for kk in range(KPL):
                        p = math.exp2(s[r, kk] - m_use)
                        l_i[r] += p
                        for j in range(DPL):
                            acc[r, j] += p * vreg[kk, j]

            # ---- merge the key groups' states like splits: common max, rescale, sum ---------------------------
            for r in range(R):
                m_blk[r] = m_i[r]
            if SHUFFLES:
                offset = G
                for _ in range(LOG_GPW):
                    for r in range(R):
                        m_blk[r] = max(m_blk[r], cuda.shfl_xor_sync(FULL_MASK, m_blk[r], offset))
                    offset *= 2
                if tid % WARP == 0:
                    for r in range(R):
                        m_red[warp, r] = m_blk[r]
            elif lane_g == 0:
                for r in range(R):
                    m_red[grp, r] = m_i[r]
            cuda.syncthreads()
            for r in range(R):
                m_b = m_red[0, r]
                for t in range(1, NSLOT):
                    m_b = max(m_b, m_red[t, r])
                m_use = m_b if m_b != NEG_INF else ZERO
                f = math.exp2(m_i[r] - m_use)  # 0 for a group that saw nothing
                l_i[r] *= f
                for j in range(DPL):
                    acc[r, j] *= f
            if SHUFFLES:
                offset = G
                for _ in range(LOG_GPW):
                    for r in range(R):
                        l_i[r] += cuda.shfl_xor_sync(FULL_MASK, l_i[r], offset)
                        for j in range(DPL):
                            acc[r, j] += cuda.shfl_xor_sync(FULL_MASK, acc[r, j], offset)
                    offset *= 2
            # with shuffles the warp's first key group now holds the warp's sums; without, every group has a slot
            if not SHUFFLES or tid % WARP < G:
                slot = warp if SHUFFLES else grp
                for r in range(R):
                    for j in range(DPL):
                        o_red[slot, r, lane_g + G * j] = acc[r, j]
                    if lane_g == 0:
                        l_red[slot, r] = l_i[r]
            cuda.syncthreads()

            # ---- normalise and write: consecutive threads take consecutive columns (coalesced stores) ----------
            for e in range(tid, R * head_dim, NT):
                r = e // head_dim
                c = e % head_dim
                rr = r0 + r
                if rr < total_rows:
                    l = ZERO
                    o = ZERO
                    for t in range(NSLOT):
                        l += l_red[t, r]
                        o += o_red[t, r, c]
                    # rows that see no key in this range give 0 (and lse -inf below), as in the reference; a NaN
                    # input makes l NaN and propagates
                    o_dst[split, b, hk * group + rr // seqlen_q, rr % seqlen_q, c] = to_output(
                        o / l if l != ZERO else ZERO)
            if write_lse and tid < R:
                rr = r0 + tid
                if rr < total_rows:
                    l = ZERO
                    m_b = m_red[0, tid]
                    for t in range(NSLOT):
                        l += l_red[t, tid]
                        m_b = max(m_b, m_red[t, tid])
                    lse_val = NEG_INF
                    if l != ZERO:
                        lse_val = (m_b + math.log2(l)) * LN2_F
                    lse_dst[split, b, hk * group + rr // seqlen_q, rr % seqlen_q] = lse_val
            cuda.syncthreads()  # the next pass rewrites the shared buffers

    bounds = (NT, min_blocks_per_sm(NT, R))
    if not KV:
        def kernel(q, k, v, o_dst, lse_dst, write_lse, scale_log2):
            body(q, k, v, o_dst, lse_dst, write_lse, scale_log2, 0, 0, scale_log2)

        return kernel_jit(launch_bounds=bounds)(kernel)

    def kv_kernel(q, k, v, o_dst, lse_dst, write_lse, scale_log2, seqlens, table, cap_log2):
        body(q, k, v, o_dst, lse_dst, write_lse, scale_log2, seqlens, table, cap_log2)

    return kernel_jit(launch_bounds=bounds)(kv_kernel)


# -- launchers ---------------------------------------------------------------------------------------------------------
def _scratch(shape, stream):
    if SIMULATOR:
        return np.empty(shape, dtype=np.float32)
    return cuda.device_array(shape, dtype=np.float32, stream=stream)


def _unit_axis(view):
    from ..runtime.views import with_unit_axes

    return with_unit_axes(view, 0, 1)


def clamp_num_splits(num_splits: int, seqlen_k: int) -> int:
    """More splits than keys would only produce empty parts; more than MAX_SPLITS only waste scratch memory; one
    launch takes at most ``max_grid(1)``."""
    return max(1, min(int(num_splits), seqlen_k, MAX_SPLITS, max_grid(1)))


def launch_split(q, k, v, o_dst, lse_dst, write_lse: bool, sm_scale: float, causal: bool, stream,
                 config: DecodeConfig | None = None, bf16: bool = False, kv: KvCache | None = None):
    """The split kernel alone: ``o_dst (num_splits, batch, heads, seqlen_q, d)``, ``lse_dst (num_splits, ...)``.

    ``num_splits`` is ``o_dst.shape[0]`` and is NOT clamped here (empty splits give 0 and ``-inf``). ``bf16``: q, k,
    v are uint16 views of bfloat16 data; o_dst is then float32 parts or a uint16 view of the bfloat16 output.
    ``kv``: the KV-cache arguments (``decode.kvcache``; k and v then as ``KvCache`` describes them); each row's keys
    are cut into ``num_splits`` ranges at its own length."""
    config = config or default_config()
    if not SIMULATOR and config.threads % WARP:
        raise ValueError(f"config.threads: must be a multiple of {WARP} on a GPU, got {config.threads}")
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads = k.shape[1]
    num_splits = o_dst.shape[0]
    if not 1 <= num_splits <= max_grid(1):
        raise ValueError(f"num_splits: must be between 1 and {max_grid(1)} for one launch, got {num_splits}")
    if not supports(batch, kv_heads):
        raise ValueError(f"k: batch * kv_heads = {batch * kv_heads} blocks per split, more than one launch takes "
                         f"({max_grid(0)})")
    lanes, cols = key_group_layout(config, head_dim)
    # rows per pass: all of the group's rows if they fit, rounded up to a power of two (fewer compiled variants;
    # the spare rows cost a few FMAs on zeros)
    rows = 1
    while rows < min(config.rows, (heads // kv_heads) * seqlen_q):
        rows *= 2
    rows = min(rows, config.rows)
    bf16_out = bool(bf16) and np.dtype(o_dst.dtype) == np.uint16
    options = None if kv is None else kv.options
    kernel = split_kernel(config, lanes, cols, rows, bool(causal), bool(bf16), bf16_out, options)
    grid = (batch * kv_heads, num_splits)
    args = (q, k, v, o_dst, lse_dst)
    if options is None:
        device_launch(kernel, grid, config.threads, stream, 0,
                      *(kernel_arg(x) for x in args), bool(write_lse), float32(sm_scale * LOG2E))
        return
    scale, cap = kv.scales(sm_scale)
    device_launch(kernel, grid, config.threads, stream, 0, *(kernel_arg(x) for x in args), bool(write_lse), scale,
                  kernel_arg(kv.seqlens), kernel_arg(kv.table), cap)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, num_splits: int, stream,
           config: DecodeConfig | None = None, scratch=None, dtype: str | None = None, kv: KvCache | None = None):
    """Split-KV attention on device views: q (batch, heads, seqlen_q, d), k/v (batch, kv_heads, seqlen_k, d) or the
    KV cache ``kv`` describes.

    One split writes ``out`` (and ``lse``) directly; several go through float32 scratch parts and the combine.
    ``scratch(shape)`` allocates them (default: Numba's allocator on ``stream``). ``dtype="bfloat16"``: q, k, v and
    out are uint16 views of bfloat16 data.
    """
    bf16 = dtype == "bfloat16"
    scratch = scratch or (lambda shape: _scratch(shape, stream))
    batch, heads, seqlen_q, head_dim = q.shape
    num_splits = clamp_num_splits(num_splits, k.shape[2] if kv is None else max(1, kv.span(seqlen_q)))
    if not _combine.supports(batch * heads * seqlen_q):
        num_splits = 1  # (the combine takes a block per query row; one split writes out itself, for any rows)
    if num_splits == 1:
        launch_split(q, k, v, _unit_axis(out), _unit_axis(lse), write_lse, sm_scale, causal, stream, config, bf16, kv)
        return
    o_parts = scratch((num_splits, batch, heads, seqlen_q, head_dim))
    lse_parts = scratch((num_splits, batch, heads, seqlen_q))
    launch_split(q, k, v, o_parts, lse_parts, True, sm_scale, causal, stream, config, bf16, kv)
    _combine.launch(o_parts, lse_parts, out, lse, write_lse, stream, bf16_out=bf16)



def choose_num_splits(batch: int, heads: int, kv_heads: int, seqlen_q: int, seqlen_k: int, sm_count: int) -> int:
    """How many key ranges to cut the cache into.

    The split kernel runs one block per ``(batch, kv_head, split)``; without splitting, a decode step of batch 1
    with 8 kv heads would stream the whole cache with 8 blocks on a GPU of 132 SMs, using a few percent of its
    bandwidth. So: aim for ``TARGET_BLOCKS_PER_SM`` blocks per SM (the launch bounds make 2-4 blocks of 128
    threads resident per SM, so this is one or two full waves: every SM keeps loads in flight until the end and
    no small last wave idles the GPU), but give each split at least ``MIN_KEYS_PER_SPLIT`` keys: every split
    costs a fixed prologue/epilogue (q loads, cross-warp merge) and writes ``group * seqlen_q`` float32 rows of
    ``o_parts`` that the combine reads back, which stays small next to the ``256 * d * 2`` elements of K and V
    the split streams. ``seqlen_q`` (and ``heads``) do not change the count: all rows of a GQA group share one
    block. Returns 1 when the (batch, kv_head) blocks alone already fill the GPU or the cache is short; then no
    combine runs at all.
    """
    base_blocks = max(1, batch * kv_heads)
    wanted = -(-TARGET_BLOCKS_PER_SM * max(1, sm_count) // base_blocks)
    by_keys = seqlen_k // MIN_KEYS_PER_SPLIT
    return max(1, min(wanted, by_keys, MAX_SPLITS))
