"""Helpers shared by the kernel tests: error metric, tolerances, poisoned outputs, device round trips."""
from __future__ import annotations

import numpy as np

import numba_attn

#: ‖out − ref‖ / ‖ref‖ bounds against the float64 reference, by input dtype (DEVELOPERS.md quality bar).
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def rel_error(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in out makes it inf (NaN never passes)."""
    out = np.asarray(to_host(out), dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {out.shape} != reference shape {ref.shape}")
    if np.isnan(out).any() and not np.isnan(ref).any():
        return float("inf")
    denom = np.linalg.norm(ref)
    diff = np.linalg.norm(out - ref)
    return float(diff / denom) if denom > 0 else float(diff)


def to_host(x):
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        import torch

        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.detach().cpu().numpy()
    if type(x).__module__.startswith("cupy"):
        return x.get()
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if hasattr(x, "__cuda_array_interface__"):  # a DeviceView
        from numba import cuda

        return cuda.as_cuda_array(x).copy_to_host()
    return np.asarray(x)


def assert_close_lse(lse, ref_lse, tol=1e-4):
    """lse equal to the reference within ``tol`` (relative to max(1, |ref|)), with -inf exactly where ref has it."""
    lse = np.asarray(to_host(lse), dtype=np.float64)
    ref_lse = np.asarray(ref_lse, dtype=np.float64)
    assert not np.isnan(lse).any(), "lse has NaN"
    inf_ref = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), inf_ref)
    finite = ~inf_ref
    err = np.abs(lse[finite] - ref_lse[finite]) / np.maximum(1.0, np.abs(ref_lse[finite]))
    assert err.size == 0 or err.max() <= tol, f"lse error {err.max():.3g} > {tol}"


def device_view_in_layout(x, layout: str):
    """Host array ``(B, H, L, D)`` -> device (or simulator) view of that shape in the given memory layout:
    ``contig``; ``blhd`` (memory ``(B, L, H, D)``, a transposed view); ``pad3`` (rows of ``D + 3`` elements, so
    rows are not 16-byte aligned and the kernels fall back to element loads); ``pad8`` (rows of ``D + 8``
    elements: strided, but every row still 16-byte aligned for 16-bit elements)."""
    from numba import cuda

    b, h, length, d = x.shape
    if layout == "contig":
        return cuda.to_device(np.ascontiguousarray(x))
    if layout == "blhd":
        mem = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        strides = (mem.strides[0], mem.strides[2], mem.strides[1], mem.strides[3])
    elif layout in ("pad3", "pad8"):
        mem = np.zeros((b, h, length, d + int(layout[3:])), x.dtype)
        mem[..., :d] = x
        strides = mem.strides
    else:
        raise ValueError(layout)
    dev = cuda.to_device(mem)
    if numba_attn.SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(np.lib.stride_tricks.as_strided(dev.copy_to_host(), (b, h, length, d), strides))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(shape=(b, h, length, d), strides=strides, dtype=x.dtype, gpu_data=dev.gpu_data)


def gpu_available() -> bool:
    return not numba_attn.SIMULATOR
