"""Ring attention's running LSE merge as one kernel: a float32 (or first-part) accumulator row and a partial row read
once, the merged row written once.

``merge_into(out, lse, part_out, part_lse, *, final_out=None)`` merges the partial attention ``(part_out,
part_lse)`` of a ring step into the running ``(out, lse)`` of the rows it covers, as ``ring._merge_into`` does with
torch ops (about 22 bytes moved per output element, plus a copy before the first merge and a cast after the last)::

    top = max(lse, part_lse); w = exp(lse - top); pw = exp(part_lse - top); total = w + pw
    out = (w * out + pw * part_out) / total;  lse = top + log(total)

with its rules (those of ``reference.combine_lse``): both ``-inf`` gives 0 and ``-inf`` (shift 0, never NaN), a NaN
or ``+inf`` lse makes the row NaN, an empty part has weight 0 (and ``0 * NaN`` is NaN, as there). ``lse`` is always
updated in place; the merged rows go into ``out`` (in place) or, with ``final_out``, into that array (``out`` only
read): in the part's dtype this fuses the ring's final cast, in float32 it widens an accumulator that is still the
first part in the inputs' dtype (``ring._forward`` keeps its first part as it comes, without a float32 copy).

**Kernels.** Two, chosen on the host per call (``vector_plan``):

* the **vector kernel** (``merge_vector_kernel``), where every row's columns are contiguous and start aligned to a
  vector (the arrays' first elements and their batch / head / row strides multiples of its bytes) and the head dim
  is a multiple of the vector width: vectors of 8 elements (16 bytes, ``ld.v4.u32``) when all three arrays are
  16-bit, of 4 when one is float32 (16-byte ``ld.v4.f32``, 8-byte ``ld.v2.u32`` for the 16-bit ones). A row takes
  a power-of-two group of lanes inside a warp, each lane ``vector_cols`` (8) consecutive columns a pass: head dim 128
  takes 16 lanes (two rows a warp), one 16-byte vector a lane in bfloat16, two vectors of 4 with a float32 array;
  blocks of ``lanes * rows`` (256) threads. 16-bit arrays travel as uint16 views (float16 too) and are converted with
  ``ptx.half_to_float`` / ``bf16_to_float`` and stored with ``cvt.rn`` packs: the same float32 arithmetic and
  rounding as the scalar kernel, bit for bit.
* the **scalar kernel** (``merge_kernel``) otherwise (strided or unaligned columns, odd head dims): a warp per row
  (``MergeConfig.rows`` warps a block), each lane loading columns ``lane + 32 j`` one element at a time.

In both, every lane computes the row's two weights from the two lse (``merge_lse_states`` / ``lse_and_shift`` of
``decode.combine``, the division by the weight sum folded into them), loads its columns of the accumulator and of the
part (coalesced, all loads of a pass in flight before any store), and stores ``w out + pw part`` in the destination's
dtype; the row's first lane writes the lse after a warp barrier (every lane has read the old one). 64-bit row
indices, any strides (rows sliced out of a longer shard), any head dim (passes over the columns). Specialised on the
dtypes of the accumulator, the part (float16, float32, or bfloat16 as uint16 bits: ``decode.combine.converters``)
and the destination. Launched on torch's current stream. Under the simulator the tensors may be CPU tensors (the
simulator's device memory is host memory); there the lanes wait for each other at a block barrier (it has no warps)
and ``SIMULATOR_CONFIG`` keeps blocks tiny. On an H200 (1 x 8 x 32768 x 128, bfloat16 parts) the vector kernel took
111-161 us a merge where the scalar one took 252-261 us (1.7-2.1 TB/s against 0.8-1.3, counting the bytes read and
written once; one run each).

``NUMBA_ATTN_RING_MERGE=kernel`` (default) makes ``ring_attention`` merge CUDA tensors with this kernel, ``torch``
with ``ring._merge_into`` (for A/B timing; CPU tensors always take the torch path). Its effect on the ring's speed is
not measured yet.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, int64, types

from ..core import ptx
from ..core.staging import device_function
from ..decode.combine import WARP, converters, lse_and_shift, merge_lse_states
from ..runtime import arrays as _arrays
from ..runtime.device import SIMULATOR, DeviceView, cuda, kernel_jit, max_grid, on_device
from ..runtime.launch import launch as device_launch

__all__ = ["MERGE_ENV", "MergeConfig", "launch", "merge_choice", "merge_into", "merge_kernel", "merge_vector_kernel",
           "vector_plan"]

#: ``kernel`` (default) or ``torch``: how ``ring_attention`` merges CUDA tensors.
MERGE_ENV = "NUMBA_ATTN_RING_MERGE"
MERGE_CHOICES = ("kernel", "torch")

_NEG_INF = float32(-math.inf)
_ZERO = float32(0.0)
_ONE = float32(1.0)
_PART_DTYPES = ("float16", "float32", "bfloat16")


def merge_choice() -> str:
    """``NUMBA_ATTN_RING_MERGE``, read at every call (a benchmark may switch it between calls)."""
    value = os.environ.get(MERGE_ENV, "kernel").strip().lower() or "kernel"
    if value not in MERGE_CHOICES:
        raise ValueError(f"{MERGE_ENV}: expected 'kernel' or 'torch', got {value!r}")
    return value


@dataclass(frozen=True)
class MergeConfig:
    """Block shape of the merge kernels."""

    lanes: int = WARP  # threads along a row's columns (scalar kernel; the vector kernel's most): a warp on a GPU
    # rows per block of the scalar kernel, one group of lanes each (lanes * rows: the vector kernel's block)
    rows: int = 8
    max_cols: int = 8  # columns a lane holds at once (loads in flight): one pass covers lanes * max_cols columns
    vector_cols: int = 8  # vector kernel: columns a lane holds at once (at least one vector): 8 = one 16-byte vector of
    # a 16-bit kernel (vectors of 8), two of a float32 one (vectors of 4)
    vector: bool = True  # take the vector kernel where the layout allows (False: always the scalar kernel)

    def __post_init__(self):
        if min(self.lanes, self.rows, self.max_cols, self.vector_cols) < 1 or self.lanes * self.rows > 1024:
            raise ValueError(f"lanes ({self.lanes}), rows ({self.rows}), max_cols ({self.max_cols}), vector_cols "
                             f"({self.vector_cols}): at least 1 each, and a block of at most 1024 threads")


GPU_CONFIG = MergeConfig()
#: every simulated thread is a Python thread: few lanes, and passes of 8 columns so that head dims like 40 take several
#: (the vector kernel: blocks of 8 threads, at most 4 lanes a row, passes of 8 columns a lane)
SIMULATOR_CONFIG = MergeConfig(lanes=4, rows=2, max_cols=2)


def default_config() -> MergeConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


@device_function
def _row_weights(lse, part_lse_row):
    """(merged lse, weight of the accumulator row, weight of the part row): the division by the weight sum folded
    into the weights; ``reference.combine_lse``'s rules (see the module docstring)."""
    # (max, exp(lse - max) + exp(part_lse - max)): NaN for a NaN lse, (-inf, 0) for two empty rows
    top, total = merge_lse_states(lse, _ONE, part_lse_row, _ONE)
    merged, _ = lse_and_shift(top, total)  # top + log(total); -inf when both are empty, NaN for +inf
    base = _ZERO if top == _NEG_INF else top  # two empty rows: weights exp(-inf) = 0, not exp(-inf + inf)
    scale = total if total > _ZERO else _ONE  # (NaN > 0 is false: NaN weights stay NaN)
    return merged, math.exp(lse - base) / scale, math.exp(part_lse_row - base) / scale


@device_function
def _row_of(acc, acc_lse, part_lse, block, row_in_block, rows_per_block):
    """``(inside, b, h, i, merged lse, weight, part weight)`` of the row ``row_in_block`` of block ``block`` (rows in
    ``(batch, head, row)`` order; 64-bit); ``inside`` False, zeros, past the last row."""
    heads = acc.shape[1]
    length = acc.shape[2]
    row = int64(block) * rows_per_block + int64(row_in_block)
    inside = row < acc.shape[0] * heads * length  # the same for every lane of a row: no barrier is skipped
    b = h = i = int64(0)
    merged = weight = part_weight = _ZERO
    if inside:
        i = row % length
        h = (row // length) % heads
        b = row // (length * heads)
        merged, weight, part_weight = _row_weights(acc_lse[b, h, i], part_lse[b, h, i])
    return inside, b, h, i, merged, weight, part_weight


@lru_cache(maxsize=None)
def merge_kernel(config: MergeConfig, cols: int, acc_dtype: str, part_dtype: str, dest_dtype: str):
    """The merge kernel for ``cols`` columns per lane and pass and the storage dtypes (``float16``, ``float32``, or
    ``uint16``: bfloat16 bits) of the accumulator ``acc``, the part and the destination ``dest`` (which may be
    ``acc`` itself: each element is read, then written, by one thread). Compiled for that one signature:
    ``kernel(acc, acc_lse, part, part_lse, dest)``, 4-d arrays ``(batch, heads, rows, headdim)`` and 3-d lse, any
    strides; grid ``ceil(batch * heads * rows / config.rows)``, block ``(config.lanes, config.rows)``."""
    load_acc, store = converters(acc_dtype == "uint16", dest_dtype == "uint16")
    load_part, _ = converters(part_dtype == "uint16", False)
    lse_type = types.Array(float32, 3, "A")
    signature = types.void(types.Array(getattr(types, acc_dtype), 4, "A"), lse_type,
                           types.Array(getattr(types, part_dtype), 4, "A"), lse_type,
                           types.Array(getattr(types, dest_dtype), 4, "A"))
    LANES = config.lanes
    ROWS = config.rows
    CJ = cols
    SPAN = LANES * CJ
    # the lanes of a row are a warp on a GPU; the simulator has no warps (nor syncwarp): it waits at a block barrier
    WARP_LANES = not SIMULATOR and LANES == WARP
    row_of = _row_of

    @kernel_jit(signature=signature)
    def kernel(acc, acc_lse, part, part_lse, dest):
        lane = cuda.threadIdx.x
        head_dim = acc.shape[3]
        inside, b, h, i, merged, weight, part_weight = row_of(acc, acc_lse, part_lse, cuda.blockIdx.x,
                                                              cuda.threadIdx.y, ROWS)
        if inside:
            a = cuda.local.array(CJ, float32)
            p = cuda.local.array(CJ, float32)
            for c0 in range(0, head_dim, SPAN):
                for j in range(CJ):  # every load of the pass before any store (dest may be acc)
                    c = c0 + lane + LANES * j
                    if c < head_dim:
                        a[j] = load_acc(acc[b, h, i, c])
                        p[j] = load_part(part[b, h, i, c])
                for j in range(CJ):
                    c = c0 + lane + LANES * j
                    if c < head_dim:
                        dest[b, h, i, c] = store(a[j] * weight + p[j] * part_weight)
        # every lane has read the row's old lse before lane 0 overwrites it
        if WARP_LANES:
            cuda.syncwarp()
        else:
            cuda.syncthreads()
        if inside and lane == 0:
            acc_lse[b, h, i] = merged

    return kernel


# -- the vector kernel ---------------------------------------------------------------------------------------------
def _vector_loader(kind: str, width: int):
    """Device function ``(x, b, h, i, c, out, o)``: ``out[o : o + width]`` = the float32 values of
    ``x[b, h, i, c : c + width]`` in one vector load (16 bytes; 8 for four 16-bit elements). ``kind``: ``float32``,
    or ``float16`` / ``bfloat16`` read through a uint16 view."""
    if kind == "float32":
        if width != 4:
            raise ValueError(f"float32 vectors have 4 elements, not {width}")

        def load(x, b, h, i, c, out, o):
            v = ptx.load_f32x4(x[b, h], i, c)
            out[o], out[o + 1], out[o + 2], out[o + 3] = v[0], v[1], v[2], v[3]

        return device_function(load)
    cvt, high = (ptx.bf16_to_float if kind == "bfloat16" else ptx.half_to_float), ptx.high_u16
    if width == 8:
        def load(x, b, h, i, c, out, o):
            w = ptx.load_u16x8(x[b, h], i, c)
            out[o], out[o + 1], out[o + 2], out[o + 3] = cvt(w[0]), cvt(high(w[0])), cvt(w[1]), cvt(high(w[1]))
            out[o + 4], out[o + 5], out[o + 6], out[o + 7] = cvt(w[2]), cvt(high(w[2])), cvt(w[3]), cvt(high(w[3]))
    else:
        def load(x, b, h, i, c, out, o):
            w = ptx.load_u16x4(x[b, h], i, c)
            out[o], out[o + 1], out[o + 2], out[o + 3] = cvt(w[0]), cvt(high(w[0])), cvt(w[1]), cvt(high(w[1]))

    return device_function(load)


def _vector_storer(kind: str, width: int):
    """Device function ``(x, b, h, i, c, r, o)``: ``x[b, h, i, c : c + width]`` = ``r[o : o + width]`` (float32,
    rounded to nearest even for 16-bit kinds, as the scalar kernel stores them) in one vector store."""
    if kind == "float32":
        if width != 4:
            raise ValueError(f"float32 vectors have 4 elements, not {width}")

        def store(x, b, h, i, c, r, o):
            ptx.store_f32x4(x[b, h, i], c, r[o], r[o + 1], r[o + 2], r[o + 3])

        return device_function(store)
    pack = ptx.pack_bf16x2 if kind == "bfloat16" else ptx.pack_half2
    if width == 8:
        store16 = ptx.store_u32x4_1d

        def store(x, b, h, i, c, r, o):
            store16(x[b, h, i], c, pack(r[o], r[o + 1]), pack(r[o + 2], r[o + 3]), pack(r[o + 4], r[o + 5]),
                    pack(r[o + 6], r[o + 7]))
    else:
        store8 = ptx.store_u32x2_1d

        def store(x, b, h, i, c, r, o):
            store8(x[b, h, i], c, pack(r[o], r[o + 1]), pack(r[o + 2], r[o + 3]))

    return device_function(store)


_STORAGE = {"float32": "float32", "float16": "uint16", "bfloat16": "uint16"}


@lru_cache(maxsize=None)
def merge_vector_kernel(lanes: int, rows: int, per_lane: int, width: int, acc_kind: str, part_kind: str,
                        dest_kind: str):
    """The merge kernel for rows whose columns are contiguous (last stride 1) and whose starts are aligned to a
    vector of ``width`` elements (16 bytes; 8 bytes for the 16-bit arrays of a ``width`` 4 kernel), head dim a
    multiple of ``width``: each of ``lanes`` lanes of a row loads ``per_lane`` vectors of ``width`` consecutive
    columns of the accumulator and of the part a pass (vector ``lane + lanes * j``; all loads before any store),
    and stores the merged vectors. ``kinds``: ``float32``, ``float16`` or ``bfloat16``, the 16-bit ones passed as
    uint16 views. ``kernel(acc, acc_lse, part, part_lse, dest)`` as ``merge_kernel``'s; grid
    ``ceil(batch * heads * rows / rows)``, block ``(lanes, rows)``: ``32 / lanes`` rows a warp."""
    load_acc, load_part = _vector_loader(acc_kind, width), _vector_loader(part_kind, width)
    store = _vector_storer(dest_kind, width)
    lse_type = types.Array(float32, 3, "A")
    signature = types.void(types.Array(getattr(types, _STORAGE[acc_kind]), 4, "A"), lse_type,
                           types.Array(getattr(types, _STORAGE[part_kind]), 4, "A"), lse_type,
                           types.Array(getattr(types, _STORAGE[dest_kind]), 4, "A"))
    LANES, ROWS, VJ, V = lanes, rows, per_lane, width
    SPAN = LANES * VJ
    HELD = VJ * V  # values a lane holds of each array
    # a row's lanes lie in one warp (lanes divides 32); the simulator has no warps: it waits at a block barrier
    WARP_SYNC = not SIMULATOR and WARP % LANES == 0 and (LANES * ROWS) % WARP == 0
    row_of = _row_of

    @kernel_jit(signature=signature)
    def kernel(acc, acc_lse, part, part_lse, dest):
        lane = cuda.threadIdx.x
        vectors = acc.shape[3] // V
        inside, b, h, i, merged, weight, part_weight = row_of(acc, acc_lse, part_lse, cuda.blockIdx.x,
                                                              cuda.threadIdx.y, ROWS)
        if inside:
            a = cuda.local.array(HELD, float32)
            p = cuda.local.array(HELD, float32)
            for v0 in range(0, vectors, SPAN):
                for j in range(VJ):  # every load of the pass before any store (dest may be acc)
                    v = v0 + lane + LANES * j
                    if v < vectors:
                        load_acc(acc, b, h, i, v * V, a, j * V)
                        load_part(part, b, h, i, v * V, p, j * V)
                for j in range(VJ):
                    v = v0 + lane + LANES * j
                    if v < vectors:
                        for k in range(j * V, j * V + V):
                            a[k] = a[k] * weight + p[k] * part_weight
                        store(dest, b, h, i, v * V, a, j * V)
        # every lane has read the row's old lse before lane 0 overwrites it
        if WARP_SYNC:
            cuda.syncwarp()
        else:
            cuda.syncthreads()
        if inside and lane == 0:
            acc_lse[b, h, i] = merged

    return kernel


def _address(x) -> int:
    """The address of ``x``'s first element: a device view, an array with ``__cuda_array_interface__``, or (under
    the simulator) a NumPy array."""
    if isinstance(x, DeviceView):
        return x.ptr
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is None:
        interface = x.__array_interface__
    return int(interface["data"][0])


def _kind(x) -> str:
    name = np.dtype(x.dtype).name
    return "bfloat16" if name == "uint16" else name


def vector_plan(acc, part, dest, config: MergeConfig | None = None):
    """``(width, lanes, rows, per_lane)`` of the vector kernel for these arrays (as ``launch`` takes them), or
    ``None`` where only the scalar kernel applies.

    The vector width is 4 elements where an array is float32 (16-byte float32 vectors, 8-byte 16-bit ones), else 8
    (16 bytes). It applies when the head dim is a multiple of it and, in each of ``acc``, ``part`` and ``dest``,
    the columns are contiguous and the first element and the strides of the batch, head and row axes (those of more
    than one element) are multiples of the vector's bytes. A row takes the fewest lanes (a power of two, at most
    ``config.lanes`` and a warp) that cover its vectors with ``config.vector_cols`` columns a lane at most per pass
    (at least one vector); a block has ``config.lanes * config.rows`` threads (on a GPU 256: 16 rows of head dim
    128, each row 16 lanes of one 16-byte vector in bfloat16, or of two vectors of 4 with a float32 array)."""
    config = config or default_config()
    if not config.vector:
        return None
    head_dim = acc.shape[3]
    arrays = (acc, part, dest)
    width = 4 if any(np.dtype(x.dtype).itemsize == 4 for x in arrays) else 8
    if head_dim == 0 or head_dim % width:
        return None
    for x in arrays:
        size = np.dtype(x.dtype).itemsize
        align = width * size
        strides = tuple(x.strides)
        if strides[3] != size or _address(x) % align:
            return None
        if any(stride % align for n, stride in zip(x.shape[:3], strides[:3]) if n > 1):
            return None
    vectors = head_dim // width
    most = max(1, config.vector_cols // width)
    lanes = min(config.lanes, WARP, 1 << (-(-vectors // most) - 1).bit_length())
    lanes = 1 << (lanes.bit_length() - 1)  # a power of two (config.lanes may not be one)
    per_lane = min(-(-vectors // lanes), most)
    rows = max(1, config.lanes * config.rows // lanes)
    return width, lanes, rows, per_lane


def _bits(x):
    """A float16 array as its uint16 bits (the vector kernel's loads and stores take 16-bit words)."""
    return x.view(np.uint16) if np.dtype(x.dtype) == np.float16 else x


def _torch():
    import torch

    return torch


def _view(name: str, t):
    """What the kernel takes for the torch tensor ``t``: a device view of a CUDA tensor (a uint16 view of bfloat16);
    under the simulator a CPU tensor's memory as NumPy."""
    if t.is_cuda:
        return _arrays._device_view_of_torch(t)
    if SIMULATOR and t.device.type == "cpu":
        return _arrays._host_numpy(t, "torch")
    raise TypeError(f"{name}: expected a CUDA tensor (CPU tensors only under the CUDA simulator), got one on "
                    f"{t.device}")


def _check(torch, out, lse, part_out, part_lse, final_out) -> None:
    named = [("out", out), ("lse", lse), ("part_out", part_out), ("part_lse", part_lse)]
    if final_out is not None:
        named.append(("final_out", final_out))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if out.dim() != 4:
        raise ValueError(f"out: expected shape (batch, heads, rows, headdim), got {tuple(out.shape)}")
    shape, lse_shape = tuple(out.shape), tuple(out.shape[:-1])
    for name, x, expected in (("part_out", part_out, shape), ("final_out", final_out, shape),
                              ("lse", lse, lse_shape), ("part_lse", part_lse, lse_shape)):
        if x is not None and tuple(x.shape) != expected:
            what = "out's shape" if len(expected) == 4 else "out's shape without headdim"
            raise ValueError(f"{name}: expected {what} {expected}, got {tuple(x.shape)}")
    part_dtype = _arrays._dtype_name(part_out, "torch")
    if part_dtype not in _PART_DTYPES:
        raise TypeError(f"part_out: dtype {part_dtype} is not supported; expected float16, float32 or bfloat16")
    for name, x in (("out", out), ("final_out", final_out)):
        dtype = None if x is None else _arrays._dtype_name(x, "torch")
        if dtype is not None and dtype not in ("float32", part_dtype):
            raise TypeError(f"{name}: dtype {dtype}; expected float32 or part_out's dtype {part_dtype}")
    for name, x in (("lse", lse), ("part_lse", part_lse)):
        if x.dtype != torch.float32:
            raise TypeError(f"{name}: dtype {_arrays._dtype_name(x, 'torch')}; expected float32")
    for name, x in named[1:]:
        if x.device != out.device:
            raise ValueError(f"{name}: on {x.device}, out on {out.device}")


def _check_memory(views: dict, dest_name: str) -> None:
    """The written arrays (the destination and ``lse``) have distinct elements and share no memory with the others
    (the destination may be ``out`` itself: in place)."""
    for written in (dest_name, "lse"):
        if not _arrays._elements_distinct(views[written]):
            raise ValueError(f"{written}: its elements overlap (a zero or overlapping stride, as from expand); pass an "
                             "array whose elements are distinct")
        for name, view in views.items():
            if name != written and _arrays._overlap(views[written], view):
                raise ValueError(f"{written}: shares memory with {name}; pass separate arrays")


def merge_into(out, lse, part_out, part_lse, *, final_out=None, config: MergeConfig | None = None):
    """Merge the partial attention ``(part_out, part_lse)`` of the same rows over other keys into ``(out, lse)``.

    Args:
        out: the running output ``(batch, heads, rows, headdim)``, float32 or ``part_out``'s dtype; merged in place
            unless ``final_out`` is given (then only read). Any strides (e.g. ``acc[:, :, rows]``).
        lse: its running lse ``(batch, heads, rows)`` float32, updated in place (natural log).
        part_out: the part ``(batch, heads, rows, headdim)``, float16, float32 or bfloat16.
        part_lse: its lse, float32; ``-inf`` for rows the part saw no key of.
        final_out: where the merged rows go instead of ``out``: float32, or ``part_out``'s dtype (the ring's last
            merge, fusing the final cast), not overlapping the other arrays.

    CUDA tensors of one device (under the simulator CPU tensors), launched on torch's current stream. Returns the
    array written (``final_out``, else ``out``).
    """
    torch = _torch()
    _check(torch, out, lse, part_out, part_lse, final_out)
    dest_name, dest = ("out", out) if final_out is None else ("final_out", final_out)
    named = {"out": out, "lse": lse, "part_out": part_out, "part_lse": part_lse}
    if final_out is not None:
        named["final_out"] = final_out
    views = {name: _view(name, x) for name, x in named.items()}
    if out.numel() == 0:
        return dest
    _check_memory(views, dest_name)
    device_id = out.get_device() if out.is_cuda else -1
    stream = 0 if SIMULATOR or device_id < 0 else _arrays.fast_library("torch").stream(device_id)
    with on_device(device_id):
        launch(views["out"], views["lse"], views["part_out"], views["part_lse"], views[dest_name], stream, config)
    return dest


def launch(acc, acc_lse, part, part_lse, dest, stream, config: MergeConfig | None = None) -> None:
    """Launch the merge on device arrays (device views, Numba device arrays; NumPy arrays under the simulator) of
    checked shapes and dtypes (bfloat16 as uint16 bits): ``dest`` (which may be ``acc``) and ``acc_lse`` get the
    merge of ``(acc, acc_lse)`` and ``(part, part_lse)``; on ``stream`` (a driver handle or Numba stream)."""
    batch, heads, length, head_dim = acc.shape
    rows = batch * heads * length
    if rows == 0 or head_dim == 0:
        return
    config = config or default_config()
    plan = vector_plan(acc, part, dest, config)
    if plan is not None:
        width, lanes, block_rows, per_lane = plan
        blocks = -(-rows // block_rows)
        if blocks > max_grid(0):
            raise ValueError(f"out: {rows} rows (batch * heads * rows), more than one launch merges "
                             f"({max_grid(0) * block_rows})")
        kernel = merge_vector_kernel(lanes, block_rows, per_lane, width, *(_kind(x) for x in (acc, part, dest)))
        device_launch(kernel, blocks, (lanes, block_rows), stream, 0, _bits(acc), acc_lse, _bits(part), part_lse,
                      _bits(dest))
        return
    blocks = -(-rows // config.rows)
    if blocks > max_grid(0):
        raise ValueError(f"out: {rows} rows (batch * heads * rows), more than one launch merges "
                         f"({max_grid(0) * config.rows})")
    cols = min(-(-head_dim // config.lanes), config.max_cols)
    kernel = merge_kernel(config, cols, *(np.dtype(x.dtype).name for x in (acc, part, dest)))
    device_launch(kernel, blocks, (config.lanes, config.rows), stream, 0, acc, acc_lse, part, part_lse, dest)
