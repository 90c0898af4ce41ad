"""How a decoding step cuts the keys of every row tile into ranges for the tensor-core split kernel.

``plan_splits`` fills one wave of blocks with lead ranges, then balances the end of the step: the SMs stream at
different rates (set by where they sit on the chip; docs/design/decode.md, "Tail ranges"), so equal ranges end over a spread of
the step.
Where a row tile has several lead ranges, the last keys form its pool, which its blocks take tile by tile after their
own range (``SplitPlan.pool_first``, the counters of ``decode.pool``); otherwise, for long caches, short tail ranges
lie behind the lead ranges on the grid and go to the SMs that finish first.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.device import max_grid
from . import mma as _mma
from .mma import NO_POOL, DecodeMmaConfig  # noqa: F401  (NO_POOL: ``SplitPlan.pool_first`` without a pool)

#: at least this many keys per lead range (each range writes float32 parts that the combine reads back)
MIN_KEYS_PER_SPLIT = 512
#: Tail ranges (docs/design/decode.md, "Tail ranges"): this share of every row tile's keys goes to short tail ranges that the
#: block scheduler hands to the SMs that finish first ...
TAIL_FRACTION = 0.2
#: ... about this many per resident block (more: finer balance, more parts for the combine) ...
TAIL_RANGES_PER_SLOT = 4
#: ... where the lead ranges keep at least this many tiles: with shorter lead ranges a tail block's start and its
#: part cost more than the balance gains (GQA 8 at 16k / 32k keys); longer ones gain (multi-head caches, GQA 8 at 64k).
MIN_LEAD_TILES = 96
#: Pooled plans (``key_pool``, where a row tile has several lead ranges): this share of every row tile's keys is its
#: pool, taken tile by tile by the row tile's blocks after their own ranges, so the blocks on faster SMs take more
#: (docs/design/decode.md, "A key pool per row tile").
POOL_FRACTION = 0.2


@dataclass(frozen=True)
class SplitPlan:
    """How the keys of every row tile are cut: ``lead_splits`` ranges of ``lead_keys`` keys from key 0, then
    ranges of ``tail_keys`` keys up to the end (the last ranges may be short or empty). Range ``z`` is grid slice
    ``z``; all lengths are whole ``block_n`` tiles.

    A pooled plan (``pool_first`` < the cache length) has lead ranges only, ending at ``pool_first``; the keys from
    there on are the row tile's pool, whose tiles its blocks take one by one after their own range (so a part covers
    its range and whichever pool tiles its block took)."""

    lead_splits: int
    lead_keys: int
    tail_keys: int
    num_splits: int
    pool_first: int = NO_POOL

    @property
    def params(self) -> tuple:
        """The kernel's parameters after the scale."""
        return (self.lead_splits, self.lead_keys, self.tail_keys, self.pool_first)

    @property
    def pooled(self) -> bool:
        return self.pool_first != NO_POOL

    def ranges(self, seqlen_k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, ends)`` of the key ranges exactly as the kernel takes them (an empty range has start >= end);
        for a pooled plan, the blocks' own ranges (the pool comes on top)."""
        z = np.arange(self.num_splits, dtype=np.int64)
        lead = np.minimum(z, self.lead_splits)
        starts = lead * self.lead_keys + (z - lead) * self.tail_keys
        lengths = np.where(z < self.lead_splits, self.lead_keys, self.tail_keys)
        return starts, np.minimum(starts + lengths, seqlen_k)

    def boundaries(self, seqlen_k: int) -> np.ndarray:
        """The ranges as key offsets ``[0, ..., seqlen_k]`` (``reference.split_kv_attention``'s ``boundaries``)."""
        if self.pooled:
            raise ValueError("the parts of a pooled plan cover key sets chosen at run time, not fixed ranges")
        starts, ends = self.ranges(seqlen_k)
        return np.append(np.minimum(starts, seqlen_k), seqlen_k)


def uniform_plan(seqlen_k: int, num_splits: int, block_n: int) -> SplitPlan:
    """``num_splits`` ranges of equal whole tiles (the caller's ``num_splits``)."""
    tiles = -(-seqlen_k // block_n)
    per = max(1, -(-tiles // num_splits)) * block_n
    return SplitPlan(num_splits, per, per, num_splits)


def plan_splits(batch: int, kv_heads: int, rows: int, seqlen_k: int, sm_count: int,
                config: DecodeMmaConfig | None = None, max_splits: int | None = None) -> SplitPlan:
    """The key ranges of a decoding step when the caller does not choose them.

    Lead ranges: about ``config.blocks_per_sm`` blocks per SM in one wave (rounded down to whole ranges per row
    tile), each with at least ``MIN_KEYS_PER_SPLIT`` keys. The SMs stream at different rates, so the end of the
    step is balanced:

    - with several lead ranges per row tile (and ``config.key_pool``): ``POOL_FRACTION`` of the row tile's keys
      form its pool, which its blocks take tile by tile after their own range (``SplitPlan.pool_first``);
    - otherwise, where the lead ranges are long (at least ``MIN_LEAD_TILES`` tiles), ``TAIL_FRACTION`` of every row
      tile's keys go to short tail ranges that lie behind the lead ranges on the grid: the block scheduler starts
      them on the SMs that finish their lead range first (their length: about ``TAIL_RANGES_PER_SLOT`` of them per
      resident block).

    At most ``max_splits`` ranges (default: the blocks the current device's grid takes along z)."""
    config = config or _mma.DEFAULT_CONFIG
    max_splits = max_grid(2) if max_splits is None else max_splits
    block_n = config.block_n
    tiles = -(-seqlen_k // block_n)
    base = max(1, batch * kv_heads * -(-rows // 16))
    slots = config.blocks_per_sm * max(1, sm_count)
    lead = max(1, min(slots // base, seqlen_k // MIN_KEYS_PER_SPLIT, max_splits))
    if config.key_pool and lead >= 2:
        lead_tiles = int(tiles * (1.0 - POOL_FRACTION)) // lead
        if lead_tiles >= 2:  # (a block asks for pool tiles from its second tile on)
            return SplitPlan(lead, lead_tiles * block_n, lead_tiles * block_n, lead, lead * lead_tiles * block_n)
    lead_tiles = int(tiles * (1.0 - TAIL_FRACTION)) // lead
    if TAIL_FRACTION <= 0 or lead_tiles < MIN_LEAD_TILES:
        return uniform_plan(seqlen_k, lead, block_n)
    pool = tiles - lead * lead_tiles  # tiles per row tile left to the tail ranges
    tail_tiles = min(lead_tiles, max(1, -(-(base * pool) // (slots * TAIL_RANGES_PER_SLOT))))
    tail = -(-pool // tail_tiles)
    if lead + tail > max_splits:
        return uniform_plan(seqlen_k, lead, block_n)
    return SplitPlan(lead, lead_tiles * block_n, tail_tiles * block_n, lead + tail)

