"""Which blocks of attention a ring step computes: for rank ``rank`` holding the shard of rank ``source``, the
``(query rows, key rows, causal, window)`` of each ``flash_forward`` / ``flash_backward`` call (local positions of
the two shards), from the layout, the causal mask and a sliding window over global positions. The table behind the
unwindowed blocks is in ``ring.py``'s docstring; a window goes through :func:`band_block` per chunk pair.
"""
from __future__ import annotations


def _blocks(rank: int, source: int, length: int, causal: bool, layout: str, window=None, world=None):
    """``(query rows, key rows, causal, window)`` of the flash_forward calls of rank ``rank`` on the shard of
    ``source`` (see the module docstring's table); an empty list when the whole shard is masked. With a ``window``
    (checked: ``(left, right)``, ints >= 0 or None; ``world`` then needed) the blocks come from
    :func:`_window_blocks`; without one each block's window is None."""
    if window is not None:
        return _window_blocks(rank, source, length, causal, layout, window, world)
    everything = slice(0, length)
    if not causal or source < rank and layout == "contiguous":
        return [(everything, everything, False, None)]
    if source == rank:
        return [(everything, everything, True, None)]
    if layout == "contiguous":  # a later rank's keys
        return []
    half = length // 2
    if source < rank:
        return [(everything, slice(0, half), False, None)]
    return [(slice(half, length), everything, False, None)]


def _pieces(rank: int, length: int, layout: str, world: int):
    """``(local start, rows, global start)`` of the chunks of rank ``rank``'s shard (one, or zigzag's two)."""
    if layout == "contiguous":
        return [(0, length, rank * length)]
    half = length // 2
    return [(0, half, rank * half), (half, half, (2 * world - 1 - rank) * half)]


def _window_blocks(rank: int, source: int, length: int, causal: bool, layout: str, window, world: int):
    """The blocks of a windowed call: for each (query chunk, key chunk) pair of the two shards (global positions
    from the layout), the rows and keys that see anything (:func:`band_block`), with the window that reproduces the
    global one there under ``flash_forward``'s bottom-right alignment."""
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    blocks = []
    for q_local, q_rows, q_start in _pieces(rank, length, layout, world):
        for k_local, k_rows, k_start in _pieces(source, length, layout, world):
            # query q_start + i sees key k_start + j iff lo <= j - i <= hi
            lo = None if left is None else q_start - k_start - left
            hi = None if right is None else q_start - k_start + right
            block = band_block(q_rows, k_rows, lo, hi)
            if block is not None:
                (r0, r1), (k0, k1), part_causal, part_window = block
                blocks.append((slice(q_local + r0, q_local + r1), slice(k_local + k0, k_local + k1), part_causal,
                               part_window))
    return blocks


def band_block(rows: int, keys: int, lo, hi):
    """Where query ``i < rows`` sees key ``j < keys`` iff ``lo <= j - i <= hi`` (None: unbounded): ``((r0, r1),
    (k0, k1), causal, window)`` -- the rows that see some key, the keys some row sees, and the ``flash_forward``
    arguments (bottom-right aligned on that sub-block) giving the same band, sides >= 0 (trimming makes them so) or
    None; or None when no query sees any key."""
    r0 = 0 if hi is None else max(0, -hi)
    r1 = rows if lo is None else min(rows, keys - lo)
    if r1 <= r0:
        return None
    k0 = 0 if lo is None else max(0, r0 + lo)
    k1 = keys if hi is None else min(keys, r1 + hi)
    if k1 <= k0:
        return None
    diagonal = (k1 - k0) - (r1 - r0)  # j'' - i'' on the sub-block's bottom-right diagonal
    left = None if lo is None else diagonal - (lo - k0 + r0)
    right = None if hi is None else (hi - k0 + r0) - diagonal
    # a side that bounds no row is dropped: the last row's left edge at or before key 0, the first row's right
    # edge at or after the last key
    left = None if left is not None and left >= k1 - k0 - 1 else left
    right = None if right is not None and right >= r1 - r0 - 1 else right
    causal = right == 0
    window = None if left is None and (right is None or causal) else (left, None if causal else right)
    return (r0, r1), (k0, k1), causal, window
