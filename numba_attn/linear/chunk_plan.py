"""How a chunked linear-attention launch is cut: the tuning knobs, the M tiles and the segments of the sequence.

The chunked kernels (``shared_state``: the state in shared memory; ``mma`` / ``mma_f32``: in registers) walk each
head's sequence in chunks of ``C`` rows. A sequential walk over the chunks of one head would leave most of the GPU
idle for a few heads, so the sequence of each (head, M tile) is cut into ``segments`` of whole chunks: a ``STATES``
pass writes every segment's increment ``K_s^T V_s``, and each walking block starts from the state before its segment.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime.cache import BoundedCache
from ..runtime.device import max_grid

#: Passes of the chunked kernels: the causal walk, the per-segment state increments, the non-causal output.
CAUSAL, STATES, APPLY = 0, 1, 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


@dataclass(frozen=True)
class ChunkConfig:
    """Tuning knobs of a chunked kernel (the register-state kernels ignore ``prefix_threads``, ``presplit`` and
    ``min_blocks_per_sm``, which tune the shared-memory-state kernel)."""

    warps: int = 4  # chunk length C = 16 * warps rows; each warp owns 16 rows of S and of the output
    block_cols: int = 64  # value columns per block (the M tile) for E <= 128
    block_cols_wide: int = 32  # ... for E > 128, to keep Q, K and H of a block in shared memory
    blocks_per_sm: int = 3  # without an occupancy figure: segments are added until the grid has this many per SM
    wave_plan: bool = True  # size segments by the occupancy calculator's resident blocks (see plan_segments)
    states_cost: float = 0.35  # time of the STATES pass per chunk, in walk steps (docs/design/linear.md)
    segment_cost: float = 0.0  # walk steps per segment (a walking block first sums its predecessors' increments)
    min_segment_chunks: int = 2  # segments shorter than this cost more in the extra passes than they gain
    prefix_threads: int = 256
    min_blocks_per_sm: int = 1  # launch bound: 2 caps registers at 255 -> 255 (4 warps), 3 at 168
    max_shared_bytes: int | None = None  # None: the device's limit (runtime.device.max_shared_per_block)
    presplit: bool = True  # keep H's tf32 (hi, lo) parts in shared memory too (more memory, fewer conversions)

    def __post_init__(self):
        for name in ("warps", "min_segment_chunks", "prefix_threads", "min_blocks_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChunkConfig.{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("block_cols", "block_cols_wide"):
            if getattr(self, name) < 8 or getattr(self, name) % 8:
                raise ValueError(f"ChunkConfig.{name}: expected a positive multiple of 8, got {getattr(self, name)}")
        if self.blocks_per_sm < 0 or self.states_cost < 0 or self.segment_cost < 0:
            raise ValueError("ChunkConfig: blocks_per_sm, states_cost and segment_cost must be >= 0")
        if self.max_shared_bytes is not None and self.max_shared_bytes < 1:
            raise ValueError(f"ChunkConfig.max_shared_bytes: expected >= 1 or None, got {self.max_shared_bytes}")

    @property
    def chunk(self) -> int:
        return 16 * self.warps


@dataclass(frozen=True)
class ChunkTiles:
    """Compile-time shape every chunked kernel has: ``warps`` warps, chunks of ``C = 16 * warps`` rows (a warp owns
    16 of them), E padded to whole m16 / k16 blocks. Each kernel's ``Tiles`` adds its value columns and layout."""

    warps: int
    e_pad: int

    def __post_init__(self):
        if self.warps < 1:
            raise ValueError(f"{type(self).__name__}.warps: expected >= 1, got {self.warps}")
        if self.e_pad < 16 or self.e_pad % 16:
            raise ValueError(f"{type(self).__name__}.e_pad: expected a positive multiple of 16, got {self.e_pad}")

    @property
    def chunk(self) -> int:
        return 16 * self.warps


def block_cols(config: ChunkConfig, e_pad: int, m: int) -> int:
    """Value columns of one block (the M tile): narrower for wide heads, never wider than M rounded up to 8."""
    width = config.block_cols if e_pad <= 128 else config.block_cols_wide
    return min(width, round_up(m, 8))


@dataclass(frozen=True)
class Plan:
    tiles: object  # the kernel's compile-time shape (its ``chunk`` rows, ``value_cols`` per block)
    m_tiles: int  # blocks across M per head
    segments: int  # blocks along the sequence per (head, M tile)
    segment_chunks: int


def plan_segments(tiles, batch_heads: int, seqlen: int, m: int, sm_count: int, config: ChunkConfig,
                  segments: int | None = None, resident: int | None = None) -> Plan:
    """The sequence split into segments (blocks along the sequence per head and M tile) for kernels of ``tiles``.

    ``resident``: blocks of the walk kernel one SM holds at once (the occupancy calculator's answer). Given, the
    segment count minimises the walk's critical path, ``waves * chunks per segment``, where a wave is one block
    on every resident slot of the GPU: every block walks the same number of chunks, so a last wave that fills a
    few slots costs as long as a full one. Segments beyond one cost the STATES pass (``config.states_cost`` of
    a walk step per chunk), a prefix launch and ``config.segment_cost`` steps per segment, so ties go to fewer.
    Without ``resident``: segments are added until the grid has ``config.blocks_per_sm`` blocks per SM.
    ``segments`` given: used as is (clamped).
    """
    m_tiles = cdiv(m, tiles.value_cols)
    chunks = max(1, cdiv(seqlen, tiles.chunk))
    if segments is None:
        most = max(1, chunks // config.min_segment_chunks)
        groups = max(1, batch_heads * m_tiles)
        if resident:
            key = (groups, chunks, most, max(1, resident * sm_count), config.states_cost, config.segment_cost)
            segments = _FEWEST_STEPS.get_or_make(key, lambda: _fewest_steps(*key))
        else:
            segments = min(cdiv(config.blocks_per_sm * sm_count, groups), most)
    segments = max(1, min(int(segments), chunks, max_grid(1)))
    segment_chunks = cdiv(chunks, segments)
    segments = cdiv(chunks, segment_chunks)  # no empty segment
    return Plan(tiles, m_tiles, segments, segment_chunks)


_FEWEST_STEPS = BoundedCache("linear segment counts")


def _fewest_steps(groups: int, chunks: int, most: int, slots: int, states_cost: float, segment_cost: float) -> int:
    best, best_cost = 1, float("inf")
    segments = 1
    while segments <= most:
        # only the distinct segment lengths matter, each with the fewest segments that give it: O(sqrt(chunks))
        length = cdiv(chunks, segments)
        fewest = cdiv(chunks, length)
        steps = cdiv(groups * fewest, slots) * length
        cost = steps * (1.0 + states_cost) + segment_cost * fewest if fewest > 1 else float(steps)
        if cost < best_cost:
            best, best_cost = fewest, cost
        if length == 1:
            break
        segments = max(segments + 1, cdiv(chunks, length - 1))
    return best
