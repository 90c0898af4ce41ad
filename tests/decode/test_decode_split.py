"""``flash_decode`` against the float64 reference, and the SIMT split kernel (``numba_attn.decode.simt``) alone.

The unmarked tests run everywhere: under the Numba CUDA simulator (tiny shapes, the tiny simulator configuration) and
on a GPU when one is present. Tests marked ``gpu`` use realistic sizes and CuPy or torch.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st

import numba_attn
import reference
from numba_attn.decode import simt as decode
from tests.decode_checks import BF16_NAN, DTYPES, bf16_inputs, bf16_values, check_attention, dev, qkv
from tests.kernel_checks import TOLERANCE, assert_close_lse, rel_error, to_host


# -- flash_decode vs reference.attention (simulator-sized) -----------------------------------------------------------
@st.composite
def decode_cases(draw, max_seqlen_q=4):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4]))
    seqlen_q = draw(st.integers(1, max_seqlen_q))
    # the simulator runs one Python thread per GPU thread: keep the number of launched blocks small
    assume(batch * kv_heads * group * seqlen_q <= 16)
    # short caches often: Lq > Lk (causal rows that see nothing) and more splits than keys
    seqlen_k = draw(st.one_of(st.integers(1, 5), st.integers(1, 40)))
    max_splits = max(1, 12 // (batch * kv_heads))
    num_splits = draw(st.integers(1, min(max_splits, seqlen_k + 3)))
    return dict(
        batch=batch,
        heads=kv_heads * group,
        kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        # every column layout of the simulator config (G = 1..8 lanes per key, padded and unpadded), few compiled
        # variants on a GPU
        head_dim=draw(st.sampled_from([1, 2, 3, 5, 8, 12, 17])),
        sm_scale=draw(st.sampled_from([None, 0.07, 1.0])),
        causal=draw(st.booleans()),
        num_splits=num_splits,
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


@given(case=decode_cases())
def test_flash_decode_matches_reference(case):
    # (pytest --hypothesis-show-statistics shows how often the interesting corners come up)
    event(f"{case['dtype']}, causal={case['causal']}, group={case['heads'] // case['kv_heads']}")
    if case["causal"] and case["seqlen_q"] > case["seqlen_k"]:
        event("causal rows that see no key")
    if case["num_splits"] > case["seqlen_k"]:
        event("more splits than keys")
    rng = np.random.default_rng(case["seed"])
    q, k, v = qkv(rng, case["batch"], case["heads"], case["kv_heads"], case["seqlen_q"], case["seqlen_k"],
                  case["head_dim"], case["dtype"])
    out, lse = numba_attn.flash_decode(q, k, v, causal=case["causal"], num_splits=case["num_splits"],
                                       sm_scale=case["sm_scale"], return_lse=True)
    check_attention(out, lse, q, k, v, case["causal"], sm_scale=case["sm_scale"])


@pytest.mark.parametrize("causal", [False, True])
def test_flash_decode_more_rows_than_a_pass(causal):
    # 2 q heads per kv head x 9 queries = 18 rows: several passes of the simulator's 2 rows (8 on a GPU: 3 passes);
    # causal with Lq > Lk leaves the first rows without any key
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, 1, 2, 1, 9, 7 if causal else 11, 5, "float32")
    out, lse = numba_attn.flash_decode(q, k, v, causal=causal, num_splits=2, return_lse=True)
    check_attention(out, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_decode_strided_views(dtype):
    rng = np.random.default_rng(2)
    big_q = rng.standard_normal((1, 3, 4, 2 * 6)).astype(dtype)
    big_kv = rng.standard_normal((2, 19, 2, 6)).astype(dtype)  # (k/v, seqlen, heads, d): heads not outermost
    q = big_q[:, 1:3, 1:, ::2]  # (1, 2, 3, 6), every stride non-trivial
    k = big_kv[0, :, 1:].transpose(1, 0, 2)[None]  # (1, 1, 19, 6)
    v = big_kv[1, ::-1, :1].transpose(1, 0, 2)[None]  # negative seqlen stride
    assert not (q.flags.c_contiguous or k.flags.c_contiguous or v.flags.c_contiguous)
    out, lse = numba_attn.flash_decode(q, k, v, causal=True, num_splits=3, return_lse=True, sm_scale=0.3)
    check_attention(out, lse, q, k, v, True, sm_scale=0.3)


def test_flash_decode_more_splits_than_keys_and_empty_rows():
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, 1, 2, 1, 4, 2, 3, "float32")
    out, lse = numba_attn.flash_decode(q, k, v, causal=True, num_splits=7, return_lse=True)
    check_attention(out, lse, q, k, v, True)
    out = to_host(out)
    lse = to_host(lse)
    # Lq = 4 > Lk = 2: queries 0 and 1 see no key
    assert (out[:, :, :2] == 0).all() and np.isneginf(lse[:, :, :2]).all()
    assert np.isfinite(lse[:, :, 2:]).all()


def test_flash_decode_no_keys_gives_zero():
    q = np.ones((1, 2, 3, 4), np.float32)
    k = np.ones((1, 1, 0, 4), np.float32)
    out, lse = numba_attn.flash_decode(q, k, k, num_splits=3, return_lse=True)
    assert (to_host(out) == 0).all() and np.isneginf(to_host(lse)).all()


def test_flash_decode_auto_splits_and_2d_inputs():
    rng = np.random.default_rng(4)
    q, k, v = (x[0, 0] for x in qkv(rng, 1, 1, 1, 2, 23, 7, "float16"))
    out = numba_attn.flash_decode(q, k, v, causal=True)
    assert out.shape == (2, 7) and out.dtype == np.float16
    ref = reference.attention(q, k, v, causal=True)
    assert rel_error(out, ref) <= TOLERANCE["float16"]


def test_split_kernel_parts_match_reference_split_kv():
    # the split kernel alone, with empty trailing splits (num_splits > seqlen_k is not clamped at this level)
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, 1, 2, 1, 2, 3, 5, "float32")
    num_splits = 5
    o_parts = dev(np.full((num_splits,) + q.shape, np.nan, np.float32))
    lse_parts = dev(np.full((num_splits,) + q.shape[:-1], np.nan, np.float32))
    sm_scale = 1 / math.sqrt(5)
    decode.launch_split(dev(q), dev(k), dev(v), o_parts, lse_parts, True, sm_scale, True, 0)
    ref_o, ref_lse = reference.split_kv_attention(q, k, v, num_splits, causal=True)
    assert rel_error(to_host(o_parts), ref_o) <= TOLERANCE["float32"]
    assert_close_lse(lse_parts, ref_lse)
    assert (to_host(o_parts)[3:] == 0).all()


def test_flash_decode_propagates_nan():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 1, 2, 1, 2, 9, 4, "float32")
    q[0, 1, 0, 2] = np.nan  # one query row
    out, lse = (to_host(x) for x in numba_attn.flash_decode(q, k, v, num_splits=2, return_lse=True))
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    assert np.isnan(out[0, 1, 0]).all() and np.isfinite(out[0, 0]).all()


@pytest.mark.parametrize("num_splits", [0, -1, 1.5, True, "2"])
def test_flash_decode_rejects_bad_num_splits(num_splits):
    q = np.zeros((1, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="num_splits"):
        numba_attn.flash_decode(q, q, q, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_launch_bfloat16_bit_views(num_splits, causal):
    """The SIMT split kernel (and the combine for several splits) on bfloat16 bits: inputs converted on load, the
    output rounded to bfloat16 on store, every element written."""
    rng = np.random.default_rng(20 + num_splits)
    (q, k, v), values = bf16_inputs(rng, 1, 4, 2, 2, 19, 6)
    out = dev(np.full(q.shape, BF16_NAN, np.uint16))
    lse = dev(np.full(q.shape[:3], np.nan, np.float32))
    decode.launch(dev(q), dev(k), dev(v), out, lse, True, 0.4, causal, num_splits, 0, dtype="bfloat16")
    ref_out, ref_lse = reference.attention(*values, causal=causal, sm_scale=0.4, return_lse=True)
    got = bf16_values(out)
    assert not np.isnan(got).any()
    assert rel_error(got, ref_out) <= TOLERANCE["bfloat16"]
    assert_close_lse(lse, ref_lse)


# -- GPU, realistic sizes ---------------------------------------------------------------------------------------------
GPU_CASES = [
    # batch, heads, kv_heads, head_dim, seqlen_k, seqlen_q, dtype, causal, num_splits
    (2, 8, 2, 128, 16384, 1, "float16", False, None),
    (2, 8, 2, 128, 16384, 4, "float16", True, None),
    (2, 8, 8, 64, 4097, 1, "float32", False, None),
    (2, 8, 8, 64, 4097, 4, "float32", True, 7),
    (2, 8, 2, 59, 4097, 4, "float16", True, 16),
    (2, 8, 2, 59, 4097, 1, "float32", False, 1),
    (1, 32, 8, 128, 16384, 1, "float16", False, None),
    (1, 16, 2, 256, 4097, 2, "float16", True, None),
    (2, 4, 4, 1, 1000, 3, "float32", True, 5),
    # the tensor-core split kernel: GQA 8 with odd lengths, many / few splits, two passes at 256, element copies at 59
    (2, 32, 4, 128, 65537, 1, "float16", True, None),
    (2, 8, 8, 128, 16385, 1, "float16", True, None),  # multi-head: the tensor-core split kernel as well
    (1, 8, 8, 64, 3001, 2, "float16", False, 5),
    (1, 16, 2, 128, 3001, 3, "float16", False, 64),
    (2, 16, 4, 256, 5000, 1, "float16", False, None),
    (2, 16, 4, 59, 5000, 1, "float16", True, 3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,seqlen_k,seqlen_q,dtype,causal,num_splits", GPU_CASES)
def test_gpu_flash_decode(batch, heads, kv_heads, head_dim, seqlen_k, seqlen_q, dtype, causal, num_splits):
    import cupy

    rng = np.random.default_rng(10)
    q, k, v = qkv(rng, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype)
    out, lse = numba_attn.flash_decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal,
                                       num_splits=num_splits, return_lse=True)
    assert isinstance(out, cupy.ndarray)
    check_attention(out.get(), lse.get(), q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 9])
def test_gpu_launch_writes_poisoned_output_strided(dtype, num_splits):
    """Kernel level: NaN-filled out and lse are fully overwritten, inputs are strided CuPy views."""
    import cupy
    from numba import cuda

    rng = np.random.default_rng(11)
    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = 2, 8, 2, 3, 5000, 96
    big_q = cupy.asarray(rng.standard_normal((batch, seqlen_q, heads, head_dim + 8)).astype(dtype))
    big_kv = cupy.asarray(rng.standard_normal((2, batch, seqlen_k, kv_heads, head_dim)).astype(dtype))
    q = big_q[..., :head_dim].transpose(0, 2, 1, 3)
    k = big_kv[0].transpose(0, 2, 1, 3)
    v = big_kv[1].transpose(0, 2, 1, 3)
    out = cupy.full((batch, heads, seqlen_q, head_dim), np.nan, dtype=dtype)
    lse = cupy.full((batch, heads, seqlen_q), np.nan, dtype=np.float32)
    sm_scale = 0.11
    decode.launch(
        *(cuda.as_cuda_array(x) for x in (q, k, v, out, lse)), True, sm_scale, True, num_splits,
        cuda.default_stream(),
    )
    cuda.default_stream().synchronize()
    check_attention(out.get(), lse.get(), q.get(), k.get(), v.get(), True, sm_scale=sm_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,seqlen_k,seqlen_q,causal,num_splits", [
    (2, 8, 8, 128, 16384, 1, False, None),  # MHA: the tensor-core split kernel and the combine
    (1, 4, 4, 64, 3001, 3, True, 1),  # one split: the split kernel writes bfloat16 itself
    (2, 32, 4, 128, 16385, 1, True, None),  # GQA 8: the tensor-core split kernel
    (1, 16, 2, 59, 5000, 1, False, 7),  # GQA, element copies (head dim 59)
])
def test_gpu_flash_decode_bfloat16_torch(batch, heads, kv_heads, head_dim, seqlen_k, seqlen_q, causal, num_splits):
    import torch

    rng = np.random.default_rng(13)
    (q, k, v), values = bf16_inputs(rng, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim)
    tq, tk, tv = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16) for x in (q, k, v))
    out, lse = numba_attn.flash_decode(tq, tk, tv, causal=causal, num_splits=num_splits, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == tq.shape
    ref_out, ref_lse = reference.attention(*values, causal=causal, return_lse=True)
    assert rel_error(out.float().cpu().numpy(), ref_out) <= TOLERANCE["bfloat16"]
    assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
def test_gpu_split_parts_and_many_rows():
    """Parts equal reference.split_kv_attention (empty splits included); seqlen_q = 100 loops over row passes."""
    import cupy
    from numba import cuda

    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, 1, 8, 2, 100, 300, 64, "float32")
    num_splits = 3
    o_parts = cupy.full((num_splits,) + q.shape, np.nan, np.float32)
    lse_parts = cupy.full((num_splits,) + q.shape[:-1], np.nan, np.float32)
    decode.launch_split(
        *(cuda.as_cuda_array(cupy.asarray(x)) for x in (q, k, v)), cuda.as_cuda_array(o_parts),
        cuda.as_cuda_array(lse_parts), True, 0.125, True, cuda.default_stream(),
    )
    cuda.default_stream().synchronize()
    ref_o, ref_lse = reference.split_kv_attention(q, k, v, num_splits, causal=True, sm_scale=0.125)
    assert rel_error(o_parts.get(), ref_o) <= TOLERANCE["float32"]
    assert_close_lse(lse_parts.get(), ref_lse)
    out, lse = numba_attn.flash_decode(*(cupy.asarray(x) for x in (q, k, v)), causal=True, return_lse=True)
    check_attention(out.get(), lse.get(), q, k, v, True)


@pytest.mark.gpu
def test_gpu_flash_decode_on_non_default_stream():
    """Inputs are produced on a non-blocking stream behind a long queue of work; the result must be ordered after it
    by running on that stream, and is read after synchronising that stream only."""
    import cupy

    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, 2, 8, 2, 4, 16384, 128, "float16")
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        busy = cupy.ones((2048, 2048), np.float32)
        for _ in range(20):
            busy = busy @ busy * (1.0 / 2048)  # keeps s busy for a while before the inputs exist
        zero = (busy[0, 0] - 1.0).astype(np.float16)  # 0, but only once the queue has drained
        q_d, k_d, v_d = (cupy.asarray(x) + zero for x in (q, k, v))
        out, lse = numba_attn.flash_decode(q_d, k_d, v_d, causal=True, num_splits=16, return_lse=True)
    s.synchronize()
    check_attention(out.get(), lse.get(), q, k, v, True)
