"""``cp.async`` copies of Q / K / V rows into the 128-byte swizzled shared-memory tiles of the warpgroup kernels.

A tile holds ``rows`` rows of one head (``[seqlen][headdim]`` in global memory), each as 128-byte rows of atom
columns (``core.warpgroup``: a 16-bit tile of ``d_pad`` columns is ``d_pad / 64`` atom columns, an 8-bit one ``d_pad
/ 128``), in a 1-D uint16 shared array. The 16-byte piece ``p`` of row ``r`` lands at piece ``p ^ phase(r)`` of its
128-byte row: ``phase(r) = r % 8`` is the hardware's 128-byte swizzle (tiles the tensor cores read); other phases
serve tiles that only the kernel's own loads read (the fp8 kernel's V staging, ``core.fp8``). Rows past the
sequence and pieces past headdim are zero-filled.
"""
from __future__ import annotations

from . import ptx
from .staging import device_function


def swizzled_tile_loader(rows: int, d_pad: int, threads: int, element_bytes: int = 2, phase_rows: int = 1,
                         phase_step: int = 1):
    """``load(head, smem, base, tid, n0, seqlen, head_dim)``: start the ``cp.async`` copy of rows ``n0 .. n0 +
    rows`` of ``head`` (elements of ``element_bytes`` bytes: 2 or 1) to the tile at element ``base`` of the uint16
    ``smem``, every one of the block's ``threads`` threads taking part; piece ``p`` of tile row ``r`` goes to piece
    ``p ^ ((r // phase_rows) * phase_step % 8)`` (defaults: the hardware's 128-byte swizzle). Consecutive threads
    take consecutive 16-byte pieces of a row: a warp reads whole rows and writes each 128-byte row of the tile once
    (the swizzle only permutes its pieces)."""
    ELEMS = 16 // element_bytes  # elements per 16-byte piece
    if d_pad % ELEMS:
        raise ValueError(f"d_pad {d_pad} is not a whole number of 16-byte pieces of {element_bytes}-byte elements")
    CHUNKS = d_pad // ELEMS  # 16-byte pieces per row
    PIECES = rows * CHUNKS
    STEPS = -(-PIECES // threads)
    GUARD = PIECES % threads != 0
    ATOM = 64 * rows  # uint16 elements of one atom column
    HARDWARE = phase_rows == 1 and phase_step == 1
    PHASE_ROWS, PHASE_STEP = phase_rows, phase_step
    # when the pieces of a row divide the block, each thread keeps one piece column and steps down the rows by a
    # multiple of the phase's period (so its swizzled column stays put too): its offsets are loop invariants plus
    # constants
    STEP_ROWS = threads // CHUNKS if threads % CHUNKS == 0 else 0
    if STEP_ROWS and (STEP_ROWS // phase_rows * phase_step % 8 or STEP_ROWS % phase_rows):
        STEP_ROWS = 0
    ROWS = rows
    THREADS = threads
    cp_async_16 = ptx.cp_async_16

    def load_fixed_column(head, smem, base, tid, n0, seqlen, head_dim):
        row = tid // CHUNKS
        chunk = tid - row * CHUNKS
        dst = (base + (chunk // 8) * ATOM + 64 * row
               + 8 * ((chunk % 8) ^ (row % 8 if HARDWARE else (row // PHASE_ROWS) * PHASE_STEP % 8)))
        column_inside = ELEMS * chunk < head_dim
        row_stride = head.strides[0]
        offset = (n0 + row) * row_stride + ELEMS * chunk * head.strides[1]
        rows_left = seqlen - n0 - row
        for step in range(STEPS):
            if not GUARD or row + STEP_ROWS * step < ROWS:
                inside = column_inside and STEP_ROWS * step < rows_left
                cp_async_16(smem, dst + 64 * STEP_ROWS * step, head,
                            offset + STEP_ROWS * step * row_stride if inside else 0, 16 if inside else 0)

    def load(head, smem, base, tid, n0, seqlen, head_dim):
        for step in range(STEPS):
            piece = tid + THREADS * step
            if not GUARD or piece < PIECES:
                row = piece // CHUNKS
                chunk = piece - row * CHUNKS
                inside = n0 + row < seqlen and ELEMS * chunk < head_dim
                offset = (n0 + row) * head.strides[0] + ELEMS * chunk * head.strides[1]
                dst = (base + (chunk // 8) * ATOM + 64 * row
                       + 8 * ((chunk % 8) ^ (row % 8 if HARDWARE else (row // PHASE_ROWS) * PHASE_STEP % 8)))
                cp_async_16(smem, dst, head, offset if inside else 0, 16 if inside else 0)

    if STEP_ROWS:
        return device_function(load_fixed_column)
    return device_function(load)
