"""Which keys a query row sees: the attention masks, written once for every kernel.

Rows and keys are positions in their sequences. A row sees the keys below ``key_end`` (the sequence's keys) and,
when ``causal``, only those on or below the bottom-right aligned diagonal: query ``i`` sees keys ``j <= i +
diag_offset``, ``diag_offset = seqlen_k - seqlen_q`` (a row that sees no key gives 0 and ``lse = -inf``).

Kernels ask four questions, all answered here: is this element hidden (``hidden``), may a whole key tile skip the
per-element test (``tile_is_partial``), where do the keys a block of rows sees end (``visible_end``, for the
block's key range in ``block_info``), and -- the backward's key blocks -- where do the rows that see a key begin
(``first_row``). The masks are monotone -- a key hidden from a row is hidden from every earlier
row, and so is every later key -- so one corner of a tile answers for the whole tile. A new kind of mask (a sliding
window, say) is a new clause in these three functions; a left edge would also test the tile's first key against the
block's last row.
"""
from __future__ import annotations

from .staging import device_function


@device_function
def hidden(key, row, key_end, causal, diag_offset):
    """True where query ``row`` must not see ``key``: past the sequence's keys, or above the causal diagonal."""
    # one return per clause: as one boolean ``or`` expression it compiled to selects, and more instructions, where
    # the kernels test it (docs/design/forward.md)
    if key >= key_end:
        return True
    if causal and key > row + diag_offset:
        return True
    return False


def tile_is_partial(block_n: int):
    """``partial(n0, m0, key_end, causal, diag_offset)``: True when some key of the tile ``n0 .. n0 + block_n - 1``
    is hidden from some row ``>= m0`` (its last key from the first row): only such tiles need the element test."""
    BLOCK_N = block_n

    @device_function
    def partial(n0, m0, key_end, causal, diag_offset):
        crosses = n0 + BLOCK_N > key_end
        if causal:
            crosses = crosses or (n0 + BLOCK_N - 1 > m0 + diag_offset)
        return crosses

    return partial


@device_function
def visible_end(row_end, key_start, key_end, causal, diag_offset):
    """One past the last key that any row below ``row_end`` sees (at least ``key_start``)."""
    if causal:
        return min(key_end, max(key_start, row_end + diag_offset))
    return key_end


@device_function
def first_row(key, row_start, row_end, causal, diag_offset):
    """The first row in ``row_start .. row_end`` that sees ``key`` (``row_end`` when none does). Every later row sees
    it too, and so a block of keys from ``key`` on is seen by no row before this one."""
    if causal:
        return min(row_end, max(row_start, key - diag_offset))
    return row_start
