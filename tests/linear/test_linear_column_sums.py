"""The non-causal layer backward's normaliser from column sums (``linear/column_sums.py``, ``layer_backward``'s
``NONCAUSAL_KEY_SUMS``): the two-stage column-sum kernel against NumPy, and ``linear_attention_backward(causal=False)``
against the float64 reference (``‖g − ref‖ / ‖ref‖``, kernel_checks.TOLERANCE) with poisoned outputs and scratch.

Simulator cases are tiny (one or two heads, up to 13 rows; the simulator's column sums cut 9 rows into slices of 4,
so stage 2 runs); the ``gpu`` tests take realistic sizes (20k keys: many slices) and strided inputs.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from numba import cuda
from kernel_checks import TOLERANCE, rel_error, to_host
from numba_attn.linear import column_sums
from numba_attn.linear import layer_backward as lb
from numba_attn.runtime.launch import SIMULATOR

#: allow_tf32 / bfloat16 products (test_linear_backward's LAYER_TF32_TOLERANCE)
LAYER_TF32_TOLERANCE = 5e-3


def _inputs(seed, batch, heads, seqlen_q, seqlen_k, e, m, dtype):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seqlen_q, e)).astype(dtype)
    k = rng.standard_normal((batch, heads, seqlen_k, e)).astype(dtype)
    v = rng.standard_normal((batch, heads, seqlen_k, m)).astype(dtype)
    dout = rng.standard_normal((batch, heads, seqlen_q, m)).astype(dtype)
    return dout, q, k, v


def _check(grads, arrays, eps, bound):
    refs = reference.linear_attention_backward(*(to_host(x).astype(np.float64) for x in arrays), eps=eps)
    for name, g, ref, x in zip(("dq", "dk", "dv"), grads, refs, arrays[1:]):
        g, x = to_host(g), to_host(x)
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert not np.isnan(np.asarray(g, np.float64)).any(), f"{name} has NaN"
        err = rel_error(g, ref)
        assert err < bound, f"{name}: relative error {err:.3g}"


# -- the column-sum kernel ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [column_sums.SIMULATOR_CONFIG,
                                    column_sums.ColumnSumsConfig(warps=2, blocks_per_sm=1, min_slice_rows=3)])
def test_column_sums(config):
    """Weighted and not, 37 columns (two 32-column pieces), 9 rows in slices (stage 2), a head of no rows; the
    same bits twice (no atomics)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 1, 9, 37)).astype(np.float32)
    weights = rng.standard_normal((2, 1, 9, 1)).astype(np.float32)
    assert column_sums._slices(2, 9, config) > 1
    # host arrays under the simulator, device arrays on a GPU (the launcher takes device memory only)
    dev = (lambda a: a) if SIMULATOR else cuda.to_device
    scratch = lambda shape: dev(np.full(shape, np.nan, np.float32))  # noqa: E731
    for weighted in (False, True):
        outs = []
        for _ in range(2):
            out = dev(np.full((2, 1, 1, 37), np.nan, np.float32))
            column_sums.launch_column_sums(dev(x), dev(weights), out, 0, scratch=scratch, weighted=weighted,
                                           config=config)
            outs.append(to_host(out))
        want = (x.astype(np.float64) * (weights if weighted else 1.0)).sum(axis=2, keepdims=True)
        np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(outs[0], outs[1])
    out = dev(np.full((2, 1, 1, 37), np.nan, np.float32))
    column_sums.launch_column_sums(dev(x[:, :, :0]), dev(weights[:, :, :0]), out, 0, scratch=scratch, weighted=True,
                                   config=config)
    np.testing.assert_array_equal(to_host(out), 0.0)


def test_column_sums_config_is_checked():
    with pytest.raises(ValueError, match="ColumnSumsConfig.warps"):
        column_sums.ColumnSumsConfig(warps=0)


# -- linear_attention_backward(causal=False) -------------------------------------------------------------------
# (seqlen_q, seqlen_k, E, M, dtype, eps, backend, allow_tf32)
CASES = [
    (11, 9, 6, 5, "float16", 0.5, "recurrent", False),  # Lq > Lk, 16-bit inputs
    (5, 9, 4, 4, "float16", 1e-6, "chunked", False),  # the products in 3xTF32 (the GPU's default for float16)
    (9, 13, 5, 7, "float32", 1e-6, "recurrent", False),
]


@pytest.mark.parametrize("seqlen_q,seqlen_k,e,m,dtype,eps,backend,tf32", CASES)
def test_noncausal_layer_backward(seqlen_q, seqlen_k, e, m, dtype, eps, backend, tf32, poisoned_outputs):
    arrays = _inputs(seqlen_q + seqlen_k, 1, 1, seqlen_q, seqlen_k, e, m, dtype)
    grads = numba_attn.linear_attention_backward(*arrays, eps=eps, backend=backend, allow_tf32=tf32)
    _check(grads, arrays, eps, LAYER_TF32_TOLERANCE if tf32 else TOLERANCE[dtype])


def test_noncausal_layer_backward_rows_by_warps(poisoned_outputs):
    """The GPU's ``rows`` kernel (a warp per row: ``phi(q_i) . s`` and ``dout . n`` summed by shuffles), E > 32 (two
    pieces of the column sums' lanes), M > 32."""
    config = lb.LayerBackwardConfig(threads=64, row_threads=32, rows_per_block=2)
    arrays = _inputs(3, 1, 1, 3, 2, 36, 33, "float32")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lb, "default_config", lambda: config)
        grads = numba_attn.linear_attention_backward(*arrays, backend="recurrent")
    _check(grads, arrays, 1e-6, TOLERANCE["float32"])


def test_noncausal_layer_backward_through_the_products(poisoned_outputs):
    """``NONCAUSAL_KEY_SUMS = False``: the normaliser's products of the ones block, as the causal path has them."""
    arrays = _inputs(4, 1, 1, 7, 6, 4, 5, "float32")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lb, "NONCAUSAL_KEY_SUMS", False)
        grads = numba_attn.linear_attention_backward(*arrays, backend="recurrent")
    _check(grads, arrays, 1e-6, TOLERANCE["float32"])


@pytest.mark.parametrize("seqlen_q,seqlen_k,eps", [(0, 5, 1e-6), (5, 0, 0.0), (5, 0, 1e-6)])
def test_noncausal_layer_backward_without_rows_or_keys(seqlen_q, seqlen_k, eps, poisoned_outputs):
    """No query rows: ``w = 0``; no keys: ``s = 0`` (z = eps, or 0: no gradient) -- zeros, none left unwritten."""
    arrays = _inputs(5, 1, 1, seqlen_q, seqlen_k, 4, 4, "float32")
    grads = numba_attn.linear_attention_backward(*arrays, eps=eps, backend="recurrent")
    for g, ref in zip(grads, reference.linear_attention_backward(*arrays, eps=eps)):
        np.testing.assert_allclose(g, ref, atol=1e-6)


def test_noncausal_layer_backward_of_bfloat16_tensors():
    torch = pytest.importorskip("torch")
    arrays = _inputs(6, 1, 1, 6, 7, 4, 4, "float32")
    tensors = [torch.from_numpy(x).to(torch.bfloat16) for x in arrays]
    grads = numba_attn.linear_attention_backward(*tensors)  # bfloat16: the chunked products in one tf32 term
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    _check([g.float() for g in grads], [t.float() for t in tensors], 1e-6, TOLERANCE["bfloat16"])


# -- realistic sizes, on a GPU only --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tf32", [("float16", False), ("bfloat16", False), ("float32", False),
                                        ("float32", True)])
def test_gpu_noncausal_layer_backward_many_slices(dtype, tf32):
    """20k keys, 700 query rows, B2 H3: the column sums in many slices; E = 96 (three lanes' pieces), M = 64. Twice,
    on new inputs: the second call is replayed from the first one's plan (``runtime.replay``)."""
    torch = pytest.importorskip("torch")
    assert column_sums._slices(6, 20000, column_sums.GPU_CONFIG) > 1
    bound = LAYER_TF32_TOLERANCE if tf32 else TOLERANCE[dtype]
    for seed in (7, 8):
        host = _inputs(seed, 2, 3, 700, 20000, 96, 64, "float32")
        tensors = [torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in host]
        grads = numba_attn.linear_attention_backward(*tensors, allow_tf32=tf32)
        _check([g.float() for g in grads], [t.float() for t in tensors], 1e-6, bound)


@pytest.mark.gpu
def test_gpu_noncausal_layer_backward_strided_and_against_the_products():
    """Strided float16 views (heads and rows swapped); the gradients match those through the ones block's products
    (``NONCAUSAL_KEY_SUMS = False``) to float32 rounding of the intermediates."""
    torch = pytest.importorskip("torch")
    host = _inputs(8, 2, 4, 3000, 5000, 64, 64, "float16")
    tensors = [torch.from_numpy(np.ascontiguousarray(x.swapaxes(1, 2))).cuda().transpose(1, 2) for x in host]
    assert not tensors[1].is_contiguous()
    grads = numba_attn.linear_attention_backward(*tensors)
    _check(grads, host, 1e-6, TOLERANCE["float16"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lb, "NONCAUSAL_KEY_SUMS", False)
        products = numba_attn.linear_attention_backward(*tensors)
    for g, p in zip(grads, products):
        assert rel_error(to_host(g), to_host(p).astype(np.float64)) < 1e-3
