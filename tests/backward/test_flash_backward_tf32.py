"""The float32 tensor-core backward (``backend="tf32"``, numba_attn/backward/tf32.py) against
reference.attention_backward (float64).

* Simulator tests (tiny: one warp, 16-key blocks, 16-row tiles, the ``ptx`` twins; outputs and scratch poisoned with
  NaN): 3xTF32 within float32's 1e-5, one tf32 term (``allow_tf32``) within 5e-3; causal or not, GQA, Lq != Lk both
  ways (rows that see no key), lengths no tile divides, a head dim that takes two key-block passes, strided inputs,
  a negative scale, deterministic (bitwise repeatable) or not, and a two-warp tile configuration.
* The fragment swizzle's bank-conflict freedom, by counting banks (no kernel).
* ``gpu`` tests: realistic sizes, head dims 64 / 128 (and the others up to 256), bounded by twice the error of
  torch's own float32 SDPA backward (memory-efficient backend) where torch is installed.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error
from numba_attn.backward import dispatch
from numba_attn.backward import tf32 as backward_tf32

TF32_TOLERANCE = 5e-3


def _case(seed, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, sm_scale=None, batch=1):
    """``(inputs, exact)``: dout, q, k, v, out (float32) and the float32 lse, and dout, q, k, v in float64."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(np.float32)
    do = rng.standard_normal(q.shape).astype(np.float32)
    exact = tuple(x.astype(np.float64) for x in (do, q, k, v))
    out, lse = reference.attention(*exact[1:], causal=causal, sm_scale=sm_scale, return_lse=True)
    return (do, q, k, v, out.astype(np.float32), lse.astype(np.float32)), exact


def _check(grads, exact, causal, sm_scale, tolerance=TOLERANCE["float32"]):
    refs = reference.attention_backward(*exact, causal=causal, sm_scale=sm_scale)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert g.shape == ref.shape and g.dtype == np.float32, name
        err = rel_error(g, ref)
        assert err < tolerance, f"{name}: relative error {err:.3g}"
    return refs


def _transposed(x):
    """The same values as a strided view: memory (batch, seqlen, heads, headdim), axes 1 and 2 swapped back."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


# (heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic, sm_scale)
CASES = [
    (2, 1, 9, 17, 16, True, False, None),  # GQA 2:1, Lq < Lk: two key blocks, no tile divides either length
    (1, 1, 18, 7, 8, True, True, None),  # Lq > Lk: rows 0..10 see no key (lse = -inf); the query-block kernel
    (1, 1, 13, 11, 40, False, False, None),  # head dim 40: two key-block passes (dV; dK and dQ)
]


@pytest.mark.parametrize("heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal,deterministic,sm_scale", CASES)
def test_equals_reference(poisoned_outputs, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic,
                          sm_scale):
    inputs, exact = _case(seqlen_q * 100 + seqlen_k, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, sm_scale)
    grads = numba_attn.flash_backward(*inputs, causal=causal, sm_scale=sm_scale, deterministic=deterministic,
                                      backend="tf32")
    refs = _check(grads, exact, causal, sm_scale)
    if causal and seqlen_q > seqlen_k:  # rows that see no key: exactly 0
        np.testing.assert_array_equal(grads[0][:, :, :seqlen_q - seqlen_k], 0.0)
        np.testing.assert_array_equal(refs[0][:, :, :seqlen_q - seqlen_k], 0.0)


def test_one_tf32_term_strided_and_deterministic_repeats(poisoned_outputs):
    # allow_tf32 under the default choice; rows of 4-byte elements 2 heads apart, head dim 12; a negative scale
    inputs, exact = _case(3, 2, 2, 5, 7, 12, True, sm_scale=-0.3)
    views = [_transposed(x) for x in inputs[:5]]
    assert not any(x.flags.c_contiguous for x in views)
    assert dispatch.choose_backend(None, "float32", 12, allow_tf32=True) == "tf32"
    first = numba_attn.flash_backward(*views, inputs[5], causal=True, sm_scale=-0.3, deterministic=True,
                                      allow_tf32=True)
    second = numba_attn.flash_backward(*views, inputs[5], causal=True, sm_scale=-0.3, deterministic=True,
                                       allow_tf32=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    _check(first, exact, True, -0.3, TF32_TOLERANCE)


def test_two_warps_two_key_tiles_and_longer_chains(monkeypatch, poisoned_outputs):
    # 2 warps x 2 key tiles: 64-key blocks; 32-row tiles whose dQ m-tiles go to one warp each; dV / dK / dQ chained
    # through the MMAs' C operand over 4 k-steps
    monkeypatch.setattr(backward_tf32, "SIMULATOR_CONFIG", dataclasses.replace(
        backward_tf32.SIMULATOR_CONFIG, warps=2, key_tiles=2, block_m=32, k_chunk=4))
    inputs, exact = _case(5, 1, 1, 9, 36, 16, True)
    _check(numba_attn.flash_backward(*inputs, causal=True, backend="tf32"), exact, True, None)


def test_empty_sequences_give_zero_gradients(poisoned_outputs):
    inputs, _ = _case(11, 2, 1, 0, 9, 16, False)
    dq, dk, dv = numba_attn.flash_backward(*inputs, backend="tf32")
    assert dq.shape == (1, 2, 0, 16)
    np.testing.assert_array_equal(dk, 0.0)
    np.testing.assert_array_equal(dv, 0.0)
    inputs, _ = _case(12, 2, 2, 5, 0, 16, False)
    dq, dk, dv = numba_attn.flash_backward(*inputs[:5], np.full((1, 2, 5), -np.inf, np.float32), backend="tf32")
    np.testing.assert_array_equal(dq, 0.0)
    assert dk.shape == dv.shape == (1, 2, 0, 16)


def test_backend_choice():
    assert dispatch.choose_backend(None, "float32", 64) == ("simt" if numba_attn.SIMULATOR else "tf32")
    assert dispatch.choose_backend(None, "float32", 64, allow_tf32=True) == "tf32"
    assert dispatch.choose_backend("simt", "float32", 64, allow_tf32=True) == "simt"
    assert dispatch.choose_backend("tf32", "float32", 256) == "tf32"
    with pytest.raises(ValueError, match="'tf32' takes float32"):
        dispatch.choose_backend("tf32", "float16", 64)
    with pytest.raises(ValueError, match="'mma' takes float16 or bfloat16"):
        dispatch.choose_backend("mma", "float32", 64)
    inputs, _ = _case(4, 1, 1, 4, 5, 8, False)
    with pytest.raises(ValueError, match="allow_tf32"):
        numba_attn.flash_backward(*inputs, allow_tf32="yes")


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_m=24), "block_m"),
    (dict(warps=0), "warps"),
    (dict(k_chunk=0), "k_chunk"),
    (dict(block_m=64, dq_row_tiles=3), "dq_row_tiles"),
    (dict(warps=2, block_m=128), "dq_row_tiles"),
])
def test_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        backward_tf32.Tf32BackwardConfig(**kwargs)


def test_gpu_tiles_fit_a_block():
    # the large tiles an sm_90 block (227 KB), the small ones an sm_80 block (163 KB), at every padded head dim
    for d_pad in range(8, 257, 8):
        config = backward_tf32.GPU_CONFIG_64 if d_pad <= 64 else (
            backward_tf32.GPU_CONFIG_128 if d_pad <= 128 else backward_tf32.GPU_CONFIG_256)
        small = backward_tf32.SMALL_CONFIG_128 if d_pad <= 128 else backward_tf32.SMALL_CONFIG_256
        assert config.shared_bytes(d_pad) <= 227 * 1024, d_pad
        assert small.shared_bytes(d_pad) <= 163 * 1024, d_pad


def test_fragment_swizzle_is_free_of_bank_conflicts():
    # core.tf32: rows of 32-word lines, word c of row r at c ^ s(r); banks of the two fragment reads of a warp
    def s(r):
        return 8 * ((r & 3) ^ ((r >> 2) & 1))

    lanes = [(lane // 4, lane % 4) for lane in range(32)]
    for col in range(0, 64, 8):
        for phase in (lanes[:16], lanes[16:]):  # row pairs: 8-byte loads, two phases of 16 lanes
            banks = [((col + 2 * t) ^ s(g)) % 32 + w for g, t in phase for w in (0, 1)]
            assert sorted(banks) == list(range(32)), col
        for odd in (0, 1):  # column pairs: 4-byte loads of rows 2t + odd, word g
            banks = [((col + g) ^ s(2 * t + odd)) % 32 for g, t in lanes]
            assert sorted(banks) == list(range(32)), (col, odd)
    # the swizzle only permutes 8-word groups inside a 32-word line
    assert all(sorted((c ^ s(r)) for c in range(32)) == list(range(32)) for r in range(8))


# -- realistic sizes, on a GPU only ---------------------------------------------------------------------------------
def _torch_errors(exact, causal, refs):
    """Relative errors of torch's own float32 SDPA backward (memory-efficient backend) against the float64
    gradients, or None."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dof, qf, kf, vf = exact
    group = qf.shape[1] // kf.shape[1]
    q, k, v, do = (torch.tensor(x, device="cuda", dtype=torch.float32) for x in (qf, kf, vf, dof))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    mask = None
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(lk - lq)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=mask)
        out.backward(do)
    errors = [rel_error(x.grad.cpu().numpy(), r) for x, r in zip((q, k, v), refs)]
    return errors if all(np.isfinite(errors)) else None


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_against_reference_and_torch(head_dim, causal, deterministic):
    inputs, exact = _case(15, 4, 2, 1000, 777, head_dim, causal, batch=2)
    grads = numba_attn.flash_backward(*inputs, causal=causal, deterministic=deterministic, backend="tf32")
    refs = reference.attention_backward(*exact, causal=causal)
    theirs = _torch_errors(exact, causal, refs)
    for name, g, ref, bound in zip(("dq", "dk", "dv"), grads, refs, theirs or [None] * 3):
        err = rel_error(g, ref)
        limit = 2 * bound if bound is not None else TOLERANCE["float32"]
        assert err <= limit, f"{name}: relative error {err:.3g} > {limit:.3g} (torch SDPA: {bound})"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 36, 96, 160, 256])
def test_gpu_other_head_dims_and_one_term(head_dim):
    inputs, exact = _case(16, 2, 1, 300, 513, head_dim, True)
    for deterministic in (False, True):
        _check(numba_attn.flash_backward(*inputs, causal=True, deterministic=deterministic, backend="tf32"), exact,
               True, None)
        _check(numba_attn.flash_backward(*inputs, causal=True, deterministic=deterministic, allow_tf32=True), exact,
               True, None, TF32_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [1, 17, 129, 2048])
def test_gpu_lengths_strides_and_repeats(seqlen):
    inputs, exact = _case(17, 4, 1, seqlen, seqlen + 3, 128, True)
    views = [_transposed(x) for x in inputs[:5]]
    first = numba_attn.flash_backward(*views, inputs[5], causal=True, deterministic=True)
    second = numba_attn.flash_backward(*views, inputs[5], causal=True, deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    _check(first, exact, True, None)
    _check(numba_attn.flash_backward(*inputs, causal=True), exact, True, None)
