"""Where a thread of a chunked linear kernel works: its warp and fragment lane, and its block's head, M tile and rows.

Every chunked kernel (``shared_state_body``, ``mma``, ``mma_f32``) has the same grid: x runs over (head, M tile),
``bhm = bh * m_tiles + M tile``, and y over the segments of the sequence, ``segment_chunks`` chunks each. (A kernel
reads the thread and block indices itself and passes them in: under the simulator only a kernel's own ``cuda``
knows them.)
"""
from __future__ import annotations

from ..core.staging import device_function


@device_function
def lanes(tid):
    """Thread ``tid`` -> (warp, lane, g, t): ``g = lane // 4`` and ``t = lane % 4`` index the rows and columns an MMA
    fragment gives a lane."""
    lane = tid % 32
    return tid // 32, lane, lane // 4, lane % 4


@device_function
def head_views(q, k, v, out, b, h):
    """The ``(seqlen, E | M)`` views of head (b, h)."""
    return q[b, h], k[b, h], v[b, h], out[b, h]


def block_position(chunk: int, cols: int):
    """``position(bhm, seg, x, seqlen, segment_chunks, m_tiles)`` -> (b, h, col0, row_begin, row_end): the head,
    first value column and rows of block (bhm, seg) in kernels of ``chunk`` rows a chunk and ``cols`` value columns a
    block (``x``: an input ``(batch, heads, ...)``, read for its number of heads)."""
    C = chunk
    COLS = cols

    @device_function
    def position(bhm, seg, x, seqlen, segment_chunks, m_tiles):
        # heads read here, not passed in as an int: the compiler then floors bh / heads in fewer instructions
        heads = x.shape[1]
        bh = bhm // m_tiles
        row_begin = seg * segment_chunks * C
        return bh // heads, bh % heads, (bhm % m_tiles) * COLS, row_begin, min(seqlen, row_begin + segment_chunks * C)

    return position
