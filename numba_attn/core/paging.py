"""Where a key of a paged KV cache lies (FlashAttention's layout, ``reference.attention_with_kvcache``).

The pages of a paged cache form a pool ``(num_pages, page_size, kv_heads, headdim)``; the kernels take it viewed as
``(num_pages, kv_heads, page_size, headdim)`` (``decode.kvcache.page_view``, no copy), so that ``cache[page, kv_head]``
is a page's ``(page_size, headdim)`` rows like a dense cache's ``cache[b, kv_head]``. Key ``p`` of batch row ``b`` is
row ``p % page_size`` of page ``block_table[b, p // page_size]``. Only the entries of the keys a row has are read.
"""
from __future__ import annotations

from numba import uint32

from .staging import device_function


@device_function
def page_of(table, b, key, page_size):
    """``(page, row)`` of key ``key`` of batch row ``b``. Keys and page sizes fit 32 bits: unsigned 32-bit division
    (a 64-bit one is a long software sequence)."""
    at = uint32(key) // uint32(page_size)
    return table[b, at], uint32(key) - at * uint32(page_size)
