"""Split-KV decoding (flash-decoding) and the log-sum-exp combine kernel, plain CUDA cores.

Decoding attends a handful of query rows (``seqlen_q`` new tokens times the ``group = heads // kv_heads`` query heads
that share a key/value head) to a long KV cache. There are only ``2 * group * seqlen_q`` flops per K/V element, so the
job is streaming the cache at memory bandwidth: many thread blocks, every K/V element read once. Two kernels:

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

**Combine kernel.** One block per query row, ``combine_split_groups`` groups of ``combine_threads_x`` threads
(columns interleaved, coalesced), each summing every ``combine_split_groups``-th part with the weight
``exp(lse_s - lse)``; every group reduces ``lse = max + log(sum_s exp(lse_s - max))`` itself across its lanes while
its first part is on the way from L2, and one barrier joins the groups' sums. Every part ``-inf`` gives 0 and
``-inf``; NaN in an lse or a value propagates, as in ``reference.combine_lse``.

Everything also runs under ``NUMBA_ENABLE_CUDASIM=1``, which has no warp shuffles: there the butterfly and the
in-warp merge go through shared memory instead (``USE_SHUFFLES``), and ``SIMULATOR_CONFIG`` keeps blocks tiny.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, int64, types, uint64

from ..runtime.device import SIMULATOR, cuda, kernel_jit
from ..runtime.launch import launch as device_launch
from ..core import ptx
from ..core.staging import device_function

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

#: Warp shuffles exist only on a real GPU; the simulator takes the shared-memory path.
USE_SHUFFLES = not SIMULATOR
_FULL_MASK = 0xFFFFFFFF
_WARP = 32
_NEG_INF = float32(-math.inf)
_ZERO = float32(0.0)


def _plain_value(x):
    return float32(x)


def _bf16_bits(x):  # float32 -> bfloat16 bits (round to nearest even), for uint16 views of bfloat16 outputs
    return ptx.low_u16(ptx.pack_bf16x2(x, float32(0.0)))


@cuda.jit(device=True, inline=True)
def merge_lse_states(m, s, m2, s2):
    """Two (max, sum of exp(x - max)) states as one; a NaN makes it NaN (as in the reference), two empty states
    (max -inf) stay empty."""
    if m != m or m2 != m2:
        return m + m2, s + s2
    mx = max(m, m2)
    if mx == _NEG_INF:
        return _NEG_INF, _ZERO
    return mx, s * math.exp(m - mx) + s2 * math.exp(m2 - mx)


@lru_cache(maxsize=None)
def converters(bf16_in: bool, bf16_out: bool):
    """``(load, store)`` device functions: element of q / k / v -> float32, float32 -> element of the output.
    bfloat16 travels as uint16 bit views (CuPy has no bfloat16), so its conversions are explicit; other dtypes
    convert by assignment."""
    load = ptx.bf16_to_float if bf16_in else device_function(_plain_value)
    store = device_function(_bf16_bits) if bf16_out else device_function(_plain_value)
    return load, store

#: Splits that ``launch`` accepts at most (grid y is limited to 65535; more would only waste scratch memory).
MAX_SPLITS = 1024
#: ``choose_num_splits``: keys a split keeps at least, and how many blocks per SM it aims for.
MIN_KEYS_PER_SPLIT = 256
TARGET_BLOCKS_PER_SM = 4


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of the split and combine kernels."""

    threads: int = 128  # split kernel block size (a multiple of 32 on a GPU)
    cols_per_lane: int = 8  # target head-dim columns per lane; sets the key-group width G
    rows: int = 8  # query rows held in registers per pass (q and the accumulator are rows * DPL each)
    keys_per_lane: int = 2  # keys each key group loads per iteration: loads in flight
    combine_threads_x: int = 32  # combine kernel: threads along the head dim of one row (its block is one row)
    combine_split_groups: int = 8  # combine kernel: groups of those threads, each summing every 8th part


#: Default configuration on a GPU, and a tiny one for the simulator (every thread is a Python thread there).
GPU_CONFIG = DecodeConfig()
SIMULATOR_CONFIG = DecodeConfig(
    threads=8, cols_per_lane=2, rows=2, keys_per_lane=2, combine_threads_x=4, combine_split_groups=2
)


def default_config() -> DecodeConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


def key_group_layout(config: DecodeConfig, head_dim: int) -> tuple[int, int]:
    """``(G, DPL)``: lanes per key (a power of two <= 32 and <= threads) and head-dim columns per lane."""
    limit = min(_WARP, config.threads)
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


@lru_cache(maxsize=None)
def split_kernel(config: DecodeConfig, lanes: int, cols: int, rows: int, causal: bool, bf16: bool = False,
                 bf16_out: bool = False):
    """Split kernel specialised on the key-group layout ``(lanes, cols)``, the rows per pass, causality and
    bfloat16 inputs (``bf16``: q, k, v are uint16 bit views) / output (``bf16_out``: o_dst is one)."""
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
    NW = -(-NT // _WARP)
    GROUPS_PER_WARP = max(1, _WARP // G)
    LOG_GPW = GROUPS_PER_WARP.bit_length() - 1
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

    @kernel_jit(launch_bounds=(NT, min_blocks_per_sm(NT, R)))
    def kernel(q, k, v, o_dst, lse_dst, write_lse, scale_log2):
        tid = cuda.threadIdx.x
        lane_g = tid % G
        grp = tid // G
        warp = tid // _WARP
        kv_heads = k.shape[1]
        b = cuda.blockIdx.x // kv_heads
        hk = cuda.blockIdx.x % kv_heads
        split = cuda.blockIdx.y
        num_splits = o_dst.shape[0]
        heads = q.shape[1]
        group = heads // kv_heads
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        head_dim = q.shape[3]
        diag = seqlen_k - seqlen_q
        total_rows = group * seqlen_q

        base = seqlen_k // num_splits
        rem = seqlen_k % num_splits
        start = split * base + min(split, rem)
        end = start + base + (1 if split < rem else 0)

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
        kreg = cuda.local.array((KPL, DPL), float32)
        vreg = cuda.local.array((KPL, DPL), float32)
        s = cuda.local.array((R, KPL), float32)
        m_blk = cuda.local.array(R, float32)

        for r0 in range(0, total_rows, R):
            # ---- this pass's rows: q in registers (scaled to base 2), fresh softmax state --------------------------
            # row rr of the group is q head hk * group + rr // seqlen_q, query rr % seqlen_q
            r_last = min(r0 + R, total_rows) - 1
            n_stop = end
            if CAUSAL:
                # the pass stops at the last key its largest query index sees
                i_max = seqlen_q - 1 if r0 // seqlen_q != r_last // seqlen_q else r_last % seqlen_q
                n_stop = min(end, max(start, i_max + diag + 1))
            # (stepped without divisions so that the loop over R unrolls and these arrays stay in registers)
            g = r0 // seqlen_q
            i = r0 - g * seqlen_q
            for r in range(R):
                valid = r0 + r < total_rows
                # the last key row r may see: one compare masks both the range end and the causal diagonal
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
            for n0 in range(start, n_stop, STEP):
                # all loads of the iteration first: 2 * KPL * DPL of them in flight per lane. They need no
                # predicates: a key past the range is clamped to the last one (its score is masked to -inf below,
                # so p = 0), and only the last column slot can pass head_dim (clamped too; q is 0 there). Unsigned
                # indices spare the negative-index wraparound on every load.
                for kk in range(KPL):
                    key = uint64(min(n0 + kk * NG + grp, n_stop - 1))
                    for j in range(DPL):
                        c = uint64(lane_g + G * j) if j < DPL - 1 else c_last
                        kreg[kk, j] = to_float(kb[key, c])
                        vreg[kk, j] = to_float(vb[key, c])
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
                                    s[r, kk] += cuda.shfl_xor_sync(_FULL_MASK, s[r, kk], offset)
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
                        if key > last_key[r]:
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
                        m_blk[r] = max(m_blk[r], cuda.shfl_xor_sync(_FULL_MASK, m_blk[r], offset))
                    offset *= 2
                if tid % _WARP == 0:
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
                        l_i[r] += cuda.shfl_xor_sync(_FULL_MASK, l_i[r], offset)
                        for j in range(DPL):
                            acc[r, j] += cuda.shfl_xor_sync(_FULL_MASK, acc[r, j], offset)
                    offset *= 2
                if tid % _WARP < G:  # the warp's first key group now holds the warp's sums
                    for r in range(R):
                        for j in range(DPL):
                            o_red[warp, r, lane_g + G * j] = acc[r, j]
                        if lane_g == 0:
                            l_red[warp, r] = l_i[r]
            else:
                for r in range(R):
                    for j in range(DPL):
                        o_red[grp, r, lane_g + G * j] = acc[r, j]
                    if lane_g == 0:
                        l_red[grp, r] = l_i[r]
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

    return kernel


@lru_cache(maxsize=None)
def combine_kernel(config: DecodeConfig, cols: int, parts_dtype: str = "float32", out_dtype: str = "float32"):
    """Combine kernel specialised on the head-dim columns per thread ``cols`` and the dtypes of ``o_parts``
    (float16 or float32) and ``out`` (float16, float32, or uint16: the bits of a bfloat16 out); compiled for that
    one signature.

    One block per query row, ``combine_threads_x x combine_split_groups`` threads. The parts of a row were just
    written by the split kernel and sit in L2, so the kernel is latency-bound: what counts is how many dependent
    L2 round trips and barriers lie between its start and its store. Each group of ``combine_threads_x`` threads
    (a warp on a GPU) sums every ``combine_split_groups``-th part over its interleaved columns. It starts the loads of
    its first part and that part's lse at once, then reduces the row's lse itself: lane ``l`` merges the
    ``(max, sum of exp)`` of parts ``l, l + combine_threads_x, ...`` and the lanes merge by a shuffle butterfly
    (every group gets the same lse, no barrier). Then the weights ``exp(lse_s - lse)``, the group's sums, and one
    barrier before the groups' sums are added. H100, 256 rows of 128 float32 columns, 8 parts: 3.9 us against 4.8
    for the earlier version, which reduced the lse through shared-memory trees over the whole block (16 barriers)
    before it loaded any part (design.md, "A combine with one barrier")."""
    _, to_output = converters(False, out_dtype == "uint16")
    signature = types.void(types.Array(getattr(types, parts_dtype), 5, "A"), types.Array(float32, 4, "A"),
                           types.Array(getattr(types, out_dtype), 4, "A"), types.Array(float32, 3, "A"), types.boolean)
    CX = config.combine_threads_x
    CS = config.combine_split_groups
    THREADS = CX * CS
    # the lanes of a group merge by shuffles when the group is a warp; otherwise (the simulator, which has no
    # shuffles, or narrower groups) every lane merges the group's states from shared memory
    SHUFFLES = USE_SHUFFLES and CX == _WARP
    LANE_MASKS = tuple(CX >> (k + 1) for k in range(CX.bit_length() - 1)) if SHUFFLES else ()
    STATE_LANES = 1 if SHUFFLES else CX
    CJ = cols
    SUM_COLS = CX * CJ
    NEG_INF = float32(-math.inf)
    ZERO = float32(0.0)
    ONE = float32(1.0)

    @kernel_jit(signature=signature)
    def kernel(o_parts, lse_parts, out, lse, write_lse):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * CX + tx
        row = cuda.blockIdx.x
        num_splits = o_parts.shape[0]
        heads = o_parts.shape[2]
        seqlen_q = o_parts.shape[3]
        head_dim = o_parts.shape[4]
        i = row % seqlen_q
        h = (row // seqlen_q) % heads
        b = row // (seqlen_q * heads)
        states = cuda.shared.array((2, CS, STATE_LANES), float32)
        sums = cuda.shared.array((CS, SUM_COLS), float32)

        # this group's first part and its lse, loaded before the weight is known: the round trip to L2 overlaps
        # the lse reduction's
        first = cuda.local.array(CJ, float32)
        has_first = ty < num_splits
        lse_first = NEG_INF
        if has_first:
            lse_first = lse_parts[ty, b, h, i]
        for j in range(CJ):
            c = tx + CX * j
            first[j] = ZERO
            if has_first and c < head_dim:
                first[j] = float32(o_parts[ty, b, h, i, c])

        # the row's lse, in every group: lanes over the parts, then across the lanes
        m = NEG_INF
        ssum = ZERO
        for t in range(tx, num_splits, CX):
            m, ssum = merge_lse_states(m, ssum, lse_parts[t, b, h, i], ONE)
        if SHUFFLES:
            for mask in LANE_MASKS:
                m, ssum = merge_lse_states(m, ssum, cuda.shfl_xor_sync(_FULL_MASK, m, mask),
                                cuda.shfl_xor_sync(_FULL_MASK, ssum, mask))
        else:
            states[0, ty, tx] = m
            states[1, ty, tx] = ssum
            cuda.syncthreads()
            m = NEG_INF
            ssum = ZERO
            for lane in range(CX):
                m, ssum = merge_lse_states(m, ssum, states[0, ty, lane], states[1, ty, lane])
        total = m  # NaN stays NaN
        if m == m:
            total = m + math.log(ssum) if m != NEG_INF and ssum > ZERO else NEG_INF
        # every part empty: weights exp(-inf - 0) = 0, so out is 0 (not exp(-inf + inf) = NaN)
        t_use = total if total != NEG_INF else ZERO

        acc = cuda.local.array(CJ, float32)
        w = math.exp(lse_first - t_use)
        for j in range(CJ):
            acc[j] = w * first[j] if has_first else ZERO
        for s in range(ty + CS, num_splits, CS):
            w = math.exp(lse_parts[s, b, h, i] - t_use)
            for j in range(CJ):
                c = tx + CX * j
                if c < head_dim:
                    acc[j] += w * float32(o_parts[s, b, h, i, c])
        for j in range(CJ):
            sums[ty, tx + CX * j] = acc[j]
        cuda.syncthreads()
        for c in range(tid, head_dim, THREADS):
            x = ZERO
            for g in range(CS):
                x += sums[g, c]
            out[b, h, i, c] = to_output(x)
        if write_lse and tid == 0:
            lse[b, h, i] = total

    return kernel


# -- launchers ---------------------------------------------------------------------------------------------------------
def kernel_arg(x):
    """Under the simulator, hand NumPy arrays over without a copy (the simulator's own transfer insists on
    contiguous buffers and would copy every argument in and out of each launch)."""
    if SIMULATOR and isinstance(x, np.ndarray):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(x)
    return x


def _scratch(shape, stream):
    if SIMULATOR:
        return np.empty(shape, dtype=np.float32)
    return cuda.device_array(shape, dtype=np.float32, stream=stream)


def _unit_axis(view):
    from ..runtime.views import with_unit_axes

    return with_unit_axes(view, 0, 1)


def clamp_num_splits(num_splits: int, seqlen_k: int) -> int:
    """More splits than keys would only produce empty parts; more than MAX_SPLITS only waste scratch memory."""
    return max(1, min(int(num_splits), seqlen_k, MAX_SPLITS))


def launch_split(q, k, v, o_dst, lse_dst, write_lse: bool, sm_scale: float, causal: bool, stream,
                 config: DecodeConfig | None = None, bf16: bool = False):
    """The split kernel alone: ``o_dst (num_splits, batch, heads, seqlen_q, d)``, ``lse_dst (num_splits, ...)``.

    ``num_splits`` is ``o_dst.shape[0]`` and is NOT clamped here (empty splits give 0 and ``-inf``). ``bf16``: q, k,
    v are uint16 views of bfloat16 data; o_dst is then float32 parts or a uint16 view of the bfloat16 output."""
    config = config or default_config()
    if not SIMULATOR and config.threads % _WARP:
        raise ValueError(f"config.threads: must be a multiple of {_WARP} on a GPU, got {config.threads}")
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads = k.shape[1]
    num_splits = o_dst.shape[0]
    if not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits: must be between 1 and 65535 for one launch, got {num_splits}")
    lanes, cols = key_group_layout(config, head_dim)
    # rows per pass: all of the group's rows if they fit, rounded up to a power of two (fewer compiled variants;
    # the spare rows cost a few FMAs on zeros)
    rows = 1
    while rows < min(config.rows, (heads // kv_heads) * seqlen_q):
        rows *= 2
    rows = min(rows, config.rows)
    bf16_out = bool(bf16) and np.dtype(o_dst.dtype) == np.uint16
    kernel = split_kernel(config, lanes, cols, rows, bool(causal), bool(bf16), bf16_out)
    grid = (batch * kv_heads, num_splits)
    args = (q, k, v, o_dst, lse_dst)
    device_launch(kernel, grid, config.threads, stream, 0,
                  *(kernel_arg(x) for x in args), bool(write_lse), float32(sm_scale * LOG2E))


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, num_splits: int, stream,
           config: DecodeConfig | None = None, scratch=None, dtype: str | None = None):
    """Split-KV attention on device views: q (batch, heads, seqlen_q, d), k/v (batch, kv_heads, seqlen_k, d).

    One split writes ``out`` (and ``lse``) directly; several go through float32 scratch parts and the combine.
    ``scratch(shape)`` allocates them (default: Numba's allocator on ``stream``). ``dtype="bfloat16"``: q, k, v and
    out are uint16 views of bfloat16 data.
    """
    bf16 = dtype == "bfloat16"
    scratch = scratch or (lambda shape: _scratch(shape, stream))
    batch, heads, seqlen_q, head_dim = q.shape
    num_splits = clamp_num_splits(num_splits, k.shape[2])
    if num_splits == 1:
        launch_split(q, k, v, _unit_axis(out), _unit_axis(lse), write_lse, sm_scale, causal, stream, config, bf16)
        return
    o_parts = scratch((num_splits, batch, heads, seqlen_q, head_dim))
    lse_parts = scratch((num_splits, batch, heads, seqlen_q))
    launch_split(q, k, v, o_parts, lse_parts, True, sm_scale, causal, stream, config, bf16)
    _launch_combine(o_parts, lse_parts, out, lse, write_lse, stream, config, bf16)


def combine_launch(head_dim: int, parts_dtype: str, out_dtype: str, config: DecodeConfig | None = None):
    """(kernel, block) of the combine for these dtypes (out "uint16": bfloat16 bits); its grid is one block per
    query row."""
    config = config or default_config()
    kernel = combine_kernel(config, -(-head_dim // config.combine_threads_x), parts_dtype, out_dtype)
    return kernel, (config.combine_threads_x, config.combine_split_groups)


def _launch_combine(o_parts, lse_parts, out, lse, write_lse: bool, stream, config: DecodeConfig | None = None,
                    bf16_out: bool = False):
    _, batch, heads, seqlen_q, head_dim = o_parts.shape
    rows = batch * heads * seqlen_q
    if rows == 0 or head_dim == 0:
        return
    out_dtype = np.dtype(out.dtype)
    if bf16_out != (out_dtype == np.uint16):
        raise TypeError(f"out: a bfloat16 output travels as uint16 bits, got {out_dtype} (bf16_out={bf16_out})")
    kernel, block = combine_launch(head_dim, np.dtype(o_parts.dtype).name, out_dtype.name, config)
    device_launch(kernel, rows, block, stream, 0, *(kernel_arg(x) for x in (o_parts, lse_parts, out, lse)),
                  bool(write_lse))


def launch_combine(o_parts, lse_parts, out, lse, stream, config: DecodeConfig | None = None):
    """Merge o_parts (num_splits, batch, heads, seqlen_q, d) by lse_parts into out (batch, heads, seqlen_q, d) and
    lse (batch, heads, seqlen_q)."""
    _launch_combine(o_parts, lse_parts, out, lse, True, stream, config)


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
