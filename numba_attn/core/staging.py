"""Copies of K / V / Q tiles from global to shared memory, shared by the tensor-core flash kernels.

A tile is ``rows`` rows of one head (``[seqlen][headdim]`` in global memory, any strides) starting at row ``n0`` and
column ``c0``, stored in a 1-D shared array as rows of ``row`` elements. Rows >= the sequence length and columns
>= headdim become zeros: they add exactly 0 to ``S`` and ``O``, never NaN.
"""
from __future__ import annotations

import numpy as np
from numba import float32, int64, uint32
from numba import uint32 as index  # unsigned shared-memory indices: no negative-index wraparound code

from ..runtime.device import SIMULATOR, cuda
from . import ptx


def device_function(fn):
    """A device function NVVM always inlines (a plain function under the simulator)."""
    if SIMULATOR:
        return fn
    return cuda.jit(device=True, forceinline=True)(fn)


def inlined_function(fn):
    """A device function Numba inlines into its caller's IR (``inline="always"``; a plain function under the
    simulator): for thin wrappers whose callers must compile to what calling their body directly does -- no
    function of their own in the module, so no PTX declaration of its own either."""
    if SIMULATOR:
        return fn
    return cuda.jit(device=True, inline="always")(fn)


def kernel_body(fn):
    """A kernel's body, called once by each of its entry kernels (``forward.common.entry_kernel``): on a GPU a device
    function Numba inlines into the entry's IR (``inline="always"``: the entry compiles to what the body written in
    it did); under the simulator a simulated device function, so that the body's module sees the running thread's
    ``cuda`` (the simulator shows it only to the modules of kernels and simulated device functions)."""
    if SIMULATOR:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, inline="always")(fn)


def float32_tile_copy(threads_x: int, threads_y: int, rows: int, width: int, row_step: int, column_step: int):
    """``copy(head, smem, base, n0, seqlen, head_dim, ty, tx)``: rows ``n0 .. n0 + rows`` and columns ``0 .. width``
    of ``head`` (any dtype and strides, converted to float32) to ``smem[base + r * row_step + d * column_step]``,
    zeros outside the sequence and past headdim; synchronous, element by element (the CUDA-core kernels: the flash
    forward and backward ``simt``). Thread ``(ty, tx)`` of a ``threads_x x threads_y`` block takes rows ``ty +
    threads_y i`` and columns ``tx + threads_x j``; ``column_step = 1``: row-major, ``row_step = 1``: transposed."""
    TX, TY, ROWS, WIDTH = threads_x, threads_y, rows, width
    ROW_STEP, COLUMN_STEP = row_step, column_step

    @device_function
    def copy(head, smem, base, n0, seqlen, head_dim, ty, tx):
        for r in range(ty, ROWS, TY):
            for dd in range(tx, WIDTH, TX):
                val = float32(0.0)
                if n0 + r < seqlen and dd < head_dim:
                    val = float32(head[n0 + r, dd])
                smem[index(base + dd * COLUMN_STEP + r * ROW_STEP)] = val

    return copy


def tile_loader(threads: int, row: int, width: int, rows: int, dtype, vector_loads: bool, l2_prefetch: bool = False,
                whole_tile_path: bool = False, swizzle: bool = False):
    """``load_tile(head, smem, base, tid, n0, seqlen, c0, head_dim)``: start the copy of rows ``n0 .. n0 + rows``,
    columns ``c0 .. c0 + width`` of ``head`` to ``smem[base + r * row + c]``, every one of the block's ``threads``
    threads taking part.

    ``dtype``: the shared array's element type (uint16 bit patterns or float32); ``width`` must be a whole number of
    16-byte pieces.
    ``vector_loads``: asynchronous 16-byte copies (``cp.async``, zero-filling what lies outside), which land by the
    next ``cp_async_wait_all`` + barrier; needs headdim and ``c0`` whole pieces, a contiguous last axis and
    16-byte aligned rows (the launcher checks). Otherwise element by element, synchronously (any strides, any
    headdim). Chosen here, in Python, so that each kernel compiles only the loader it uses.
    ``l2_prefetch``: the asynchronous copies ask L2 for 256-byte sector groups (``ptx.cp_async_16_prefetch``).
    ``whole_tile_path``: a tile wholly inside the rows and columns skips the per-piece bounds checks (one test per
    tile): the checks, 64-bit compares and selects, were most of the ~16 instructions per piece of a float32 tile.
    On for the linear walks and the decode split kernel, where it was measured (docs/design/decode.md); the flash forward
    kernels keep the checked path until they are timed with it.
    ``swizzle``: rows without padding (``row == width``, a whole number of 8-piece groups), 16-byte piece ``p`` of
    tile row ``r`` stored at piece ``p ^ (r % 8)``, so that the 8 rows an ``ldmatrix`` matrix reads, or the rows
    ``2t, 2t + 1`` of a fragment's scalar reads, fall on different banks without the padding's memory.
    ``swizzle="fragments"``: float32 rows of ``row`` words, a multiple of 32, word ``c`` of row ``r`` at ``c ^
    tf32.fragment_swizzle(r)`` (``core.tf32``: row-pair and column-pair fragment reads both without conflicts)."""
    ZERO = np.dtype(dtype).type(0)
    PIECE = 16 // ZERO.itemsize  # elements per 16-byte piece
    if width % PIECE:
        raise ValueError(f"tile width {width} is not a multiple of {PIECE} elements (16 bytes)")
    PIECES = width // PIECE  # 16-byte pieces per row
    SWIZZLE = swizzle is True
    FRAGMENTS = swizzle == "fragments"
    if swizzle not in (False, True, "fragments"):
        raise ValueError(f"swizzle: expected False, True or 'fragments', got {swizzle!r}")
    if SWIZZLE and (row != width or PIECES % 8):
        raise ValueError(f"a swizzled tile needs unpadded rows of whole 8-piece groups (row {row}, width {width})")
    if FRAGMENTS and (ZERO.itemsize != 4 or row % 32 or width > row):
        raise ValueError(f"a fragment-swizzled tile needs 4-byte elements in rows of 32-word lines (row {row}, "
                         f"width {width})")
    # the pieces of a tile in steps of the block: thread tid takes piece column tid % PIECES of rows
    # tid // PIECES + k ROWS (when PIECES divides the block, so that the column and the global offset within a row
    # stay fixed per thread)
    ROWS = threads // PIECES if threads % PIECES == 0 else 0
    STEPS = -(-rows // ROWS) if ROWS else 0
    ROWS_GUARD = ROWS and rows % ROWS != 0
    ROW = row
    WHOLE_TILE_PATH = whole_tile_path
    cp_async_16 = ptx.cp_async_16_prefetch if l2_prefetch else ptx.cp_async_16
    load2 = ptx.load2
    store1 = ptx.store1

    @device_function
    def placed(r, col):  # where column ``col`` of tile row ``r`` lies in the row
        if SWIZZLE:
            return col ^ (PIECE * (r % 8))
        if FRAGMENTS:  # (core.tf32.fragment_swizzle, written out: core.tf32 imports this module)
            return col ^ (8 * ((r & 3) ^ ((r >> 2) & 1)))
        return col

    def load_vector(head, smem, base, tid, n0, seqlen, c0, head_dim):
        row_stride = head.strides[0]
        r = tid // PIECES
        col = PIECE * (tid - r * PIECES)
        inside_cols = c0 + col < head_dim
        offset = (n0 + r) * row_stride + (c0 + col) * head.strides[1]
        if WHOLE_TILE_PATH and n0 + rows <= seqlen and c0 + width <= head_dim:
            for step in range(STEPS):
                if not ROWS_GUARD or r + step * ROWS < rows:
                    cp_async_16(smem, base + (r + step * ROWS) * ROW + placed(r + step * ROWS, col), head, offset, 16)
                offset += ROWS * row_stride
            return
        for step in range(STEPS):
            rr = r + step * ROWS
            if not ROWS_GUARD or rr < rows:
                inside = inside_cols and n0 + rr < seqlen
                # outside: read nothing, fill zeros (from the head's first element: a valid address)
                cp_async_16(smem, base + rr * ROW + placed(rr, col), head,
                            offset + step * ROWS * row_stride if inside else 0, 16 if inside else 0)

    def load_vector_any(head, smem, base, tid, n0, seqlen, c0, head_dim):  # PIECES does not divide the block
        for idx in range(tid, rows * PIECES, threads):
            r = idx // PIECES
            col = PIECE * (idx - r * PIECES)
            inside = n0 + r < seqlen and c0 + col < head_dim
            offset = (n0 + r) * head.strides[0] + (c0 + col) * head.strides[1]
            cp_async_16(smem, base + r * ROW + placed(r, col), head, offset if inside else 0, 16 if inside else 0)

    def load_elements(head, smem, base, tid, n0, seqlen, c0, head_dim):
        for idx in range(tid, rows * width, threads):
            r = idx // width
            col = idx - r * width
            x = ZERO
            if n0 + r < seqlen and c0 + col < head_dim:
                x = load2(head, n0 + r, c0 + col)
            store1(smem, base + r * ROW + placed(r, col), x)

    if vector_loads:
        return device_function(load_vector if ROWS else load_vector_any)
    return device_function(load_elements)


def paged_kv_loader(threads: int, row: int, width: int, rows: int, dtype, vector_loads: bool,
                    l2_prefetch: bool = False):
    """``load_kv(k_cache, v_cache, table, b, kv_head, smem, k_base, v_base, tid, n0, seqlen, c0, head_dim)``: the K
    and V tiles of keys ``n0 ..`` from a paged KV cache (``core.paging``), ``tile_loader``'s copies: tile row ``r`` is
    key ``n0 + r`` of batch row ``b``, in page ``table[b, (n0 + r) // page_size]`` of the pools ``(num_pages,
    kv_heads, page_size, headdim)`` (any strides, the same page size). Rows >= ``seqlen`` become zeros. ``vector_loads``
    and ``l2_prefetch`` as in ``tile_loader`` (the launcher checks that every row of the pools is 16-byte aligned).

    Where the block's threads are a whole number of a row's pieces, each thread copies one 16-byte column of rows
    ``r, r + threads / pieces, ..`` of both tiles: it looks up all its rows' pages first, once for K and V, then
    starts all its copies. The look-ups have no branches (a row past ``seqlen`` looks up the last key's page, and its
    copy reads nothing), so their table loads are in flight together, and a power-of-two page size takes a shift
    instead of a division: per-row look-ups in series before the copies left paged decode at 0.70-0.75x the dense
    cache's speed on an H100."""
    from .paging import page_of  # (paging builds on this module's device_function)

    ZERO = np.dtype(dtype).type(0)
    PIECE = 16 // ZERO.itemsize
    if width % PIECE:
        raise ValueError(f"tile width {width} is not a multiple of {PIECE} elements (16 bytes)")
    PIECES = width // PIECE
    ROW = row
    cp_async_16 = ptx.cp_async_16_prefetch if l2_prefetch else ptx.cp_async_16
    load2 = ptx.load2
    store1 = ptx.store1

    def load_vector(cache, table, b, kv_head, smem, base, tid, n0, seqlen, c0, head_dim):
        page_size = cache.shape[2]
        head_offset = kv_head * cache.strides[1]
        for idx in range(tid, rows * PIECES, threads):
            r = idx // PIECES
            col = PIECE * (idx - r * PIECES)
            inside = n0 + r < seqlen and c0 + col < head_dim
            offset = 0
            if inside:
                page, at = page_of(table, b, n0 + r, page_size)
                offset = page * cache.strides[0] + head_offset + at * cache.strides[2] + (c0 + col) * cache.strides[3]
            # outside: read nothing, fill zeros (from the pool's first element: a valid address)
            cp_async_16(smem, base + r * ROW + col, cache, offset, 16 if inside else 0)

    def load_elements(cache, table, b, kv_head, smem, base, tid, n0, seqlen, c0, head_dim):
        page_size = cache.shape[2]
        for idx in range(tid, rows * width, threads):
            r = idx // width
            col = idx - r * width
            x = ZERO
            if n0 + r < seqlen and c0 + col < head_dim:
                page, at = page_of(table, b, n0 + r, page_size)
                x = load2(cache[page, kv_head], at, c0 + col)
            store1(smem, base + r * ROW + col, x)

    one = device_function(load_vector if vector_loads else load_elements)

    def load_kv_each(k_cache, v_cache, table, b, kv_head, smem, k_base, v_base, tid, n0, seqlen, c0, head_dim):
        one(k_cache, table, b, kv_head, smem, k_base, tid, n0, seqlen, c0, head_dim)
        one(v_cache, table, b, kv_head, smem, v_base, tid, n0, seqlen, c0, head_dim)

    ROWS = threads // PIECES if threads % PIECES == 0 else 0  # rows per step of the block
    STEPS = -(-rows // ROWS) if ROWS else 0
    ROWS_GUARD = ROWS and rows % ROWS != 0
    SLOTS = max(STEPS, 1)

    def load_kv_fixed(k_cache, v_cache, table, b, kv_head, smem, k_base, v_base, tid, n0, seqlen, c0, head_dim):
        page_size = uint32(k_cache.shape[2])
        low = page_size - uint32(1)
        shift = uint32(cuda.popc(low))
        pow2 = (page_size & low) == 0
        r = tid // PIECES
        col = PIECE * (tid - r * PIECES)
        inside_cols = c0 + col < head_dim
        last = uint32(max(seqlen - 1, 0))
        pages = cuda.local.array(SLOTS, int64)
        within = cuda.local.array(SLOTS, int64)
        for step in range(STEPS):  # every look-up first, without branches ...
            key = min(uint32(n0 + r + step * ROWS), last)
            at = (key >> shift) if pow2 else key // page_size
            pages[step] = table[b, at]
            within[step] = key - at * page_size
        for which in range(2):  # ... then every copy, K's and V's
            cache = k_cache if which == 0 else v_cache
            base = k_base if which == 0 else v_base
            column = kv_head * cache.strides[1] + (c0 + col) * cache.strides[3]
            for step in range(STEPS):
                rr = r + step * ROWS
                if not ROWS_GUARD or rr < rows:
                    inside = inside_cols and n0 + rr < seqlen
                    offset = pages[step] * cache.strides[0] + within[step] * cache.strides[2] + column
                    # outside: read nothing, fill zeros (from the pool's first element: a valid address)
                    cp_async_16(smem, base + rr * ROW + col, cache, offset if inside else 0, 16 if inside else 0)

    if vector_loads and ROWS:
        # (under the simulator a simulated device function: only the running thread's ``cuda`` makes local arrays)
        return cuda.jit(device=True)(load_kv_fixed) if SIMULATOR else device_function(load_kv_fixed)
    return device_function(load_kv_each)
