"""Weighted column sums per (batch, head): ``out[b, h, 0, c] = sum_i w_i x[b, h, i, c]`` over a sequence's rows, in
float32, deterministic (a fixed order of additions for a given device and shape: no atomics).

The non-causal layer backward (``layer_backward``) needs two such sums per (batch, head): the key sum
``s = sum_j phi(k_j)`` and ``sum_i dz_i phi(q_i)``. One kernel does both stages of a two-stage reduction: block
``(bh, p)`` sums the rows of slice ``p`` of its head into ``partial[b, h, p]`` (stage 1), then the same kernel sums
those slices (stage 2, its ``x`` the partial sums, unweighted). One compiled kernel (the weight is a runtime
switch; every array argument is 4-D float32), two or four launches per backward. Inside a block, warp ``w`` adds
rows ``w, w + warps, ...`` of its slice, four at a time in separate sums (four loads in flight), lane ``l``
column ``l`` of each 32-column piece; the warps' sums meet in shared memory and warp 0 adds them in warp order.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from numba import float32

from ..runtime.device import SIMULATOR, cuda, kernel_jit, multiprocessor_count
from ..runtime.launch import launch as device_launch
from .chunk_plan import cdiv

#: columns a warp adds at a time (a lane each)
PIECE = 32
#: rows a warp adds per step, in separate sums
UNROLL = 4
#: launch bound: blocks per SM the registers must allow (NVVM took 80 registers, three blocks of 256 threads)
BLOCKS_PER_SM = 4


@dataclass(frozen=True)
class ColumnSumsConfig:
    """Launch shape of the column sums."""

    warps: int = 8  # warps per block
    blocks_per_sm: int = 4  # stage 1 aims at this many blocks per SM (slices per head: about this * SMs / heads)
    min_slice_rows: int = 128  # fewest rows of a slice (a slice of fewer rows costs more in stage 2 than it saves)

    def __post_init__(self):
        for name in ("warps", "blocks_per_sm", "min_slice_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"ColumnSumsConfig.{name}: expected >= 1, got {getattr(self, name)}")


GPU_CONFIG = ColumnSumsConfig()
#: the simulator runs each thread as a Python thread: one warp, short slices (so that tiny tests meet stage 2)
SIMULATOR_CONFIG = ColumnSumsConfig(warps=1, blocks_per_sm=2, min_slice_rows=4)


def default_config() -> ColumnSumsConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


@lru_cache(maxsize=None)
def column_sums_kernel(warps: int):
    """``(x, weights, weighted, out, slice_rows)``: ``out[b, h, p, c]`` = the sum over rows ``i`` of slice ``p``
    (rows ``p * slice_rows`` up to ``(p + 1) * slice_rows``, fewer in the last) of ``x[b, h, i, c]``, times
    ``weights[b, h, i, 0]`` when ``weighted``; grid ``(batch * heads, slices)``, ``32 * warps`` threads."""
    WARPS = warps
    ZERO = float32(0.0)

    @kernel_jit(launch_bounds=(32 * WARPS, BLOCKS_PER_SM))
    def kernel(x, weights, weighted, out, slice_rows):
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        heads = x.shape[1]
        b = cuda.blockIdx.x // heads
        h = cuda.blockIdx.x % heads
        p = cuda.blockIdx.y
        start = p * slice_rows
        stop = min(start + slice_rows, x.shape[2])
        cols = x.shape[3]
        sums = cuda.shared.array((WARPS, PIECE), float32)
        for piece in range(0, cols, PIECE):
            c = piece + lane
            inside = c < cols
            acc0 = ZERO
            acc1 = ZERO
            acc2 = ZERO
            acc3 = ZERO
            step = WARPS * UNROLL
            i = start + warp
            if inside:
                while i + 3 * WARPS < stop:  # four rows in flight
                    x0 = x[b, h, i, c]
                    x1 = x[b, h, i + WARPS, c]
                    x2 = x[b, h, i + 2 * WARPS, c]
                    x3 = x[b, h, i + 3 * WARPS, c]
                    if weighted:
                        x0 *= weights[b, h, i, 0]
                        x1 *= weights[b, h, i + WARPS, 0]
                        x2 *= weights[b, h, i + 2 * WARPS, 0]
                        x3 *= weights[b, h, i + 3 * WARPS, 0]
                    acc0 += x0
                    acc1 += x1
                    acc2 += x2
                    acc3 += x3
                    i += step
                while i < stop:  # the rest, one at a time
                    x0 = x[b, h, i, c]
                    if weighted:
                        x0 *= weights[b, h, i, 0]
                    acc0 += x0
                    i += WARPS
            sums[warp, lane] = (acc0 + acc1) + (acc2 + acc3)
            cuda.syncthreads()
            if warp == 0 and inside:
                total = ZERO
                for w in range(WARPS):
                    total += sums[w, lane]
                out[b, h, p, c] = total
            cuda.syncthreads()

    return kernel


def _slices(batch_heads: int, rows: int, config: ColumnSumsConfig) -> int:
    """Slices per head of stage 1: enough blocks for ``blocks_per_sm`` per SM, none shorter than ``min_slice_rows``."""
    wanted = cdiv(config.blocks_per_sm * multiprocessor_count(), max(1, batch_heads))
    return max(1, min(wanted, cdiv(rows, config.min_slice_rows)))


def launch_column_sums(x, weights, out, stream, *, scratch, weighted: bool,
                       config: ColumnSumsConfig | None = None):
    """``out[b, h, 0, :] = sum_i w_i x[b, h, i, :]`` on float32 device views: ``x (batch, heads, rows, cols)``,
    ``weights (batch, heads, rows, >= 1)`` (column 0 is ``w``; any 4-D float32 array when not ``weighted``),
    ``out (batch, heads, 1, cols)``; ``scratch(shape)``: a float32 device array for the slices' sums. No rows:
    zeros."""
    config = config or default_config()
    batch, heads, rows, cols = x.shape
    if batch * heads == 0 or cols == 0:
        return
    kernel = column_sums_kernel(config.warps)
    threads = 32 * config.warps
    slices = _slices(batch * heads, rows, config)
    slice_rows = cdiv(rows, slices) if rows else 0
    if slices == 1:
        device_launch(kernel, (batch * heads, 1), threads, stream, 0, x, weights, bool(weighted), out, slice_rows)
        return
    partial = scratch((batch, heads, slices, cols))
    device_launch(kernel, (batch * heads, slices), threads, stream, 0, x, weights, bool(weighted), partial,
                  slice_rows)
    device_launch(kernel, (batch * heads, 1), threads, stream, 0, partial, weights, False, out, slices)
