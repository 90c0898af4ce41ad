"""Bad input gets a clear exception naming the argument; edge-case input gets a defined result."""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn


def _qkv(shape_q=(1, 2, 4, 8), shape_k=(1, 2, 5, 8), shape_v=None, dtype=np.float32):
    rng = np.random.default_rng(0)
    shape_v = shape_v or shape_k
    return (rng.standard_normal(shape_q).astype(dtype), rng.standard_normal(shape_k).astype(dtype),
            rng.standard_normal(shape_v).astype(dtype))


ATTENTION_FUNCTIONS = [numba_attn.flash_forward, numba_attn.flash_decode]


@pytest.mark.parametrize("fn", ATTENTION_FUNCTIONS)
@pytest.mark.parametrize(
    "shapes,match",
    [
        (((2, 4, 8), (2, 5, 8), (2, 5, 8)), "q: expected shape"),  # rank 3
        (((1, 2, 4, 8), (5, 8), (5, 8)), "same rank"),
        (((1, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)), "batch"),
        (((1, 3, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8)), "divide"),  # GQA not divisible
        (((1, 2, 4, 8), (1, 2, 5, 8), (1, 1, 5, 8)), "same number of heads"),
        (((1, 2, 4, 8), (1, 2, 5, 4), (1, 2, 5, 8)), "k: headdim"),
        (((1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 4)), "v: headdim"),
        (((1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 6, 8)), "v: seqlen"),
        (((1, 2, 4, 0), (1, 2, 5, 0), (1, 2, 5, 0)), "headdim must be between 1 and 256"),
        (((1, 2, 4, 257), (1, 2, 5, 257), (1, 2, 5, 257)), "headdim must be between 1 and 256"),
    ],
)
def test_bad_shapes(fn, shapes, match):
    q, k, v = _qkv(*shapes)
    with pytest.raises(ValueError, match=match):
        fn(q, k, v)


@pytest.mark.parametrize("fn", ATTENTION_FUNCTIONS)
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex64])
def test_unsupported_dtype(fn, dtype):
    q, k, v = _qkv(dtype=dtype)
    with pytest.raises(TypeError, match=r"q: dtype .* is not supported"):
        fn(q, k, v)


@pytest.mark.parametrize("fn", ATTENTION_FUNCTIONS)
def test_mixed_dtypes(fn):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="k: dtype float16 differs from q's float32"):
        fn(q, k.astype(np.float16), v)


def test_not_an_array():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q: expected a NumPy array"):
        numba_attn.flash_forward(q.tolist(), k, v)


@pytest.mark.parametrize("sm_scale", [float("nan"), float("inf"), "0.1"])
def test_bad_sm_scale(sm_scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sm_scale"):
        numba_attn.flash_forward(q, k, v, sm_scale=sm_scale)


@pytest.mark.parametrize(
    "out,match",
    [
        (np.empty((1, 2, 4, 7), np.float32), "out: expected shape"),
        (np.empty((1, 2, 4, 8), np.float16), "out: expected dtype float32"),
    ],
)
def test_bad_out(out, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        numba_attn.flash_forward(q, k, v, out=out)


@pytest.mark.parametrize("num_splits", [0, -1, 1.5, True, "2"])
def test_bad_num_splits(num_splits):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="num_splits"):
        numba_attn.flash_decode(q, k, v, num_splits=num_splits)


def test_combine_lse_bad_input():
    o = np.zeros((3, 1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="lse_parts: expected shape"):
        numba_attn.combine_lse(o, np.zeros((3, 1, 2, 5), np.float32))
    with pytest.raises(TypeError, match="lse_parts: dtype float16"):
        numba_attn.combine_lse(o, np.zeros((3, 1, 2, 4), np.float16))
    with pytest.raises(ValueError, match="o_parts: expected shape"):
        numba_attn.combine_lse(np.zeros((3, 4), np.float32), np.zeros((3,), np.float32))
    with pytest.raises(ValueError, match="o_parts: needs at least one part"):
        numba_attn.combine_lse(np.zeros((0, 4, 8), np.float32), np.zeros((0, 4), np.float32))


@pytest.mark.parametrize("fn", [numba_attn.causal_dot_product, numba_attn.linear_attention])
@pytest.mark.parametrize(
    "shapes,match",
    [
        (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 5, 8)), "v: \\(batch, heads, seqlen\\)"),
        (((1, 2, 4, 8), (1, 2, 4, 6), (1, 2, 4, 8)), "k: feature dim E"),
        (((1, 2, 4, 0), (1, 2, 4, 0), (1, 2, 4, 8)), "q: feature dim E"),
        (((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 300)), "v: value dim M"),
        (((4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), "same rank"),
    ],
)
def test_bad_linear_shapes(fn, shapes, match):
    q, k, v = _qkv(*shapes)
    with pytest.raises(ValueError, match=match):
        fn(q, k, v)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), None])
def test_bad_eps(eps):
    q, k, v = _qkv((1, 1, 4, 8), (1, 1, 4, 8))
    with pytest.raises(ValueError, match="eps"):
        numba_attn.linear_attention(q, k, v, eps=eps)


@pytest.mark.gpu
def test_host_device_mix_is_rejected():
    import cupy

    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k: is on the GPU but q is on the host"):
        numba_attn.flash_forward(q, cupy.asarray(k), v)


@pytest.mark.gpu
def test_out_on_wrong_side_is_rejected():
    import cupy

    q, k, v = (cupy.asarray(x) for x in _qkv())
    with pytest.raises(ValueError, match="out: must live where the inputs live"):
        numba_attn.flash_forward(q, k, v, out=np.empty(q.shape, np.float32))
