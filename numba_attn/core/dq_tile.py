"""The float32 ``dQ`` accumulator in whole tiles (the warpgroup backwards' ``dq_bulk`` / ``dq_writer``), the
FlashAttention-3 way: the consumers store a tile's ``dQ`` fragments into a shared staging tile, and ONE bulk
reduction (``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``, ``ptx.bulk``) of the whole tile, issued
by one thread, adds it to the global accumulator. The bulk copy moves bytes as they are, so the staging tile and
each tile of the accumulator share one layout:

Layout (``dq_acc``: float32 ``(batch, heads, seqlen_pad, d_pad)`` contiguous, ``seqlen_pad`` a multiple of the
kernel's ``block_m`` so that every tile, starting at a multiple of ``block_m``, is ``block_m * d_pad`` contiguous
floats of its head)
    rows of ``d_pad`` floats, no padding; the logical column ``c`` of (absolute) row ``r`` is stored at column

        c ^ swizzle(r)        swizzle(r) = 8 (r % 4)           for d_pad >= 32
                              swizzle(r) = 8 ((r // 2) % 2)    for d_pad == 16

    (a function of ``r % 4``: tile-relative rows give the same, tiles start at multiples of 64). The XOR moves whole
    aligned 8-column groups within the row, so a column pair ``2i, 2i + 1`` stays an aligned pair.

Why (the C fragment of ``core.warpgroup``: thread ``(g, t) = (lane / 4, lane % 4)`` of warp ``w`` holds rows
``16 w + g`` and ``+ 8``, columns ``8 nb + 2t, + 1`` of each n8 block ``nb``; one 8-byte store per pair)
    an 8-byte store of a warp runs as two 128-byte phases, lanes 0-15 (rows g = 0..3) and 16-31 (g = 4..7):

        phase rows   row-major (stride d_pad floats)        permuted
        g = 0..3     all four rows on banks 8 nb' .. +7     row g on banks 8 ((nb ^ g) % 4) .. +7
                     (d_pad >= 32: 4-way conflict)          (the four rows cover the 32 banks once)

    at d_pad 16 a row is 16 banks (rows g, g + 1 on either half of the banks already), and the XOR of rows
    ``g // 2 = 1`` by 8 columns puts rows 0..3 on banks 0-7, 16-23, 8-15, 24-31.

The ``convert`` kernel reads the accumulator through the same permutation (``tile_swizzle``); the other paths
(``red.global.add`` per thread, the SIMT / ``mma`` / deterministic kernels) keep the row-major layout.
"""
from __future__ import annotations

from . import ptx
from .ptx import bulk
from .staging import device_function


def swizzle(row: int, d_pad: int) -> int:
    """Host twin of ``tile_swizzle(d_pad)``: the XOR mask of the columns of ``row``."""
    return 8 * ((row // 2) % 2) if d_pad == 16 else 8 * (row % 4)


def tile_swizzle(d_pad: int):
    """``swizzle(row) -> int``: the XOR mask of the columns of ``row`` (module docstring), ``d_pad`` in 16, 32,
    64, 128."""
    if d_pad not in (16, 32, 64, 128):
        raise ValueError(f"d_pad: the tiled dQ layout takes 16, 32, 64 or 128 columns, got {d_pad}")
    if d_pad == 16:
        @device_function
        def swizzle16(row):
            return ((row >> 1) & 1) << 3

        return swizzle16

    @device_function
    def swizzle32(row):
        return (row & 3) << 3

    return swizzle32


def tile_stager(blocks: int, d_pad: int):
    """``stage(floats, at, acc, row0, col0, scale)``: a thread's C fragments ``acc[0, nb, :]`` (``blocks`` n8
    blocks; tile rows ``row0``, ``row0 + 8``, columns ``col0 + 8 nb`` (+1)) times ``scale`` into the staging tile
    at float index ``at`` of ``floats`` (1024-byte aligned or at least 16), permuted: one 8-byte store per pair."""
    BLOCKS, D_PAD = blocks, d_pad
    mask = tile_swizzle(d_pad)
    store_f32x2 = ptx.store_f32x2

    @device_function
    def stage(floats, at, acc, row0, col0, scale):
        sw = mask(row0)  # (row0 + 8 has the same)
        for nb in range(BLOCKS):
            for half in range(2):
                store_f32x2(floats, at + (row0 + 8 * half) * D_PAD + ((col0 + 8 * nb) ^ sw),
                            acc[0, nb, 2 * half] * scale, acc[0, nb, 2 * half + 1] * scale)

    return stage


def tile_flusher(block_m: int, d_pad: int, evict_last: bool = False):
    """``flush(smem, at, dq_head, m0)``: ONE bulk reduction of the staged tile (``block_m * d_pad`` floats from
    16-bit index ``at`` of the uint16 shared ``smem``) onto rows ``m0 ..`` of the 2-D float32 ``dq_head``
    (``(seqlen_pad, d_pad)`` contiguous), committed as one bulk group of the calling thread (which alone calls it);
    ``evict_last``: with that L2 policy for the accumulator's lines."""
    TILE_BYTES = 4 * block_m * d_pad
    reduce = bulk.bulk_reduce_add_f32_evict_last if evict_last else bulk.bulk_reduce_add_f32
    commit = bulk.bulk_commit

    @device_function
    def flush(smem, at, dq_head, m0):
        reduce(dq_head, m0, smem, at, TILE_BYTES)
        commit()

    return flush


def padded_rows(seqlen_q: int, block_m: int) -> int:
    """Rows of a tiled accumulator: ``seqlen_q`` rounded up to ``block_m`` (the last tile stays in its head)."""
    return -(-int(seqlen_q) // block_m) * block_m


def check_accumulator(dq_acc, seqlen_q: int, block_m: int, d_pad: int) -> None:
    """ValueError unless ``dq_acc`` can take whole-tile bulk reductions: float32 ``(batch, heads, >= seqlen_q rounded
    up to block_m, d_pad)`` with contiguous rows of ``d_pad`` floats per head."""
    rows = padded_rows(seqlen_q, block_m)
    shape, strides = tuple(dq_acc.shape), tuple(dq_acc.strides)
    if len(shape) != 4 or shape[3] != d_pad or shape[2] < rows or strides[3] != 4 or strides[2] != 4 * d_pad:
        raise ValueError(f"dq_acc: the tiled dQ needs float32 (batch, heads, >= {rows}, {d_pad}) with contiguous "
                         f"rows per head, got shape {shape}, strides {strides}")
