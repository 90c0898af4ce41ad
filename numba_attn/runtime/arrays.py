"""Array handling for every public call, in one place.

The kernels only ever see device views (``_device.DeviceView``: pointer, shape, strides, dtype; NumPy arrays under
the simulator). This module turns whatever the caller passed into those views and turns the results back into the
caller's kind of array:

* NumPy arrays and torch CPU tensors are copied to the device and the results copied back (NumPy / torch out);
* CuPy arrays, Numba device arrays and torch CUDA tensors are used in place through ``__cuda_array_interface__``
  (any strides, no copy) and the outputs are allocated by the caller's library;
* torch ``bfloat16`` tensors (which have no ``__cuda_array_interface__``) travel as a ``uint16`` bit view; raw bf16
  buffers can be passed the same way with ``dtype="bfloat16"`` where a function offers it.

Kernels are launched on the caller's *current* stream (CuPy's or torch's), so the results are ordered after the
caller's earlier work and before its later work without any device-wide synchronisation.

It also holds the argument checks shared by the public functions, so that every bad input gets the same clear
message naming the argument and what was expected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .device import SIMULATOR, DeviceView, cuda, current_device_id, default_stream, external_stream

#: Head dims the kernels accept (the tiles hold at most 256 columns).
MAX_HEAD_DIM = 256

_HOST, _CUPY, _TORCH, _NUMBA = "host", "cupy", "torch", "numba"

BFLOAT16 = "bfloat16"


# Every public call looks up its arrays' library and dtype names; decoding calls come once per generated token and
# take tens of microseconds of GPU time, so these lookups are cached per type / dtype object.
_LIBRARY_OF_TYPE: dict = {}
_TORCH_DTYPE_NAMES: dict = {}


def _library_of(x: Any) -> str:
    library = _LIBRARY_OF_TYPE.get(type(x))
    if library is not None:
        return library
    module = type(x).__module__
    if isinstance(x, np.ndarray):
        library = "numpy"
    elif module.startswith("torch"):
        library = "torch"
    elif module.startswith("cupy"):
        library = "cupy"
    elif hasattr(x, "__cuda_array_interface__"):
        return "numba"  # any object with the interface: by object, not by type
    else:
        return "unknown"
    _LIBRARY_OF_TYPE[type(x)] = library
    return library


def _dtype_name(x: Any, library: str) -> str:
    if library == "torch":
        name = _TORCH_DTYPE_NAMES.get(x.dtype)
        if name is None:
            name = str(x.dtype).replace("torch.", "")
            name = {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)
            _TORCH_DTYPE_NAMES[x.dtype] = name
        return name
    return np.dtype(x.dtype).name


@dataclass(frozen=True)
class _Placement:
    kind: str  # host, cupy, torch or numba
    library: str  # numpy, torch, cupy, numba
    device_id: int  # -1 for host arrays


_TORCH_CUDA_PLACEMENTS: dict = {}


def _placement(name: str, x: Any) -> _Placement:
    library = _library_of(x)
    if library == "numpy":
        return _Placement(_HOST, "numpy", -1)
    if library == "torch":
        if x.is_cuda:
            index = x.get_device()
            placement = _TORCH_CUDA_PLACEMENTS.get(index)
            if placement is None:
                placement = _TORCH_CUDA_PLACEMENTS[index] = _Placement(_TORCH, "torch", index)
            return placement
        if x.device.type == "cpu":
            return _Placement(_HOST, "torch", -1)
        raise TypeError(f"{name}: torch tensors must be on a CUDA device or the CPU, got device {x.device}")
    if library == "cupy":
        return _Placement(_CUPY, "cupy", x.device.id)
    if library == "numba":
        return _Placement(_NUMBA, "numba", current_device_id() if not SIMULATOR else 0)
    raise TypeError(
        f"{name}: expected a NumPy array, CuPy array, Numba device array or torch tensor, got {type(x).__name__}"
    )


@dataclass
class Output:
    """An output array: ``view`` is what the kernel writes, ``obj`` the caller's array (None: make one at the end)."""

    view: Any
    obj: Any = None


def _torch_from_numpy(host: np.ndarray):
    import torch

    return torch.from_numpy(host)


@dataclass
class Call:
    """One public call's arrays: validated, on the device, with the stream to launch on.

    ``call.inputs[name]`` is the device view a kernel takes; ``call.output(shape)`` makes an output of the caller's
    kind; ``call.result(output)`` is what the caller gets back.
    """

    kind: str
    library: str
    device_id: int
    dtype: str  # float16, float32 or bfloat16
    stream: Any
    inputs: dict = field(default_factory=dict)

    # -- outputs -------------------------------------------------------------------------------------------------
    def output(self, shape: tuple, dtype: str | None = None, out: Any = None, name: str = "out") -> "Output":
        """An output of the caller's kind: a new uninitialised one, or the caller's ``out`` after checking it."""
        dtype = dtype or self.dtype
        if out is not None:
            self._check_out(name, out, shape, dtype)
        if self.kind == _HOST:
            # a fresh contiguous buffer even for a caller's out= (which may be strided): copied into it at the end
            if SIMULATOR:
                view = np.empty(shape, dtype=_storage_dtype(dtype))
            else:
                view = cuda.device_array(shape, dtype=_storage_dtype(dtype), stream=self.stream)
            return Output(view=view, obj=out)
        if out is not None:
            return Output(view=self._device_view(name, out, _placement(name, out)), obj=out)
        if self.kind == _CUPY:
            arr = fast_library("cupy").empty(shape, dtype, self.device_id)
            return Output(view=_device_view_of_cupy(arr), obj=arr)
        if self.kind == _TORCH:
            arr = fast_library("torch").empty(shape, dtype, self.device_id)
            return Output(view=_device_view_of_torch(arr), obj=arr)
        view = cuda.device_array(shape, dtype=_storage_dtype(dtype), stream=self.stream)
        return Output(view=view, obj=view)

    def scratch(self, shape: tuple, dtype: str = "float32"):
        """A temporary device array for a kernel's intermediate results (split-KV parts, partial states).

        Allocated by the caller's library on the caller's stream (CuPy's and torch's pools are stream-ordered),
        so dropping it after the launches is safe and costs no synchronisation; Numba's allocator otherwise.
        """
        if SIMULATOR:
            return np.empty(shape, dtype=_storage_dtype(dtype))
        if self.kind in (_CUPY, _TORCH):
            return self.output(shape, dtype).view
        return cuda.device_array(shape, dtype=_storage_dtype(dtype), stream=self.stream)

    def _check_out(self, name: str, out: Any, shape: tuple, dtype: str) -> None:
        placement = _placement(name, out)
        if placement.kind != self.kind or placement.device_id != self.device_id:
            raise ValueError(
                f"{name}: must live where the inputs live ({self.library}, device {self.device_id}), "
                f"got {placement.library} on device {placement.device_id}"
            )
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
        if _dtype_name(out, placement.library) != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {_dtype_name(out, placement.library)}")
        if placement.kind == _HOST and placement.library == "numpy" and not out.flags.writeable:
            raise ValueError(f"{name}: must be writeable")

    def result(self, output: "Output"):
        """What the caller gets back: the output array of its kind (copied to the host for host callers)."""
        if self.kind != _HOST:
            return output.obj
        if SIMULATOR:
            host = output.view
        else:
            host = output.view.copy_to_host(stream=self.stream)
            self.stream.synchronize()
        if output.obj is not None:
            if output.obj is not host:
                output.obj[...] = host if self.library == "numpy" else _torch_from_numpy(host)
            return output.obj
        return _torch_from_numpy(host) if self.library == "torch" else host

    # -- inputs --------------------------------------------------------------------------------------------------
    def _device_view(self, name: str, x: Any, placement: _Placement):
        if placement.library == "torch":
            return _device_view_of_torch(x)
        if placement.library == "cupy":
            return _device_view_of_cupy(x)
        if SIMULATOR:
            if cuda.is_cuda_array(x) and hasattr(x, "gpu_data"):
                return x  # already a (simulated) Numba device array
            return cuda.as_cuda_array(x, sync=False)
        return DeviceView.of(x)

    def add_input(self, name: str, x: Any, placement: _Placement):
        if self.kind == _HOST:
            host = x.detach().numpy() if placement.library == "torch" else x
            if SIMULATOR:
                # the simulator only takes contiguous host buffers
                self.inputs[name] = np.ascontiguousarray(host)
            else:
                # one contiguous host buffer per input: the copy to the device is a copy anyway
                self.inputs[name] = cuda.to_device(np.ascontiguousarray(host), stream=self.stream)
        else:
            self.inputs[name] = self._device_view(name, x, placement)


def _storage_dtype(dtype: str):
    # bfloat16 travels as its bit pattern; the kernels convert it on load
    return np.uint16 if dtype == BFLOAT16 else np.dtype(dtype)


def _torch_storage_dtypes() -> dict:
    import torch

    # bfloat16 travels as its bit pattern (uint16); the kernels convert it on load
    return {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
            torch.bfloat16: np.dtype(np.uint16), torch.float64: np.dtype(np.float64)}


_TORCH_DTYPES: dict = {}


def _device_view_of_torch(t: Any) -> DeviceView:
    # read straight from the tensor: its __cuda_array_interface__ (and a Numba array made from it) costs tens of
    # microseconds per array, more than a small kernel runs
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update(_torch_storage_dtypes())
    dtype = _TORCH_DTYPES.get(t.dtype)
    if dtype is None:
        return DeviceView.of(t)
    itemsize = dtype.itemsize
    return DeviceView(t.data_ptr(), tuple(t.shape), tuple(s * itemsize for s in t.stride()), dtype, t)


def _device_view_of_cupy(x: Any) -> DeviceView:
    return DeviceView(x.data.ptr, x.shape, x.strides, x.dtype, x)


def fast_layout(x: Any):
    """``(dtype, device, shape, byte strides, pointer, storage dtype)`` of a torch CUDA tensor or a CuPy array, read
    with a few attribute lookups (``_decode_plan``'s keys); None for anything else."""
    library = _library_of(x)
    if library == "torch":
        if not _TORCH_DTYPES:
            _TORCH_DTYPES.update(_torch_storage_dtypes())
        storage = _TORCH_DTYPES.get(x.dtype)
        if storage is None or not x.is_cuda:
            return None
        itemsize = storage.itemsize
        return (x.dtype, x.get_device(), tuple(x.shape), tuple(s * itemsize for s in x.stride()), x.data_ptr(),
                storage)
    if library == "cupy":
        return (x.dtype, x.device.id, x.shape, x.strides, x.data.ptr, x.dtype)
    return None


class _TorchOps:
    """The few torch operations a planned call needs (``fast_library``)."""

    def __init__(self):
        import torch

        self.torch = torch
        self.dtypes: dict = {}
        self.devices: dict = {}
        # the current stream's handle without making a Stream object (20x cheaper); private, so looked up once
        self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def empty(self, shape: tuple, dtype: str, device_id: int):
        torch_dtype = self.dtypes.get(dtype)
        if torch_dtype is None:
            torch_dtype = self.dtypes[dtype] = getattr(self.torch, dtype)
        device = self.devices.get(device_id)
        if device is None:
            device = self.devices[device_id] = self.torch.device("cuda", device_id)
        return self.torch.empty(shape, dtype=torch_dtype, device=device)

    @staticmethod
    def pointer(x) -> int:
        return x.data_ptr()

    @staticmethod
    def view(x) -> DeviceView:
        return _device_view_of_torch(x)

    def stream(self, device_id: int) -> int:
        if self.raw_stream is not None:
            return self.raw_stream(device_id)
        return self.torch.cuda.current_stream(device_id).cuda_stream


class _CupyOps:
    """The few CuPy operations a planned call needs (``fast_library``)."""

    def __init__(self):
        import cupy

        self.cupy = cupy

    def empty(self, shape: tuple, dtype: str, device_id: int):
        with self.cupy.cuda.Device(device_id):
            return self.cupy.empty(shape, dtype=_storage_dtype(dtype))

    @staticmethod
    def pointer(x) -> int:
        return x.data.ptr

    @staticmethod
    def view(x) -> DeviceView:
        return _device_view_of_cupy(x)

    def stream(self, device_id: int) -> int:
        with self.cupy.cuda.Device(device_id):
            return self.cupy.cuda.get_current_stream().ptr


_FAST_LIBRARIES: dict = {}


def fast_library(library: str):
    """Allocation, pointers, views and the current stream of ``library`` ("torch" or "cupy")."""
    ops = _FAST_LIBRARIES.get(library)
    if ops is None:
        ops = _FAST_LIBRARIES[library] = {"torch": _TorchOps, "cupy": _CupyOps}[library]()
    return ops


def _caller_stream(kind: str, device_id: int):
    if SIMULATOR:
        return 0
    if kind == _CUPY:
        import cupy

        with cupy.cuda.Device(device_id):
            ptr = cupy.cuda.get_current_stream().ptr
    elif kind == _TORCH:
        import torch

        ptr = torch.cuda.current_stream(device_id).cuda_stream
    else:
        return cuda.default_stream()
    # ptr 0 is the legacy default stream; Numba's default stream object is that stream
    return external_stream(ptr) if ptr else default_stream(device_id)


def prepare(
    arrays: dict[str, Any],
    *,
    dtypes: tuple[str, ...] = ("float16", "float32", BFLOAT16),
    own_dtype: dict[str, tuple[str, ...]] | None = None,
) -> Call:
    """Validate the named input arrays of one call and bring them onto the device.

    All arrays must be of one kind (all host or all on the same GPU) and share one dtype from ``dtypes``, except
    those named in ``own_dtype``, which need one of their own listed dtypes instead.
    """
    own_dtype = own_dtype or {}
    first_name, first_placement = None, None
    common_dtype = None
    placements = {}
    for name, x in arrays.items():
        placement = _placement(name, x)
        dtype = _dtype_name(x, placement.library)
        allowed = own_dtype.get(name, dtypes)
        if dtype not in allowed:
            raise TypeError(f"{name}: dtype {dtype} is not supported; expected {' or '.join(allowed)}")
        if first_placement is None:
            first_name, first_placement, common_dtype = name, placement, dtype
        else:
            if placement.kind == _HOST and first_placement.kind != _HOST or (
                placement.kind != _HOST and first_placement.kind == _HOST
            ):
                raise ValueError(
                    f"{name}: is on the {'host' if placement.kind == _HOST else 'GPU'} but {first_name} is on the "
                    f"{'host' if first_placement.kind == _HOST else 'GPU'}; pass all arrays from one place"
                )
            if placement.device_id != first_placement.device_id:
                raise ValueError(
                    f"{name}: is on GPU {placement.device_id} but {first_name} is on GPU {first_placement.device_id}"
                )
            if name not in own_dtype and dtype != common_dtype:
                raise TypeError(f"{name}: dtype {dtype} differs from {first_name}'s {common_dtype}; cast them to one")
        placements[name] = placement

    # Several device libraries at once (say CuPy q, torch k) are allowed; outputs follow the first array's library.
    kind = first_placement.kind
    library = first_placement.library
    call = Call(
        kind=kind,
        library=library,
        device_id=first_placement.device_id,
        dtype=common_dtype,
        stream=_caller_stream(kind, first_placement.device_id),
    )
    for name, x in arrays.items():
        call.add_input(name, x, placements[name])
    return call


# -- shape checks shared by the public functions ---------------------------------------------------------------------
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
    return not any(stride % piece for size, stride in zip(shape[:-1], strides[:-1]) if size > 1)


def lift(view: Any, ndim: int):
    """Prepend length-1 axes up to ``ndim``: ``(seqlen, headdim)`` -> ``(1, 1, seqlen, headdim)``, ``(seqlen,)`` ->
    ``(1, 1, seqlen)``. The kernels only know the batched layout."""
    return with_unit_axes(view, 0, ndim - view.ndim) if view.ndim < ndim else view


def check_rank(name: str, x: Any) -> int:
    _placement(name, x)  # not an array at all: a TypeError naming the argument
    ndim = len(x.shape)
    if ndim not in (2, 4):
        raise ValueError(f"{name}: expected shape (batch, heads, seqlen, headdim) or (seqlen, headdim), got {tuple(x.shape)}")
    return ndim


@dataclass
class AttentionShape:
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    ndim: int  # 2 or 4, the rank the caller used

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    def out_shape(self, last: int | None = None) -> tuple:
        last = self.head_dim if last is None else last
        if self.ndim == 2:
            return (self.seqlen_q, last)
        return (self.batch, self.heads, self.seqlen_q, last)

    def lse_shape(self) -> tuple:
        return (self.seqlen_q,) if self.ndim == 2 else (self.batch, self.heads, self.seqlen_q)


def _batched_shapes(q: Any, k: Any, v: Any) -> tuple[tuple, tuple, tuple, int]:
    """The shapes of q, k, v as ``(batch, heads, seqlen, dim)`` and the rank the caller used (2 or 4, the same for
    all three)."""
    ranks = {name: check_rank(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(ranks.values())) != 1:
        raise ValueError(f"q, k, v: must all have the same rank, got {ranks['q']}, {ranks['k']}, {ranks['v']}")
    qs, ks, vs = (tuple(x.shape) for x in (q, k, v))
    if ranks["q"] == 2:
        qs, ks, vs = (1, 1) + qs, (1, 1) + ks, (1, 1) + vs
    return qs, ks, vs, ranks["q"]


def attention_shape(q: Any, k: Any, v: Any) -> AttentionShape:
    """Check q, k, v of ``(batch, heads, seqlen, headdim)`` (k/v may have fewer heads: GQA) or ``(seqlen, headdim)``."""
    qs, ks, vs, ndim = _batched_shapes(q, k, v)
    b, h, lq, d = qs
    if ks[0] != b or vs[0] != b:
        raise ValueError(f"k, v: batch must match q's batch {b}, got k {ks[0]} and v {vs[0]}")
    if ks[1] != vs[1]:
        raise ValueError(f"k, v: must have the same number of heads, got {ks[1]} and {vs[1]}")
    hk = ks[1]
    if hk < 1 or h % hk != 0:
        raise ValueError(f"k: number of heads {hk} must divide q's {h} (grouped-query attention)")
    if ks[2] != vs[2]:
        raise ValueError(f"v: seqlen must equal k's seqlen {ks[2]}, got {vs[2]}")
    if not (1 <= d <= MAX_HEAD_DIM):
        raise ValueError(f"q: headdim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if ks[3] != d:
        raise ValueError(f"k: headdim must equal q's headdim {d}, got {ks[3]}")
    if vs[3] != d:
        raise ValueError(f"v: headdim must equal q's headdim {d}, got {vs[3]}")
    return AttentionShape(b, h, hk, lq, ks[2], d, ndim)


@dataclass
class LinearShape:
    batch: int
    heads: int
    seqlen: int
    key_dim: int  # E
    value_dim: int  # M
    ndim: int

    def out_shape(self) -> tuple:
        if self.ndim == 2:
            return (self.seqlen, self.value_dim)
        return (self.batch, self.heads, self.seqlen, self.value_dim)

    def state_shape(self) -> tuple:
        """Shape of a state ``sum k_j v_j^T``: ``(batch, heads, E, M)``, or ``(E, M)`` for unbatched inputs."""
        if self.ndim == 2:
            return (self.key_dim, self.value_dim)
        return (self.batch, self.heads, self.key_dim, self.value_dim)


def linear_shape(q: Any, k: Any, v: Any, max_dim: int = MAX_HEAD_DIM) -> LinearShape:
    """Check q, k ``(batch, heads, seqlen, E)`` and v ``(batch, heads, seqlen, M)`` (or the same without batch, heads)."""
    qs, ks, vs, ndim = _batched_shapes(q, k, v)
    if ks[:3] != qs[:3]:
        raise ValueError(f"k: (batch, heads, seqlen) must equal q's {qs[:3]}, got {ks[:3]}")
    if vs[:3] != qs[:3]:
        raise ValueError(f"v: (batch, heads, seqlen) must equal q's {qs[:3]}, got {vs[:3]}")
    if ks[3] != qs[3]:
        raise ValueError(f"k: feature dim E must equal q's {qs[3]}, got {ks[3]}")
    if not (1 <= qs[3] <= max_dim):
        raise ValueError(f"q: feature dim E must be between 1 and {max_dim}, got {qs[3]}")
    if not (1 <= vs[3] <= max_dim):
        raise ValueError(f"v: value dim M must be between 1 and {max_dim}, got {vs[3]}")
    return LinearShape(qs[0], qs[1], qs[2], qs[3], vs[3], ndim)
