"""Sliding windows in numba_attn.flash_forward against reference.attention(..., window=...): the SIMT kernel here
(the tensor-core kernels: test_flash_variants.py), the argument checks and the shared tile predicates.

Query ``i`` sees keys ``i' - left <= j <= i' + right``, ``i' = i + seqlen_k - seqlen_q`` (None: unbounded; causal:
``right = min(right, 0)``). Tiny shapes run under the CUDA simulator (tiles of 8 rows / 8 keys there, so lengths
1..40 reach tiles the window skips, cuts and covers); outputs start as NaN so an unwritten element fails. The block
range and the tile predicates (``core.block_info.key_tile_range``, ``core.mask``) are checked in pure Python
against ``reference``'s band, element by element. Realistic sizes on a GPU: test_flash_variants.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, assert_close_lse, rel_error
from numba_attn.core import block_info, mask
from numba_attn.forward import dispatch
from reference._masks import mask_band

WINDOWS = [(0, 0), (3, None), (None, 2), (2, 5)]


def _inputs(seed, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, heads, seqlen_q, head_dim)).astype(dtype)
    k = rng.standard_normal((1, kv_heads, seqlen_k, head_dim)).astype(dtype)
    v = rng.standard_normal((1, kv_heads, seqlen_k, head_dim)).astype(dtype)
    return q, k, v


# (seqlen_q, seqlen_k, head_dim, dtype, kv_heads, window, causal): every window with and without causal, Lq = Lk,
# Lq < Lk and Lq > Lk, GQA 2:1, rows whose window holds no key (Lq > Lk, or a narrow window pushed off the keys)
CASES = [
    (40, 40, 16, "float32", 2, (0, 0), False),
    (13, 29, 16, "float32", 1, (0, 0), True),
    (40, 3, 16, "float16", 2, (0, 0), False),  # rows 0..36 see no key
    (17, 33, 8, "float16", 1, (3, None), False),
    (29, 13, 8, "float16", 2, (3, None), True),  # Lq > Lk: the first 16 rows see nothing
    (1, 40, 8, "float32", 2, (3, None), True),
    (33, 17, 8, "float32", 2, (None, 2), True),
    (40, 40, 8, "float16", 2, (None, 2), False),
    (9, 9, 16, "float32", 1, (None, 2), False),
    (24, 40, 16, "float16", 1, (2, 5), True),
    (40, 24, 8, "float32", 1, (2, 5), False),
    (5, 5, 8, "float32", 2, (2, 5), False),
]


@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim,dtype,kv_heads,window,causal", CASES)
def test_window_matches_reference(poisoned_outputs, seqlen_q, seqlen_k, head_dim, dtype, kv_heads, window, causal):
    q, k, v = _inputs(seqlen_q * 41 + seqlen_k, 2, kv_heads, seqlen_q, seqlen_k, head_dim, dtype)
    out, lse = numba_attn.flash_forward(q, k, v, causal=causal, window=window, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, window=window, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_error(out, ref) < TOLERANCE[dtype]
    assert_close_lse(lse, ref_lse)
    empty = np.isneginf(ref_lse)  # rows whose window holds no key: exactly 0 and -inf
    assert (out[empty] == 0).all()


def test_empty_windows_give_zero_and_minus_inf(poisoned_outputs):
    # window (0, 0) with seqlen_q > seqlen_k: query i sees key i - 30 only, so rows 0..29 see nothing
    q, k, v = _inputs(3, 2, 2, 40, 10, 8, "float32")
    out, lse = numba_attn.flash_forward(q, k, v, window=(0, 0), return_lse=True)
    assert (out[:, :, :30] == 0).all() and np.isneginf(lse[:, :, :30]).all()
    ref, ref_lse = reference.attention(q, k, v, window=(0, 0), return_lse=True)
    assert rel_error(out, ref) < TOLERANCE["float32"]
    assert_close_lse(lse, ref_lse)


def test_unbounded_window_is_no_window():
    # (None, None) builds the kernel without a window (mask.window_sides): bitwise the plain call
    q, k, v = _inputs(4, 2, 1, 11, 19, 8, "float32")
    for causal in (False, True):
        plain = numba_attn.flash_forward(q, k, v, causal=causal, backend="simt")  # (on a GPU float32 takes tf32)
        unbounded = numba_attn.flash_forward(q, k, v, causal=causal, window=(None, None), backend="simt")
        np.testing.assert_array_equal(unbounded, plain)
        # with causal, a right side >= 0 is the diagonal's already
        if causal:
            np.testing.assert_array_equal(
                numba_attn.flash_forward(q, k, v, causal=True, window=[None, 7], backend="simt"), plain)


def test_window_with_allow_tf32_takes_the_tf32_kernel():
    # under the simulator float32 with allow_tf32 picks "mma" (one tf32 term), windows included
    assert dispatch.choose_backend(None, "float32", allow_tf32=True) == "mma"
    q, k, v = _inputs(5, 2, 2, 10, 12, 8, "float32")
    out = numba_attn.flash_forward(q, k, v, window=(2, 1), allow_tf32=True)
    assert rel_error(out, reference.attention(q, k, v, window=(2, 1))) < 2e-3  # one tf32 product: ~1e-3


@pytest.mark.parametrize("window,error", [
    (3, TypeError), ("ab", TypeError), ({0: 1}, TypeError), ((1,), ValueError), ((1, 2, 3), ValueError),
    ((-1, 0), ValueError), ((0, -2), ValueError), ((True, 0), TypeError), ((0, np.bool_(False)), TypeError),
    ((0, 1.5), TypeError), ((0.0, None), TypeError),
])
def test_bad_windows_raise(window, error):
    q, k, v = _inputs(7, 1, 1, 3, 3, 8, "float32")
    with pytest.raises(error, match="^window"):
        numba_attn.flash_forward(q, k, v, window=window)
    with pytest.raises(error):  # the reference refuses the same values
        reference.attention(q, k, v, window=window)


def test_numpy_integer_sides_are_taken():
    q, k, v = _inputs(8, 1, 1, 6, 6, 8, "float32")
    out = numba_attn.flash_forward(q, k, v, window=(np.int64(1), np.int32(0)))
    assert rel_error(out, reference.attention(q, k, v, window=(1, 0))) < TOLERANCE["float32"]


# ---- the building blocks in pure Python (device functions are plain functions under the simulator) ----------------
BLOCK_M, BLOCK_N = 8, 8


@pytest.mark.parametrize("window", WINDOWS + [(None, None), (0, None), (None, 0), (17, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(64, 64), (23, 61), (61, 23), (1, 40), (40, 1)])
@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="calls the device functions from Python: simulator only")
def test_block_range_skips_tiles_outside_the_window(window, causal, seqlen_q, seqlen_k):
    """Each query block visits exactly the key tiles that hold a key one of its rows sees -- tiles wholly outside
    the window are never visited -- and a tile the predicate calls whole is seen entirely by every row."""
    sides = mask.window_sides(window, causal)
    key_range = block_info.key_tile_range(BLOCK_M, BLOCK_N, sides)
    walk = block_info.key_tile_walk(BLOCK_M, BLOCK_N, sides)
    partial = mask.tile_is_partial(BLOCK_N, BLOCK_M, sides)
    hidden = mask.hidden_in(sides)
    band = mask_band(causal, window)
    diag = seqlen_k - seqlen_q
    visited_total = 0
    for m0 in range(0, seqlen_q, BLOCK_M):
        # the block's rows, those past seqlen_q included (the kernel computes them; it writes no such row)
        rows = np.arange(m0, m0 + BLOCK_M)
        block_visible = band.visible(rows, np.arange(seqlen_k), seqlen_q, seqlen_k)
        n_begin, n_end = key_range(m0, 0, seqlen_k, causal, diag)
        visited = set(range(n_begin, n_end, BLOCK_N))
        n_first, n_tiles = walk(m0, 0, seqlen_k, causal, diag)  # the tensor-core kernels' count of the same tiles
        assert set(range(n_first, n_first + max(n_tiles, 0) * BLOCK_N, BLOCK_N)) == visited
        needed = {n0 for n0 in range(0, seqlen_k, BLOCK_N) if block_visible[:, n0:n0 + BLOCK_N].any()}
        assert visited == needed, (m0, sorted(visited), sorted(needed))
        visited_total += len(visited)
        for n0 in visited:
            keys = np.arange(n0, n0 + BLOCK_N)
            # the element predicate is the band (rows past seqlen_q and keys past seqlen_k included)
            expect = band.visible(rows, keys, seqlen_q, seqlen_k) & (keys < seqlen_k)[None, :]
            got = ~np.array([[hidden(j, i, seqlen_k, causal, diag) for j in keys] for i in rows])
            np.testing.assert_array_equal(got, expect)
            if not partial(n0, m0, seqlen_k, causal, diag):
                assert expect.all(), (m0, n0)
    if band.left is not None and band.left <= 3 and band.right is not None and seqlen_q == seqlen_k == 64:
        # a narrow window: each block sees at most 2 or 3 of the 8 tiles, not all up to the diagonal
        assert visited_total <= 3 * (seqlen_q // BLOCK_M)


@pytest.mark.parametrize("window", WINDOWS + [(None, None), (0, None), (None, 0), (17, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_n,block_m", [(8, 8), (16, 4), (5, 3)])
@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="calls the device functions from Python: simulator only")
def test_plain_tiles_are_the_tiles_no_mask_touches(window, causal, block_n, block_m):
    """``plain_tiles`` gives exactly the tiles of a walk that ``tile_is_partial`` passes, for walks starting
    anywhere (packed sequences start at any key), any number of tiles, rows and key ends."""
    sides = mask.window_sides(window, causal)
    partial = mask.tile_is_partial(block_n, block_m, sides)
    plain = mask.plain_tiles(block_n, block_m, sides)
    for key_end in (0, 1, 29, 40):
        for diag in (-9, 0, 11):
            for m0 in range(-3, 40, 7):
                for n_first in (0, 3, 16, 37):
                    for n_tiles in (0, 1, 4, 9):
                        first, end = plain(n_first, n_tiles, m0, key_end, causal, diag)
                        assert 0 <= first <= end <= n_tiles  # (a kernel loops up to first and from end)
                        expect = [j for j in range(n_tiles)
                                  if not partial(n_first + j * block_n, m0, key_end, causal, diag)]
                        assert list(range(first, end)) == expect, (key_end, diag, m0, n_first, n_tiles)


@pytest.mark.parametrize("window", WINDOWS + [(None, None), (0, None), (None, 0), (17, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="calls the device functions from Python: simulator only")
def test_visible_keys_are_the_keys_hidden_does_not_hide(window, causal):
    """``visible_keys_in``' row bounds (what the softmax masks by) say exactly what ``hidden_in`` says per key."""
    sides = mask.window_sides(window, causal)
    visible = mask.visible_keys_in(sides)
    hidden = mask.hidden_in(sides)
    for key_end in (0, 1, 29):
        for diag in (-9, 0, 11):
            for row in range(-3, 40, 5):
                lo, hi = visible(row, key_end, causal, diag)
                assert lo == mask.NO_LOWER_BOUND or sides[0] != mask.UNBOUNDED
                for key in range(-2, 45):
                    assert (lo <= key < hi) == (not hidden(key, row, key_end, causal, diag)), (row, key, lo, hi)


@pytest.mark.parametrize("window", WINDOWS + [(None, None), (17, 3)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_n, k_step", [(32, 16), (64, 32), (128, 16), (224, 32), (16, 16)])
@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="calls the device functions from Python: simulator only")
def test_tile_width_covers_every_key_a_row_sees(window, causal, block_n, k_step):
    """``tile_width``'s code for a tile and a block of 64 rows names a width of ``narrow_widths`` (or the whole tile,
    or none) that holds every key of the tile some row sees (``hidden_in``), from the keys the last row sees
    (``visible_keys_in``; the masks are monotone) -- the narrowest such where no left side hides keys (a walk starts
    where the left side lets it: ``block_info``)."""
    sides = mask.window_sides(window, causal)
    widths = mask.narrow_widths(block_n, k_step)
    assert all(w % k_step == 0 and 0 < w < block_n for w in widths)
    code_of = mask.tile_width(block_n, widths)
    visible = mask.visible_keys_in(sides)
    hidden = mask.hidden_in(sides)
    choices = (0, *widths, block_n)
    for key_end in (0, 37, 300):
        for diag in (-70, 0, 11):
            for m0 in (-3, 0, 50, 64, 128, 192, 209):  # (with n0 below: keys seen ending on a width, and not)
                limit = visible(m0 + 63, key_end, causal, diag)[1]
                for n0 in range(0, 320, 64):
                    seen = [key - n0 for key in range(n0, n0 + block_n)
                            if any(not hidden(key, row, key_end, causal, diag) for row in range(m0, m0 + 64))]
                    width = choices[code_of(n0, limit)]
                    needed = max(seen) + 1 if seen else 0
                    assert width >= needed, (m0, n0, seen, width)
                    if sides[0] == mask.UNBOUNDED:
                        assert all(w < needed for w in choices if w < width), (m0, n0, seen, width)
    with pytest.raises(ValueError, match="widths"):
        mask.tile_width(64, (64,))


def test_calls_that_may_meet_a_narrow_tile():
    none = mask.NO_WINDOW
    assert not mask.may_narrow(False, none, False, 4096, 128)  # whole tiles only: the kernel before narrow tiles
    assert mask.may_narrow(False, none, False, 4096, 224)  # a last tile of 64 keys
    assert mask.may_narrow(True, none, False, 4096, 128)  # the diagonal
    assert mask.may_narrow(False, mask.window_sides((16, 0), False), False, 4096, 128)
    assert mask.may_narrow(False, none, True, 4096, 128)  # packed sequences end anywhere


def test_window_sides():
    assert mask.window_sides(None, False) == mask.NO_WINDOW
    assert mask.window_sides((None, None), True) == mask.NO_WINDOW
    assert mask.window_sides((None, 4), True) == mask.NO_WINDOW  # the diagonal bounds it already
    assert mask.window_sides((3, 0), True) == (3, mask.UNBOUNDED)
    assert mask.window_sides((3, 2), False) == (3, 2)
    # without a window the builders give the causal-only functions (what the kernels compiled before windows)
    assert mask.hidden_in(mask.NO_WINDOW) is mask.hidden
    assert mask.visible_end_in(mask.NO_WINDOW) is mask.visible_end


# ---- on a GPU (realistic sizes on every kernel: test_flash_variants.py) -----------------------------------------------
@pytest.mark.gpu
def test_gpu_replayed_calls_keep_their_window():
    # CuPy calls replay recorded plans (runtime.replay): the window is part of a plan's key
    import cupy

    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 2, 300, 64)).astype("float16") for _ in range(3))
    dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
    for _ in range(2):
        for window in [(16, 0), [16, 0], (64, 8), None]:
            out = numba_attn.flash_forward(dq, dk, dv, window=window)
            ref = reference.attention(q, k, v, window=None if window is None else tuple(window))
            assert rel_error(out.get(), ref) < TOLERANCE["float16"]
