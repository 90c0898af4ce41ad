"""numba_attn.flash_backward against reference.attention_backward (float64).

Tiny shapes run under the CUDA simulator in CI (block tiles of 8 keys / rows there, so lengths 1..40 that no tile
divides reach every masked tail); the `gpu` tests run realistic sizes on real hardware only. The error metric is
‖g − ref‖ / ‖ref‖ per gradient (kernel_checks.TOLERANCE); float16 is compared with the float64 gradients of the
float16-rounded inputs.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error


def _case(seed, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, causal, sm_scale):
    """Inputs in ``dtype``, the forward's ``out`` (rounded to ``dtype``) and float32 ``lse`` from the reference."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    dout = rng.standard_normal((batch, heads, seqlen_q, head_dim)).astype(dtype)
    out, lse = reference.attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
    return dout, q, k, v, out.astype(dtype), lse.astype(np.float32)


def _check(grads, dout, q, k, v, causal, sm_scale, dtype):
    refs = reference.attention_backward(dout, q, k, v, causal=causal, sm_scale=sm_scale)
    for name, g, ref, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert not np.isnan(g).any(), f"{name} has NaN"
        err = rel_error(g, ref)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3g}"
    return refs


# (heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, dtype, deterministic, sm_scale)
CASES = [
    (2, 2, 13, 11, 8, False, "float32", False, None),
    (2, 1, 13, 11, 8, True, "float32", True, None),  # GQA 2:1
    (2, 2, 9, 21, 16, True, "float16", False, 0.3),  # Lq < Lk: the diagonal starts at key 12
    (2, 1, 21, 9, 16, True, "float32", False, None),  # Lq > Lk: rows 0..11 see no key (lse = -inf)
    (2, 2, 21, 9, 16, True, "float16", True, None),
    (2, 1, 1, 17, 40, False, "float16", False, None),  # one query row, head dim 40
    (2, 2, 40, 37, 8, True, "float32", False, -0.5),  # a negative scale
    (2, 1, 17, 1, 8, False, "float32", True, None),  # one key
    (2, 2, 5, 6, 40, True, "float32", True, 1.3),
]


@pytest.mark.parametrize("heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal,dtype,deterministic,sm_scale", CASES)
def test_flash_backward_equals_reference(heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, dtype,
                                         deterministic, sm_scale):
    dout, q, k, v, out, lse = _case(seqlen_q * 100 + seqlen_k, 1, heads, kv_heads, seqlen_q, seqlen_k, head_dim,
                                    dtype, causal, sm_scale)
    grads = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=causal, sm_scale=sm_scale,
                                      deterministic=deterministic)
    refs = _check(grads, dout, q, k, v, causal, sm_scale, dtype)
    if causal and seqlen_q > seqlen_k:  # rows that see no key: exactly 0
        np.testing.assert_array_equal(grads[0][:, :, :seqlen_q - seqlen_k], 0.0)
        np.testing.assert_array_equal(refs[0][:, :, :seqlen_q - seqlen_k], 0.0)


def test_forward_then_backward_with_the_kernels_out_and_lse():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 2, 11, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 1, 14, 8)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = numba_attn.flash_forward(q, k, v, causal=True, return_lse=True, backend="simt")
    grads = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=True)
    _check(grads, dout, q, k, v, True, None, "float32")


def _transposed(x):
    """The same values as a strided view: memory (batch, seqlen, heads, headdim), axes 1 and 2 swapped back."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_strided_inputs(dtype):
    dout, q, k, v, out, lse = _case(7, 1, 2, 2, 10, 12, 8, dtype, True, None)
    lse_strided = np.zeros(lse.shape[:-1] + (2 * lse.shape[-1],), np.float32)[..., ::2]
    lse_strided[...] = lse
    views = [_transposed(x) for x in (dout, q, k, v, out)]
    views[3] = np.ascontiguousarray(v[:, :, ::-1])[:, :, ::-1]  # v: a negative stride
    assert views[3].strides[2] < 0
    assert not any(x.flags.c_contiguous for x in views) and not lse_strided.flags.c_contiguous
    grads = numba_attn.flash_backward(*views, lse_strided, causal=True)
    _check(grads, dout, q, k, v, True, None, dtype)


def test_two_dimensional_inputs():
    dout, q, k, v, out, lse = _case(8, 1, 1, 1, 6, 9, 8, "float32", False, 0.7)
    grads = numba_attn.flash_backward(dout[0, 0], q[0, 0], k[0, 0], v[0, 0], out[0, 0], lse[0, 0], sm_scale=0.7)
    assert [g.shape for g in grads] == [(6, 8), (9, 8), (9, 8)]
    refs = reference.attention_backward(dout, q, k, v, sm_scale=0.7)
    for g, ref in zip(grads, refs):
        assert rel_error(g, ref[0, 0]) < TOLERANCE["float32"]


def test_numba_device_arrays_come_back_as_numba_arrays():
    from numba import cuda

    dout, q, k, v, out, lse = _case(9, 1, 2, 2, 7, 5, 8, "float32", True, None)
    grads = numba_attn.flash_backward(*(cuda.to_device(x) for x in (dout, q, k, v, out, lse)), causal=True)
    assert all(hasattr(g, "copy_to_host") for g in grads)
    _check(tuple(g.copy_to_host() for g in grads), dout, q, k, v, True, None, "float32")


@pytest.mark.parametrize("deterministic", [False, True])
def test_every_element_is_written(poisoned_outputs, deterministic):
    """Outputs and scratch (delta, the float32 dq accumulator) start as NaN: an element the kernels leave unwritten,
    or a scratch value read before it is written, shows as NaN or as an error."""
    dout, q, k, v, out, lse = _case(10, 1, 2, 1, 19, 10, 12, "float16", True, None)
    grads = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=deterministic)
    _check(grads, dout, q, k, v, True, None, "float16")


@pytest.mark.parametrize("deterministic", [False, True])
def test_empty_sequences_give_zero_gradients(deterministic):
    # no query row: dk = dv = 0 (every key is written though none is seen); no key: dq = 0
    dout, q, k, v, out, lse = _case(11, 1, 2, 1, 0, 9, 8, "float32", False, None)
    dq, dk, dv = numba_attn.flash_backward(dout, q, k, v, out, lse, deterministic=deterministic)
    assert dq.shape == q.shape and dk.shape == k.shape
    np.testing.assert_array_equal(dk, 0.0)
    np.testing.assert_array_equal(dv, 0.0)
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 2, 5, 8)).astype(np.float16)
    k = v = np.zeros((1, 2, 0, 8), np.float16)
    out = np.zeros_like(q)
    lse = np.full((1, 2, 5), -np.inf, np.float32)
    dq, dk, dv = numba_attn.flash_backward(q, q, k, v, out, lse, deterministic=deterministic)
    np.testing.assert_array_equal(dq, 0.0)
    assert dk.shape == dv.shape == (1, 2, 0, 8)


def test_deterministic_is_bitwise_repeatable():
    dout, q, k, v, out, lse = _case(13, 1, 2, 1, 14, 17, 8, "float32", True, None)
    first = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    second = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    _check(first, dout, q, k, v, True, None, "float32")


def _valid(dtype="float32"):
    return _case(14, 1, 2, 1, 4, 5, 8, dtype, False, None)


@pytest.mark.parametrize("index,bad,error,match", [
    (0, np.zeros((1, 2, 4, 7), np.float32), ValueError, "dout: expected q's shape"),
    (4, np.zeros((1, 2, 3, 8), np.float32), ValueError, "out: expected q's shape"),
    (5, np.zeros((1, 2, 5), np.float32), ValueError, "lse: expected shape"),
    (5, np.zeros((1, 2, 4), np.float16), TypeError, "lse: dtype float16"),
    (0, np.zeros((1, 2, 4, 8), np.float16), TypeError, "dout: dtype float16 differs"),
    (4, [[0.0]], TypeError, "out: expected a NumPy array"),
    (2, np.zeros((1, 3, 5, 8), np.float32), ValueError, "k, v: must have the same number of heads"),
])
def test_bad_arrays_are_named(index, bad, error, match):
    arrays = list(_valid())
    arrays[index] = bad
    with pytest.raises(error, match=match):
        numba_attn.flash_backward(*arrays)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(causal=1), TypeError, "causal: expected True or False"),
    (dict(deterministic="yes"), TypeError, "deterministic: expected True or False"),
    (dict(sm_scale=True), TypeError, "sm_scale:"),
    (dict(sm_scale=float("inf")), ValueError, "sm_scale:"),
])
def test_bad_options_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        numba_attn.flash_backward(*_valid(), **kwargs)


def test_float64_is_refused():
    with pytest.raises(TypeError, match="q: dtype float64 is not supported"):
        numba_attn.flash_backward(*(x.astype(np.float64) for x in _valid()[:5]), _valid()[5])


def test_bfloat16_takes_the_tensor_core_backward():
    from numba_attn.backward import dispatch

    assert dispatch.choose_backend(None, "bfloat16", 64) in ("mma", "wgmma_ws")  # (wgmma_ws: sm_90)
    with pytest.raises(ValueError, match="'simt' does not take bfloat16"):
        dispatch.choose_backend("simt", "bfloat16", 64)
    torch = pytest.importorskip("torch")
    dout, q, k, v, out, lse = _case(14, 1, 2, 1, 6, 5, 16, "float32", True, None)
    arrays = [torch.from_numpy(x).to(torch.bfloat16) for x in (dout, q, k, v, out)]
    grads = numba_attn.flash_backward(*arrays, torch.from_numpy(lse), causal=True)
    assert all(g.dtype == torch.bfloat16 for g in grads)
    exact = [x.double().numpy() for x in arrays[:4]]
    for g, ref in zip(grads, reference.attention_backward(*exact, causal=True)):
        assert rel_error(g.float().numpy(), ref) < TOLERANCE["bfloat16"]


# -- realistic sizes, on a GPU only ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_realistic_sizes(dtype, head_dim, causal, deterministic):
    dout, q, k, v, out, lse = _case(15, 2, 4, 2, 1000, 777, head_dim, dtype, causal, None)
    grads = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    _check(grads, dout, q, k, v, causal, None, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_strided_and_repeatable(head_dim):
    dout, q, k, v, out, lse = _case(16, 1, 4, 1, 128, 300, head_dim, "float16", True, None)
    views = [_transposed(x) for x in (dout, q, k, v, out)]
    first = numba_attn.flash_backward(*views, lse, causal=True, deterministic=True)
    second = numba_attn.flash_backward(*views, lse, causal=True, deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    _check(first, dout, q, k, v, True, None, "float16")
