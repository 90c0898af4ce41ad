"""The log-sum-exp merge of split-KV parts: the combine kernel and its launch, the same merge for the tensor-core
split kernel's last block of a pooled row tile (``tile_merger``), and the device functions the split kernels share
with them (``merge_lse_states``, ``converters``).

**Combine kernel.** One block per query row, ``split_groups`` groups of ``threads_x`` threads (columns interleaved,
coalesced), each summing every ``split_groups``-th part with the weight ``exp(lse_s - lse)``; every group reduces
``lse = max + log(sum_s exp(lse_s - max))`` itself across its lanes while its first part is on the way from L2, and
one barrier joins the groups' sums. Every part ``-inf`` gives 0 and ``-inf``; NaN in an lse or a value propagates,
as in ``reference.combine_lse``.

Under ``NUMBA_ENABLE_CUDASIM=1``, which has no warp shuffles, the lanes merge through shared memory instead
(``USE_SHUFFLES``), and ``SIMULATOR_CONFIG`` keeps blocks tiny.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, types

from ..runtime.device import SIMULATOR, cuda, kernel_jit, max_grid
from ..runtime.launch import launch as device_launch
from ..core import ptx
from ..core.constants import LN2, LOG2E  # noqa: F401  (the decode kernels' base-2 softmax)
from ..core.staging import device_function


#: Warp shuffles exist only on a real GPU; the simulator takes the shared-memory path.
USE_SHUFFLES = not SIMULATOR
FULL_MASK = 0xFFFFFFFF
WARP = 32
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


def _exported_device_function(fn):
    """``core.staging.device_function`` for a device function that uses ``cuda.*`` and is called by a kernel of
    another module: under the simulator it needs the simulator's wrapper, which swaps in its ``cuda`` module for
    this module's globals while the function runs."""
    return cuda.jit(device=True)(fn) if SIMULATOR else device_function(fn)


@cuda.jit(device=True, inline=True)
def lse_and_shift(m, s):
    """``(lse, shift)`` of a merged ``(max, sum of exp)`` state: ``lse = m + log(s)`` (NaN stays NaN, a NaN or +inf
    part makes it NaN, a state with no key gives -inf), and the shift of the weights ``exp(lse_s - shift)``: 0 where every part is empty, so
    that the weights are 0 and not ``exp(-inf + inf) = NaN``."""
    lse = _NEG_INF if m == _NEG_INF else m + math.log(s)  # a +inf part: m = +inf, s = NaN, so lse is NaN
    return lse, (lse if lse != _NEG_INF else _ZERO)


@lru_cache(maxsize=None)
def converters(bf16_in: bool, bf16_out: bool):
    """``(load, store)`` device functions: element of q / k / v -> float32, float32 -> element of the output.
    bfloat16 travels as uint16 bit views (CuPy has no bfloat16), so its conversions are explicit; other dtypes
    convert by assignment."""
    load = ptx.bf16_to_float if bf16_in else device_function(_plain_value)
    store = device_function(_bf16_bits) if bf16_out else device_function(_plain_value)
    return load, store


@dataclass(frozen=True)
class CombineConfig:
    """Block shape of the combine kernel (its block is one query row)."""

    threads_x: int = 32  # threads along the head dim of the row
    split_groups: int = 8  # groups of those threads, each summing every split_groups-th part

    def __post_init__(self):
        if self.threads_x < 1 or self.split_groups < 1 or self.threads_x * self.split_groups > 1024:
            raise ValueError(f"threads_x ({self.threads_x}) and split_groups ({self.split_groups}): at least 1 each, "
                             "and a block of at most 1024 threads")


#: Default block on a GPU, and a tiny one for the simulator (every thread is a Python thread there).
GPU_CONFIG = CombineConfig()
SIMULATOR_CONFIG = CombineConfig(threads_x=4, split_groups=2)


def default_config() -> CombineConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


@lru_cache(maxsize=None)
def combine_kernel(config: CombineConfig, cols: int, parts_dtype: str = "float32", out_dtype: str = "float32"):
    """Combine kernel specialised on the head-dim columns per thread ``cols`` and the dtypes of ``o_parts``
    (float16 or float32) and ``out`` (float16, float32, or uint16: the bits of a bfloat16 out); compiled for that
    one signature.

    One block per query row, ``threads_x x split_groups`` threads. The parts of a row were just written by the split
    kernel and sit in L2, so the kernel is latency-bound: what counts is how many dependent L2 round trips and
    barriers lie between its start and its store. Each group of ``threads_x`` threads (a warp on a GPU) sums every
    ``split_groups``-th part over its interleaved columns. It starts the loads of its first part and that part's lse
    at once, then reduces the row's lse itself: lane ``l`` merges the ``(max, sum of exp)`` of parts
    ``l, l + threads_x, ...`` and the lanes merge by a shuffle butterfly (every group gets the same lse, no barrier).
    Then the weights ``exp(lse_s - lse)``, the group's sums, and one barrier before the groups' sums are added: an
    earlier version that reduced the lse through shared-memory trees over the whole block (16 barriers) before it
    loaded any part was slower (docs/design/decode.md, "A combine with one barrier")."""
    _, to_output = converters(False, out_dtype == "uint16")
    signature = types.void(types.Array(getattr(types, parts_dtype), 5, "A"), types.Array(float32, 4, "A"),
                           types.Array(getattr(types, out_dtype), 4, "A"), types.Array(float32, 3, "A"), types.boolean)
    CX = config.threads_x
    CS = config.split_groups
    THREADS = CX * CS
    # the lanes of a group merge by shuffles when the group is a warp; otherwise (the simulator, which has no
    # shuffles, or narrower groups) every lane merges the group's states from shared memory
    SHUFFLES = USE_SHUFFLES and CX == WARP
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
                m, ssum = merge_lse_states(m, ssum, cuda.shfl_xor_sync(FULL_MASK, m, mask),
                                           cuda.shfl_xor_sync(FULL_MASK, ssum, mask))
        else:
            states[0, ty, tx] = m
            states[1, ty, tx] = ssum
            cuda.syncthreads()
            m = NEG_INF
            ssum = ZERO
            for lane in range(CX):
                m, ssum = merge_lse_states(m, ssum, states[0, ty, lane], states[1, ty, lane])
        total, t_use = lse_and_shift(m, ssum)

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


def tile_merger(threads: int, d_pad: int, weights_at: int, weight_parts: int, merge_loads: int, bf16: bool):
    """``merge_parts(o_parts, lse_parts, out_rows, lse_rows, write_lse, merge, b, h, m0, tile_rows, tid)``: the
    parts of the 16 rows from ``m0`` merged into 16-bit output rows (and, with ``write_lse``, their lse) by a block of
    ``threads`` threads, for the split kernel's last block of a pooled row tile (``decode.mma``). The parts are
    float32 rows ``d_pad`` wide, read 16 bytes at a time; ``merge`` is float32 shared memory whose ``weights_at ..``
    holds the weights of ``weight_parts`` parts per row at a time.

    The lse of a row over ``threads // 16`` lanes of one warp (a butterfly, as in the combine kernel), then 4-column
    groups of the 16 rows per thread, ``ROUND`` parts of each loaded at a time: about ``merge_loads`` 16-byte loads
    in flight per thread, a power of two that divides ``weight_parts`` so that rounds never straddle the weights in
    shared memory."""
    THREADS = threads
    QUADS = d_pad // 4  # 4-column groups of an output row
    LSE_LANES = THREADS // 16
    LSE_MASKS = tuple(LSE_LANES >> (n + 1) for n in range(LSE_LANES.bit_length() - 1))
    ITEMS = -(-16 * QUADS // THREADS)
    WEIGHT_PARTS = weight_parts
    ROUND = min(WEIGHT_PARTS, 1 << (max(1, merge_loads // ITEMS).bit_length() - 1))
    WEIGHTS = weights_at  # weight of part s of row r at WEIGHTS + r * WEIGHT_PARTS + s % WEIGHT_PARTS
    NEG_INF = np.float32(-np.inf)
    ZERO = np.float32(0.0)
    ONE = np.float32(1.0)
    load_part_quad = ptx.load_f32x4
    low_u16, high_u16 = ptx.low_u16, ptx.high_u16
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    shfl_xor = ptx.shfl_xor_f32
    store2 = ptx.store2

    @device_function
    def load_round(o_parts, b, h, m0, s0, num_splits, tile_rows, tid, values):
        """Parts ``s0 .. s0 + ROUND`` of this thread's column groups into ``values`` (0 past the parts / rows)."""
        for it in range(ITEMS):
            item = tid + THREADS * it
            r = item // QUADS
            c = 4 * (item - r * QUADS)
            for u in range(ROUND):
                if r < tile_rows and s0 + u < num_splits:
                    values[it, u, 0], values[it, u, 1], values[it, u, 2], values[it, u, 3] = load_part_quad(
                        o_parts[s0 + u, b, h], m0 + r, c)
                else:
                    for e in range(4):
                        values[it, u, e] = ZERO

    @_exported_device_function
    def merge_parts(o_parts, lse_parts, out_rows, lse_rows, write_lse, merge, b, h, m0, tile_rows, tid):
        """The row tile's parts (all written, seen through the acquire of the arrival) merged like the combine
        kernel merges them: ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse) part_s``."""
        num_splits = cuda.gridDim.z
        values = cuda.local.array((ITEMS, ROUND, 4), float32)
        total = cuda.local.array((ITEMS, 4), float32)
        load_round(o_parts, b, h, m0, 0, num_splits, tile_rows, tid, values)  # in flight under the lse reduction
        # row r's lse: lane j of its LSE_LANES merges parts j, j + LSE_LANES, ..., then a butterfly
        r = tid // LSE_LANES
        j = tid % LSE_LANES
        m = NEG_INF
        ssum = ZERO
        if r < tile_rows:
            for s in range(j, num_splits, LSE_LANES):
                m, ssum = merge_lse_states(m, ssum, lse_parts[s, b, h, m0 + r], ONE)
        for mask in LSE_MASKS:
            m, ssum = merge_lse_states(m, ssum, shfl_xor(m, mask), shfl_xor(ssum, mask))
        lse_row, shift = lse_and_shift(m, ssum)
        if write_lse and j == 0 and r < tile_rows:
            lse_rows[b, h, m0 + r] = lse_row
        for it in range(ITEMS):
            for e in range(4):
                total[it, e] = ZERO
        for first in range(0, num_splits, WEIGHT_PARTS):
            last = min(num_splits, first + WEIGHT_PARTS)
            if first > 0:
                cuda.syncthreads()  # everyone is done with the previous weights
            if r < tile_rows:
                for s in range(first + j, last, LSE_LANES):
                    merge[WEIGHTS + r * WEIGHT_PARTS + s - first] = math.exp(lse_parts[s, b, h, m0 + r] - shift)
            cuda.syncthreads()
            for s0 in range(first, last, ROUND):
                if s0 > 0:
                    load_round(o_parts, b, h, m0, s0, num_splits, tile_rows, tid, values)
                for it in range(ITEMS):
                    item = tid + THREADS * it
                    row = item // QUADS
                    if row < tile_rows:
                        for u in range(ROUND):
                            if s0 + u < last:
                                weight = merge[WEIGHTS + row * WEIGHT_PARTS + s0 + u - first]
                                for e in range(4):
                                    total[it, e] += weight * values[it, u, e]
        out = out_rows[b, h]
        head_dim = out_rows.shape[3]
        for it in range(ITEMS):
            item = tid + THREADS * it
            row = item // QUADS
            c = 4 * (item - row * QUADS)
            if row < tile_rows:
                for e in range(0, 4, 2):
                    word = pack(total[it, e], total[it, e + 1])
                    if c + e < head_dim:
                        store2(out, m0 + row, c + e, low_u16(word))
                    if c + e + 1 < head_dim:
                        store2(out, m0 + row, c + e + 1, high_u16(word))

    return merge_parts


def supports(rows: int) -> bool:
    """Whether one launch merges ``rows`` query rows (``batch * heads * seqlen_q``): a block each, on grid x."""
    return rows <= max_grid(0)


def kernel_arg(x):
    """Under the simulator, hand NumPy arrays over without a copy (the simulator's own transfer insists on
    contiguous buffers and would copy every argument in and out of each launch)."""
    if SIMULATOR and isinstance(x, np.ndarray):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(x)
    return x


def combine_launch(head_dim: int, parts_dtype: str, out_dtype: str, config: CombineConfig | None = None):
    """(kernel, block) of the combine for these dtypes (out "uint16": bfloat16 bits); its grid is one block per
    query row."""
    config = config or default_config()
    kernel = combine_kernel(config, -(-head_dim // config.threads_x), parts_dtype, out_dtype)
    return kernel, (config.threads_x, config.split_groups)


def launch(o_parts, lse_parts, out, lse, write_lse: bool, stream, config: CombineConfig | None = None,
           bf16_out: bool = False):
    """Merge ``o_parts (num_splits, batch, heads, seqlen_q, d)`` by ``lse_parts`` into ``out`` (a uint16 view of
    bfloat16 with ``bf16_out``) and, with ``write_lse``, ``lse``."""
    _, batch, heads, seqlen_q, head_dim = o_parts.shape
    rows = batch * heads * seqlen_q
    if rows == 0 or head_dim == 0:
        return
    if not supports(rows):
        raise ValueError(f"o_parts: {rows} query rows (batch * heads * seqlen_q), more than one launch merges "
                         f"({max_grid(0)})")
    out_dtype = np.dtype(out.dtype)
    if bf16_out != (out_dtype == np.uint16):
        raise TypeError(f"out: a bfloat16 output travels as uint16 bits, got {out_dtype} (bf16_out={bf16_out})")
    kernel, block = combine_launch(head_dim, np.dtype(o_parts.dtype).name, out_dtype.name, config)
    device_launch(kernel, rows, block, stream, 0, *(kernel_arg(x) for x in (o_parts, lse_parts, out, lse)),
                  bool(write_lse))


def launch_combine(o_parts, lse_parts, out, lse, stream, config: CombineConfig | None = None):
    """Merge o_parts (num_splits, batch, heads, seqlen_q, d) by lse_parts into out (batch, heads, seqlen_q, d) and
    lse (batch, heads, seqlen_q)."""
    launch(o_parts, lse_parts, out, lse, True, stream, config)
