"""numba_attn.flash_forward against reference.attention.

The Hypothesis tests run tiny shapes under the CUDA simulator in CI (and on the GPU when one is present); the
`gpu` tests run realistic sizes on real hardware only.
"""
from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numba_attn
import reference
from kernel_checks import TOLERANCE, assert_close_lse, rel_error


def _inputs(rng, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, scale=1.0):
    q = (rng.standard_normal((batch, heads, seqlen_q, head_dim)) * scale).astype(dtype)
    k = (rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)) * scale).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    return q, k, v


@st.composite
def attention_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2]))
    return dict(
        batch=draw(st.integers(1, 2)),
        heads=kv_heads * group,
        kv_heads=kv_heads,
        seqlen_q=draw(st.integers(1, 13)),
        seqlen_k=draw(st.integers(1, 13)),
        head_dim=draw(st.integers(1, 10)),
        causal=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "float16"])),
        # float16: the default (tensor-core kernel) and the portable kernel
        backend=draw(st.sampled_from([None, "simt"])),
        seed=draw(st.integers(0, 2**31)),
    )


@settings(max_examples=25)
@given(attention_cases())
def test_flash_forward_equals_reference(case):
    rng = np.random.default_rng(case["seed"])
    q, k, v = _inputs(rng, case["batch"], case["heads"], case["kv_heads"], case["seqlen_q"], case["seqlen_k"],
                      case["head_dim"], case["dtype"])
    out, lse = numba_attn.flash_forward(q, k, v, causal=case["causal"], return_lse=True, backend=case["backend"])
    ref_out, ref_lse = reference.attention(q, k, v, causal=case["causal"], return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_error(out, ref_out) < TOLERANCE[case["dtype"]]
    assert_close_lse(lse, ref_lse)


def test_causal_rows_without_keys_give_zero_and_minus_inf():
    # Lq > Lk with the bottom-right causal mask: the first Lq - Lk rows see no key at all
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, 1, 1, 1, 9, 4, 5, "float32")
    out, lse = numba_attn.flash_forward(q, k, v, causal=True, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[0, 0, :5], 0.0)
    assert np.isneginf(lse[0, 0, :5]).all()
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert rel_error(out, ref_out) < TOLERANCE["float32"]
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("logit", [1e4, -1e4])
def test_huge_logits_stay_finite(logit):
    # scores around +-1e4 overflow a naive exp; the online softmax must stay exact
    rng = np.random.default_rng(2)
    q = np.full((1, 1, 6, 4), 1.0, np.float32)
    k = rng.standard_normal((1, 1, 7, 4)).astype(np.float32) * abs(logit)
    k[..., 0] = np.sign(logit) * abs(logit) * 2
    v = rng.standard_normal((1, 1, 7, 4)).astype(np.float32)
    out, lse = numba_attn.flash_forward(q, k, v, sm_scale=1.0, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, sm_scale=1.0, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert rel_error(out, ref_out) < TOLERANCE["float32"]
    assert_close_lse(lse, ref_lse, tol=1e-6)


def test_two_dimensional_inputs_and_strided_views():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((11, 16)).astype(np.float32)
    q = base[::2, 1:9]  # non-contiguous (6, 8)
    k = rng.standard_normal((8, 10)).astype(np.float32)[:, ::1][:, 2:10]
    v = np.asfortranarray(rng.standard_normal((8, 8)).astype(np.float32))
    out, lse = numba_attn.flash_forward(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (6, 8) and lse.shape == (6,)
    assert rel_error(out, ref_out) < TOLERANCE["float32"]
    assert_close_lse(lse, ref_lse)


def test_backend_choice_is_checked():
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, 1, 1, 1, 4, 5, 16, "float32")
    with pytest.raises(ValueError, match="backend: expected one of"):
        numba_attn.flash_forward(q, k, v, backend="cudnn")
    # every backend takes float16 and float32 ("mma": m16n8k16 for float16, 3xTF32 m16n8k8 for float32)
    for dtype in ("float16", "float32"):
        xq, xk, xv = (x.astype(dtype) for x in (q, k, v))
        ref = reference.attention(xq, xk, xv)
        for backend in numba_attn.BACKENDS:
            if backend in ("wgmma", "wgmma_ws") and (dtype == "float32" or not _wgmma_runs()):
                with pytest.raises(ValueError, match=f"backend: '{backend}'"):  # float16 / bfloat16 on sm_90 only
                    numba_attn.flash_forward(xq, xk, xv, backend=backend)
                continue
            if backend == "wgmma_ws" and numba_attn.SIMULATOR:
                continue  # (384 simulated threads: tests/forward/test_flash_wgmma_ws.py runs it under the simulator)
            assert rel_error(numba_attn.flash_forward(xq, xk, xv, backend=backend), ref) < TOLERANCE[dtype]


def _wgmma_runs() -> bool:
    from numba_attn.runtime.device import compute_capability

    return numba_attn.SIMULATOR or compute_capability() >= (9, 0)


def test_out_argument_is_filled_in_place():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 1, 2, 1, 5, 6, 3, "float32")
    out = np.full(q.shape, np.nan, np.float32)
    result = numba_attn.flash_forward(q, k, v, out=out)
    assert result is out
    assert rel_error(out, reference.attention(q, k, v)) < TOLERANCE["float32"]


def test_empty_sequences():
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 1, 1, 1, 0, 4, 3, "float32")
    out, lse = numba_attn.flash_forward(q, k, v, return_lse=True)
    assert out.shape == (1, 1, 0, 3) and lse.shape == (1, 1, 0)
    q, k, v = _inputs(rng, 1, 1, 1, 3, 0, 3, "float32")
    out, lse = numba_attn.flash_forward(q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, 0.0)
    assert np.isneginf(lse).all()


def test_nan_input_propagates_without_crash():
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, 1, 1, 1, 4, 5, 3, "float32")
    q[0, 0, 2, 1] = np.nan
    out = numba_attn.flash_forward(q, k, v)
    ref_out = reference.attention(q, k, v)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))


def test_sm_scale_is_used():
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 1, 1, 1, 4, 5, 3, "float32")
    out = numba_attn.flash_forward(q, k, v, sm_scale=0.1)
    assert rel_error(out, reference.attention(q, k, v, sm_scale=0.1)) < TOLERANCE["float32"]


# ---- realistic sizes on a GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,backend", [("float32", "simt"), ("float16", "simt"), ("float16", "mma")])
@pytest.mark.parametrize(
    "batch,heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal",
    [
        (2, 4, 4, 1000, 1000, 64, False),
        (2, 4, 4, 1000, 1000, 64, True),
        (1, 8, 2, 777, 1531, 128, True),  # GQA, Lq != Lk, lengths no tile divides
        (1, 2, 1, 300, 257, 59, True),  # odd head dim, Lq > Lk: early rows see nothing
        (1, 2, 2, 129, 200, 256, False),
        (1, 3, 3, 64, 5000, 80, False),
    ],
)
def test_gpu_flash_forward(dtype, backend, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal):
    import cupy

    rng = np.random.default_rng(10)
    q, k, v = _inputs(rng, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype)
    dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
    out = cupy.full(q.shape, cupy.nan, dtype=dtype)  # poison: unwritten elements show as NaN
    numba_attn.flash_forward(dq, dk, dv, causal=causal, out=out, backend=backend)
    rows = np.unique(np.r_[0:8, seqlen_q // 2 : seqlen_q // 2 + 8, seqlen_q - 8 : seqlen_q].clip(0, seqlen_q - 1))
    ref = reference.attention(q, k, v, causal=causal, rows=rows)
    host = out.get()
    assert not np.isnan(host).any()
    assert rel_error(host[:, :, rows], ref) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_bfloat16_torch_tensors(causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(14)
    q, k, v = _inputs(rng, 2, 8, 2, 1000, 1300, 128, "float32")
    tq, tk, tv = (torch.from_numpy(x).cuda().to(torch.bfloat16) for x in (q, k, v))
    out, lse = numba_attn.flash_forward(tq, tk, tv, causal=causal, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == tq.shape
    bq, bk, bv = (t.float().cpu().numpy() for t in (tq, tk, tv))  # the bf16-rounded inputs
    rows = np.arange(0, 1000, 37)
    ref = reference.attention(bq, bk, bv, causal=causal, rows=rows)
    assert rel_error(out.float().cpu().numpy()[:, :, rows], ref) < TOLERANCE["bfloat16"]
    assert not torch.isnan(lse).any()


@pytest.mark.gpu
def test_gpu_lse_and_torch_inputs():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng, 1, 2, 2, 200, 300, 64, "float32")
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    out, lse = numba_attn.flash_forward(tq, tk, tv, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert rel_error(out.cpu().numpy(), ref_out) < TOLERANCE["float32"]
    assert_close_lse(lse.cpu().numpy(), ref_lse)


@pytest.mark.gpu
def test_gpu_runs_on_the_callers_stream():
    import cupy

    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng, 2, 4, 4, 2048, 2048, 64, "float16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
        out = numba_attn.flash_forward(dq, dk, dv)
        # ordered after the kernel on the same stream; only this stream is synchronised below
        host = cupy.asnumpy(out, stream=stream)
        stream.synchronize()
    rows = np.arange(0, 2048, 97)
    assert rel_error(host[:, :, rows], reference.attention(q, k, v, causal=False, rows=rows)) < TOLERANCE["float16"]


@pytest.mark.gpu
def test_gpu_strided_device_views():
    import cupy

    rng = np.random.default_rng(13)
    # (batch, seqlen, heads, headdim) storage viewed as (batch, heads, seqlen, headdim): the usual packed-QKV case
    qkv = cupy.asarray(rng.standard_normal((2, 333, 3, 4, 64)).astype(np.float16))
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    out = numba_attn.flash_forward(q, k, v, causal=True)
    rows = np.arange(333)
    ref = reference.attention(q.get(), k.get(), v.get(), causal=True, rows=rows)
    assert rel_error(out.get(), ref) < TOLERANCE["float16"]
