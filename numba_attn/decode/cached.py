"""Repeated ``flash_decode`` calls without the per-call checks.

A decoding step on the tensor-core path runs for tens of microseconds of GPU time (B8 H32 D128, GQA-8, 16k keys:
about 100 us), while the checked path -- library and dtype lookups, shape checks, views, kernel choice -- took
about 150 us of host time per call: the GPU waited on Python. So the first call of a kind goes the checked way
and leaves a ``DecodePlan``; later calls whose arrays have the same kind, dtype, device, shapes (the cache length
aside), strides and alignment find it by ``plan_key`` and only allocate and launch.

The key holds every input that decides what the checked path does apart from the cache length, which may grow
from call to call (contiguous caches then change their strides too, which the launch takes per call). Anything
the key does not pin down that the checked path would reject -- K and V of different lengths, an empty cache --
makes ``DecodePlan.run`` return None, and the caller takes the checked path, which raises or handles it. Calls
with KV-cache options (``decode.kvcache``) have fixed shapes (the capacity, the block table's): their key holds
every shape, and their device ``cache_seqlens`` / ``block_table`` only move their pointers. Host index arrays
make no plan (their values are checked on every call).

A call served by a plan does what ``runtime.replay`` does for the other functions: reads the arrays' layouts,
allocates the output, fills the pointers into the launches' parameter lists (made once per cache length,
``_Launches``) and launches; the pool's counters are asked for at each call, because a call inside a CUDA-graph
capture needs counters of its own (``decode.pool``). The parts of a plan that merges them in its one launch live in
a buffer the plan keeps per stream (launches on one stream run one after the other, so they can share it, as they
share the pool's counters); a plan of two launches (split, combine), and any call inside a capture, allocates its
parts per call (two calls from two threads on one stream could interleave their launches).
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..runtime import arrays as _arrays
from ..runtime import launch as _launch
from ..runtime import views as _views
from ..runtime.cache import BoundedCache
from ..runtime.device import DeviceView, _driver_current_device
from ..runtime.views import carve
from . import launch as _decode_launch
from . import pool as _pool
from .mma import FINISH_PARTS

#: Serve repeated calls from plans (False: every call takes the checked path, for comparison and debugging).
ENABLED = True
#: plans by key (a long-running server sees few kinds of call)
_PLANS = BoundedCache("decode plans")


def clear() -> None:
    """Forget every plan (after changing a module-level knob that the checked path reads, such as
    ``dispatch.MMA_MIN_GROUP`` or ``decode.mma.DEFAULT_CONFIG``)."""
    _PLANS.clear()


def _part(layout, growing: bool) -> tuple:
    """What a key holds of an array's fast layout: dtype, device, shape, strides and the pointer's 16-byte
    alignment. ``growing``: a KV cache whose length axis (the second last) may change from call to call, and with it
    a contiguous cache's strides: its length and strides are left out, and only whether its rows can be read in
    aligned 16-byte pieces (the kernels' vector loads, ``views.rows_in_pieces``) counts."""
    dtype, device, shape, strides, ptr, storage = layout
    if not growing:
        return dtype, device, shape, strides, ptr % 16
    seq = len(shape) - 2
    aligned = _views.layout_rows_in_pieces(shape, strides, ptr, storage.itemsize, 16 // storage.itemsize)
    return dtype, device, shape[:seq] + shape[seq + 1:], aligned


def find(q: Any, k: Any, v: Any, options: tuple, cache_seqlens=None, block_table=None):
    """``(key, plan, layouts)``: the plan for this call (None if there is none yet), the key to register one under
    (None where no plan can serve these arrays: host or Numba arrays) and the arrays' fast layouts (q, k, v, then
    those of ``cache_seqlens`` and ``block_table`` where given). ``options``: the call's checked scalar arguments."""
    if not ENABLED:
        return None, None, None
    fast_layout = _arrays.fast_layout
    layouts = [fast_layout(q), fast_layout(k), fast_layout(v)]
    kv = cache_seqlens is not None or block_table is not None
    if kv:
        layouts.append(None if cache_seqlens is None else fast_layout(cache_seqlens))
        layouts.append(None if block_table is None else fast_layout(block_table))
        if (cache_seqlens is not None and layouts[3] is None) or (block_table is not None and layouts[4] is None):
            return None, None, None
    if layouts[0] is None or layouts[1] is None or layouts[2] is None:
        return None, None, None
    key = (_part(layouts[0], False), _part(layouts[1], not kv), _part(layouts[2], not kv), options)
    if kv:  # (int32 arrays: any 4-byte aligned pointer serves)
        seqlens, table = layouts[3], layouts[4]
        key += (None if seqlens is None else seqlens[:4], None if table is None else table[:4])
    try:
        return key, _PLANS.get(key), layouts
    except TypeError:  # an unhashable option: the checked path says what is wrong with it
        return None, None, None


def register(key, plan: "DecodePlan") -> None:
    _PLANS.put(key, plan)


class _Launches:
    """The launches of one cache length (``DecodeLaunch._step``): the split kernel's and (unless it merges the
    parts itself) the combine kernel's parameter lists, with where each pointer of a call goes."""

    __slots__ = ("step", "pooled", "split", "combine", "slots", "combine_slots", "size", "lse_parts")

    def __init__(self, plan: "DecodePlan", keys: int):
        launch = plan.launch
        self.step = step = launch._step(keys)
        self.pooled = step.plan.pooled
        self.size = step.size
        template = DeviceView(0, (step.size,), (4,), np.float32, None)
        o_parts, lse_parts = carve(template, [step.parts_shape, step.parts_shape[:-1]])
        self.lse_parts = lse_parts.ptr  # (relative to the parts' buffer)
        self.split, self.slots = _parameters(
            ("q", plan.q_rows), ("k", plan.k_view), ("v", plan.v_view), ("o_parts", o_parts),
            ("lse_parts", lse_parts), (None, (launch.scale_log2,) + step.plan.params),
            ("counters", _pool.POOL_COUNTERS.unused()), ("out", plan.out_rows), ("lse", plan.lse_rows),
            (None, (launch.finish if step.merges else FINISH_PARTS,)),
            *((("seqlens", plan.seqlens_view), ("table", plan.table_view), (None, (launch.cap,)))
              if launch.kv is not None else ()))
        # (one tuple to unpack per call: cheaper than a look-up per pointer)
        self.slots = tuple(self.slots.get(name, -1) for name in _SPLIT_SLOTS)
        self.combine = self.combine_slots = None
        if not step.merges:
            self.combine, slots = _parameters(
                ("o_parts", o_parts), ("lse_parts", lse_parts), ("out", plan.out_rows), ("lse", plan.lse_rows),
                (None, (launch.write_lse,)))
            self.combine_slots = tuple(slots[name] for name in _COMBINE_SLOTS)


#: the pointers a planned call fills in, in the order of ``_Launches.slots`` (-1: the launch has no such argument)
_SPLIT_SLOTS = ("q", "k", "v", "o_parts", "lse_parts", "counters", "out", "lse", "seqlens", "table")
_COMBINE_SLOTS = ("o_parts", "lse_parts", "out", "lse")


def _parameters(*arguments) -> tuple:
    """``(values, slots)``: a kernel's flat parameter list from ``(name, view or scalars)`` pairs, and where each
    named array's pointer lies in it."""
    values, slots = [], {}
    for name, argument in arguments:
        if name is None:
            values.extend(argument)
            continue
        slots[name] = len(values) + 4  # (meminfo, parent, nitems, itemsize, data, shape..., strides...)
        values.extend(argument.params)
    return values, slots


class DecodePlan:
    """What the checked path worked out for one kind of call: the query-row, output and lse views (templates: only
    their pointers change), the cache's views where their shapes are fixed (KV-cache options with index arrays),
    the output kind, and the ``decode.launch.DecodeLaunch`` with the kernels.

    ``kv_args``: ``(cache_seqlens, block_table, capacity)`` of a call with KV-cache options (the kernel's; the
    index arrays' views or placeholders); ``growing``: the cache's length is the keys of ``k`` (no index arrays),
    and may change from call to call."""

    def __init__(self, call, out_shape: tuple, lse_shape: tuple | None, q_rows: DeviceView, out_rows: DeviceView,
                 lse_rows, launch: _decode_launch.DecodeLaunch, k=None, v=None, kv_args=None, growing: bool = True):
        self.library = _arrays.fast_library(call.library)
        self.device_id, self.dtype = call.device_id, call.dtype
        self.out_shape, self.lse_shape = out_shape, lse_shape
        # templates own no memory (the first call's arrays are not kept alive); the kernels read 16-bit inputs as
        # their bits; without return_lse, lse_rows is the shared placeholder the kernels never write
        self.q_rows = q_rows.view(np.uint16).moved(0, None)
        self.out_rows = out_rows.moved(0, None)
        self.lse_rows = lse_rows.moved(0, None) if lse_shape is not None else DeviceView.of(lse_rows)
        self.launch = launch
        self.growing = growing
        self.k_view = self.v_view = DeviceView(0, (0, 0, 0, 0), (0, 0, 0, 0), np.uint16, None)
        if not growing:  # (a paged pool as the kernels see it)
            self.k_view, self.v_view = (DeviceView.of(x).view(np.uint16).moved(0, None) for x in (k, v))
        self.seqlens_view = self.table_view = None
        self.capacity = None
        if kv_args is not None:
            self.seqlens_view, self.table_view = (DeviceView.of(x) for x in kv_args[:2])
            self.capacity = kv_args[2]
        self._launches: dict = {}  # keys -> _Launches (a decoding loop asks for a few lengths; bounded below)
        self._entries = None  # the kernels' launchables, at the first planned call
        self._parts: dict = {}  # (stream, thread) -> (buffer, pointer, floats): the parts of merged launches

    def _launches_for(self, keys: int) -> _Launches:
        launches = self._launches.get(keys)
        if launches is None:
            if len(self._launches) >= 256:
                self._launches.clear()
            launches = self._launches[keys] = _Launches(self, keys)
        return launches

    def run(self, layouts):
        """Launch on arrays whose key is the plan's; None when the checked path must take them."""
        if _driver_current_device() != self.device_id:  # (the checked path switches devices; plans do not)
            return None
        launch = self.launch
        if self.growing:
            k_layout = layouts[1]
            seq = len(k_layout[2]) - 2
            capacity = k_layout[2][seq]
            if capacity == 0 or layouts[2][2][seq] != capacity:
                return None
        else:
            capacity = self.capacity
        keys = capacity if launch.kv is None else launch.keys(None, (None, None, capacity))
        if not _launch.FAST_LAUNCH:
            return self._run_checked(layouts, capacity)
        entries = self._entries
        if entries is None:
            entries = self._entries = (_launch.prepared(launch.split_kernel), _launch.prepared(launch.combine_kernel))
        launches = self._launches_for(keys)
        library, device_id = self.library, self.device_id
        out = library.empty(self.out_shape, self.dtype, device_id)
        lse = library.empty(self.lse_shape, "float32", device_id) if self.lse_shape is not None else None
        stream = library.stream(device_id)
        pooled = launches.pooled
        counters = None
        base = 0
        if pooled:  # (a capture without arena space gets None: counters of its own, in the scratch)
            capturing = _launch.stream_capturing(stream)
            counters = _pool.POOL_COUNTERS.get(launch.pool_words, stream, device_id, capturing)
            if counters is not None and not capturing and launches.combine is None:
                base = self._kept_parts(stream, launches.size)
        own = launch.pool_words if pooled and counters is None else 0
        if not base:
            base = library.pointer(library.empty((launches.size + own,), "float32", device_id))
        q_at, k_at, v_at, o_at, l_at, c_at, out_at, lse_at, s_at, t_at = launches.slots
        values = launches.split.copy()
        values[q_at] = layouts[0][4]
        if self.growing:
            values[k_at - 4:k_at + 9] = _cache_params(layouts[1])
            values[v_at - 4:v_at + 9] = _cache_params(layouts[2])
        else:
            values[k_at] = layouts[1][4]
            values[v_at] = layouts[2][4]
            if layouts[3] is not None:
                values[s_at] = layouts[3][4]
            if layouts[4] is not None:
                values[t_at] = layouts[4][4]
        o_parts = values[o_at] = base
        lse_parts = values[l_at] = base + launches.lse_parts
        out_ptr = values[out_at] = library.pointer(out)
        lse_ptr = values[lse_at] = library.pointer(lse) if lse is not None else self.lse_rows.ptr
        if own:
            counters = DeviceView(base + 4 * launches.size, (own,), (4,), np.uint32, None)
            _launch.zero_words_async(counters.ptr, own, stream)
        if counters is not None:
            values[c_at] = counters.ptr
        split, combine = entries
        step = launches.step
        try:
            split.launch(step.grid, launch.block, launch.shared_bytes, stream, values)
        except BaseException:
            if pooled:
                _pool.POOL_COUNTERS.reset(counters, launch.pool_words, stream)
            raise
        if launches.combine is not None:
            values = launches.combine.copy()
            o_at, l_at, out_at, lse_at = launches.combine_slots
            values[o_at], values[l_at], values[out_at], values[lse_at] = o_parts, lse_parts, out_ptr, lse_ptr
            combine.launch(launch.combine_grid3, launch.combine_block3, 0, stream, values)
        return (out, lse) if lse is not None else out

    def _kept_parts(self, stream: int, size: int) -> int:
        """The pointer of ``size`` float32s kept for merged launches on ``stream`` (per thread on the per-thread
        default stream, as ``decode.pool`` keys its counters); 0 where this plan keeps buffers for 16 streams
        already (a program with a stream per request allocates per call)."""
        key = (stream, threading.get_ident() if stream == _pool.PoolCounters.PER_THREAD_STREAM else 0)
        kept = self._parts.get(key)
        if kept is not None and kept[2] >= size:
            return kept[1]
        if kept is None and len(self._parts) >= 16:
            return 0
        buffer = self.library.empty((size,), "float32", self.device_id)
        self._parts[key] = (buffer, self.library.pointer(buffer), size)
        return self._parts[key][1]

    def _run_checked(self, layouts, capacity: int):
        """``run`` through ``DecodeLaunch`` itself (launches through Numba's dispatcher: ``FAST_LAUNCH`` off)."""
        library, device_id = self.library, self.device_id
        out = library.empty(self.out_shape, self.dtype, device_id)
        lse = library.empty(self.lse_shape, "float32", device_id) if self.lse_shape is not None else None
        out_rows = self.out_rows.moved(library.pointer(out), out)
        lse_rows = self.lse_rows.moved(library.pointer(lse), lse) if lse is not None else self.lse_rows
        if self.growing:
            k, v = (DeviceView(x[4], *_shape_strides(x), np.uint16, None) for x in layouts[1:3])
        else:
            k, v = self.k_view.moved(layouts[1][4], None), self.v_view.moved(layouts[2][4], None)
        kv_args = None
        if self.launch.kv is not None:
            seqlens, table = self.seqlens_view, self.table_view
            if not self.growing and layouts[3] is not None:
                seqlens = seqlens.moved(layouts[3][4], None)
            if not self.growing and layouts[4] is not None:
                table = table.moved(layouts[4][4], None)
            kv_args = (seqlens, table, capacity)

        def scratch(shape, dtype="float32"):
            return library.view(library.empty(shape, dtype, device_id))

        self.launch(self.q_rows.moved(layouts[0][4], None), k, v, out_rows, lse_rows, library.stream(device_id),
                    scratch, kv_args=kv_args)
        return (out, lse) if lse is not None else out


def _shape_strides(layout) -> tuple:
    """A growing cache's shape and byte strides as the kernels take them: ``(seqlen, headdim)`` gets two unit axes."""
    shape, strides = layout[2], layout[3]
    if len(shape) == 2:
        return (1, 1) + shape, (0, 0) + strides
    return shape, strides


def _cache_params(layout) -> tuple:
    """A growing cache's kernel parameters (``DeviceView.params`` of its 16-bit bits)."""
    shape, strides = layout[2], layout[3]
    if len(shape) == 2:
        shape, strides = (1, 1) + shape, (0, 0) + strides
    return (0, 0, shape[0] * shape[1] * shape[2] * shape[3], 2, layout[4]) + shape + strides
