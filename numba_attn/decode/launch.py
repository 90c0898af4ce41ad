"""Launching the tensor-core split kernel of ``decode.mma`` for a ``flash_decode`` call: the regrouped views, the
plan per cache length, the pool's counters, the parts in one scratch allocation, and the combine kernel where the
split kernel does not merge the parts itself.

``flash_decode`` regroups the query rows of each GQA group into one sequence (``runtime.views.grouped_heads``, no
copy): ``(batch, kv_heads, group * seqlen_q, headdim)``, so that one 16-row MMA tile holds a whole group (8 rows for
GQA 8 and one token) and every K/V element is read once per kv head. The keys are cut into ranges (``decode.plan``);
each block of the grid ``(batch * kv_heads, row tiles, num_splits)`` streams its keys and writes its normalised
float32 part and its lse. In a pooled plan the row tile's last block to finish merges the parts into the output
itself; otherwise ``decode.combine``'s kernel merges them.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..runtime import device as _device
from ..runtime import launch as _launch
from ..runtime.cache import BoundedCache
from ..runtime.device import SIMULATOR, DeviceView, max_grid
from ..runtime.launch import launch as device_launch
from ..runtime.launch import prepared
from ..runtime.views import carve, grouped_heads
from ..forward.common import bits as _bits
from ..forward.common import vector_loads_ok
from . import combine as _combine
from . import pool as _pool
from .combine import LOG2E
from .mma import FINISH_OUT, FINISH_OUT_LSE, FINISH_PARTS, DecodeMmaConfig, config_for, layout_for, padded_head_dim
from .mma import split_kernel
from .kvcache import KvCache
from .plan import SplitPlan, plan_splits, uniform_plan


@lru_cache(maxsize=None)
def _placeholders():
    """(out rows, lse rows) for launches that write only the parts: empty arrays the kernel never touches."""
    if SIMULATOR:
        return np.zeros((0, 0, 0, 0), np.uint16), np.zeros((0, 0, 0), np.float32)
    return (DeviceView(0, (0, 0, 0, 0), (0, 0, 0, 0), np.uint16, None),
            DeviceView(0, (0, 0, 0), (0, 0, 0), np.float32, None))


def grouped_views(q, out, lse, write_lse: bool, kv_heads: int, masked: bool):
    """``(q, out, lse)`` regrouped for ``DecodeLaunch`` (the query rows of a GQA group as one sequence, no copy), or
    None where that cannot be done: rows that do not regroup without a copy, or a mask (``masked``: causal or a
    window) over several query rows (it would see the regrouped row index, not the token's position)."""
    if masked and q.shape[2] > 1:
        return None
    q_rows, out_rows = grouped_heads(q, kv_heads), grouped_heads(out, kv_heads)
    lse_rows = grouped_heads(lse, kv_heads) if write_lse else lse
    if q_rows is None or out_rows is None or (write_lse and lse_rows is None):
        return None
    return q_rows, out_rows, lse_rows


class _Step:
    """A launch for one cache length, worked out once: the plan, whether the split kernel merges the parts, the
    split kernel's grid, the parts' shape and scratch size and (on a GPU) their parameter templates, pointers
    relative to the scratch."""

    __slots__ = ("plan", "merges", "grid", "parts_shape", "size", "parts_params")

    def __init__(self, launch: "DecodeLaunch", plan: SplitPlan):
        self.plan, self.merges, self.grid = plan, launch.merges(plan), launch.split_grid(plan)
        # pooled plans merge in the kernel, which reads whole 16-byte column groups: parts as wide as d_pad
        self.parts_shape = (plan.num_splits,) + (launch.merged_parts_shape if self.merges else launch.parts_shape)
        self.size = math.prod(self.parts_shape[:-1]) * (self.parts_shape[-1] + 1)  # the parts and their lse
        self.parts_params = None
        if not SIMULATOR:
            template = DeviceView(0, (self.size,), (4,), np.float32, None)
            self.parts_params = tuple(view.params for view in carve(template, [self.parts_shape,
                                                                               self.parts_shape[:-1]]))


class DecodeLaunch:
    """Split-KV attention for few query rows, on the views of ``grouped_views``: the split kernel over
    key ranges (``plan_splits`` per cache length when ``num_splits`` is None), then ``decode.combine``'s kernel, or,
    for pooled plans, one launch whose last blocks merge the parts (``merge_in_kernel``).

    Made for one kind of call (the query rows' and output's shapes and dtype, the scale, the options): the kernels,
    block shapes and constant parameters are worked out here, once; calling it launches on arrays of that kind with
    any cache length. ``decode.cached`` keeps one per kind of call, so a decoding step costs little host time."""

    def __init__(self, q_rows, out_rows, write_lse: bool, sm_scale: float, num_splits: int | None, sm_count: int,
                 config: DecodeMmaConfig | None = None, dtype: str | None = None, vector_loads: bool = True,
                 device_id: int | None = None, kv: KvCache | None = None):
        self.batch, self.kv_heads, self.rows, head_dim = q_rows.shape
        grid = (self.batch * self.kv_heads, -(-self.rows // 16), self.batch * self.kv_heads * self.rows)
        limits = (max_grid(0), max_grid(1), max_grid(0))
        if any(n > limit for n, limit in zip(grid, limits)):
            raise ValueError(f"q: {grid[0]} (batch, kv head) pairs of {self.rows} query rows need the grids "
                             f"{grid[:2]} (split kernel, x and y) and {grid[2]} (combine), more than one launch takes "
                             f"({limits})")
        self.max_splits = max_grid(2)
        self.config = config = config or config_for(head_dim)
        dtype = dtype or ("float16" if np.dtype(q_rows.dtype) == np.float16 else "bfloat16")
        layout = layout_for(config, padded_head_dim(head_dim))
        # KV-cache options (``decode.kvcache``): the kernel's, a window's left side (the plans cut the window's keys)
        # and the scales of a softcap; calls pass their ``(cache_seqlens, block_table, capacity)``
        self.kv = None if kv is None else kv.options
        self.window_left = None if kv is None or not kv.options.has_left else kv.options.window[0]
        scale_first = not sm_scale > 0 and (kv is None or kv.softcap is None)
        self.split_kernel = split_kernel(config, layout.d_pad, dtype == "bfloat16", vector_loads, scale_first,
                                         self.kv)
        self.shared_bytes = layout.shared_bytes
        self.combine_kernel, self.combine_block = _combine.combine_launch(head_dim, "float32",
                                                                          np.dtype(out_rows.dtype).name)
        self.scale_log2 = np.float32(sm_scale * LOG2E)
        self.cap = None
        if kv is not None:
            self.scale_log2, self.cap = kv.scales(sm_scale)
        self.write_lse, self.num_splits, self.sm_count = bool(write_lse), num_splits, sm_count
        self.parts_shape = (self.batch, self.kv_heads, self.rows, head_dim)
        self.merged_parts_shape = (self.batch, self.kv_heads, self.rows, layout.d_pad)
        self.merges_in_kernel = config.key_pool and config.merge_in_kernel
        self.finish = FINISH_OUT_LSE if write_lse else FINISH_OUT
        self.pool_words = 2 * self.batch * self.kv_heads * -(-self.rows // 16)  # a pooled launch's counters
        self.device_id = device_id  # None: the current device, asked at every pooled launch
        self.combine_grid = self.batch * self.kv_heads * self.rows  # one block per query row
        # (as 3-tuples, for the prepared launches of planned calls)
        self.block, self.combine_grid3 = (config.threads, 1, 1), (self.combine_grid, 1, 1)
        self.combine_block3 = self.combine_block + (1,)
        self._prepared = None  # the two kernels' launchables, made at the first call on a GPU
        # seqlen_k -> _Step: every layer of a decoding step asks for the same length
        self._steps = BoundedCache("decode launch steps")

    def plan(self, seqlen_k: int) -> SplitPlan:
        """The key ranges for a cache of ``seqlen_k`` keys: ``plan_splits``, or the caller's ``num_splits`` equal
        ranges (at most one per tile)."""
        return self._step(seqlen_k).plan

    def keys(self, k, kv_args) -> int:
        """The keys a plan cuts: the cache's length, or with KV-cache options a row's capacity, or a window's width
        where that is less (never the rows' lengths, which the kernel reads)."""
        if kv_args is None:
            return k.shape[2]
        if self.window_left is None:
            return kv_args[2]
        return min(kv_args[2], self.window_left + 1)

    def _step(self, seqlen_k: int) -> _Step:
        step = self._steps.get(seqlen_k)
        if step is not None:
            return step
        batch, kv_heads, rows, _ = self.parts_shape
        if self.num_splits is None:
            plan = plan_splits(batch, kv_heads, rows, seqlen_k, self.sm_count, self.config, self.max_splits)
        else:
            block_n = self.config.block_n
            splits = max(1, min(int(self.num_splits), -(-seqlen_k // block_n), self.max_splits))
            plan = uniform_plan(seqlen_k, splits, block_n)
        step = _Step(self, plan)
        self._steps.put(seqlen_k, step)
        return step

    def split_grid(self, plan: SplitPlan) -> tuple:
        """Range ``z`` of every (batch, kv head) and row tile is grid slice ``z``: the block scheduler starts the
        blocks in this order, so tail ranges start last."""
        batch, kv_heads, rows, _ = self.parts_shape
        return (batch * kv_heads, -(-rows // 16), plan.num_splits)

    def counters(self, plan: SplitPlan, stream: int):
        """The pool's counters for a launch of ``plan`` on ``stream`` (a driver handle): those of
        ``decode.pool.POOL_COUNTERS``, the placeholder of a plan without a pool, or None where a capture must zero its
        own."""
        if not plan.pooled:
            return _pool.POOL_COUNTERS.unused()
        device_id = self.device_id
        if device_id is None:
            device_id = 0 if SIMULATOR else _device.current_device_id()
        return _pool.POOL_COUNTERS.get(self.pool_words, stream, device_id)

    def merges(self, plan: SplitPlan) -> bool:
        """Whether the split kernel itself merges this plan's parts into the output (no combine kernel)."""
        return plan.pooled and self.merges_in_kernel

    def launch_split(self, q_rows, k, v, o_parts, lse_parts, stream, plan: SplitPlan | None = None,
                     counters=None, out_rows=None, lse_rows=None, kv_args=None) -> None:
        """The split kernel alone: ``o_parts (num_splits, batch, kv_heads, rows, headdim)`` and ``lse_parts``
        (the same without headdim), float32; ``plan`` None: ``num_splits`` equal ranges; ``counters`` None: those
        of ``self.counters`` for this stream. With ``out_rows`` (and ``lse_rows`` where this launch writes the lse)
        a pooled plan is merged into them in the kernel; its ``o_parts`` must then be ``d_pad`` columns wide.
        ``kv_args``: ``(cache_seqlens, block_table, capacity)`` of a launch with KV-cache options."""
        if plan is None:
            plan = uniform_plan(self.keys(k, kv_args), o_parts.shape[0], self.config.block_n)
        if plan.num_splits != o_parts.shape[0]:
            raise ValueError(f"o_parts: {o_parts.shape[0]} parts for a plan of {plan.num_splits} ranges")
        if plan.pooled and not self.config.key_pool:
            raise ValueError("a pooled plan needs a kernel with key_pool")
        finish = FINISH_PARTS
        if out_rows is not None:
            if not self.merges(plan):
                raise ValueError("out_rows: only a pooled plan of a kernel with merge_in_kernel merges in the kernel")
            if tuple(o_parts.shape[1:]) != self.merged_parts_shape:
                raise ValueError(f"o_parts: the in-kernel merge needs parts of shape (num_splits,) + "
                                 f"{self.merged_parts_shape}, got {tuple(o_parts.shape)}")
            finish = self.finish
        else:
            out_rows, lse_rows = _placeholders()
        if lse_rows is None:
            lse_rows = _placeholders()[1]
        if counters is None:
            counters = self.counters(plan, 0 if SIMULATOR else _launch.stream_handle(stream))
            if counters is None:
                raise RuntimeError("no pool counters inside this capture: launch through the DecodeLaunch itself")
        extra = () if self.kv is None else (_combine.kernel_arg(kv_args[0]), _combine.kernel_arg(kv_args[1]),
                                            self.cap)
        try:
            device_launch(self.split_kernel, self.split_grid(plan), self.config.threads, stream, self.shared_bytes,
                          _bits(q_rows, "q"), _bits(k, "k"), _bits(v, "v"), o_parts, lse_parts, self.scale_log2,
                          *plan.params, counters, _bits(out_rows, "out"), lse_rows, finish, *extra)
        except BaseException:
            if plan.pooled:
                _pool.POOL_COUNTERS.reset(counters, self.pool_words, 0 if SIMULATOR else _launch.stream_handle(stream))
            raise

    def __call__(self, q_rows, k, v, out_rows, lse_rows, stream, scratch, plan: SplitPlan | None = None,
                 kv_args=None) -> None:
        """Attention of ``q_rows`` over the cache into ``out_rows`` (and ``lse_rows`` with ``write_lse``); ``plan``
        None: ``self.plan`` for the cache length (``keys``). ``kv_args``: ``(cache_seqlens, block_table,
        capacity)`` of a launch with KV-cache options."""
        batch, kv_heads, rows, _ = self.parts_shape
        if batch * kv_heads == 0 or rows == 0:
            return
        step = self._step(self.keys(k, kv_args)) if plan is None else _Step(self, plan)
        plan = step.plan
        handle = 0 if SIMULATOR else _launch.stream_handle(stream)
        counters = self.counters(plan, handle)
        own = self.pool_words if counters is None else 0  # no counters to share: its own, in the scratch
        # one allocation for all: a decoding step's host time is comparable to its kernels' time
        buffer = scratch((step.size + own,))
        if own:
            counters = DeviceView(DeviceView.of(buffer).ptr + 4 * step.size, (own,), (4,), np.uint32, None)
            _launch.zero_words_async(counters.ptr, own, handle)
        if not SIMULATOR and _launch.FAST_LAUNCH:
            self._launch_prepared(q_rows, k, v, out_rows, lse_rows, handle, buffer, step, counters, kv_args)
            return
        o_parts, lse_parts = carve(buffer, [step.parts_shape, step.parts_shape[:-1]])
        if step.merges:
            self.launch_split(q_rows, k, v, o_parts, lse_parts, stream, plan, counters, out_rows,
                              lse_rows if self.write_lse else None, kv_args)
            return
        self.launch_split(q_rows, k, v, o_parts, lse_parts, stream, plan, counters, kv_args=kv_args)
        device_launch(self.combine_kernel, self.combine_grid, self.combine_block, stream, 0,
                      *(_combine.kernel_arg(x) for x in (o_parts, lse_parts, out_rows, lse_rows)), self.write_lse)

    def _launch_prepared(self, q_rows, k, v, out_rows, lse_rows, handle, buffer, step: _Step, counters,
                         kv_args=None) -> None:
        """The launches with parameters packed straight from the views (``_launch.prepared``): the shapes and
        dtypes were settled when this kind of call was planned, so nothing is checked again."""
        if self._prepared is None:
            self._prepared = (prepared(self.split_kernel), prepared(self.combine_kernel))
        split_entry, combine_entry = self._prepared
        plan, merges = step.plan, step.merges
        base = DeviceView.of(buffer).ptr
        o_params, lse_params = (p[:4] + (base + p[4],) + p[5:] for p in step.parts_params)
        view = DeviceView.of  # (returns a DeviceView itself: the plan's views cost nothing here)
        out_params, lse_rows_params = view(out_rows).params, view(lse_rows).params
        kv_params = () if kv_args is None else view(kv_args[0]).params + view(kv_args[1]).params + (self.cap,)
        try:
            split_entry.launch(step.grid, (self.config.threads, 1, 1),
                               self.shared_bytes, handle, view(q_rows).params + view(k).params + view(v).params
                               + o_params + lse_params + (self.scale_log2,) + plan.params + counters.params
                               + out_params + lse_rows_params + (self.finish if merges else FINISH_PARTS,)
                               + kv_params)
        except BaseException:
            if plan.pooled:
                _pool.POOL_COUNTERS.reset(counters, self.pool_words, handle)
            raise
        if not merges:
            combine_entry.launch((self.combine_grid, 1, 1), self.combine_block + (1,), 0, handle,
                                 o_params + lse_params + out_params + lse_rows_params + (self.write_lse,))


def launch_decode(q_rows, k, v, out_rows, lse_rows, write_lse: bool, sm_scale: float, num_splits: int | None, stream,
                  scratch, sm_count: int, config: DecodeMmaConfig | None = None, dtype: str | None = None,
                  vector_loads: bool | None = None):
    """``DecodeLaunch`` made and called once (``vector_loads`` None: from the arrays' layout)."""
    if vector_loads is None:
        vector_loads = vector_loads_ok(q_rows, k, v)
    DecodeLaunch(q_rows, out_rows, write_lse, sm_scale, num_splits, sm_count, config, dtype, vector_loads)(
        q_rows, k, v, out_rows, lse_rows, stream, scratch)
