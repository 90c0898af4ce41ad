"""Launch of the register-state chunked walks (``mma``: float16 / bfloat16 inputs, ``mma_f32``: float32): what they
take, their shared configuration, signature and the two launches (``STATES``, then the ``CAUSAL`` walk).

The sequence of each (head, M tile) is cut into segments of whole chunks (``chunk_plan``):

1. ``STATES`` (more than one segment only): block ``(head, M tile, segment)`` writes its segment's ``K_s^T V_s``
   (float32) for every segment but the last.
2. ``CAUSAL``: block ``(head, M tile, segment)`` starts from the initial state plus the increments of the segments
   before it (it sums them itself: no prefix launch), walks its chunks, and the last segment's block writes the final
   state.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numba import types

from ..runtime.device import DeviceView, multiprocessor_count
from ..runtime.launch import launch as device_launch
from ..runtime.launch import resident_blocks
from ..runtime.views import rows_in_pieces
from .arguments import scratch_state, sizes, unused4
from .chunk_plan import CAUSAL, STATES, ChunkConfig, ChunkTiles, block_cols, plan_segments, round_up

#: widest E (padded to 16) these kernels take; the records of H grow with E and E + 8 wide Q, K rows with it
MAX_E = 128
#: the simulator: one warp, 16-row chunks, 16-column M tiles
SIMULATOR_CONFIG = ChunkConfig(warps=1, block_cols=16, block_cols_wide=16, blocks_per_sm=1, min_segment_chunks=1)
#: launch bound: blocks per SM (2 x 4 warps: 255 registers, and the shared memory of E = 64 fits twice)
MIN_BLOCKS = 2
#: walk steps per segment in the plans of ``launch_walks`` (at least): with three times the groups and no cost per
#: segment the wave rule chose 128 segments of 2 chunks at 16k rows (B4 H8, 16-bit), whose blocks each summed up to
#: 127 predecessors' increments: 10.5 ms instead of about 0.6 on an H100. 0.1 (as float32's ``segment_cost``)
#: gives 8 segments there, as the single walks get
FUSED_SEGMENT_COST = 0.1


@dataclass(frozen=True)
class RegisterTiles(ChunkTiles):
    """Compile-time shape of a register-state kernel: ``cols`` value columns a block (whole n16 pairs: the plan's M
    tiles are) and the launch bound ``min_blocks``."""

    cols: int
    min_blocks: int = MIN_BLOCKS

    def __post_init__(self):
        super().__post_init__()
        if self.cols < 16 or self.cols % 16:
            raise ValueError(f"{type(self).__name__}.cols: expected a positive multiple of 16, got {self.cols}")
        if self.min_blocks < 1:
            raise ValueError(f"{type(self).__name__}.min_blocks: expected >= 1, got {self.min_blocks}")

    @property
    def value_cols(self) -> int:
        return self.cols


def supports(e: int, m: int) -> bool:
    """The plain causal product (no normaliser) with E <= ``MAX_E``."""
    return 0 < e <= MAX_E and m > 0


def tile_shape(config: ChunkConfig, e: int, m: int) -> tuple[int, int]:
    """(E padded to 16, value columns per block): the plan's M tiles are whole n16 pairs."""
    e_pad = round_up(e, 16)
    return e_pad, block_cols(config, e_pad, round_up(m, 16))


def vector_loads_ok(q, k, v, out) -> bool:
    """cp.async staging needs rows in aligned 16-byte pieces (E, M multiples of 8 16-bit or 4 float32 elements, unit
    last stride, 16-byte aligned row starts); the output pairs need aligned even pieces. Otherwise the tiles are
    staged element by element. The simulator checks the same: its ``cp.async`` twin copies raw bytes."""
    piece = 16 // np.dtype(q.dtype).itemsize
    return all(rows_in_pieces(x, piece) for x in (q, k, v)) and rows_in_pieces(out, 2)


_F32_4D = types.Array(types.float32, 4, "A")
_F32_3D = types.Array(types.float32, 3, "A")


def signature(data_type, problems: int = 1):
    """(q, k, v, out of ``data_type``, increments, init, final, has_init, write_final, segment_chunks,
    state_segments, m_tiles); for ``problems`` > 1 (``state.problem_kernels``): (q, k, v, out per problem,
    increments, init per problem, final, has_init per problem, final_problem, segment_chunks, state_segments,
    m_tiles)."""
    data = types.Array(data_type, 4, "A")
    if problems == 1:
        return types.void(data, data, data, data, _F32_3D, _F32_4D, _F32_4D, types.boolean, types.boolean,
                          types.int64, types.int64, types.int64)
    return types.void(*(data,) * (4 * problems), _F32_3D, *(_F32_4D,) * (problems + 1), *(types.boolean,) * problems,
                      types.int64, types.int64, types.int64, types.int64)


def _launch(kernel, tiles, mode: int, grid, stream, *args):
    device_launch(kernel, grid, 32 * tiles.warps, stream, tiles.shared_bytes(mode), *args)


def launch_walk(kernel_for, tiles, q, k, v, out, stream, *, initial_state, final_state, segments, config, scratch):
    """The STATES pass (more than one segment) and the CAUSAL walk of ``tiles``; ``kernel_for(mode)`` is the compiled
    kernel of a pass. ``initial_state`` / ``final_state`` float32 ``(batch, heads, E, M)`` or None; ``segments``:
    sequence blocks per (head, M tile), None for ``chunk_plan.plan_segments``'s choice."""
    bh, seqlen, _, _, m = sizes(q, v)
    walk = kernel_for(CAUSAL)
    resident = (resident_blocks(walk, 32 * tiles.warps, tiles.shared_bytes(CAUSAL)) if config.wave_plan else None)
    p = plan_segments(tiles, bh, seqlen, round_up(m, 16), multiprocessor_count(), config, segments, resident)
    grid_x = bh * p.m_tiles
    has_init = initial_state is not None
    if p.segments > 1:  # the increments K_s^T V_s of every segment but the last
        increments = scratch_state(scratch, (grid_x * (p.segments - 1), tiles.e_pad, tiles.cols), stream)
        _launch(kernel_for(STATES), tiles, STATES, (grid_x, p.segments - 1), stream, q, k, v, out, increments,
                unused4(increments), unused4(increments), False, False, p.segment_chunks, p.segments - 1, p.m_tiles)
    else:
        increments = scratch_state(scratch, (1, 1, 1), stream)
    _launch(walk, tiles, CAUSAL, (grid_x, p.segments), stream, q, k, v, out, increments,
            initial_state if has_init else unused4(increments),
            final_state if final_state is not None else unused4(increments),
            has_init, final_state is not None, p.segment_chunks, max(1, p.segments - 1), p.m_tiles)


def launch_walks(kernel_for, tiles, walks, stream, *, final_state, final_walk: int, borrow: bool, segments, config,
                 scratch, split: bool = False):
    """Several walks of the same tiles and sizes in one STATES and one CAUSAL launch (grid z the walk,
    ``state.problem_kernels``): ``walks`` a list of ``(q, k, v, out, initial_state or None)``, 2 or 3 of them;
    ``final_state`` written by walk ``final_walk`` (-1: none); ``borrow``: the last walk starts from the
    transposed increments of the walk before it (its own E and M swapped: the backward's ``dk`` and ``dv`` walks),
    so the STATES pass leaves it out. ``kernel_for(mode, problems, borrow)`` is the compiled kernel. ``split``: the
    walks as one CAUSAL launch each (single-problem kernels, where picking the problem's arrays costs the walk
    registers it has not got), after the one STATES launch."""
    q, _, v, _, _ = walks[0]
    bh, seqlen, _, _, m = sizes(q, v)
    problems = len(walks)
    if config.segment_cost < FUSED_SEGMENT_COST:
        config = replace(config, segment_cost=FUSED_SEGMENT_COST)
    walk = kernel_for(CAUSAL, 1 if split else problems, borrow and not split)
    resident = (resident_blocks(walk, 32 * tiles.warps, tiles.shared_bytes(CAUSAL)) if config.wave_plan else None)
    p = plan_segments(tiles, bh * problems, seqlen, round_up(m, 16), multiprocessor_count(), config, segments,
                      resident)
    grid_x = bh * p.m_tiles
    owners = problems - 1 if borrow else problems  # walks with increments of their own
    state_segments = max(1, p.segments - 1)
    if p.segments > 1:
        increments = scratch_state(scratch, (owners * grid_x * (p.segments - 1), tiles.e_pad, tiles.cols), stream)
        unused = unused4(increments)
        operands = [x for w in walks[:owners] for x in w[:4]]
        if owners == 1:
            args = (*operands, increments, unused, unused, False, False)
        else:
            args = (*operands, increments, *(unused,) * (owners + 1), *(False,) * owners, -1)
        _launch(kernel_for(STATES, owners, False), tiles, STATES, (grid_x, p.segments - 1, owners), stream, *args,
                p.segment_chunks, state_segments, p.m_tiles)
    else:
        increments = scratch_state(scratch, (1, 1, 1), stream)
        unused = unused4(increments)
    if split:
        for i, (wq, wk, wv, wout, init) in enumerate(walks):
            lent = borrow and i == problems - 1  # from the increments of the walk before it
            rows = _rows_from(increments, (i - 1 if lent else i) * grid_x * state_segments, p.segments > 1)
            _launch(kernel_for(CAUSAL, 1, lent), tiles, CAUSAL, (grid_x, p.segments), stream, wq, wk, wv, wout, rows,
                    init if init is not None else unused,
                    final_state if final_state is not None and i == final_walk else unused, init is not None,
                    final_state is not None and i == final_walk, p.segment_chunks, state_segments, p.m_tiles)
        return
    inits = [w[4] if w[4] is not None else unused for w in walks]
    _launch(walk, tiles, CAUSAL, (grid_x, p.segments, problems), stream, *[x for w in walks for x in w[:4]],
            increments, *inits, final_state if final_state is not None else unused,
            *[w[4] is not None for w in walks], final_walk if final_state is not None else -1, p.segment_chunks,
            state_segments, p.m_tiles)


def _rows_from(increments, start: int, any_rows: bool):
    """The increments from row ``start`` on (a view: a single-problem walk reads its rows from 0)."""
    if not any_rows or start == 0:
        return increments
    if isinstance(increments, np.ndarray):
        return increments[start:]
    view = DeviceView.of(increments)
    return DeviceView(view.ptr + start * view.strides[0], (view.shape[0] - start,) + tuple(view.shape[1:]),
                      view.strides, view.dtype, view.owner)
