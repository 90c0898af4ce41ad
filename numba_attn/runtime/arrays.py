"""Array handling for every public call, in one place.

The kernels only ever see device views (``_device.DeviceView``: pointer, shape, strides, dtype; NumPy arrays under
the simulator). This module turns whatever the caller passed into those views and turns the results back into the
caller's kind of array:

* NumPy arrays and torch CPU tensors are copied to the device and the results copied back (NumPy / torch out);
* CuPy arrays, Numba device arrays and torch CUDA tensors are used in place through ``__cuda_array_interface__``
  (any strides, no copy) and the outputs are allocated by the caller's library;
* torch ``bfloat16`` tensors (which have no ``__cuda_array_interface__``) travel as a ``uint16`` bit view; raw bf16
  buffers can be passed the same way with ``dtype="bfloat16"`` where a function offers it;
* torch ``float8_e4m3fn`` tensors travel as a ``uint8`` bit view (``flash_forward``'s fp8 inputs; raw e4m3 buffers
  as uint8 arrays with ``input_dtype="float8_e4m3fn"``).

Kernels are launched on the caller's *current* stream (CuPy's or torch's), so the results are ordered after the
caller's earlier work and before its later work without any device-wide synchronisation.

Shape checks live in ``shapes``, views without copies in ``views``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import replay as _replay
from .device import (SIMULATOR, DeviceView, cuda, current_device_id, default_stream, external_stream,
                     pointer_device)

_HOST, _CUPY, _TORCH, _NUMBA = "host", "cupy", "torch", "numba"

BFLOAT16 = "bfloat16"
FLOAT8_E4M3 = "float8_e4m3fn"


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
    elif SIMULATOR and _is_simulated_device_array(x):
        library = "numba"
    else:
        return "unknown"
    _LIBRARY_OF_TYPE[type(x)] = library
    return library


def _is_simulated_device_array(x: Any) -> bool:
    """A Numba device array of the simulator (``cuda.to_device`` there), which has no ``__cuda_array_interface__``."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return isinstance(x, FakeCUDAArray)


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
_LIBRARY_NAMES = {"numpy": "NumPy array", "torch": "torch tensor", "cupy": "CuPy array",
                  "numba": "Numba device array"}


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
        if SIMULATOR:
            return _Placement(_NUMBA, "numba", 0)
        # the device that holds the memory (the current one for an empty array, whose pointer may be null)
        device = pointer_device(DeviceView.of(x).ptr)
        return _Placement(_NUMBA, "numba", device if device >= 0 else current_device_id())
    raise TypeError(
        f"{name}: expected a NumPy array, CuPy array, Numba device array or torch tensor, got {type(x).__name__}"
    )


@dataclass
class Output:
    """An output array: ``view`` is what the kernel writes, ``obj`` the caller's array (None: make one at the end)."""

    view: Any
    obj: Any = None
    dtype: str | None = None  # of the values (bfloat16 views hold uint16 bits)


def _torch_from_numpy(host: np.ndarray, dtype: str | None = None):
    """The torch CPU tensor over ``host``'s memory; ``dtype`` bfloat16: ``host`` holds its bits (uint16)."""
    import torch

    if dtype == BFLOAT16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(host)


def _host_numpy(x: Any, library: str) -> np.ndarray:
    """A host array (NumPy, or a torch CPU tensor) as NumPy over the same memory; bfloat16 tensors, which NumPy
    cannot hold, as their bits (uint16)."""
    if library != "torch":
        return x
    x = x.detach()
    if _dtype_name(x, "torch") == BFLOAT16:
        import torch

        return x.view(torch.int16).numpy().view(np.uint16)
    if _dtype_name(x, "torch") == FLOAT8_E4M3:
        import torch

        return x.view(torch.uint8).numpy()
    return x.numpy()


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
    host_inputs: dict = field(default_factory=dict)  # host callers: the caller's arrays (NumPy), before any copy

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
            return Output(view=view, obj=out, dtype=dtype)
        if out is not None:
            view = self._device_view(name, out, _placement(name, out))
            self.check_writes(name, view)
            return Output(view=view, obj=out)
        if self.kind == _CUPY or self.kind == _TORCH:
            arr = fast_library(self.kind).empty(shape, dtype, self.device_id)
            view = _device_view_of_cupy(arr) if self.kind == _CUPY else _device_view_of_torch(arr)
            _replay.note_alloc(arr, view.ptr, shape, dtype, view.size * view.dtype.itemsize)
            return Output(view=view, obj=arr)
        arr = cuda.device_array(shape, dtype=_storage_dtype(dtype), stream=self.stream)
        return Output(view=arr._ary if SIMULATOR else arr, obj=arr)

    def check_writes(self, name: str, view: Any) -> None:
        """Raise unless the output ``view`` (the memory written, a device view or a host caller's NumPy array) can
        be written as the kernels do: its elements distinct (no zero or overlapping strides) and none of them in
        an input's memory (the kernels read inputs while other blocks write outputs, in no order that would make
        in-place work come out right; host callers get the same rule, so that code moves to the GPU unchanged)."""
        if not _elements_distinct(view):
            raise ValueError(f"{name}: its elements overlap (a zero or overlapping stride, as from expand or "
                             f"broadcast_to, shape {tuple(view.shape)}, strides {tuple(view.strides)}); pass an "
                             "array whose elements are distinct")
        inputs = self.host_inputs if self.kind == _HOST else self.inputs
        for input_name, x in inputs.items():
            if _overlap(view, x):
                raise ValueError(f"{name}: shares memory with {input_name}; outputs must not overlap the inputs "
                                 "(pass a separate array)")

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

    def upload(self, host: np.ndarray):
        """A device copy of the small host array ``host`` (an index table a kernel reads), made by the caller's
        library on the caller's stream, so that it is ordered before the call's kernels; under the simulator the
        array itself. Its values must follow from the call's replay key (``replay.note_upload``: a plan keeps them
        and copies them again for the streams it replays on)."""
        if SIMULATOR:
            return host
        if self.kind == _CUPY or self.kind == _TORCH:
            arr = fast_library(self.kind).upload(host, self.device_id)
            view = _device_view_of_cupy(arr) if self.kind == _CUPY else _device_view_of_torch(arr)
            _replay.note_upload(arr, view.ptr, view.size * view.dtype.itemsize, host)
            return view
        return cuda.to_device(host, stream=self.stream)

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
        if placement.kind == _HOST:  # (device outputs are checked in ``output``)
            self.check_writes(name, _host_numpy(out, placement.library))

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
                output.obj[...] = host if self.library == "numpy" else _torch_from_numpy(host, output.dtype)
            return output.obj
        return _torch_from_numpy(host, output.dtype) if self.library == "torch" else host

    # -- inputs --------------------------------------------------------------------------------------------------
    def _device_view(self, name: str, x: Any, placement: _Placement):
        if placement.library == "torch":
            return _device_view_of_torch(x)
        if placement.library == "cupy":
            return _device_view_of_cupy(x)
        if SIMULATOR:
            return x._ary  # the simulated device array's memory: kernels under the simulator take NumPy arrays
        return DeviceView.of(x)

    def add_input(self, name: str, x: Any, placement: _Placement):
        if self.kind == _HOST:
            host = _host_numpy(x, placement.library)
            self.host_inputs[name] = host
            if SIMULATOR:
                # the caller's memory itself (``launch`` hands it to the simulator without copies); read-only
                # arrays (np.load(mmap_mode="r"), np.frombuffer) are fine: inputs are never written
                self.inputs[name] = host
            else:
                # one contiguous host buffer per input: the copy to the device is a copy anyway
                self.inputs[name] = cuda.to_device(np.ascontiguousarray(host), stream=self.stream)
        else:
            self.inputs[name] = self._device_view(name, x, placement)


# -- memory overlap ---------------------------------------------------------------------------------------------------
def _layout(x: Any) -> tuple:
    """``(address, shape, byte strides, item size)`` of a device view, NumPy array or CUDA-array-interface object."""
    if isinstance(x, DeviceView):
        return x.ptr, x.shape, x.strides, x.dtype.itemsize
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0], x.shape, x.strides, x.itemsize
    if hasattr(x, "__cuda_array_interface__"):
        view = DeviceView.of(x)
        return view.ptr, view.shape, view.strides, view.dtype.itemsize
    if SIMULATOR and _is_simulated_device_array(x):
        return _layout(x._ary)
    raise TypeError(f"no memory layout for {type(x).__name__}")


def _span(layout: tuple) -> tuple | None:
    """The byte range ``[first, last)`` that the elements of ``layout`` lie in; None when it has no element."""
    ptr, shape, strides, itemsize = layout
    if any(n == 0 for n in shape):
        return None
    low = high = ptr
    for n, stride in zip(shape, strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + itemsize


_TOO_HARD = getattr(getattr(np, "exceptions", np), "TooHardError", RuntimeError)  # (np.TooHardError before 1.25)


class _Addresses:
    """An array over addresses only, for ``np.shares_memory``'s exact overlap test: NumPy never reads through it."""

    def __init__(self, layout: tuple):
        ptr, shape, strides, itemsize = layout
        self.__array_interface__ = {"data": (ptr, True), "shape": tuple(shape), "strides": tuple(strides),
                                    "typestr": f"|V{itemsize}", "version": 3}


def _overlap(a: Any, b: Any) -> bool:
    """Whether some element of ``a`` and some element of ``b`` share a byte (exact, for any strides; where the
    exact test would take too long, overlapping spans count as overlap)."""
    la, lb = _layout(a), _layout(b)
    sa, sb = _span(la), _span(lb)
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False
    try:
        return bool(np.shares_memory(np.asarray(_Addresses(la)), np.asarray(_Addresses(lb)), max_work=100_000))
    except _TOO_HARD:
        return True


def _elements_distinct(x: Any) -> bool:
    """Whether no two elements of ``x`` share a byte, i.e. writing every element loses nothing. Sufficient test:
    the axes of more than one element, sorted by stride, each step over all the smaller axes' span. Layouts that
    interleave axes without overlap fail it too; no array library makes those."""
    _, shape, strides, itemsize = _layout(x)
    span = itemsize
    for n, stride in sorted(((n, abs(s)) for n, s in zip(shape, strides) if n > 1), key=lambda a: a[1]):
        if stride < span:
            return False
        span = stride * (n - 1) + span
    return True


def _storage_dtype(dtype: str):
    # bfloat16 travels as its bit pattern; the kernels convert it on load
    return np.uint16 if dtype == BFLOAT16 else np.dtype(dtype)


def _torch_storage_dtypes() -> dict:
    import torch

    # bfloat16 travels as its bit pattern (uint16); the kernels convert it on load; int32: flash_decode's index
    # arrays (cache_seqlens, block_table); float8 e4m3 as its bit pattern (uint8)
    dtypes = {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
              torch.bfloat16: np.dtype(np.uint16), torch.float64: np.dtype(np.float64),
              torch.int32: np.dtype(np.int32)}
    if hasattr(torch, "float8_e4m3fn"):
        dtypes[torch.float8_e4m3fn] = np.dtype(np.uint8)
    return dtypes


_TORCH_DTYPES: dict | None = None


def _torch_dtypes() -> dict:
    """``_torch_storage_dtypes()``, made once (assigned whole: a thread never sees it half filled)."""
    global _TORCH_DTYPES
    dtypes = _TORCH_DTYPES
    if dtypes is None:
        dtypes = _TORCH_DTYPES = _torch_storage_dtypes()
    return dtypes


def _device_view_of_torch(t: Any) -> DeviceView:
    # read straight from the tensor: its __cuda_array_interface__ (and a Numba array made from it) costs tens of
    # microseconds per array, more than a small kernel runs
    dtype = _torch_dtypes().get(t.dtype)
    if dtype is None:
        return DeviceView.of(t)
    itemsize = dtype.itemsize
    return DeviceView(t.data_ptr(), tuple(t.shape), tuple(map(itemsize.__mul__, t.stride())), dtype, t)


def _device_view_of_cupy(x: Any) -> DeviceView:
    return DeviceView(x.data.ptr, x.shape, x.strides, x.dtype, x)


def fast_layout(x: Any):
    """``(dtype, device, shape, byte strides, pointer, storage dtype)`` of a torch CUDA tensor or a CuPy array, read
    with a few attribute lookups (``_decode_plan``'s keys); None for anything else."""
    library = _library_of(x)
    if library == "torch":
        storage = _torch_dtypes().get(x.dtype)
        if storage is None or not x.is_cuda:
            return None
        itemsize = storage.itemsize
        # (map over a bound method: no Python frame per axis, as a generator has)
        return (x.dtype, x.get_device(), tuple(x.shape), tuple(map(itemsize.__mul__, x.stride())), x.data_ptr(),
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

    def upload(self, host: np.ndarray, device_id: int):
        """A copy of the host array on the device, queued on the current stream. Not blocking: from pageable memory
        the copy returns once the driver has staged the bytes (``host`` may go), and the kernels queued after it on
        the stream read the copy; a blocking copy would wait for all the stream's queued work."""
        device = self.devices.get(device_id)
        if device is None:
            device = self.devices[device_id] = self.torch.device("cuda", device_id)
        return self.torch.from_numpy(np.ascontiguousarray(host)).to(device, non_blocking=True)

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

    def upload(self, host: np.ndarray, device_id: int):
        """A copy of the host array on the device, on the current stream."""
        with self.cupy.cuda.Device(device_id):
            return self.cupy.asarray(host)

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
    return external_stream(ptr, device_id) if ptr else default_stream(device_id)


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
            if placement.kind != _HOST and placement.library != first_placement.library:
                raise ValueError(
                    f"{name}: is a {_LIBRARY_NAMES[placement.library]} but {first_name} is a "
                    f"{_LIBRARY_NAMES[first_placement.library]}; pass the device arrays of one call from one "
                    "library (the kernels run on the first array's library's current stream, which does not wait "
                    "for work queued on another library's stream); torch.as_tensor(x, device='cuda') and "
                    "cupy.asarray(x) convert without a copy"
                )
            if placement.device_id != first_placement.device_id:
                raise ValueError(
                    f"{name}: is on GPU {placement.device_id} but {first_name} is on GPU {first_placement.device_id}"
                )
            if name not in own_dtype and dtype != common_dtype:
                raise TypeError(f"{name}: dtype {dtype} differs from {first_name}'s {common_dtype}; cast them to one")
        placements[name] = placement

    # Device arrays come from one library (checked above); host arrays may mix NumPy and torch CPU tensors (they are
    # copied anyway), and the outputs follow the first array's library.
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
