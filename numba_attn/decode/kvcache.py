"""KV-cache options of ``flash_decode``: ragged lengths, paged caches, sliding windows and soft-capping, as
``reference.attention_with_kvcache`` defines them.

Layouts (the reference's)::

    q                        (batch, heads, seqlen_q, headdim)
    dense  k_cache, v_cache  (batch, kv_heads, capacity, headdim)          block_table None
    paged  k_cache, v_cache  (num_pages, page_size, kv_heads, headdim)     block_table (batch, max_pages) int32

The dense cache keeps this package's ``(batch, heads, seqlen, headdim)`` layout (that of ``flash_decode``'s ``k``
and ``v`` without these options; FlashAttention's dense cache is ``(batch, seqlen, heads, headdim)``: pass
``k.transpose(1, 2)``, a view). The paged cache is FlashAttention's; the kernels take it as ``(num_pages,
kv_heads, page_size, headdim)`` (``page_view``, no copy). Row ``b`` sees keys ``0 .. cache_seqlens[b] - 1``
(``cache_seqlens`` None: the whole capacity, ``capacity`` or ``max_pages * page_size``), its queries aligned
bottom-right at its own length.

The kernels read the lengths when they run: a device ``cache_seqlens`` may change between the replays of a
captured CUDA graph. So nothing the host decides -- the number of splits, the key ranges -- depends on the lengths,
only on the capacity (and a window's width). What the kernels specialise on at compile time is a ``KvOptions``;
``None`` there means none of these options, and the kernels compile exactly to the code they had before these
options existed.

Checks (``check_inputs``): shapes, int32 (or, on the host, integer) index arrays, and on the host the values:
lengths in ``[0, capacity]``, the block-table entries a row reads in ``[0, num_pages)``. Device index arrays are not
read back (that would synchronise): their values are the caller's contract, as in FlashAttention.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.mask import NO_WINDOW, UNBOUNDED, window_sides
from ..core.softmax import softcap_scales
from ..runtime.arguments import ArgumentTypeError
from ..runtime.arrays import _dtype_name, _placement
from ..runtime.device import SIMULATOR, DeviceView, cuda
from ..runtime.shapes import MAX_HEAD_DIM, AttentionShape, check_array
from ..runtime.views import restride

INDEX_DTYPE = "int32"


@dataclass(frozen=True)
class KvOptions:
    """What a decode kernel specialises on: per-row lengths read at run time (``ragged``), a paged cache
    (``paged``), a sliding window (``window``: ``mask.window_sides``, compile-time sides) and soft-capped scores
    (``softcap``: the cap itself is a kernel parameter)."""

    ragged: bool = False
    paged: bool = False
    window: tuple = NO_WINDOW
    softcap: bool = False

    def __post_init__(self):
        if any(type(x) is not bool for x in (self.ragged, self.paged, self.softcap)):
            raise TypeError(f"ragged, paged, softcap: expected bools, got {self}")
        if (type(self.window) is not tuple or len(self.window) != 2
                or any(type(s) is not int or s < UNBOUNDED for s in self.window)):
            raise ValueError(f"window: expected compile-time sides (mask.window_sides), got {self.window!r}")

    @property
    def name(self) -> str:
        parts = [p for p, on in (("ragged", self.ragged), ("paged", self.paged), ("softcap", self.softcap)) if on]
        if self.window != NO_WINDOW:
            parts.append("window" + "_".join("x" if s == UNBOUNDED else str(s) for s in self.window))
        return "_".join(parts) or "none"

    @property
    def has_left(self) -> bool:
        return self.window[0] != UNBOUNDED


#: Specialisations ``scripts/decode_ptx.py --kv`` compiles (every option alone and all together).
KV_SPECS = (KvOptions(ragged=True), KvOptions(paged=True), KvOptions(window=(64, UNBOUNDED)),
            KvOptions(softcap=True), KvOptions(True, True, (100, 3), True))


@dataclass(frozen=True)
class KvCache:
    """One call's KV-cache arguments for the kernels: the options, the device views of ``cache_seqlens`` ``(batch,)``
    and ``block_table`` ``(batch, max_pages)`` (placeholders the kernels never read where an option is off), the
    capacity of a row, and the scales of ``softcap`` (None: no cap)."""

    options: KvOptions
    seqlens: Any
    table: Any
    capacity: int
    window: tuple | None  # the checked (left, right) of the call
    softcap: float | None = None

    def span(self, seqlen_q: int) -> int:
        """Keys a row's queries may see at most, whatever its length: the capacity, or a window's width. The
        split plans cut this many keys, counted from the first key a row's queries see."""
        if self.options.window[0] == UNBOUNDED:
            return self.capacity
        return min(self.capacity, self.options.window[0] + seqlen_q)

    def scales(self, sm_scale: float) -> tuple:
        """``(scale, cap)`` float32 kernel parameters: ``sm_scale * log2(e)`` and unused, or with a softcap
        ``(sm_scale / softcap, softcap * log2(e))`` (``core.softmax.softcap_scales``)."""
        from .combine import LOG2E

        if self.softcap is None:
            return np.float32(sm_scale * LOG2E), np.float32(0.0)
        return softcap_scales(sm_scale, self.softcap)

    def for_rows(self, seqlen_q: int) -> "KvCache | None":
        """The arguments of the tensor-core kernel, which takes one query position (``seqlen_q == 1``) or no mask:
        there only a window's left side cuts keys (its right side and the causal diagonal lie past the last key).
        None where no option is left (the kernel's default code serves: a dense cache of full rows)."""
        options = self.options
        if seqlen_q == 1:
            options = dataclasses.replace(options, window=(options.window[0], UNBOUNDED))
        if options == KvOptions():
            return None
        return dataclasses.replace(self, options=options)


def options_for(ragged: bool, paged: bool, window, causal: bool, softcap) -> KvOptions | None:
    """The compile-time options of a call, None where it has none (the kernels' default code)."""
    options = KvOptions(bool(ragged), bool(paged), window_sides(window, causal), softcap is not None)
    return None if options == KvOptions() else options


_PLACEHOLDERS: dict = {}


def placeholders():
    """``(seqlens, table)`` arguments for kernels whose options leave them unread: empty int32 arrays."""
    if "views" not in _PLACEHOLDERS:
        if SIMULATOR:
            views = (np.zeros(1, np.int32), np.zeros((1, 1), np.int32))
        else:
            views = (DeviceView(0, (0,), (4,), np.int32, None), DeviceView(0, (0, 0), (4, 4), np.int32, None))
        _PLACEHOLDERS["views"] = views
    return _PLACEHOLDERS["views"]


def page_view(view):
    """A paged cache ``(num_pages, page_size, kv_heads, headdim)`` as the kernels take it, ``(num_pages, kv_heads,
    page_size, headdim)``; no copy."""
    shape, strides = tuple(view.shape), tuple(view.strides)
    return restride(view, (shape[0], shape[2], shape[1], shape[3]), (strides[0], strides[2], strides[1], strides[3]))


# -- host checks ------------------------------------------------------------------------------------------------------
@dataclass
class KvInputs:
    """A call's checked shapes and index arrays: ``shape`` (``seqlen_k`` is a row's capacity), whether the cache is
    paged, and ``arrays`` -- the named arrays for ``arrays.prepare`` (the index arrays as int32 device arrays of the
    caller's library, or host int32 arrays for host callers)."""

    shape: AttentionShape
    paged: bool
    ragged: bool
    arrays: dict


def _shape4(name: str, x, layout: str) -> tuple:
    check_array(name, x)
    shape = tuple(int(n) for n in x.shape)
    if len(shape) != 4:
        raise ValueError(f"{name}: expected shape {layout}, got {shape}")
    return shape


def _host_integers(name: str, value, meaning: str):
    """``value`` as a NumPy integer array, or None when it is a device array."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return np.asarray(value, np.int64)
    try:
        placement = _placement(name, value)
    except TypeError:
        placement = None
    if placement is not None and placement.kind != "host":
        return None
    if placement is None and not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(f"{name}: expected an integer array ({meaning}), got {type(value).__name__}")
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name}: expected an integer array ({meaning}), got dtype {array.dtype}")
    return array


def _device_integers(name: str, value, shape: tuple) -> None:
    dtype = _dtype_name(value, _placement(name, value).library)
    if dtype != INDEX_DTYPE:
        raise ArgumentTypeError(f"{name}: a device array must be {INDEX_DTYPE}, got {dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(value.shape)}")


def _on_device_like(q, host: np.ndarray):
    """``host`` (int32) as a device array of ``q``'s library and device; ``host`` itself for host callers."""
    placement = _placement("q", q)
    if placement.kind == "host":
        return host
    if placement.library == "torch":
        import torch

        return torch.as_tensor(host, device=q.device)
    if placement.library == "cupy":
        import cupy

        with cupy.cuda.Device(placement.device_id):
            return cupy.asarray(host)
    return cuda.to_device(host)


def check_inputs(q, k_cache, v_cache, cache_seqlens, block_table) -> KvInputs:
    """Check the arrays of a ``flash_decode`` call with ``cache_seqlens`` or ``block_table`` (the reference's rules;
    ValueError / TypeError naming the argument)."""
    paged = block_table is not None
    b, h, lq, d = _shape4("q", q, "(batch, heads, seqlen_q, headdim)")
    layout = "(num_pages, page_size, kv_heads, headdim)" if paged else "(batch, kv_heads, capacity, headdim)"
    ks = _shape4("k_cache", k_cache, layout)
    vs = _shape4("v_cache", v_cache, layout)
    if vs != ks:
        raise ValueError(f"v_cache: expected k_cache's shape {ks}, got {vs}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: headdim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if ks[3] != d:
        raise ValueError(f"k_cache: headdim must equal q's headdim {d}, got {ks[3]}")
    if paged:
        num_pages, page_size, kv_heads = ks[0], ks[1], ks[2]
        if page_size < 1:
            raise ValueError(f"k_cache: page_size must be at least 1, got shape {ks}")
    else:
        if ks[0] != b:
            raise ValueError(f"k_cache: batch must match q's batch {b}, got {ks[0]}")
        kv_heads, capacity = ks[1], ks[2]
    if kv_heads < 1 or h % kv_heads:
        raise ValueError(f"k_cache: number of heads {kv_heads} must divide q's {h} (grouped-query attention)")
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}

    table = None
    if paged:
        table = _host_integers("block_table", block_table, "page indices")
        if table is None:
            if len(block_table.shape) != 2 or block_table.shape[0] != b:
                raise ValueError(f"block_table: expected shape (batch, max_pages) with batch {b}, got "
                                 f"{tuple(block_table.shape)}")
            _device_integers("block_table", block_table, (b, int(block_table.shape[1])))
            max_pages = int(block_table.shape[1])
        else:
            if table.ndim != 2 or table.shape[0] != b:
                raise ValueError(f"block_table: expected shape (batch, max_pages) with batch {b}, got {table.shape}")
            max_pages = table.shape[1]
        capacity = max_pages * page_size

    lengths = None
    if cache_seqlens is not None:
        lengths = _host_integers("cache_seqlens", cache_seqlens, "valid keys per batch row")
        if lengths is None:
            _device_integers("cache_seqlens", cache_seqlens, (b,))
            arrays["cache_seqlens"] = cache_seqlens
        else:
            if lengths.ndim == 0:
                lengths = np.full(b, lengths, np.int64)
            if lengths.shape != (b,):
                raise ValueError(f"cache_seqlens: expected shape ({b},) (batch,), got {lengths.shape}")
            if lengths.size and (lengths.min() < 0 or lengths.max() > capacity):
                raise ValueError(f"cache_seqlens: entries must lie in [0, {capacity}] (the cache's capacity), got "
                                 f"{lengths.tolist() if lengths.size <= 16 else (lengths.min(), lengths.max())}")
            arrays["cache_seqlens"] = _on_device_like(q, lengths.astype(np.int32))
    if table is not None:
        if lengths is None and cache_seqlens is None:
            lengths = np.full(b, capacity, np.int64)
        if lengths is not None:  # the entries each row reads
            for row, length in enumerate(lengths):
                read = table[row, :-(-int(length) // page_size)]
                bad = (read < 0) | (read >= num_pages)
                if bad.any():
                    p = int(np.argmax(bad))
                    raise ValueError(f"block_table: entry [{row}, {p}] = {int(read[p])} is not a page of k_cache "
                                     f"(0 <= page < {num_pages})")
        elif table.size and table.max() >= num_pages:  # device lengths: no row may read a page past the pool
            raise ValueError(f"block_table: entry {int(table.max())} is not a page of k_cache (< {num_pages})")
        arrays["block_table"] = _on_device_like(q, table.astype(np.int32))
    elif paged:
        arrays["block_table"] = block_table
    shape = AttentionShape(b, h, kv_heads, lq, capacity, d, 4)
    return KvInputs(shape, paged, cache_seqlens is not None, arrays)
