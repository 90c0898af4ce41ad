"""Attention over real batches: packed sequences of different lengths, and KV caches (dense or paged).

Two ways to hold a batch whose sequences have different lengths, both FlashAttention's:

* Packed (:func:`attention_varlen`, as ``flash_attn_varlen_func``): the tokens of all sequences one after the
  other, ``q`` of shape ``(total_q, heads, headdim)``, ``k`` and ``v`` of ``(total_k, kv_heads, headdim)``.
  Sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
  of ``k`` and ``v``: ``cu_seqlens`` are the cumulative lengths ``[0, len_0, len_0 + len_1, ..., total]``.
* KV cache (:func:`attention_with_kvcache`, as ``flash_attn_with_kvcache`` without appending new keys): queries
  ``(batch, heads, seqlen_q, headdim)`` in this package's layout, and for each batch row ``b`` a cache of which only
  the first ``cache_seqlens[b]`` keys are valid. The cache is dense, ``(batch, kv_heads, max_seqlen_k, headdim)``,
  or paged: a pool of pages ``(num_pages, page_size, kv_heads, headdim)`` and a ``block_table`` ``(batch,
  max_pages)`` whose entry ``[b, p]`` is the page holding key positions ``p * page_size ... (p + 1) * page_size - 1``
  of row ``b`` (FlashAttention's paged layout; pages may be in any order and shared between rows).

Each sequence is an independent attention problem with the conventions of :mod:`reference.attention`, applied to
its own lengths: the causal mask and the window are aligned bottom-right within the sequence (query ``i`` of a
sequence with ``seqlen_q`` queries and ``seqlen_k`` keys sits at key position ``i + seqlen_k - seqlen_q``),
grouped-query heads (``heads`` a multiple of ``kv_heads``), ``softcap``, and a row that sees no key (an empty
sequence of keys, a window wholly before key 0) has output 0 and ``lse = -inf``. Keys outside a sequence, past
``cache_seqlens`` or in pages a row does not read never affect it, whatever they hold. Results are float64.
"""

from __future__ import annotations

import numbers

import numpy as np

from ._masks import check_softcap, check_window, mask_band
from ._shapes import ArgumentTypeError, check_flag, resolve_sm_scale, to_float64
from .attention import _masked_attention
from .attention_backward import attention_backward

__all__ = ["attention_varlen", "attention_varlen_backward", "attention_with_kvcache"]


def _sequence_attention(q, k, v, band, sm_scale, softcap):
    """Attention of one sequence, ``q`` ``(heads, seqlen_q, headdim)``, ``k``, ``v`` ``(kv_heads, seqlen_k,
    headdim)``, masked by ``band`` at its own lengths. Returns ``(out, lse)`` of ``(heads, seqlen_q, headdim)`` and
    ``(heads, seqlen_q)``."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    visible = band.visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k)
    out, lse = _masked_attention(q[None], k[None], v[None], visible, sm_scale, softcap)
    return out[0], lse[0]


def _check_options(causal, sm_scale, window, softcap, return_lse, headdim):
    """Checked ``(band, sm_scale, softcap, return_lse)``, as :func:`reference.attention` checks them."""
    band = mask_band(check_flag(causal, "causal"), check_window(window))
    return band, resolve_sm_scale(sm_scale, headdim), check_softcap(softcap), check_flag(return_lse, "return_lse")


def _check_heads(heads, kv_heads, what):
    """Grouped-query heads: ``heads`` a multiple of ``kv_heads`` (``what``: the key/value arrays' names)."""
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"q heads ({heads}) must be a multiple of {what} heads ({kv_heads}) for grouped-query "
                         "attention")


def _integer_array(value, name, meaning):
    """``value`` as an int64 array if it holds integers (not bools, not floats); a ValueError naming it otherwise."""
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name} must be an integer array ({meaning}); got dtype {array.dtype}")
    return array.astype(np.int64)


def _check_cu_seqlens(cu_seqlens, name, total, array_name):
    """``cu_seqlens`` as int64 offsets ``[0, ..., total]``, non-decreasing; a ValueError naming it otherwise."""
    offsets = _integer_array(cu_seqlens, name, "cumulative sequence lengths")
    if offsets.ndim != 1 or offsets.size < 1:
        raise ValueError(f"{name} must be a 1-d array of batch + 1 offsets; got shape {offsets.shape}")
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0; got {offsets.tolist()}")
    if (np.diff(offsets) < 0).any():
        raise ValueError(f"{name} must be non-decreasing; got {offsets.tolist()}")
    if offsets[-1] != total:
        raise ValueError(f"{name} must end at {array_name}'s number of tokens ({total}); got {offsets.tolist()}")
    return offsets


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, sm_scale=None, window=None,
                     softcap=None, return_lse=False):
    """Attention of a batch of packed sequences of different lengths (FlashAttention's varlen layout).

    Args:
        q: ``(total_q, heads, headdim)``, the queries of all sequences one after the other.
        k, v: ``(total_k, kv_heads, headdim)``, likewise; ``heads`` must be a multiple of ``kv_heads``.
        cu_seqlens_q, cu_seqlens_k: integer arrays of ``batch + 1`` offsets, starting at 0, non-decreasing, ending at
            ``total_q`` and ``total_k``: sequence ``b`` is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` against
            ``k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``. Sequences may be empty; both give the same ``batch``.
        causal, sm_scale, window, softcap: as for :func:`reference.attention`, each sequence aligned bottom-right
            at its own lengths.
        return_lse: also return the natural-log lse.

    Returns:
        ``out`` of shape ``(total_q, heads, headdim)``, or ``(out, lse)`` with ``lse`` of shape ``(heads,
        total_q)`` (FlashAttention's varlen lse layout). Each sequence's rows equal :func:`reference.attention` of
        that sequence alone; rows that see no key have ``out = 0`` and ``lse = -inf``.
    """
    q, k, v = to_float64(q, "q"), to_float64(k, "k"), to_float64(v, "v")
    for name, array in (("q", q), ("k", k), ("v", v)):
        if array.ndim != 3:
            raise ValueError(f"{name} must have shape (total_tokens, heads, headdim); got shape {array.shape}")
    if q.shape[2] < 1:
        raise ValueError(f"q must have headdim >= 1; got shape {q.shape}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k has headdim {k.shape[2]} but q has headdim {q.shape[2]}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {k.shape}; got shape {v.shape}")
    _check_heads(q.shape[1], k.shape[1], "k/v")
    band, sm_scale, softcap, return_lse = _check_options(causal, sm_scale, window, softcap, return_lse, q.shape[2])
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "q")
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], "k")
    if cu_k.size != cu_q.size:
        raise ValueError(f"cu_seqlens_k describes {cu_k.size - 1} sequences but cu_seqlens_q {cu_q.size - 1}")

    out = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(cu_q.size - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        # (tokens, heads, headdim) -> (heads, tokens, headdim), this package's layout
        out_b, lse_b = _sequence_attention(*(x.transpose(1, 0, 2) for x in (q[rows], k[keys], v[keys])),
                                           band, sm_scale, softcap)
        out[rows], lse[:, rows] = out_b.transpose(1, 0, 2), lse_b
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, sm_scale=None,
                              window=None, softcap=None):
    """Gradients of :func:`attention_varlen`'s output: ``(dq, dk, dv)`` of the shapes of ``q``, ``k``, ``v``, float64.

    ``dout`` has the output's shape ``(total_q, heads, headdim)``; the other arguments are :func:`attention_varlen`'s.
    Each sequence's gradients are :func:`reference.attention_backward` of that sequence alone (``dk``, ``dv`` summed
    over each kv head's group of query heads); keys of a sequence without queries get ``dk = dv = 0``, rows that
    see no key ``dq = 0``.
    """
    q, k, v = to_float64(q, "q"), to_float64(k, "k"), to_float64(v, "v")
    attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, sm_scale=sm_scale, window=window,
                     softcap=softcap)  # the same argument checks, and the same errors
    dout = to_float64(dout, "dout")
    if dout.shape != q.shape:
        raise ValueError(f"dout must have the output's shape {q.shape}; got shape {dout.shape}")
    cu_q = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], "q")
    cu_k = _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], "k")
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(cu_q.size - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        # (tokens, heads, headdim) -> (1, heads, tokens, headdim), and back
        grads = attention_backward(*(x.transpose(1, 0, 2)[None] for x in (dout[rows], q[rows], k[keys], v[keys])),
                                   causal=causal, sm_scale=sm_scale, window=window, softcap=softcap)
        for full, part, where in zip((dq, dk, dv), grads, (rows, keys, keys)):
            full[where] = part[0].transpose(1, 0, 2)
    return dq, dk, dv


def _check_cache_seqlens(cache_seqlens, batch, capacity):
    """Valid key counts per batch row, ``(batch,)`` int64 in ``[0, capacity]``; None: the whole capacity."""
    if cache_seqlens is None:
        return np.full(batch, capacity, dtype=np.int64)
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
        cache_seqlens = np.full(batch, cache_seqlens)
    lengths = _integer_array(cache_seqlens, "cache_seqlens", "valid keys per batch row")
    if lengths.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},); got shape {lengths.shape}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > capacity):
        raise ValueError(f"cache_seqlens must lie in [0, {capacity}] (the cache's capacity); got {lengths.tolist()}")
    return lengths


def _check_block_table(block_table, batch):
    """``block_table`` as an int64 ``(batch, max_pages)`` array; a ValueError naming it otherwise."""
    table = _integer_array(block_table, "block_table", "page indices")
    if table.ndim != 2 or table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch, max_pages) with batch {batch}; got shape {table.shape}")
    return table


def _pages_read(block_table, b, length, page_size):
    """The entries of ``block_table`` row ``b`` that hold its keys ``0 .. length - 1``."""
    return block_table[b, : -(-length // page_size)]


def _check_pages_read(block_table, cache_seqlens, page_size, num_pages):
    """Every page a row reads must be a page of the cache; the entries past them are never read."""
    for b, length in enumerate(cache_seqlens):
        read = _pages_read(block_table, b, length, page_size)
        bad = (read < 0) | (read >= num_pages)
        if bad.any():
            p = int(np.argmax(bad))
            raise ValueError(f"block_table[{b}, {p}] = {read[p]} is not a page of k_cache (0 <= page < {num_pages})")


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, causal=False,
                           sm_scale=None, window=None, softcap=None, return_lse=False):
    """Attention of queries against a KV cache, dense or paged, each batch row seeing its own number of keys.

    Layouts (``q`` and the dense cache are this package's ``(batch, heads, seqlen, headdim)``; the paged cache is
    FlashAttention's)::

        q                        (batch, heads, seqlen_q, headdim)
        dense  k_cache, v_cache  (batch, kv_heads, max_seqlen_k, headdim)    block_table None
        paged  k_cache, v_cache  (num_pages, page_size, kv_heads, headdim)   block_table (batch, max_pages)

    Key position ``p`` of row ``b`` is ``k_cache[b, :, p]`` (dense) or ``k_cache[block_table[b, p // page_size],
    p % page_size]`` (paged). The capacity of a row is ``max_seqlen_k``, or ``max_pages * page_size``.

    Args:
        q: the queries; ``heads`` must be a multiple of ``kv_heads``.
        k_cache, v_cache: the cache, same shape, as above.
        cache_seqlens: how many keys of each row are valid: an integer array ``(batch,)`` (or one int for all rows)
            with entries in ``[0, capacity]``; None (the default): the whole capacity. Row ``b`` sees only keys
            ``0 .. cache_seqlens[b] - 1``; the rest of its cache is never read.
        block_table: None for a dense cache, or an integer array ``(batch, max_pages)`` of page indices (int32 in
            FlashAttention). The entries a row reads (its first ``ceil(cache_seqlens[b] / page_size)``) must lie in
            ``[0, num_pages)``; the others are ignored (padding such as -1 is fine).
        causal, sm_scale, window, softcap: as for :func:`reference.attention`, row ``b`` aligned bottom-right at
            ``seqlen_k = cache_seqlens[b]`` (its queries are the last ``seqlen_q`` positions of its sequence).
        return_lse: also return the natural-log lse.

    Returns:
        ``out`` of shape ``(batch, heads, seqlen_q, headdim)``, or ``(out, lse)`` with ``lse`` of shape ``(batch,
        heads, seqlen_q)``. Row ``b`` equals :func:`reference.attention` of ``q[b]`` against its first
        ``cache_seqlens[b]`` keys; rows that see no key (``cache_seqlens[b] = 0``, a window wholly before key 0)
        have ``out = 0`` and ``lse = -inf``.
    """
    q, k_cache, v_cache = to_float64(q, "q"), to_float64(k_cache, "k_cache"), to_float64(v_cache, "v_cache")
    if q.ndim != 4:
        raise ValueError(f"q must have shape (batch, heads, seqlen_q, headdim); got shape {q.shape}")
    batch, heads, _, headdim = q.shape
    if headdim < 1:
        raise ValueError(f"q must have headdim >= 1; got shape {q.shape}")
    paged = block_table is not None
    layout = "(num_pages, page_size, kv_heads, headdim)" if paged else "(batch, kv_heads, max_seqlen_k, headdim)"
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must have shape {layout}; got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {k_cache.shape}; got shape {v_cache.shape}")
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache has headdim {k_cache.shape[3]} but q has headdim {headdim}")
    if paged:
        num_pages, page_size, kv_heads, _ = k_cache.shape
        if page_size < 1:
            raise ValueError(f"k_cache must have page_size >= 1; got shape {k_cache.shape}")
        block_table = _check_block_table(block_table, batch)
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has batch {batch}")
        kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    _check_heads(heads, kv_heads, "k_cache/v_cache")
    band, sm_scale, softcap, return_lse = _check_options(causal, sm_scale, window, softcap, return_lse, headdim)
    cache_seqlens = _check_cache_seqlens(cache_seqlens, batch, capacity)
    if paged:
        _check_pages_read(block_table, cache_seqlens, page_size, num_pages)

    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:-1])
    for b, length in enumerate(cache_seqlens):
        if paged:
            pages = _pages_read(block_table, b, length, page_size)
            # (pages, page_size, kv_heads, headdim) -> key positions in order -> (kv_heads, length, headdim)
            k_b, v_b = (cache[pages].reshape(-1, kv_heads, headdim)[:length].transpose(1, 0, 2)
                        for cache in (k_cache, v_cache))
        else:
            k_b, v_b = k_cache[b, :, :length], v_cache[b, :, :length]
        out[b], lse[b] = _sequence_attention(q[b], k_b, v_b, band, sm_scale, softcap)
    return (out, lse) if return_lse else out
