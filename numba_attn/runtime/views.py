"""Views of device memory without copies: unit axes, grouped query heads, restrides, scratch carving, and whether a
view's rows can be read in aligned vector pieces. Work on ``DeviceView`` s, Numba device arrays and (under the
simulator) NumPy arrays alike."""
from __future__ import annotations

from typing import Any

import numpy as np

from .device import DeviceView


def with_unit_axes(view: Any, at: int, count: int):
    """The device (or simulator NumPy) view with ``count`` axes of length 1 inserted before axis ``at``; no copy."""
    shape = tuple(view.shape[:at]) + (1,) * count + tuple(view.shape[at:])
    strides = tuple(view.strides[:at]) + (0,) * count + tuple(view.strides[at:])
    return restride(view, shape, strides)


def grouped_heads(view: Any, kv_heads: int):
    """``(batch, heads, seqlen, ...)`` -> ``(batch, kv_heads, group * seqlen, ...)``, ``group = heads // kv_heads``:
    row ``i * seqlen + l`` of kv head ``g`` is row ``l`` of head ``g * group + i``, so a GQA group's query rows
    become one longer sequence; no copy. None when the strides do not allow it (seqlen > 1 and a head's rows not
    directly after the previous head's)."""
    batch, heads, seqlen = (int(n) for n in view.shape[:3])
    group = heads // kv_heads
    stride_b, stride_h, stride_l = view.strides[:3]
    if seqlen == 1 or group == 1:
        row_stride = stride_h if seqlen == 1 else stride_l
    elif stride_h == seqlen * stride_l:
        row_stride = stride_l
    else:
        return None
    shape = (batch, kv_heads, group * seqlen) + tuple(view.shape[3:])
    strides = (stride_b, group * stride_h, row_stride) + tuple(view.strides[3:])
    return restride(view, shape, strides)


def restride(view: Any, shape: tuple, strides: tuple):
    """The device (or simulator NumPy) view of the same memory with this shape and these byte strides; no copy."""
    if isinstance(view, np.ndarray):
        return np.lib.stride_tricks.as_strided(view, shape, strides)
    if isinstance(view, DeviceView):
        return view.with_axes(shape, strides)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(shape=shape, strides=strides, dtype=view.dtype, stream=view.stream, gpu_data=view.gpu_data)


def swapped_last_axes(view: Any):
    """The view with its last two axes swapped (a ``(batch, heads, E, M)`` state read as ``(batch, heads, M, E)``);
    no copy."""
    shape, strides = tuple(view.shape), tuple(view.strides)
    return restride(view, shape[:-2] + (shape[-1], shape[-2]), strides[:-2] + (strides[-1], strides[-2]))


def reversed_axis(view: Any, axis: int):
    """The view with axis ``axis`` in reverse order (a negative stride from its last element); no copy. The
    backward of the causal dot product walks the sequence from its last row this way."""
    if isinstance(view, np.ndarray):
        index = [slice(None)] * view.ndim
        index[axis] = slice(None, None, -1)
        return view[tuple(index)]
    view = DeviceView.of(view)
    n, stride = view.shape[axis], view.strides[axis]
    strides = list(view.strides)
    strides[axis] = -stride
    return DeviceView(view.ptr + (n - 1) * stride if n > 1 else view.ptr, view.shape, tuple(strides), view.dtype,
                      view.owner)


def carve(buffer: Any, shapes: list) -> list:
    """C-contiguous views of consecutive pieces of the flat ``buffer`` (a device view, a Numba device array or a
    simulator NumPy array), one per shape: several scratch arrays from one allocation."""
    views, offset = [], 0
    for shape in shapes:
        size = 1
        for n in shape:
            size *= n
        if isinstance(buffer, DeviceView):
            itemsize = buffer.dtype.itemsize
            strides, step = [], itemsize
            for n in reversed(shape):
                strides.append(step)
                step *= n
            views.append(DeviceView(buffer.ptr + offset * itemsize, shape, tuple(reversed(strides)), buffer.dtype,
                                    buffer.owner))
        else:
            views.append(buffer[offset:offset + size].reshape(shape))
        offset += size
    if offset > buffer.shape[0]:
        raise ValueError(f"buffer: {buffer.shape[0]} elements cannot hold pieces of {offset}")
    return views


def rows_in_pieces(x: Any, elements: int) -> bool:
    """True when every row of ``x`` (its last axis) can be read and written in aligned pieces of ``elements``
    elements: the last axis contiguous and a multiple of ``elements`` long, every row start aligned to a piece
    (base address and the strides of the other axes multiples of the piece's bytes). The kernels' vector loads
    need this."""
    if isinstance(x, DeviceView):
        ptr = x.ptr
    else:
        ptr = int((getattr(x, "__cuda_array_interface__", None) or x.__array_interface__)["data"][0])
    # plain tuples (the simulator's refuse index -1)
    return layout_rows_in_pieces(tuple(x.shape), tuple(x.strides), ptr, np.dtype(x.dtype).itemsize, elements)


def layout_rows_in_pieces(shape: tuple, strides: tuple, ptr: int, itemsize: int, elements: int) -> bool:
    """``rows_in_pieces`` of the array with this shape, byte strides, address and item size."""
    piece = elements * itemsize
    if 0 in shape[:-1] and shape[-1] % elements == 0:
        return True  # no row to read (say an empty KV cache): nothing can be misaligned
    if shape[-1] % elements or strides[-1] != itemsize or ptr % piece:
        return False
    for size, stride in zip(shape[:-1], strides[:-1]):  # (a loop, not a generator: planned decode calls ask)
        if size > 1 and stride % piece:
            return False
    return True


def lift(view: Any, ndim: int):
    """Prepend length-1 axes up to ``ndim``: ``(seqlen, headdim)`` -> ``(1, 1, seqlen, headdim)``, ``(seqlen,)`` ->
    ``(1, 1, seqlen)``. The kernels only know the batched layout."""
    return with_unit_axes(view, 0, ndim - view.ndim) if view.ndim < ndim else view
