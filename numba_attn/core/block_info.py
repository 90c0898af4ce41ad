"""Where a thread block of an attention kernel works: its (batch, head, kv head), its query rows, its key tiles.

Two grid layouts (``QUERY_MAJOR``, ``HEAD_MAJOR``); ``grid`` builds either on the host and checks it against the
device's limits, ``block_position`` reads it back on the device. ``key_tiles`` gives the key tiles a block of query
rows walks (``mask.visible_end``: causal blocks stop at the diagonal), ``key_tile_range`` the same under a sliding
window, where a block's keys also begin late (``mask.visible_start``), and ``key_tile_walk`` counts those tiles as
the pipelined kernels do; ``query_tiles_start`` the first query tile a
block of keys meets (the backward's reverse walk, ``mask.first_row``), and ``query_tile_range`` the query tiles such
a block walks under a window and in packed sequences, whose key blocks read their keys and rows from a schedule of
their own (``key_block_bounds_of``). A sequence's keys are ``key_start ..
key_end``: ``0 .. seqlen_k`` for every entry of a dense batch; packed sequences of different lengths
(``flash_forward_varlen``) take a third grid, ``PACKED``, whose blocks read their rows and keys from a schedule
(``block_position_of`` and ``sequence_bounds_of``, which give the dense functions unchanged otherwise); a KV cache's rows have
lengths of their own (``cache_length``: ``cache_seqlens``, read at run time, or the cache's capacity).
``persistent_schedule``: the persistent kernels' order of tiles (a block per SM, looping over the call's query blocks).
"""
from __future__ import annotations

from numba import int64

from ..runtime.device import SIMULATOR, cuda, device_properties
from .mask import NO_WINDOW, first_row, visible_end, visible_end_in, visible_rows, visible_start
from .staging import device_function, inlined_function


def _reads_thread_position(fn):
    """``device_function`` for code that reads ``cuda.threadIdx`` and the like. The simulator shows the running
    thread's ``cuda`` only to the modules of its kernels and of its simulated device functions: under it, one."""
    return cuda.jit(device=True)(fn) if SIMULATOR else device_function(fn)


#: grid ``(query blocks, heads, batch)``: the query blocks of one head are neighbours, so the blocks resident at once
#: share that head's K and V through L2 (docs/design/forward.md); heads and batch then stop at the device's grid y and z
QUERY_MAJOR = "query blocks, heads, batch"
#: grid ``(batch * heads, query blocks)``
HEAD_MAJOR = "batch * heads, query blocks"
LAYOUTS = (QUERY_MAJOR, HEAD_MAJOR)


def grid(layout: str, batch: int, heads: int, seqlen_q: int, block_m: int) -> tuple:
    """The launch grid of ``layout`` for ``block_m``-row query blocks; ValueError past the device's grid limits."""
    blocks = -(-seqlen_q // block_m)
    if layout == QUERY_MAJOR:
        shape, names = (blocks, heads, batch), ("query blocks", "heads", "batch")
    elif layout == HEAD_MAJOR:
        shape, names = (batch * heads, blocks), ("batch * heads", "query blocks")
    else:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    limits = device_properties().max_grid  # one look-up per launch
    for n, name, limit in zip(shape, names, limits):
        if n > limit:
            raise ValueError(f"q: {name} ({n}) must be at most {limit} for one launch")
    return shape


#: int32 words per entry of a packed-sequence schedule (``PACKED``): the block's first query row, one past its
#: sequence's last row, and its sequence's first and one-past-last key (rows and keys: positions in the packed arrays)
SCHEDULE_WORDS = 4
#: grid ``(schedule entries, heads)`` over packed sequences (``flash_forward_varlen``): block ``x`` works on entry ``x``
PACKED = "schedule entries, heads"


def packed_grid(entries: int, heads: int) -> tuple:
    """The ``PACKED`` launch grid; ValueError past the device's grid limits."""
    limits = device_properties().max_grid
    for n, name, limit in zip((entries, heads), ("query blocks", "heads"), limits):
        if n > limit:
            raise ValueError(f"q: {name} ({n}) must be at most {limit} for one launch")
    return entries, heads, 1


def block_position(layout: str, block_m: int):
    """``position(q, k, v, out, longest_first) -> (b, h, m0, q_head, k_head, v_head, out_head)``: this block's batch
    entry, query head and first query row, and the 2-D views of its head (two strides per access instead of four):
    Q and O of head ``h``, K and V of its kv head (grouped heads: q head ``h`` reads kv head ``h // (heads //
    kv_heads)``). ``longest_first`` reverses the query blocks, so that under a causal mask the longest (last)
    blocks start first."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    BLOCK_M = block_m
    QUERIES_ON_X = layout == QUERY_MAJOR

    @_reads_thread_position
    def position(q, k, v, out, longest_first):
        heads = q.shape[1]
        if QUERIES_ON_X:
            m_block = cuda.blockIdx.x
            if longest_first:
                m_block = cuda.gridDim.x - 1 - m_block
            h = cuda.blockIdx.y
            b = cuda.blockIdx.z
        else:
            m_block = cuda.blockIdx.y
            if longest_first:
                m_block = cuda.gridDim.y - 1 - m_block
            b = cuda.blockIdx.x // heads
            h = cuda.blockIdx.x % heads
        hk = h // (heads // k.shape[1])
        return b, h, m_block * BLOCK_M, q[b, h], k[b, hk], v[b, hk], out[b, h]

    return position


@_reads_thread_position
def lane_position():
    """``(tid, warp, lane, g, t)`` of this thread; for the MMA fragments ``g = lane // 4`` (groupID: rows ``g`` and
    ``g + 8``) and ``t = lane % 4`` (threadID_in_group: columns ``2t``, ``2t + 1``)."""
    tid = cuda.threadIdx.x
    lane = tid % 32
    return tid, tid // 32, lane, lane // 4, lane % 4


@device_function
def sequence_bounds(q, k, b):
    """``(seqlen_q, key_start, key_end, diag_offset)`` of batch entry ``b``: its query rows, the keys ``key_start ..
    key_end`` of its sequence and the causal diagonal's offset (query ``i`` sees keys ``j <= i + diag_offset``).
    Every entry has the arrays' full lengths today."""
    seqlen_q = q.shape[2]
    seqlen_k = k.shape[2]
    return seqlen_q, 0, seqlen_k, seqlen_k - seqlen_q


def cache_length(ragged: bool, paged: bool):
    """``length(seqlens, table, k, b) -> seqlen_k``: the keys of batch row ``b`` of a KV cache. ``ragged``:
    ``seqlens[b]`` (``cache_seqlens``, read when the kernel runs, so that a captured CUDA graph follows lengths that
    grow); otherwise the capacity: ``k.shape[2]`` of a dense cache ``(batch, kv_heads, capacity, headdim)``, or
    ``max_pages * page_size`` of a paged one (``k`` the pages as ``(num_pages, kv_heads, page_size, headdim)``,
    ``table`` the ``(batch, max_pages)`` block table; ``core.paging``)."""
    RAGGED = ragged
    PAGED = paged

    @device_function
    def length(seqlens, table, k, b):
        if RAGGED:
            return int64(seqlens[b])
        if PAGED:
            return int64(table.shape[1]) * k.shape[2]
        return int64(k.shape[2])

    return length


def block_position_of(layout: str, block_m: int, packed: bool = False):
    """``position(q, k, v, out, longest_first, schedule) -> (b, h, m0, q_head, k_head, v_head, out_head)``.

    Dense batches: ``block_position(layout, block_m)`` (``schedule`` unused; inlined, so a kernel compiles to what
    calling that did). Packed sequences (``packed``, the ``PACKED`` grid): views ``(1, heads, total, headdim)`` of the
    packed arrays, ``b = 0``, and the first row from this block's entry of the int32 ``schedule`` (``SCHEDULE_WORDS``
    per entry, written by ``forward.varlen``; an idle entry has an empty sequence)."""
    if not packed:
        position = block_position(layout, block_m)

        @inlined_function
        def dense(q, k, v, out, longest_first, schedule):
            return position(q, k, v, out, longest_first)

        return dense

    @_reads_thread_position
    def packed_position(q, k, v, out, longest_first, schedule):
        heads = q.shape[1]
        h = cuda.blockIdx.y
        hk = h // (heads // k.shape[1])
        m0 = schedule[SCHEDULE_WORDS * cuda.blockIdx.x]
        return 0, h, m0, q[0, h], k[0, hk], v[0, hk], out[0, h]

    return packed_position


def sequence_bounds_of(packed: bool = False):
    """``bounds(q, k, b, schedule) -> (seqlen_q, key_start, key_end, diag_offset)``: ``sequence_bounds`` for dense
    batches (inlined); for packed sequences from this block's schedule entry, in the packed arrays' positions: the
    rows end at ``seqlen_q`` (the sequence's end, which loads and stores stop at), the keys are ``key_start ..
    key_end``, and the diagonal is aligned bottom-right within the sequence, ``diag_offset = key_end - row_end``."""
    if not packed:
        @inlined_function
        def dense(q, k, b, schedule):
            return sequence_bounds(q, k, b)

        return dense

    @_reads_thread_position
    def packed_bounds(q, k, b, schedule):
        at = SCHEDULE_WORDS * cuda.blockIdx.x
        row_end = schedule[at + 1]
        key_end = schedule[at + 3]
        return row_end, schedule[at + 2], key_end, key_end - row_end

    return packed_bounds


def key_tiles(block_m: int, block_n: int):
    """``tiles(m0, key_start, key_end, causal, diag_offset) -> n_tiles``: the ``block_n``-key tiles from
    ``key_start`` that rows ``m0 .. m0 + block_m - 1`` walk (0 or less: none)."""
    BLOCK_M = block_m
    BLOCK_N = block_n

    @device_function
    def tiles(m0, key_start, key_end, causal, diag_offset):
        n_end = visible_end(m0 + BLOCK_M, key_start, key_end, causal, diag_offset)
        return (n_end - key_start + BLOCK_N - 1) // BLOCK_N

    return tiles


def key_tile_range(block_m: int, block_n: int, window=NO_WINDOW):
    """``tiles(m0, key_start, key_end, causal, diag_offset) -> (n_begin, n_end)``: rows ``m0 .. m0 + block_m - 1``
    walk the ``block_n``-key tiles ``range(n_begin, n_end, block_n)`` (none when ``n_begin >= n_end``; rows past
    the sequence's end count, as in ``key_tiles``): from the
    tile of ``key_start``'s grid that holds the first key any of them sees under the compile-time ``window``
    (``mask.window_sides``), to the last such key. Tiles wholly outside the window are never visited; the ones it
    cuts are masked (``mask.tile_is_partial``). Without a window: ``(key_start, mask.visible_end(...))``."""
    BLOCK_M = block_m
    BLOCK_N = block_n
    first_key = visible_start(window)
    end_key = visible_end_in(window)
    # (inlined into the kernel's IR: without a window it compiles to the ``visible_end`` call kernels made before)
    if window == NO_WINDOW:
        @inlined_function
        def causal_range(m0, key_start, key_end, causal, diag_offset):
            return key_start, visible_end(m0 + BLOCK_M, key_start, key_end, causal, diag_offset)

        return causal_range

    @inlined_function
    def window_range(m0, key_start, key_end, causal, diag_offset):
        first = first_key(m0, key_start, key_end, diag_offset)
        end = end_key(m0 + BLOCK_M, key_start, key_end, causal, diag_offset)
        begin = key_start + (first - key_start) // BLOCK_N * BLOCK_N
        if first >= end:  # the window holds no key of these rows: no tile (not the aligned one before ``first``)
            end = begin
        return begin, end

    return window_range


def key_tile_walk(block_m: int, block_n: int, window=NO_WINDOW):
    """``walk(m0, key_start, key_end, causal, diag_offset) -> (n_first, n_tiles)``: ``key_tile_range`` as the pipelined
    kernels count their tiles: tile ``j`` starts at key ``n_first + j * block_n``, for ``j < n_tiles`` (0 or less:
    none). Without a window ``(key_start, key_tiles(...))``, inlined: what kernels counted before windows."""
    BLOCK_N = block_n
    if window == NO_WINDOW:
        count = key_tiles(block_m, block_n)

        @inlined_function
        def causal_walk(m0, key_start, key_end, causal, diag_offset):
            return key_start, count(m0, key_start, key_end, causal, diag_offset)

        return causal_walk
    key_range = key_tile_range(block_m, block_n, window)

    @inlined_function
    def window_walk(m0, key_start, key_end, causal, diag_offset):
        n_begin, n_end = key_range(m0, key_start, key_end, causal, diag_offset)
        return n_begin, (n_end - n_begin + BLOCK_N - 1) // BLOCK_N

    return window_walk


def query_tiles_start(block_m: int):
    """``start(n0, seqlen_q, causal, diag_offset) -> m0``: the first ``block_m``-aligned tile of query rows that holds
    a row seeing key ``n0`` (and so any key of a block from ``n0`` on); ``seqlen_q`` or more: none does."""
    BLOCK_M = block_m

    @device_function
    def start(n0, seqlen_q, causal, diag_offset):
        return first_row(n0, 0, seqlen_q, causal, diag_offset) // BLOCK_M * BLOCK_M

    return start


def query_tile_range(block_m: int, block_n: int, window=NO_WINDOW):
    """``tiles(n0, row_start, row_end, key_end, causal, diag_offset) -> (m_begin, m_end)``: the backward's key block
    ``n0 .. n0 + block_n - 1`` (keys from ``key_end`` on do not count) walks the ``block_m``-row query tiles
    ``range(m_begin, m_end, block_m)``, aligned on ``row_start``'s grid: from the tile holding the first row that
    sees one of its keys to the last such row (``mask.visible_rows``), none when ``m_begin >= m_end``. Without a
    window and with ``row_start = 0``: ``(query_tiles_start(...), row_end)``, what the dense kernels walked."""
    BLOCK_M = block_m
    LAST = block_n - 1
    rows = visible_rows(window)

    @inlined_function
    def tile_range(n0, row_start, row_end, key_end, causal, diag_offset):
        first, end = rows(n0, min(n0 + LAST, key_end - 1), row_start, row_end, causal, diag_offset)
        return row_start + (first - row_start) // BLOCK_M * BLOCK_M, end

    return tile_range


#: a key block's entry of a packed-sequence schedule for the backward's key-block kernels (``SCHEDULE_WORDS`` int32
#: words, the forward's entry with keys and rows swapped): the block's first key, one past its sequence's last key,
#: and its sequence's first and one-past-last query row (positions in the packed arrays)
KEY_SCHEDULE = "first key, key end, row start, row end"


def key_block_bounds_of(packed: bool = False):
    """``bounds(q, k, b, schedule) -> (row_start, row_end, key_end, diag_offset)`` of a backward key block: the query
    rows of its sequence, one past its last key and the diagonal's offset. Dense batches: ``(0, seqlen_q, seqlen_k,
    seqlen_k - seqlen_q)`` (inlined); packed sequences: from this block's ``KEY_SCHEDULE`` entry, ``diag_offset =
    key_end - row_end`` (bottom-right within the sequence, as ``sequence_bounds_of``)."""
    if not packed:
        @inlined_function
        def dense(q, k, b, schedule):
            seqlen_q, _, seqlen_k, diag_offset = sequence_bounds(q, k, b)
            return 0, seqlen_q, seqlen_k, diag_offset

        return dense

    @_reads_thread_position
    def packed_key_bounds(q, k, b, schedule):
        at = SCHEDULE_WORDS * cuda.blockIdx.x
        key_end = schedule[at + 1]
        row_end = schedule[at + 3]
        return schedule[at + 2], row_end, key_end, key_end - row_end

    return packed_key_bounds


def persistent_schedule(block_m: int):
    """``(round_tile(k, causal), tile_of(tile, q, causal))`` for ``block_m``-row query blocks of ``q``, a
    ``(batch, heads, seqlen_q, d)`` array."""
    BLOCK_M = block_m

    @_reads_thread_position
    def round_tile(k, causal):
        """This block's tile of round ``k``: the ``gridDim.x`` blocks take one round's tiles in order; under a causal
        mask every other round in reverse. In plain rounds block ``i`` keeps meeting the same query blocks of every
        head (132 blocks, 1k causal rows: 8 query blocks per head, and block 0 gets rows of 8 and 4 key tiles in
        turn, block 3 rows of 5 and 1); a model of B4 H32 D128 causal puts the busiest block at 1.30 / 1.19 / 1.12x
        the mean at 1k / 2k / 4k keys in plain rounds, 1.03x in snake ones. (Rows without a mask are alike, and
        there reversed rounds measured slower.)"""
        if causal and k % 2 == 1:
            return k * cuda.gridDim.x + cuda.gridDim.x - 1 - cuda.blockIdx.x
        return k * cuda.gridDim.x + cuda.blockIdx.x

    @device_function
    def tile_of(tile, q, causal):
        """``(b, h, m0)`` of ``tile``: heads outer, query blocks inner, the last (longest) query blocks first under a
        causal mask."""
        blocks = (q.shape[2] + BLOCK_M - 1) // BLOCK_M
        bh = tile // blocks
        m_block = tile - bh * blocks
        if causal:
            m_block = blocks - 1 - m_block
        return bh // q.shape[1], bh % q.shape[1], m_block * BLOCK_M

    return round_tile, tile_of
