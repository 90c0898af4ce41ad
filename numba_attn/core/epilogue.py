"""The end of the tensor-core kernels: each row's output divided by its sum and stored, and its lse; the backward's
gradients stored as they are, or added to a float32 accumulator.

The output accumulator ``acc[mt, ob, e]`` is in the C-fragment layout of ``softmax`` (lane ``(g, t)``: rows ``row0 +
16 mt`` for e = 0, 1 and ``+ 8`` for e = 2, 3; columns ``8 ob + 2t + e % 2`` of the pass's first column ``d_off``).
Only rows below ``seqlen_q`` and columns below ``head_dim`` are written: what lies past them belongs to the caller.
"""
from __future__ import annotations

import numpy as np

from . import ptx
from .softmax import log_sum_exp, row_sum
from .staging import device_function, inlined_function
from .warpgroup import swizzle

#: ``warpgroup.swizzle`` in device code: the byte offset of a 128-byte-swizzled tile
swizzled = device_function(swizzle)

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


def as_16bit(bf16: bool):
    """``convert(x0, x1) -> (w0, w1)``: two float32 values rounded to float16 (or bfloat16) bit patterns."""
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    low_u16 = ptx.low_u16
    high_u16 = ptx.high_u16

    @device_function
    def convert(x0, x1):
        w = pack(x0, x1)
        return low_u16(w), high_u16(w)

    return convert


@device_function
def as_float32(x0, x1):
    """``convert`` for float32 outputs: the values themselves."""
    return x0, x1


def _normalised_rows(m_tiles: int, o_blocks: int, put):
    """``rows(acc, m_run, l_run, dst, base, lse, b, h, row0, r0, t, d_off, seqlen_q, head_dim, lse_now, post,
    out_scale)``: each row's outputs divided by its full sum (``softmax.row_sum``) and scaled, handed in pairs to
    ``put(dst, base, row, r, col, x0, x1, head_dim)`` (``row`` the row in the sequence, ``r`` its place in a staged
    tile, ``r0`` this lane's first) for rows below ``seqlen_q``; lane ``t = 0`` of each row stores its lse when
    ``lse_now``. A row that saw no key gives 0 and -inf."""
    M_TILES = m_tiles
    O_BLOCKS = o_blocks

    @inlined_function
    def rows(acc, m_run, l_run, dst, base, lse, b, h, row0, r0, t, d_off, seqlen_q, head_dim, lse_now, post,
             out_scale):
        for mt in range(M_TILES):
            for half in range(2):
                row = row0 + 16 * mt + 8 * half
                l_row = row_sum(l_run[2 * mt + half])
                inv = out_scale / l_row if l_row > _ZERO else _ZERO
                if row < seqlen_q:
                    for ob in range(O_BLOCKS):
                        put(dst, base, row, r0 + 16 * mt + 8 * half, d_off + 8 * ob + 2 * t,
                            acc[mt, ob, 2 * half] * inv, acc[mt, ob, 2 * half + 1] * inv, head_dim)
                if lse_now and t == 0 and row < seqlen_q:
                    lse[b, h, row] = log_sum_exp(m_run[2 * mt + half], l_row, post)

    return rows


def store_rows(m_tiles: int, o_blocks: int, convert, scaled: bool = False, scale_argument: bool | None = None,
               pairs: bool = False):
    """``finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, d_off, seqlen_q, head_dim, lse_now, post)``: full
    row sums (``softmax.row_sum``), one division per row, ``convert``ed pairs stored to ``out_head[row, col]``; when
    ``lse_now``, lane ``t = 0`` of each row stores ``lse[b, h, row]``. A row that saw no key gives 0 and -inf.
    ``scaled``: every output is multiplied by one more argument, ``out_scale`` (the fp8 kernels' V descale).
    ``scale_argument`` (default: ``scaled``): ``finish`` takes ``out_scale`` -- and ignores it when not ``scaled``
    (the 16-bit forms of kernels whose body also serves 8-bit inputs). ``pairs``: each lane's two columns in one
    store of twice the width (``out_head``'s rows in aligned pairs: ``runtime.views.rows_in_pieces(out, 2)``; an
    even ``head_dim``) instead of two."""
    PAIRS = pairs
    store2 = ptx.store2
    store_pair = ptx.store_pair

    @inlined_function
    def put(out_head, base, row, r, col, x0, x1, head_dim):
        w0, w1 = convert(x0, x1)
        if PAIRS:
            if col < head_dim:
                store_pair(out_head, row, col, w0, w1)
        else:
            if col < head_dim:
                store2(out_head, row, col, w0)
            if col + 1 < head_dim:
                store2(out_head, row, col + 1, w1)

    rows = _normalised_rows(m_tiles, o_blocks, put)

    # (``rows`` is inlined into each form in Numba's IR, so each is one function in the module as before: a form
    # calling another device function would add one, and change the kernels' PTX)
    if scaled:
        @device_function
        def finish_scaled(acc, m_run, l_run, out_head, lse, b, h, row0, t, d_off, seqlen_q, head_dim, lse_now, post,
                          out_scale):
            rows(acc, m_run, l_run, out_head, 0, lse, b, h, row0, 0, t, d_off, seqlen_q, head_dim, lse_now, post,
                 out_scale)

        return finish_scaled

    @device_function
    def finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, d_off, seqlen_q, head_dim, lse_now, post):
        rows(acc, m_run, l_run, out_head, 0, lse, b, h, row0, 0, t, d_off, seqlen_q, head_dim, lse_now, post, _ONE)

    if not scale_argument:
        return finish

    @inlined_function
    def finish_unscaled(acc, m_run, l_run, out_head, lse, b, h, row0, t, d_off, seqlen_q, head_dim, lse_now, post,
                        out_scale):
        finish(acc, m_run, l_run, out_head, lse, b, h, row0, t, d_off, seqlen_q, head_dim, lse_now, post)

    return finish_unscaled


def stage_rows(o_blocks: int, bf16: bool, box_rows: int):
    """``stage(acc, m_run, l_run, smem, tile, lse, b, h, row0, r0, t, seqlen_q, lse_now, post, out_scale)``: as
    ``store_rows(1, o_blocks, as_16bit(bf16), scaled=True)``'s ``finish``, but the rows go to a staged tile of
    16-bit elements in shared memory, ``smem[tile:]`` (1024-byte aligned), laid out as the TMA loads one (and
    ``ptx.bulk.tma_store_4d`` stores one): boxes of ``box_rows`` rows by 64 columns, 128 bytes a row, 16-byte
    pieces swizzled (``warpgroup.swizzle``); row ``r0`` of the tile is this lane's first (``row0`` in the
    sequence). Each lane writes one 4-byte pair at a time: the swizzle puts a warp's eight rows of one 8-column
    block in eight different 16-byte pieces, so the 32 lanes hit 32 different banks. Only rows below ``seqlen_q``
    are written (the TMA store clips the rest); the lse as ``store_rows``. (Stored straight from the fragments, each
    warp store touches eight rows: ``docs/design`` has what that cost the warp-specialised forward.)"""
    BOX = 64 * box_rows  # elements of one 64-column box
    pack = ptx.pack_bf16x2 if bf16 else ptx.pack_half2
    store_word = ptx.store_u16x2

    @inlined_function
    def put(smem, tile, row, r, col, x0, x1, head_dim):
        store_word(smem, tile + (col >> 6) * BOX + (swizzled(2 * (r * 64 + (col & 63))) >> 1), pack(x0, x1))

    rows = _normalised_rows(1, o_blocks, put)

    @device_function
    def stage(acc, m_run, l_run, smem, tile, lse, b, h, row0, r0, t, seqlen_q, lse_now, post, out_scale):
        rows(acc, m_run, l_run, smem, tile, lse, b, h, row0, r0, t, 0, seqlen_q, 0, lse_now, post, out_scale)

    return stage


def store_fragments(m_tiles: int, blocks: int, convert):
    """``store(acc, out_head, row0, row_end, col0, head_dim, scale)``: the C fragments ``acc[mt, nb, e]`` (the
    layout above: rows ``row0 + 16 mt + 8 (e // 2)``, ``row0`` with this lane's ``g``; columns ``col0 + 8 nb + e % 2``,
    ``col0`` with its ``2t``) times ``scale``, ``convert``ed and stored to ``out_head[row, col]`` for rows below
    ``row_end`` and columns below ``head_dim`` (the backward's gradients: no row sums, no lse)."""
    M_TILES = m_tiles
    BLOCKS = blocks
    store2 = ptx.store2

    @device_function
    def store(acc, out_head, row0, row_end, col0, head_dim, scale):
        for mt in range(M_TILES):
            for half in range(2):
                row = row0 + 16 * mt + 8 * half
                if row < row_end:
                    for nb in range(BLOCKS):
                        col = col0 + 8 * nb
                        w0, w1 = convert(acc[mt, nb, 2 * half] * scale, acc[mt, nb, 2 * half + 1] * scale)
                        if col < head_dim:
                            store2(out_head, row, col, w0)
                        if col + 1 < head_dim:
                            store2(out_head, row, col + 1, w1)

    return store


def add_fragments(m_tiles: int, blocks: int, vector: bool, quads: bool = False):
    """``add(acc, dst_head, row0, row_end, col0, col_end, scale)``: ``acc * scale`` (C fragments, as
    ``store_fragments``) added to the float32 ``dst_head[row, col]`` by atomic reductions, for rows below ``row_end``
    and column pairs below ``col_end`` (even: the destination is as wide as the padded head dim, so a pair is whole).
    ``vector``: one ``red.add.v2.f32`` per column pair (sm_90; the rows 8-byte aligned), else two scalar ones.
    ``quads`` (sm_90; rows 16-byte aligned, ``col0 - 2t`` a multiple of 8): lanes ``t``, ``t ^ 1`` swap a pair per
    n8 block (two shuffles) so that the even lane holds 4 columns of row ``g``, the odd one 4 of row ``g + 8``: one
    ``red.add.v4.f32`` per n8 block instead of two ``.v2`` (quads up to the padded head dim: past ``col_end`` by
    one pair at most). Every lane must call it (the shuffles)."""
    M_TILES = m_tiles
    BLOCKS = blocks
    VECTOR = vector
    QUADS = quads
    red = ptx.red_add_f32
    red2 = ptx.red_add_f32x2
    red4 = ptx.red_add_f32x4
    swap = ptx.shfl_xor_f32

    @device_function
    def add(acc, dst_head, row0, row_end, col0, col_end, scale):
        if QUADS:
            odd = (col0 >> 1) & 1  # t % 2
            for mt in range(M_TILES):
                row = row0 + 16 * mt + 8 * odd
                for nb in range(BLOCKS):
                    x0 = acc[mt, nb, 0] * scale
                    x1 = acc[mt, nb, 1] * scale
                    x2 = acc[mt, nb, 2] * scale
                    x3 = acc[mt, nb, 3] * scale
                    # the even lane gives its row-(g + 8) pair, the odd one its row-g pair
                    y0 = swap(x0 if odd else x2, 1)
                    y1 = swap(x1 if odd else x3, 1)
                    col = col0 + 8 * nb - 2 * odd
                    if row < row_end and col < col_end:
                        if odd:
                            red4(dst_head, row, col, y0, y1, x2, x3)
                        else:
                            red4(dst_head, row, col, x0, x1, y0, y1)
            return
        for mt in range(M_TILES):
            for half in range(2):
                row = row0 + 16 * mt + 8 * half
                if row < row_end:
                    for nb in range(BLOCKS):
                        col = col0 + 8 * nb
                        if col < col_end:
                            x0 = acc[mt, nb, 2 * half] * scale
                            x1 = acc[mt, nb, 2 * half + 1] * scale
                            if VECTOR:
                                red2(dst_head, row, col, x0, x1)
                            else:
                                red(dst_head, row, col, x0)
                                red(dst_head, row, col + 1, x1)

    return add
