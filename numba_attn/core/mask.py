"""Which keys a query row sees: the attention masks, written once for every kernel.

Rows and keys are positions in their sequences. A row sees the keys below ``key_end`` (the sequence's keys) and,
when ``causal``, only those on or below the bottom-right aligned diagonal: query ``i`` sees keys ``j <= i +
diag_offset``, ``diag_offset = seqlen_k - seqlen_q`` (a row that sees no key gives 0 and ``lse = -inf``).

Kernels ask five questions, all answered here: is this element hidden (``hidden``; for a whole row of a tile at once:
the keys it sees, ``visible_keys_in``), may a whole key tile skip the
per-element test (``tile_is_partial``; which tiles of a walk may: ``plain_tiles``), where do the keys a block of
rows sees end (``visible_end``, for the block's key range in ``block_info``; how much of a tile they see:
``tile_width``), and -- the backward's key blocks --
where do the rows that see a key begin (``first_row``; under a window also where they end: ``visible_rows``). The
masks are monotone -- a key hidden from a row is hidden from every earlier row, and so is every later key --
so one corner of a tile answers for the whole tile.

Sliding windows (``window=(left, right)``, as ``reference._masks``): query ``i`` sees keys ``i + diag_offset - left
<= j <= i + diag_offset + right``; with ``causal`` the right side is ``min(right, 0)``. A window is a compile-time
pair of sides (``window_sides``: ints, ``UNBOUNDED`` for an open side) given to the builders ``hidden_in``,
``tile_is_partial``, ``plain_tiles``, ``visible_start`` / ``visible_end_in`` and ``visible_rows``, which return a
device function specialised to it; for ``NO_WINDOW`` they return the causal-only functions above unchanged, so
kernels built without a window compile to the code they always did. The left edge adds a clause: a tile is
partial when its first key is hidden from the block's last row, and a block's keys begin at ``visible_start``.
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


@device_function
def first_seeing_row(key, key_end, causal, diag_offset):
    """The first row that sees ``key`` by the causal mask (``-1`` without it, so every row ``>= 0`` does), or a
    number past every row when ``key >= key_end``: ``hidden(key, row, ...)`` is ``row < first_seeing_row(key, ...)``
    -- one compare per element once the key's bound is known (the backward's keys-on-rows fragments)."""
    if key >= key_end:
        return 1 << 62
    if causal:
        return key - diag_offset
    return -1


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


#: a window side without a bound (compile-time sentinel of ``window_sides``)
UNBOUNDED = -1
#: no window: the masks above, and only them
NO_WINDOW = (UNBOUNDED, UNBOUNDED)


def window_sides(window, causal: bool) -> tuple:
    """The compile-time ``(left, right)`` of a checked ``window`` (None or ``(left, right)`` of ints >= 0 or None)
    under ``causal``: ints, ``UNBOUNDED`` for an open side. A right side the causal diagonal already bounds (``right
    >= 0`` with ``causal``) is dropped, so such windows build the causal kernel's code; ``NO_WINDOW`` when no side is
    left."""
    if window is None:
        return NO_WINDOW
    left, right = window
    if right is not None and causal and right >= 0:
        right = None
    return (UNBOUNDED if left is None else int(left), UNBOUNDED if right is None else int(right))


def _check_sides(window) -> tuple:
    left, right = window
    for side in (left, right):
        if type(side) is not int or side < UNBOUNDED:
            raise ValueError(f"window sides: expected ints >= 0 or UNBOUNDED, got {window!r}")
    return left, right


def hidden_in(window=NO_WINDOW):
    """``hidden`` for the compile-time ``window`` (``window_sides``): the same arguments, and also True where
    ``key`` is right of ``row + diag_offset + right`` or left of ``row + diag_offset - left``."""
    left, right = _check_sides(window)
    if window == NO_WINDOW:
        return hidden
    HAS_LEFT, LEFT = left != UNBOUNDED, left
    HAS_RIGHT, RIGHT = right != UNBOUNDED, right

    @device_function
    def hidden_windowed(key, row, key_end, causal, diag_offset):
        if key >= key_end:
            return True
        if causal and key > row + diag_offset:
            return True
        if HAS_RIGHT and key > row + diag_offset + RIGHT:
            return True
        if HAS_LEFT and key < row + diag_offset - LEFT:
            return True
        return False

    return hidden_windowed


#: ``visible_keys``' lower bound for a row without a left side (below every key: keys are positions >= 0)
NO_LOWER_BOUND = -(1 << 30)


def visible_keys_in(window=NO_WINDOW):
    """``keys(row, key_end, causal, diag_offset) -> (lo, hi)``: query ``row`` sees exactly the keys ``lo <= key <
    hi`` -- ``hidden_in(window)`` is ``not lo <= key < hi`` (``lo`` is ``NO_LOWER_BOUND`` without a left side; ``hi
    <= lo`` when it sees none). A kernel that masks a tile row by row computes the two bounds once per row, not the
    clauses per element (``softmax.softmax_step``)."""
    left, right = _check_sides(window)
    HAS_LEFT, LEFT = left != UNBOUNDED, left
    HAS_RIGHT, RIGHT = right != UNBOUNDED, right
    LOWEST = NO_LOWER_BOUND

    @device_function
    def keys(row, key_end, causal, diag_offset):
        hi = key_end
        if causal:
            hi = min(hi, row + diag_offset + 1)
        if HAS_RIGHT:
            hi = min(hi, row + diag_offset + RIGHT + 1)
        lo = LOWEST
        if HAS_LEFT:
            lo = row + diag_offset - LEFT
        return lo, hi

    return keys


def tile_is_partial(block_n: int, block_m: int = 0, window=NO_WINDOW):
    """``partial(n0, m0, key_end, causal, diag_offset)``: True when some key of the tile ``n0 .. n0 + block_n - 1``
    is hidden from some row of ``m0 .. m0 + block_m - 1`` (right side: its last key from the first row; a window's
    left side: its first key from the last row): only such tiles need the element test. ``block_m`` is needed with
    a left side only."""
    left, right = _check_sides(window)
    BLOCK_N = block_n
    if window == NO_WINDOW:
        @device_function
        def partial(n0, m0, key_end, causal, diag_offset):
            crosses = n0 + BLOCK_N > key_end
            if causal:
                crosses = crosses or (n0 + BLOCK_N - 1 > m0 + diag_offset)
            return crosses

        return partial
    if left != UNBOUNDED and block_m < 1:
        raise ValueError("tile_is_partial: a window's left side needs block_m")
    LAST_ROW = block_m - 1
    HAS_LEFT, LEFT = left != UNBOUNDED, left
    HAS_RIGHT, RIGHT = right != UNBOUNDED, right

    @device_function
    def partial_windowed(n0, m0, key_end, causal, diag_offset):
        crosses = n0 + BLOCK_N > key_end
        if causal:
            crosses = crosses or (n0 + BLOCK_N - 1 > m0 + diag_offset)
        if HAS_RIGHT:
            crosses = crosses or (n0 + BLOCK_N - 1 > m0 + diag_offset + RIGHT)
        if HAS_LEFT:
            crosses = crosses or (n0 < m0 + LAST_ROW + diag_offset - LEFT)
        return crosses

    return partial_windowed


def plain_tiles(block_n: int, block_m: int = 0, window=NO_WINDOW):
    """``plain(n_first, n_tiles, m0, key_end, causal, diag_offset) -> (first, end)``: the key tiles ``j`` of a walk
    (tile ``j`` starts at key ``n_first + j * block_n``; ``0 <= j < n_tiles``) that ``tile_is_partial`` passes for
    rows ``m0 .. m0 + block_m - 1`` are exactly ``first <= j < end``, ``0 <= first <= end <= n_tiles``: the masks are
    monotone, so the partial tiles sit at the two ends of a walk. A kernel runs that range in a loop of its own
    whose softmax has no mask code: given the per-tile flag, ptxas predicated the mask's per-element compares into
    every tile (a third of the warp-specialised forward's instructions, all predicated off). ``block_m`` is needed
    with a left side only."""
    left, right = _check_sides(window)
    if left != UNBOUNDED and block_m < 1:
        raise ValueError("plain_tiles: a window's left side needs block_m")
    BLOCK_N = block_n
    LAST_ROW = block_m - 1
    HAS_LEFT, LEFT = left != UNBOUNDED, left
    HAS_RIGHT, RIGHT = right != UNBOUNDED, right

    @device_function
    def plain(n_first, n_tiles, m0, key_end, causal, diag_offset):
        # tile j ends at or below key_end when n_first + (j + 1) * BLOCK_N <= key_end; floor division, so a
        # negative numerator gives a negative bound (clamped to 0)
        end = min(n_tiles, max(0, (key_end - n_first) // BLOCK_N))
        if causal:  # its last key on or below the first row's diagonal
            end = min(end, max(0, (m0 + diag_offset + 1 - n_first) // BLOCK_N))
        if HAS_RIGHT:
            end = min(end, max(0, (m0 + diag_offset + RIGHT + 1 - n_first) // BLOCK_N))
        first = 0
        if HAS_LEFT:  # its first key seen by the last row: j >= ceil((that row's left edge - n_first) / BLOCK_N)
            first = min(n_tiles, max(0, -((n_first - (m0 + LAST_ROW + diag_offset - LEFT)) // BLOCK_N)))
        # (never past the walk: a kernel's loop up to ``first`` would wait for tiles that never come)
        return first, max(end, first)

    return plain


def narrow_widths(block_n: int, k_step: int) -> tuple:
    """The narrower widths (keys, ascending) a kernel may compute a key tile at where the keys its rows see end
    inside the tile (``tile_width``): 64 and 128 below ``block_n`` from 96-key tiles up, else half the tile where
    that is whole MMA k-steps of ``k_step`` keys; ``()`` for none."""
    if block_n >= 96:
        return tuple(w for w in (64, 128) if w < block_n)
    half = block_n // 2
    return (half,) if half >= k_step and half % k_step == 0 else ()


def may_narrow(causal: bool, window: tuple, packed: bool, seqlen_k: int, block_n: int) -> bool:
    """Whether a call may meet a key tile that ``tile_width`` narrows: under a causal mask, a window (``window``: its
    sides, ``NO_WINDOW`` for none) or packed sequences, or where ``block_n`` does not divide the keys. (Host side: a
    kernel built without narrow tiles is the code before them, which the calls that meet none keep.)"""
    return bool(causal) or tuple(window) != NO_WINDOW or bool(packed) or seqlen_k % block_n != 0


def tile_width(block_n: int, widths: tuple):
    """``code(n0, key_limit) -> int``: the width tile ``n0 .. n0 + block_n - 1`` needs when no row of the caller's
    sees key ``key_limit`` or a later one (``visible_keys_in``'s ``hi`` of its last row): 0 when no key of the tile
    is seen, ``i`` for ``widths[i - 1]`` (``narrow_widths``: at most two, ascending, multiples of 8 below
    ``block_n``), ``len(widths) + 1`` for the whole tile. The masks are monotone, so a walk's codes after a tile
    narrower than the whole are all 0."""
    if len(widths) > 2 or list(widths) != sorted(set(widths)) or any(w % 8 or not 0 < w < block_n for w in widths):
        raise ValueError(f"widths: at most two ascending multiples of 8 below block_n={block_n}, got {widths}")
    BLOCK_N = block_n
    FULL = len(widths) + 1
    FIRST = widths[0] if widths else block_n
    SECOND = widths[1] if len(widths) > 1 else block_n

    @device_function
    def code(n0, key_limit):
        seen = key_limit - n0
        if seen >= BLOCK_N:
            return FULL
        if seen <= 0:
            return 0
        if seen <= FIRST:  # (no widths: FIRST is the tile, code 1 the whole)
            return 1
        if seen <= SECOND:
            return 2
        return FULL

    return code


def visible_end_in(window=NO_WINDOW):
    """``visible_end`` for the compile-time ``window``: a right side ends the keys at ``row_end + diag_offset +
    right`` too."""
    left, right = _check_sides(window)
    if right == UNBOUNDED:
        return visible_end
    RIGHT = right

    @device_function
    def visible_end_windowed(row_end, key_start, key_end, causal, diag_offset):
        end = row_end + diag_offset + RIGHT
        if causal:
            end = min(end, row_end + diag_offset)
        return min(key_end, max(key_start, end))

    return visible_end_windowed


def visible_start(window=NO_WINDOW):
    """``start(row_start, key_start, key_end, diag_offset)``: the first key that any row from ``row_start`` on sees
    (``key_start`` without a left side; at most ``key_end``)."""
    left, right = _check_sides(window)
    LEFT = left
    if left == UNBOUNDED:
        @device_function
        def start_unbounded(row_start, key_start, key_end, diag_offset):
            return key_start

        return start_unbounded

    @device_function
    def start_windowed(row_start, key_start, key_end, diag_offset):
        return min(key_end, max(key_start, row_start + diag_offset - LEFT))

    return start_windowed


def visible_rows(window=NO_WINDOW):
    """``rows(key, key_last, row_start, row_end, causal, diag_offset) -> (first, end)``: the rows of ``row_start ..
    row_end`` that see some key of ``key .. key_last`` (inclusive) under the compile-time ``window`` are ``first ..
    end`` (none when ``first >= end``): the backward's key blocks walk only them. The right side (and ``causal``)
    bounds the first row by the first key, the left side the last row by the last key. Without a window:
    ``(first_row(...), row_end)``."""
    left, right = _check_sides(window)
    if window == NO_WINDOW:
        @device_function
        def rows_causal(key, key_last, row_start, row_end, causal, diag_offset):
            return first_row(key, row_start, row_end, causal, diag_offset), row_end

        return rows_causal
    HAS_LEFT, LEFT = left != UNBOUNDED, left
    HAS_RIGHT, RIGHT = right != UNBOUNDED, right

    @device_function
    def rows_windowed(key, key_last, row_start, row_end, causal, diag_offset):
        first = row_start
        if causal:
            first = max(first, key - diag_offset)
        if HAS_RIGHT:
            first = max(first, key - diag_offset - RIGHT)
        end = row_end
        if HAS_LEFT:
            end = min(end, key_last + 1 - diag_offset + LEFT)
        return min(first, row_end), end

    return rows_windowed
