"""Repeated ``flash_decode`` calls without the per-call checks.

A decoding step on the tensor-core path runs for tens of microseconds of GPU time (B8 H32 D128, GQA-8, 16k keys:
about 100 us), while the checked path -- library and dtype lookups, shape checks, views, kernel choice -- took
about 150 us of host time per call: the GPU waited on Python. So the first call of a kind goes the checked way
and leaves a ``DecodePlan``; later calls whose arrays have the same kind, dtype, device, shapes (the cache length
aside), query strides and alignment find it by ``plan_key`` and only rebuild the views and launch.

The key holds every input that decides what the checked path does apart from the cache length, which may grow
from call to call (contiguous caches then change their strides too, which the views take per call). Anything
the key does not pin down that the checked path would reject -- K and V of different lengths, an empty cache --
makes ``DecodePlan.run`` return None, and the caller takes the checked path, which raises or handles it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime import arrays as _arrays
from ..runtime import views as _views
from ..runtime.cache import BoundedCache
from ..runtime.device import DeviceView
from . import launch as _decode_launch

#: Serve repeated calls from plans (False: every call takes the checked path, for comparison and debugging).
ENABLED = True
#: plans by key (a long-running server sees few kinds of call)
_PLANS = BoundedCache("decode plans")


def clear() -> None:
    """Forget every plan (after changing a module-level knob that the checked path reads, such as
    ``dispatch.MMA_MIN_GROUP`` or ``decode.mma.DEFAULT_CONFIG``)."""
    _PLANS.clear()


def _aligned_rows(layout) -> bool:
    """``_views.rows_in_pieces(x, 8)`` on a fast layout: rows readable in aligned 16-byte pieces."""
    _, _, shape, strides, ptr, dtype = layout
    return _views.layout_rows_in_pieces(shape, strides, ptr, dtype.itemsize, 8)


def find(q: Any, k: Any, v: Any, causal, sm_scale, num_splits, return_lse):
    """``(key, plan, layouts)``: the plan for this call (None if there is none yet), the key to register one under
    (None where no plan can serve these arrays: host or Numba arrays) and the arrays' fast layouts."""
    if not ENABLED:
        return None, None, None
    lq, lk, lv = _arrays.fast_layout(q), _arrays.fast_layout(k), _arrays.fast_layout(v)
    if lq is None or lk is None or lv is None:
        return None, None, None
    seq = len(lk[2]) - 2  # the length axis of k and v
    key = (
        lq[0], lq[1], lq[2], lq[3], _aligned_rows(lq),
        lk[0], lk[1], lk[2][:seq] + lk[2][seq + 1:], _aligned_rows(lk),
        lv[0], lv[1], lv[2][:seq] + lv[2][seq + 1:], _aligned_rows(lv),
        bool(causal), sm_scale, num_splits, bool(return_lse),
    )
    return key, _PLANS.get(key), (lq, lk, lv)


def register(key, plan: "DecodePlan") -> None:
    _PLANS.put(key, plan)


class DecodePlan:
    """What the checked path worked out for one kind of call: the query-row, output and lse views (templates: only
    their pointers change), the output kind, and the ``decode.launch.DecodeLaunch`` with the kernels."""

    def __init__(self, call, out_shape: tuple, lse_shape: tuple | None, q_rows: DeviceView, out_rows: DeviceView,
                 lse_rows, launch: _decode_launch.DecodeLaunch):
        self.library = _arrays.fast_library(call.library)
        self.device_id, self.dtype = call.device_id, call.dtype
        self.out_shape, self.lse_shape = out_shape, lse_shape
        # templates own no memory (the first call's arrays are not kept alive); the kernels read 16-bit inputs as
        # their bits; without return_lse, lse_rows is the shared placeholder the kernels never write
        self.q_rows = q_rows.view(np.uint16).moved(0, None)
        self.out_rows = out_rows.moved(0, None)
        self.lse_rows = lse_rows.moved(0, None) if lse_shape is not None else DeviceView.of(lse_rows)
        self.launch = launch

    def run(self, q: Any, k: Any, v: Any, layouts):
        """Launch on arrays whose key is the plan's; None when the checked path must take them."""
        (_, _, _, _, q_ptr, _), (_, _, k_shape, k_strides, k_ptr, _), (_, _, v_shape, v_strides, v_ptr, _) = layouts
        seq = len(k_shape) - 2
        seqlen_k = k_shape[seq]
        if seqlen_k == 0 or v_shape[seq] != seqlen_k:
            return None
        if seq == 0:  # (seqlen, headdim): the kernels see (1, 1, seqlen, headdim)
            k_shape, k_strides = (1, 1) + k_shape, (0, 0) + k_strides
            v_shape, v_strides = (1, 1) + v_shape, (0, 0) + v_strides
        library, device_id = self.library, self.device_id
        out = library.empty(self.out_shape, self.dtype, device_id)
        lse = library.empty(self.lse_shape, "float32", device_id) if self.lse_shape is not None else None
        out_rows = self.out_rows.moved(library.pointer(out), out)
        lse_rows = self.lse_rows.moved(library.pointer(lse), lse) if lse is not None else self.lse_rows
        bits = self.q_rows.dtype

        def scratch(shape, dtype="float32"):
            return library.view(library.empty(shape, dtype, device_id))

        self.launch(self.q_rows.moved(q_ptr, q), DeviceView(k_ptr, k_shape, k_strides, bits, k),
                    DeviceView(v_ptr, v_shape, v_strides, bits, v), out_rows, lse_rows, library.stream(device_id),
                    scratch)
        return (out, lse) if lse is not None else out
