"""Sliding windows and soft-capping on every forward kernel (SIMT, mma, tf32, wgmma) against reference.attention.

The simulator runs each kernel's real code on its tiny simulator tiles (``flash_forward`` picks them there), so one
or two windows per kernel reach tiles the window skips, cuts and covers; outputs start as NaN (``poisoned_outputs``)
so an unwritten element fails. The ``gpu`` tests run realistic sizes through every backend, bfloat16 included.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, assert_close_lse, rel_error

#: (backend, dtype, extra flash_forward keywords) of each kernel: "mma" with float32 is the 3xTF32 kernel
KERNELS = {
    "simt": ("simt", "float32", {}),
    "mma": ("mma", "float16", {}),
    "tf32": ("mma", "float32", {}),
    "wgmma": ("wgmma", "float16", {}),
}


def _inputs(seed, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, batch=1):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    return q, k, v


def _check(kernel, seqlen_q, seqlen_k, head_dim, heads, causal, seed=0, scale_inputs=1.0, **options):
    backend, dtype, extra = KERNELS[kernel]
    q, k, v = ((scale_inputs * x).astype(dtype) for x in _inputs(seed, heads[0], heads[1], seqlen_q, seqlen_k,
                                                                  head_dim, dtype))
    out, lse = numba_attn.flash_forward(q, k, v, causal=causal, backend=backend, return_lse=True, **extra, **options)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True, **options)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_error(out, ref) < TOLERANCE[dtype]
    assert_close_lse(lse, ref_lse)
    assert (out[np.isneginf(ref_lse)] == 0).all()  # rows whose window holds no key: exactly 0 and -inf


# (seqlen_q, seqlen_k, head_dim, (heads, kv_heads), window, causal) per kernel: the simulator tiles are 16 rows x 16
# keys (mma; wgmma: 64 rows), 16 x 8 (tf32), 8 x 8 (simt); a left side alone, both sides, and a window with causal
WINDOW_CASES = {
    "mma": [(24, 40, 16, (1, 1), (5, 3), False), (37, 29, 16, (2, 1), (9, None), True)],
    "tf32": [(24, 40, 8, (1, 1), (4, 6), False), (21, 21, 8, (2, 1), (7, 0), True)],
    "wgmma": [(20, 70, 16, (1, 1), (11, 2), True)],
}


@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="the gpu tests cover this on a GPU")
@pytest.mark.parametrize("kernel,case", [(kernel, case) for kernel, cases in WINDOW_CASES.items()
                                         for case in cases])
def test_simulated_window(poisoned_outputs, kernel, case):
    seqlen_q, seqlen_k, head_dim, heads, window, causal = case
    _check(kernel, seqlen_q, seqlen_k, head_dim, heads, causal, seed=seqlen_q, window=window)


# soft-capping: a cap small enough to bend the scores (|sm_scale q.k| reaches several units here), with a window,
# with causal, with a negative scale (capped kernels never scale first)
SOFTCAP_CASES = {
    "simt": [(19, 27, 8, (2, 1), dict(softcap=1.5, window=(6, 2)), False),
             (13, 13, 16, (1, 1), dict(softcap=0.7), True)],
    "mma": [(21, 40, 16, (1, 1), dict(softcap=2.0), True), (9, 20, 16, (1, 1), dict(softcap=3.0, sm_scale=-0.4), False)],
    "tf32": [(20, 17, 8, (1, 1), dict(softcap=1.0, window=(5, None)), False)],
    # wgmma: with causal and a cap in test_flash_varlen.py
}


@pytest.mark.parametrize("kernel,case", [(kernel, case) for kernel, cases in SOFTCAP_CASES.items()
                                         for case in cases])
def test_simulated_softcap(poisoned_outputs, kernel, case):
    if not numba_attn.SIMULATOR and kernel != "simt":
        pytest.skip("the gpu tests cover this on a GPU")
    seqlen_q, seqlen_k, head_dim, heads, options, causal = case
    _check(kernel, seqlen_q, seqlen_k, head_dim, heads, causal, seed=seqlen_k, scale_inputs=2.0, **options)


def test_softcap_changes_the_result_and_zero_is_none():
    q, k, v = (3 * x for x in _inputs(1, 1, 1, 6, 9, 8, "float32"))
    plain = numba_attn.flash_forward(q, k, v)
    np.testing.assert_array_equal(numba_attn.flash_forward(q, k, v, softcap=0), plain)  # 0: no cap, as reference
    capped = numba_attn.flash_forward(q, k, v, softcap=1.0)
    assert rel_error(capped, plain) > 1e-2  # the cap matters at these scores
    assert rel_error(capped, reference.attention(q, k, v, softcap=1.0)) < TOLERANCE["float32"]


@pytest.mark.parametrize("softcap,error", [
    (True, TypeError), ("1", TypeError), (-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
    ([2.0], TypeError), (1e-44, ValueError),
])
def test_bad_softcaps_raise(softcap, error):
    q, k, v = _inputs(2, 1, 1, 3, 3, 8, "float32")
    with pytest.raises(error, match="^softcap"):
        numba_attn.flash_forward(q, k, v, softcap=softcap)


# ---- realistic sizes on a GPU -----------------------------------------------------------------------------------------
GPU_KERNELS = ["simt16", "simt", "mma", "mma_bf16", "tf32", "wgmma", "wgmma_bf16"]


def _gpu_inputs(kernel, shape_q, shape_k, seed):
    """Device inputs of ``kernel`` (torch tensors, so that bfloat16 works) and their float64 host values."""
    torch = pytest.importorskip("torch")
    from numba_attn.runtime.device import compute_capability

    backend = {"simt16": "simt", "mma_bf16": "mma", "tf32": "mma", "wgmma_bf16": "wgmma"}.get(kernel, kernel)
    dtype = {"simt16": "float16", "simt": "float32", "tf32": "float32", "mma_bf16": "bfloat16",
             "wgmma_bf16": "bfloat16"}.get(kernel, "float16")
    if backend == "wgmma" and compute_capability() < (9, 0):
        pytest.skip("wgmma needs compute capability 9.0")
    rng = np.random.default_rng(seed)
    tensors = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to("cuda", getattr(torch, dtype))
               for shape in (shape_q, shape_k, shape_k)]
    host = [t.float().cpu().numpy().astype(np.float64) for t in tensors]
    return backend, dtype, tensors, host


def _rows(seqlen_q):
    return np.unique(np.r_[0:8, seqlen_q // 2: seqlen_q // 2 + 8, seqlen_q - 8: seqlen_q].clip(0, seqlen_q - 1))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize(
    "heads,kv_heads,seqlen_q,seqlen_k,head_dim,window,causal",
    [
        (4, 4, 1000, 1000, 128, (512, 0), True),  # local causal attention (Mistral-style; scripts/check_variants.py)
        (8, 2, 777, 1531, 128, (100, 50), False),  # both sides, GQA, Lq != Lk
        (2, 1, 1531, 777, 64, (None, 3), False),  # right side only, Lq > Lk
        (2, 2, 300, 5000, 128, (64, None), True),  # left side only, queries at the end of a long cache
        (2, 2, 2000, 200, 80, (0, 0), False),  # most rows see no key
    ],
)
def test_gpu_window_every_kernel(kernel, heads, kv_heads, seqlen_q, seqlen_k, head_dim, window, causal):
    backend, dtype, (q, k, v), (qh, kh, vh) = _gpu_inputs(kernel, (2, heads, seqlen_q, head_dim),
                                                          (2, kv_heads, seqlen_k, head_dim), 20)
    out = q.new_full(q.shape, float("nan"))  # poison: unwritten elements show as NaN
    _, lse = numba_attn.flash_forward(q, k, v, causal=causal, window=window, backend=backend, out=out,
                                      return_lse=True)
    rows = _rows(seqlen_q)
    ref, ref_lse = reference.attention(qh, kh, vh, causal=causal, window=window, rows=rows, return_lse=True)
    host = out.float().cpu().numpy()
    assert not np.isnan(host).any()
    assert rel_error(host[:, :, rows], ref) < TOLERANCE[dtype]
    assert_close_lse(lse.cpu().numpy()[:, :, rows], ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize(
    "heads,kv_heads,seqlen_q,seqlen_k,head_dim,softcap,window,causal,input_scale",
    [
        (8, 4, 1024, 1024, 128, 30.0, None, True, 1.0),  # a Gemma-like cap at ordinary scores (it barely bends)
        (4, 4, 777, 1531, 128, 5.0, None, False, 3.0),  # large scores: the cap matters everywhere
        (4, 2, 1000, 1000, 64, 2.0, (128, 0), True, 2.0),  # with a causal window
    ],
)
def test_gpu_softcap_every_kernel(kernel, heads, kv_heads, seqlen_q, seqlen_k, head_dim, softcap, window, causal,
                                  input_scale):
    backend, dtype, (q, k, v), (qh, kh, vh) = _gpu_inputs(kernel, (1, heads, seqlen_q, head_dim),
                                                          (1, kv_heads, seqlen_k, head_dim), 21)
    q, k = q * input_scale, k * input_scale
    qh, kh = (t.float().cpu().numpy().astype(np.float64) for t in (q, k))
    out = q.new_full(q.shape, float("nan"))
    _, lse = numba_attn.flash_forward(q, k, v, causal=causal, window=window, softcap=softcap, backend=backend,
                                      out=out, return_lse=True)
    rows = _rows(seqlen_q)
    ref, ref_lse = reference.attention(qh, kh, vh, causal=causal, window=window, softcap=softcap, rows=rows,
                                       return_lse=True)
    host = out.float().cpu().numpy()
    assert not np.isnan(host).any()
    assert rel_error(host[:, :, rows], ref) < TOLERANCE[dtype]
    assert_close_lse(lse.cpu().numpy()[:, :, rows], ref_lse)
