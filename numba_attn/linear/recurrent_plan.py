"""How the recurrent linear-attention kernels (``recurrent``) are laid out: the tuning knobs, each block's share of the
state on its threads and registers, the split of M over blocks and of the sequence over the non-causal passes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.device import SIMULATOR, max_grid
from .chunk_plan import cdiv, round_up

#: Kernel modes: the causal walk, and the two passes of the non-causal layer.
CAUSAL, REDUCE, APPLY = 0, 1, 2


@dataclass(frozen=True)
class LinearConfig:
    """Tuning knobs."""

    max_threads: int = 256  # per block; even at 255 registers a thread such a block fits one SM's register file
    min_threads: int = 64  # more E-slices until a block has this many threads (when E allows): shorter rows
    cols_per_thread: int = 4  # RM: columns of the state per thread; q and k shared loads are reused RM times
    state_per_thread: int = 64  # RE * RM registers of state per thread
    rows_per_sync: int = 8  # R: rows per barrier (lowered per layout to fit shared memory and max_prefetch)
    max_prefetch: int = 40  # registers a thread may hold for the next chunk's rows
    max_shared_bytes: int = 44 * 1024  # static shared memory, which CUDA caps at 48 KiB per block on every GPU
    dim_quantum: int = 8  # E and a block's M columns are rounded up to this: fewer compiled variants
    min_cols_per_block: int = 8  # the M split stops here: q and k are re-read by every split
    blocks_per_sm: int = 2  # target grid size, in blocks per SM, for the split heuristics
    # non-causal passes split the sequence down to this many rows per block. A block walks its rows a chunk per
    # barrier: causal_dot_product's one walk of 256 rows took 75 us a call (B1 H2 N256, H100), ~0.3 us a row. At 256
    # no short sequence was split: linear_attention at B1 H2 N256 ran each of its two passes as 2 blocks walking all
    # 256 rows on a 132-SM GPU (351 us a call). 32: 8 blocks of 32 rows per (batch, head) there, and a combine
    # launch. Not yet timed (``scripts/startup.py --linear-min-rows 256`` gives the A/B)
    min_rows_per_block: int = 32
    combine_threads: int = 256  # block size of the kernel that adds the non-causal partial states
    combine_blocks_per_sm: int = 8

    def __post_init__(self):
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LinearConfig.{name}: expected an integer >= 1, got {value!r}")
        if self.min_threads > self.max_threads:
            raise ValueError(f"LinearConfig: min_threads {self.min_threads} > max_threads {self.max_threads}")


#: Default knobs on a GPU and under the simulator (every thread a Python thread: keep blocks tiny, lengths odd).
GPU_CONFIG = LinearConfig()
SIMULATOR_CONFIG = LinearConfig(max_threads=16, min_threads=4, cols_per_thread=2, state_per_thread=8, rows_per_sync=3,
                                max_prefetch=16, max_shared_bytes=48 * 1024, dim_quantum=1, min_cols_per_block=2,
                                blocks_per_sm=1, min_rows_per_block=4, combine_threads=16, combine_blocks_per_sm=1)


def default_config() -> LinearConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


@dataclass(frozen=True)
class Staging:
    """How a block's threads copy ``rows x width`` elements: thread ``tid`` takes column ``tid % width`` of rows
    ``tid // width + row_step * a`` when the block is at least a row wide, else columns ``tid + col_step * c`` of every
    row. Each thread's addresses then differ by constant multiples of two strides, so the compiler keeps a handful of
    pointers live instead of one per staged element."""

    by_row: bool
    row_step: int
    col_step: int
    n_rows: int  # per thread
    n_cols: int  # per thread

    @property
    def count(self) -> int:
        return self.n_rows * self.n_cols


def staging(width: int, threads: int, rows: int) -> Staging:
    if width <= threads:
        step = threads // width
        return Staging(True, step, width, cdiv(rows, step), 1)
    return Staging(False, 1, threads, rows, cdiv(width, threads))


@dataclass(frozen=True)
class Layout:
    """One block's share of the state: ``E_pad x M_cols`` entries on ``te * tm`` threads, ``rows`` rows per barrier."""

    te: int  # E-slices
    tm: int  # column threads
    re: int  # state rows per thread
    rm: int  # state columns per thread
    rows: int  # R

    @property
    def threads(self) -> int:
        return self.te * self.tm

    @property
    def e_pad(self) -> int:
        return self.te * self.re

    @property
    def m_cols(self) -> int:
        return self.tm * self.rm

    def prefetch(self, mode: int) -> int:
        """Registers per thread that stage the next chunk's q/k/v rows."""
        emit, update = mode != REDUCE, mode != APPLY
        qk = staging(self.e_pad, self.threads, self.rows).count
        vv = staging(self.m_cols, self.threads, self.rows).count
        return (qk if emit else 0) + ((qk + vv) if update else 0)

    def shared_bytes(self, mode: int, normalise: bool) -> int:
        emit, update = mode != REDUCE, mode != APPLY
        words = 0
        if emit:
            words += self.e_pad  # q rows
            words += self.rm * self.tm * (self.te + 1)  # partial dot products
            words += self.te if normalise else 0  # partial normalisers
        if update:
            words += self.e_pad + self.m_cols  # k and v rows
        return 2 * self.rows * words * 4  # double-buffered float32


def _shape_layout(e: int, m_cols: int, config: LinearConfig) -> Layout:
    """Threads and register tile for ``e`` state rows and at least ``m_cols`` columns (``rows`` not yet chosen)."""
    e = round_up(e, config.dim_quantum)
    m_cols = round_up(m_cols, config.dim_quantum)
    rm = min(config.cols_per_thread, m_cols)
    tm = cdiv(m_cols, rm)
    te = cdiv(e, max(1, config.state_per_thread // rm))  # fewest E-slices whose rows fit the register budget
    te = max(te, min(e, cdiv(config.min_threads, tm)))
    re = cdiv(e, te)
    te = cdiv(e, re)
    return Layout(te=te, tm=tm, re=re, rm=rm, rows=1)


def _with_rows(layout: Layout, mode: int, normalise: bool, config: LinearConfig) -> Layout:
    """The most rows per barrier (up to ``rows_per_sync``) within the shared-memory and prefetch budgets."""
    for rows in range(config.rows_per_sync, 1, -1):
        candidate = Layout(layout.te, layout.tm, layout.re, layout.rm, rows)
        if (
            candidate.shared_bytes(mode, normalise) <= config.max_shared_bytes
            and candidate.prefetch(mode) <= config.max_prefetch
        ):
            return candidate
    return Layout(layout.te, layout.tm, layout.re, layout.rm, 1)


def _fits(e: int, m: int, splits: int, config: LinearConfig) -> bool:
    return _shape_layout(e, cdiv(m, splits), config).threads <= config.max_threads


def min_m_splits(e: int, m: int, config: LinearConfig | None = None) -> int:
    """Fewest blocks per (batch, head) whose state slices fit the register budget (1 unless E * M is large)."""
    config = config or default_config()
    splits = 1
    while not _fits(e, m, splits, config):
        splits += 1
    return splits


def choose_m_splits(batch_heads: int, e: int, m: int, sm_count: int, config: LinearConfig | None = None) -> int:
    """M split for the causal walk: enough blocks for ``blocks_per_sm`` per SM, columns per block >= the minimum."""
    config = config or default_config()
    lowest = min_m_splits(e, m, config)
    highest = max(lowest, m // config.min_cols_per_block)
    wanted = cdiv(config.blocks_per_sm * sm_count, batch_heads)
    return max(lowest, min(highest, wanted))


@dataclass(frozen=True)
class Plan:
    """How one call is launched: the layout of each block and the grid's M split (``m_splits`` blocks exactly)."""

    layout: Layout
    m_splits: int


def plan(e: int, m: int, mode: int, normalise: bool, m_splits: int, config: LinearConfig | None = None) -> Plan:
    """Layout for ``m_splits`` requested blocks along M; the grid may get fewer when M is rounded to whole tiles."""
    config = config or default_config()
    if isinstance(m_splits, bool) or not isinstance(m_splits, (int, np.integer)) or m_splits < 1:
        raise ValueError(f"m_splits: expected an integer >= 1 or None, got {m_splits!r}")
    lowest = min_m_splits(e, m, config)
    if m_splits < lowest:
        raise ValueError(
            f"m_splits: E={e}, M={m} needs at least {lowest} blocks per (batch, head) to keep the state in "
            f"registers, got {m_splits}"
        )
    layout = _with_rows(_shape_layout(e, cdiv(m, int(m_splits)), config), mode, normalise, config)
    return Plan(layout=layout, m_splits=cdiv(m, layout.m_cols))



def sequence_blocks(seqlen: int, blocks_across: int, sm_count: int, config: LinearConfig,
                    splits: int | None = None) -> tuple[int, int]:
    """(blocks, rows per block) of a non-causal pass over ``seqlen`` rows, no block empty (one, writing zeros, when
    there are no rows). ``splits`` None: fill the GPU, but keep at least ``min_rows_per_block`` rows a block."""
    if splits is None:
        wanted = cdiv(config.blocks_per_sm * sm_count, blocks_across)
        splits = max(1, min(wanted, cdiv(seqlen, config.min_rows_per_block)))
    splits = max(1, min(int(splits), seqlen, max_grid(1)))
    rows = max(1, cdiv(seqlen, splits))
    return max(1, cdiv(seqlen, rows)), rows
