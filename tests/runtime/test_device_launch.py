"""The launcher of `runtime.launch` and the device views of `runtime.device`: and the cached cuLaunchKernel path against Numba's own launch."""
from __future__ import annotations

import numpy as np
import pytest

from numba_attn.runtime import arrays as _arrays
from numba_attn.runtime import views as _views
from numba_attn.runtime import device as _device
from numba_attn.runtime import launch as _launch
from numba_attn.runtime.device import DeviceView


class _Foreign:
    """Some other library's device array: only ``__cuda_array_interface__``."""

    def __init__(self, ptr, shape, typestr, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": strides}


def test_view_of_contiguous_interface_computes_strides():
    view = DeviceView.of(_Foreign(4096, (2, 3, 5), "<f4"))
    assert view.strides == (60, 20, 4)
    assert view.params == (0, 0, 30, 4, 4096, 2, 3, 5, 60, 20, 4)


def test_view_of_strided_interface_keeps_strides():
    view = DeviceView.of(_Foreign(8192, (4, 3), "<f2", strides=(64, 2)))
    assert (view.shape, view.strides, view.dtype, view.size) == ((4, 3), (64, 2), np.dtype(np.float16), 12)
    assert view.__cuda_array_interface__["strides"] == (64, 2)


def test_view_reinterprets_only_equal_item_sizes():
    view = DeviceView.of(_Foreign(8192, (4, 3), "<f2"))
    assert view.view(np.uint16).dtype == np.uint16 and view.view(np.uint16).ptr == 8192
    with pytest.raises(TypeError, match="item sizes differ"):
        view.view(np.float32)


def test_unit_axes_on_a_view_have_stride_zero():
    view = _views.with_unit_axes(DeviceView.of(_Foreign(4096, (3, 5), "<f4")), 0, 2)
    assert view.shape == (1, 1, 3, 5) and view.strides == (0, 0, 20, 4) and view.ptr == 4096


class _FakeCompiled:
    """What the launcher reads of a compiled Numba kernel: its argument types and its function handle."""

    def __init__(self, argument_types):
        self.argument_types = argument_types
        cufunc = type("Cufunc", (), {"handle": 0x1234})()
        self._codelibrary = type("Library", (), {"get_cufunc": lambda self: cufunc})()


def test_parameters_pack_in_numba_kernel_abi():
    """Each array becomes meminfo, parent, nitems, itemsize, data, shape..., strides... and each scalar one
    8-byte slot whose leading bytes hold the value (what cuLaunchKernel reads for a smaller parameter)."""
    import ctypes
    import struct

    from numba.cuda import types

    compiled = _FakeCompiled([types.Array(types.float32, 2, "A"), types.int32, types.float32, types.boolean,
                              types.int64, types.uint16])
    entry = _launch._Launchable(object(), compiled, 0, fixed_signature=True)
    assert entry.slots == 9 + 5 and entry.handle == 0x1234
    view = DeviceView.of(_Foreign(4096, (3, 5), "<f4", strides=(40, 4)))
    buffer, pointers = entry.buffers()
    entry.packer.pack_into(buffer, 0, *view.params, -7, 1.5, True, -(2**40), 65535)
    raw = bytes(buffer)
    assert struct.unpack("<9q", raw[:72]) == (0, 0, 15, 4, 4096, 3, 5, 40, 4)
    assert struct.unpack("<i", raw[72:76])[0] == -7
    assert struct.unpack("<f", raw[80:84])[0] == 1.5
    assert raw[88] == 1
    assert struct.unpack("<q", raw[96:104])[0] == -(2**40)
    assert struct.unpack("<H", raw[104:106])[0] == 65535
    base = ctypes.addressof(buffer)
    assert list(pointers) == [base + 8 * i for i in range(entry.slots)]


def test_fixed_contiguous_signatures_are_left_to_numba():
    """Per launch only dtype and rank are checked: a fixed signature with a C-contiguous array type would take a
    strided view silently, so the launcher refuses it (Numba's launch then checks the layout)."""
    from numba.cuda import types

    compiled = _FakeCompiled([types.Array(types.float32, 1, "C")])
    with pytest.raises(NotImplementedError):
        _launch._Launchable(object(), compiled, 0, fixed_signature=True)
    assert _launch._Launchable(object(), compiled, 0, fixed_signature=False).slots == 7


# -- on a GPU ------------------------------------------------------------------------------------------------------
def _scalars_kernel():
    from numba import cuda

    @cuda.jit
    def kernel(x, out, scale, offset, flag, big):
        # one thread per row; strided 2-d views, and one scalar of each parameter width
        i = cuda.grid(1)
        if i < x.shape[0]:
            for j in range(x.shape[1]):
                out[i, j] = x[i, j] * scale + offset + (1.0 if flag else 0.0) + big * 1e-12

    return kernel


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False])
def test_fast_launch_packs_arrays_and_scalars(fast, monkeypatch):
    import cupy
    from numba import float32, int32, int64

    monkeypatch.setattr(_launch, "FAST_LAUNCH", fast)
    kernel = _scalars_kernel()
    rng = np.random.default_rng(1)
    base = cupy.asarray(rng.standard_normal((70, 9)).astype(np.float32))
    x = base[::3, 1:8]  # strided rows and an offset start
    out_base = cupy.full((24, 16), np.nan, np.float32)
    out = out_base[:, ::2][:, :7]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        _launch.launch(kernel, 1, 32, _device.external_stream(stream.ptr), 0,
                       DeviceView.of(x), DeviceView.of(out), float32(1.5), int32(-3), True, int64(5 * 10**12))
    stream.synchronize()
    expected = cupy.asnumpy(x) * 1.5 - 3 + 1 + 5.0
    np.testing.assert_allclose(cupy.asnumpy(out), expected, rtol=1e-6)
    # nothing outside the strided view was written
    untouched = cupy.asnumpy(out_base).copy()
    untouched[:, :14:2] = 0
    assert np.isnan(untouched[:, 1::2]).all() and np.isnan(untouched[:, 14:]).all()


@pytest.mark.gpu
def test_fast_launch_keeps_an_overload_per_layout(monkeypatch):
    """A lazily compiled kernel gets one overload per Numba type: a contiguous and a strided view of the same
    dtype must not share one (the contiguous code ignores strides)."""
    import cupy
    from numba import float32, int32, int64

    monkeypatch.setattr(_launch, "FAST_LAUNCH", True)
    kernel = _scalars_kernel()
    x = cupy.arange(64, dtype=cupy.float32).reshape(8, 8)
    for source in (x, x[:, ::2], x.T):
        out = cupy.zeros(source.shape, cupy.float32)
        _launch.launch(kernel, 1, 32, 0, 0, DeviceView.of(source), DeviceView.of(out),
                       float32(1.0), int32(0), False, int64(0))
        np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(source))


@pytest.mark.gpu
def test_fast_launch_rejects_a_wrong_dtype_for_a_fixed_signature():
    import cupy
    from numba import cuda, types

    @cuda.jit(types.void(types.Array(types.float32, 1, "A")))
    def kernel(x):
        x[0] = 1.0

    bad = cupy.zeros(4, cupy.float64)
    with pytest.raises(TypeError, match="expected a 1-d float32 array, got 1-d float64"):
        _launch.launch(kernel, 1, 1, 0, 0, DeviceView.of(bad))


@pytest.mark.gpu
def test_fast_launch_raises_the_shared_memory_limit():
    """A kernel using 100 KB of dynamic shared memory: a plain launch fails, the launcher raises the attribute."""
    import cupy
    from numba import cuda, float32

    @cuda.jit
    def kernel(out):
        buf = cuda.shared.array(0, float32)
        t = cuda.threadIdx.x
        for i in range(t, 25_600, cuda.blockDim.x):
            buf[i] = i
        cuda.syncthreads()
        if t == 0:
            out[0] = buf[25_599]

    out = cupy.zeros(1, cupy.float32)
    _launch.launch(kernel, 1, 128, 0, 100 * 1024, DeviceView.of(out))
    assert float(out[0]) == 25_599.0
