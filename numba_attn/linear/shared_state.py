"""Chunked linear attention with the state in shared memory (``mma.sync.m16n8k8`` with tf32 operands, float32
accumulation): the causal product and layer for E up to 256, and the non-causal layer. Configuration, compiled
kernels and launches; the kernel body is ``shared_state_body``.

``out_i = sum_{j <= i} (q_i . k_j) v_j`` cut into chunks of ``C`` rows (``reference.causal_dot_product_chunked``)::

    out_c = (Q_c K_c^T * tril) V_c  +  Q_c H_c        H_c = S_0 + sum_{c' < c} K_c'^T V_c'

The intra-chunk part is two small matrix products per chunk (like one attention tile without a softmax); the state
``H`` (``E x M``, float32) carries everything before the chunk. The sequence of each head is cut into segments of
whole chunks (``chunk_plan``):

1. ``STATES`` pass (only when there is more than one segment): block ``(head, M tile, segment)`` writes
   ``K_s^T V_s`` of its segment to a float32 scratch array.
2. ``prefix`` kernel: turns those increments into the state BEFORE each segment (exclusive prefix over segments,
   starting from ``initial_state``), in place, one thread per state entry.
3. ``CAUSAL`` pass: block ``(head, M tile, segment)`` loads its segment's starting state into shared memory and walks
   its chunks: ``out_c`` from ``Q_c, K_c, V_c`` and ``H``, then ``H += K_c^T V_c``. The block of the last segment
   ends with the final state (``return_state``).

Non-causal linear attention is passes 1 and 2 (a total instead of a prefix) and an ``APPLY`` pass, ``out_c = Q_c H``.
The normalised layer appends a column of ones to V (an extra n8 block per M tile): the same products then carry the
cumulative key sum ``z`` as one more state column and give the denominator ``phi(q_i) . z_i`` beside the numerator.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32

from ..runtime.cache import BoundedCache
from ..runtime.device import SIMULATOR, cuda, kernel_jit, max_shared_per_block, multiprocessor_count
from ..runtime.launch import launch as device_launch
from ..runtime.launch import resident_blocks
from ..runtime.views import rows_in_pieces
from .arguments import scratch_state, sizes, unused4
from .chunk_plan import (APPLY, CAUSAL, STATES, ChunkConfig, ChunkTiles, Plan, block_cols, cdiv, plan_segments,
                         round_up)
from .shared_state_body import kernel_source, signature

#: widest E and M (the state's rows and a block's columns must fit shared memory)
MAX_DIM = 256

GPU_CONFIG = ChunkConfig()
#: the simulator runs every thread as a Python thread and every MMA as a block-wide barrier: one warp, narrow tiles
SIMULATOR_CONFIG = ChunkConfig(warps=1, block_cols=8, block_cols_wide=8, blocks_per_sm=1, min_segment_chunks=1)


def default_config() -> ChunkConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


@dataclass(frozen=True)
class Tiles(ChunkTiles):
    """Compile-time shape of one specialisation (sizes in float32 words)."""

    value_cols: int  # value columns of V / out a block owns
    normalise: bool  # one more n8 block: a ones column of V, giving the normaliser
    min_blocks: int = 1  # launch bound (blocks per SM the registers must allow)
    presplit: bool = False  # H also kept as its tf32 (hi, lo) parts, ready for the Q H product

    def __post_init__(self):
        super().__post_init__()
        if self.value_cols < 8 or self.value_cols % 8:
            raise ValueError(f"Tiles.value_cols: expected a positive multiple of 8, got {self.value_cols}")
        if self.min_blocks < 1:
            raise ValueError(f"Tiles.min_blocks: expected >= 1, got {self.min_blocks}")

    @property
    def cols(self) -> int:  # state / V-tile columns
        return self.value_cols + (8 if self.normalise else 0)

    @property
    def q_stride(self) -> int:
        return self.e_pad + 4

    @property
    def v_stride(self) -> int:
        return self.cols + 4

    @property
    def h_stride(self) -> int:
        return self.cols + (8 - self.cols % 32) % 32

    @property
    def k_offset(self) -> int:
        return self.chunk * self.q_stride

    @property
    def v_offset(self) -> int:
        return 2 * self.chunk * self.q_stride

    @property
    def h_offset(self) -> int:
        return self.v_offset + self.chunk * self.v_stride

    @property
    def h_size(self) -> int:
        return self.e_pad * self.h_stride

    @property
    def shared_bytes(self) -> int:
        return 4 * (self.h_offset + self.h_size * (3 if self.presplit else 1))


def _fitting_tiles(config: ChunkConfig, e: int, m: int, normalise: bool, limit: int) -> Tiles | None:
    e_pad = round_up(e, 16)
    value_cols = block_cols(config, e_pad, m)
    tiles = Tiles(config.warps, e_pad, value_cols, normalise, config.min_blocks_per_sm, presplit=config.presplit)
    if tiles.shared_bytes > limit:  # no room for the split copies: split H where it is read
        tiles = Tiles(config.warps, e_pad, value_cols, normalise, config.min_blocks_per_sm, presplit=False)
    return tiles if tiles.shared_bytes <= limit else None


# asked twice per call (the launcher's occupancy query, then the plan): made once per shape
_TILES = BoundedCache("linear shared-state tiles")


def tiles_for(config: ChunkConfig, e: int, m: int, normalise: bool, shared_limit: int | None = None) -> Tiles:
    """The tiles of E x M (normalised: one more n8 block) within ``shared_limit`` bytes of shared memory (None:
    ``config.max_shared_bytes``, else the device's)."""
    limit = shared_limit or config.max_shared_bytes or max_shared_per_block()
    key = (config, e, m, normalise, limit)
    tiles = _TILES.get_or_make(key, lambda: _fitting_tiles(config, e, m, normalise, limit))
    if tiles is None:
        raise ValueError(f"E={e}, M={m}: the tiles need more than {limit} bytes of shared memory")
    return tiles


def supports(e: int, m: int, normalise: bool = False, config: ChunkConfig | None = None) -> bool:
    """Whether this kernel takes E x M (a whole state column block and the chunk's tiles fit shared memory)."""
    config = config or default_config()
    if not (0 < e <= MAX_DIM and 0 < m <= MAX_DIM):
        return False
    limit = config.max_shared_bytes or max_shared_per_block()
    return _fitting_tiles(config, e, m, normalise, limit) is not None


def plan(batch_heads: int, seqlen: int, e: int, m: int, normalise: bool, sm_count: int,
         config: ChunkConfig | None = None, segments: int | None = None, resident: int | None = None) -> Plan:
    """Tiles and segments of this kernel (``chunk_plan.plan_segments``)."""
    config = config or default_config()
    tiles = tiles_for(config, e, m, normalise)
    return plan_segments(tiles, batch_heads, seqlen, m, sm_count, config, segments, resident)


def vector_loads_ok(*arrays) -> bool:
    """True when every row can be read and written in aligned pieces of 4 elements (8 bytes of 16-bit data, 16 of
    float32). Under the simulator only the row length matters: its twins read element by element, any strides."""
    if SIMULATOR:
        return all(x.shape[-1] % 4 == 0 for x in arrays)
    return all(rows_in_pieces(x, 4) for x in arrays)


@lru_cache(maxsize=None)
def chunk_kernel(tiles: Tiles, mode: int, dtype: str, split: bool, feature_map: bool, vector: bool = False):
    """The compiled kernel of one specialisation (tiles, mode, dtype, operand split, feature map and load width are
    constants)."""
    source = kernel_source(tiles, mode, dtype, split, feature_map, vector)
    return kernel_jit(launch_bounds=(32 * tiles.warps, tiles.min_blocks), signature=signature(dtype))(source)


@lru_cache(maxsize=None)
def prefix_kernel(threads: int):
    @kernel_jit(launch_bounds=(threads, 1))
    def prefix(state, segments, init, has_init, m_tiles, value_cols, read_state, exclusive):
        """Per state entry: the state BEFORE each segment (``exclusive``: in place, starting from ``init``) or the
        total over segments (written to segment 0). ``read_state`` False: no increments yet, only ``init``."""
        e_pad = state.shape[1]
        cols = state.shape[2]
        groups = state.shape[0] // segments
        total = groups * e_pad * cols
        start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        for idx in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
            c = idx % cols
            e = (idx // cols) % e_pad
            bhm = idx // (cols * e_pad)
            running = float32(0.0)
            if has_init:
                bh = bhm // m_tiles
                m = (bhm % m_tiles) * value_cols + c
                if c < value_cols and e < init.shape[2] and m < init.shape[3]:
                    running = init[bh // init.shape[1], bh % init.shape[1], e, m]
            for seg in range(segments):
                r = bhm * segments + seg
                x = float32(0.0)
                if read_state:
                    x = state[r, e, c]
                if exclusive:
                    state[r, e, c] = running
                running += x
            if not exclusive:
                state[bhm * segments, e, c] = running

    return prefix


def run_prefix(state, segments, init, has_init, p: Plan, read_state, exclusive, stream, config):
    threads = config.prefix_threads
    total = (state.shape[0] // segments) * state.shape[1] * state.shape[2]
    blocks = max(1, min(cdiv(total, threads), 8 * multiprocessor_count()))
    args = (state, segments, init, bool(has_init), p.m_tiles, p.tiles.value_cols, bool(read_state), bool(exclusive))
    device_launch(prefix_kernel(threads), blocks, threads, stream, 0, *args)


def _launch_pass(kernel, p: Plan, grid_y, stream, *args):
    """One pass of this kernel: grid (head, M tile) x ``grid_y`` segments, ``args[0]`` is q."""
    grid = (args[0].shape[0] * args[0].shape[1] * p.m_tiles, grid_y)
    device_launch(kernel, grid, 32 * p.tiles.warps, stream, p.tiles.shared_bytes, *args)


def launch_causal(q, k, v, out, stream, *, dtype: str, split: bool, initial_state=None, final_state=None,
                  normalise=False, eps=0.0, segments=None, config: ChunkConfig | None = None, scratch=None):
    """Causal dot product (``normalise=False``) or the causal layer with ``phi = elu + 1`` (``normalise=True``) on
    device views ``(batch, heads, seqlen, E | M)``, any strides: uint16 bit views of float16 / bfloat16 data, or
    float32 (``dtype``; ``split``: float32 operands in three tf32 terms instead of one).

    ``initial_state`` / ``final_state``: float32 ``(batch, heads, E, M)`` views (plain product only), read before /
    written after the sequence. ``segments``: sequence blocks per (head, M tile), None for :func:`plan`'s choice.
    """
    config = config or default_config()
    bh, seqlen, _, e, m = sizes(q, v)
    vector = vector_loads_ok(q, k, v, out)
    tiles = tiles_for(config, e, m, normalise)
    walk = chunk_kernel(tiles, CAUSAL, dtype, split, normalise, vector)
    resident = resident_blocks(walk, 32 * tiles.warps, tiles.shared_bytes) if config.wave_plan else None
    p = plan_segments(tiles, bh, seqlen, m, multiprocessor_count(), config, segments, resident)
    has_init = initial_state is not None
    shape = (bh * p.m_tiles * p.segments, p.tiles.e_pad, p.tiles.cols)
    if p.segments > 1 or has_init:
        state = scratch_state(scratch, shape, stream)
        if p.segments > 1:
            states = chunk_kernel(p.tiles, STATES, dtype, split, normalise, vector)
            _launch_pass(states, p, p.segments, stream, q, k, v, out, state, unused4(state), False, False,
                         np.float32(0.0), p.segment_chunks, p.segments, p.m_tiles)
        init = initial_state if has_init else unused4(state)
        run_prefix(state, p.segments, init, has_init, p, p.segments > 1, True, stream, config)
        has_state = True
    else:
        state = scratch_state(scratch, (1, 1, 1), stream)
        has_state = False
    # seqlen == 0 still launches one block per (head, M tile): it writes the final state (= the initial one)
    final = final_state if final_state is not None else unused4(state)  # a placeholder, not written
    _launch_pass(walk, p, p.segments, stream, q, k, v, out, state, final, has_state, final_state is not None,
                 np.float32(eps), p.segment_chunks, p.segments, p.m_tiles)


def launch_noncausal(q, k, v, out, eps, stream, *, dtype: str, split: bool, segments=None,
                     config: ChunkConfig | None = None, scratch=None, layer: bool = True):
    """Non-causal linear attention with ``phi = elu + 1`` and the normaliser: ``out = phi(Q) H / (phi(Q) z + eps)``
    with ``H = phi(K)^T V`` and ``z = sum phi(k_j)`` over all keys. k, v may have a seqlen different from q's.
    ``layer=False``: the plain product ``out = Q (K^T V)`` (no feature map, no normaliser, ``eps`` unused)."""
    config = config or default_config()
    bh, seqlen_q, seqlen_k, e, m = sizes(q, v)
    vector = vector_loads_ok(q, k, v, out)
    sm_count = multiprocessor_count()
    tiles = tiles_for(config, e, m, layer)
    apply = chunk_kernel(tiles, APPLY, dtype, split, layer, vector)
    resident = resident_blocks(apply, 32 * tiles.warps, tiles.shared_bytes) if config.wave_plan else None
    p_keys = plan_segments(tiles, bh, seqlen_k, m, sm_count, config, segments, resident)
    p_rows = plan_segments(tiles, bh, seqlen_q, m, sm_count, config, None, resident)
    shape = (bh * p_keys.m_tiles * p_keys.segments, p_keys.tiles.e_pad, p_keys.tiles.cols)
    state = scratch_state(scratch, shape, stream)
    if seqlen_k > 0:
        states = chunk_kernel(p_keys.tiles, STATES, dtype, split, layer, vector)
        _launch_pass(states, p_keys, p_keys.segments, stream, q, k, v, out, state, unused4(state), False, False,
                     np.float32(0.0), p_keys.segment_chunks, p_keys.segments, p_keys.m_tiles)
    run_prefix(state, p_keys.segments, unused4(state), False, p_keys, seqlen_k > 0, False, stream, config)
    _launch_pass(apply, p_rows, p_rows.segments, stream, q, k, v, out, state, unused4(state), True, False,
                 np.float32(eps), p_rows.segment_chunks, p_keys.segments, p_rows.m_tiles)
