"""The real-batch layouts of the varlen, paged and window sweeps: mixed sequence lengths and their offsets, ragged
cache lengths, paged KV caches with pages in a shuffled order, and the key-query pairs a sliding window keeps.

Host-side pieces are NumPy; :func:`paged_cache` works on the environment's arrays (NumPy, CuPy or torch), as
FlashAttention lays a paged cache out: pools ``(num_pages, page_size, kv_heads, headdim)`` and an int32
``block_table (batch, max_pages)``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .environment import Env


def mixed_lengths(mean: int, count: int, seed: int = 0) -> tuple:
    """``count`` lengths ``(2i + 1) * mean / count`` (i < count, rounded): evenly spread over ``[mean / count,
    2 mean - mean / count]``, mean ``mean``; in an order shuffled by ``seed``, as a packed batch arrives (neither
    sorted by length nor the longest first)."""
    lengths = [max(1, round((2 * i + 1) * mean / count)) for i in range(count)]
    order = np.random.default_rng(seed).permutation(count)
    return tuple(int(lengths[i]) for i in order)


def cu_seqlens(lengths) -> np.ndarray:
    """``[0, len_0, len_0 + len_1, ..., total]`` as int32 (FlashAttention's offsets)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def ragged_lengths(capacity: int, batch: int) -> tuple:
    """Valid keys of each row of a ragged cache: ``capacity / 2 + b * capacity / (2 batch)``, evenly spread over
    ``[capacity / 2, capacity)``; row 0, the one the check reads, is the shortest (its unused keys are the most)."""
    return tuple(capacity // 2 + b * capacity // (2 * batch) for b in range(batch))


def window_pairs(seqlen: int, window: int) -> int:
    """Query-key pairs a causal window ``(window, 0)`` keeps: row ``i`` sees ``min(i, window) + 1`` keys."""
    full = min(seqlen, window + 1)  # rows 0 .. window see i + 1 keys
    return full * (full + 1) // 2 + (seqlen - full) * (window + 1)


def paged_cache(env: Env, k, v, page_size: int, seed: int = 0) -> tuple:
    """``(k_pool, v_pool, block_table)``: the dense cache ``(batch, kv_heads, capacity, headdim)`` as pages of
    ``page_size`` keys in a shuffled order (fixed by ``seed``), so a kernel that ignored the table would read
    another row's keys. ``capacity`` must be a multiple of ``page_size``. Made outside the timed region."""
    batch, kv_heads, capacity, head_dim = k.shape
    if capacity % page_size:
        raise ValueError(f"capacity {capacity} is not a multiple of the page size {page_size}")
    max_pages = capacity // page_size
    order = np.random.default_rng(seed).permutation(batch * max_pages)  # logical page -> physical page
    gather = env.from_numpy(np.argsort(order).astype(np.int64))  # physical page -> logical page
    pools = []
    for dense in (k, v):
        # (B, Hk, L, D) -> (B, L, Hk, D) -> logical pages (B * max_pages, page, Hk, D), then in physical order
        logical = dense.swapaxes(1, 2).reshape(batch * max_pages, page_size, kv_heads, head_dim)
        pools.append(logical[gather])
        del logical
    table = env.from_numpy(order.reshape(batch, max_pages).astype(np.int32))
    return pools[0], pools[1], table
