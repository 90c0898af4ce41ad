"""The tensor-core backward (``backend="mma"``, numba_attn/backward/mma.py) against reference.attention_backward.

* Simulator tests (tiny: one warp, 16-key blocks, 16-row tiles, the ``ptx`` twins): float16 through the public API,
  bfloat16 as bit patterns through ``dispatch`` (CI has no torch to carry bfloat16), outputs and scratch poisoned
  with NaN; causal or not, GQA, Lq != Lk both ways, lengths no tile divides, a head dim that takes two key-block
  passes, strided inputs, deterministic or not (deterministic: bitwise repeatable).
* ``gpu`` tests: realistic sizes, float16 and bfloat16, head dims 64 / 128 (and the others up to 256), compared with
  the float64 reference and, where torch is installed, bounded by twice the error of torch's own SDPA backward.
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error
from numba_attn.backward import dispatch
from numba_attn.backward import mma as backward_mma
from numba_attn.core import ptx
from numba_attn.runtime.attention_args import BackwardArgs


def _rounded(x, dtype):
    """(array in ``dtype`` -- bfloat16 as uint16 bits --, its exact float64 values)."""
    if dtype == "bfloat16":
        bits = ptx.float32_to_bf16_bits(x.astype(np.float32))
        return bits, ptx.bf16_bits_to_float32(bits).astype(np.float64)
    y = x.astype(dtype)
    return y, y.astype(np.float64)


def _case(seed, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, causal, sm_scale=None, batch=1):
    """``(inputs, exact)``: dout, q, k, v, out (rounded to ``dtype``) and the float32 lse, and their float64 values."""
    rng = np.random.default_rng(seed)
    shapes = {"q": (batch, heads, seqlen_q, head_dim), "k": (batch, kv_heads, seqlen_k, head_dim)}
    q, qf = _rounded(rng.standard_normal(shapes["q"]), dtype)
    k, kf = _rounded(rng.standard_normal(shapes["k"]), dtype)
    v, vf = _rounded(rng.standard_normal(shapes["k"]), dtype)
    do, dof = _rounded(rng.standard_normal(shapes["q"]), dtype)
    out, lse = reference.attention(qf, kf, vf, causal=causal, sm_scale=sm_scale, return_lse=True)
    out, outf = _rounded(out, dtype)
    return (do, q, k, v, out, lse.astype(np.float32)), (dof, qf, kf, vf)


def _as_float(x, dtype):
    return ptx.bf16_bits_to_float32(x).astype(np.float64) if dtype == "bfloat16" else x.astype(np.float64)


def _check(grads, exact, causal, sm_scale, dtype, tolerance=None):
    refs = reference.attention_backward(*exact, causal=causal, sm_scale=sm_scale)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert g.shape == ref.shape, name
        err = rel_error(_as_float(g, dtype), ref)
        assert err < (tolerance or TOLERANCE[dtype]), f"{name}: relative error {err:.3g}"
    return refs


def _bits_backward(inputs, causal, sm_scale, deterministic, dtype, backend="mma"):
    """``dispatch``'s ``backend`` path on host arrays (16-bit values or bfloat16 bits) under the simulator, every output
    and scratch array poisoned with NaN (the public API takes bfloat16 only as torch tensors)."""
    dout, q, k, v, out, lse = inputs
    grads = [np.full(x.shape, np.nan, np.float32).astype(q.dtype) if dtype != "bfloat16"
             else np.full(x.shape, 0x7FC0, np.uint16) for x in (q, k, v)]
    call = types.SimpleNamespace(dtype=dtype, stream=0,
                                 scratch=lambda shape, kind="float32": np.full(shape, np.nan, np.float32))
    scale = float(sm_scale if sm_scale is not None else 1.0 / np.sqrt(q.shape[3]))
    args = BackwardArgs(dout, q, k, v, out, lse, *grads, scale, causal)
    dispatch.run(call, args, backend, deterministic)
    return grads


# (heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic, sm_scale)
FLOAT16_CASES = [
    (2, 1, 19, 23, 16, True, False, None),  # GQA 2:1, Lq < Lk, two key blocks, no tile divides either length
    (1, 1, 21, 9, 16, True, True, None),  # Lq > Lk: rows 0..11 see no key (lse = -inf); the query-block kernel
]


@pytest.mark.parametrize("heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal,deterministic,sm_scale", FLOAT16_CASES)
def test_float16_equals_reference(poisoned_outputs, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal,
                                  deterministic, sm_scale):
    inputs, exact = _case(seqlen_q * 100 + seqlen_k, heads, kv_heads, seqlen_q, seqlen_k, head_dim, "float16",
                          causal, sm_scale)
    grads = numba_attn.flash_backward(*inputs, causal=causal, sm_scale=sm_scale, deterministic=deterministic,
                                      backend="mma")
    assert all(g.dtype == np.float16 for g in grads)
    refs = _check(grads, exact, causal, sm_scale, "float16")
    if causal and seqlen_q > seqlen_k:  # rows that see no key: exactly 0
        np.testing.assert_array_equal(grads[0][:, :, :seqlen_q - seqlen_k], 0.0)
        np.testing.assert_array_equal(refs[0][:, :, :seqlen_q - seqlen_k], 0.0)


# (heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic, sm_scale, tiles: SIMULATOR_CONFIG changes)
BFLOAT16_CASES = [
    (1, 1, 13, 11, 40, False, False, None, {}),  # head dim 40: padded to 48, two key-block passes (dV; dK and dQ)
    (2, 1, 7, 10, 16, True, True, -0.5, {}),  # GQA, a negative scale, deterministic
    # two warps: 32-key blocks, 32-row tiles, K / V fragments held in registers, the dQ columns split between warps
    (1, 1, 9, 20, 32, True, False, None, dict(warps=2, block_m=32, dq_row_tiles=2, kv_in_registers=True)),
]


@pytest.mark.parametrize("heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal,deterministic,sm_scale,tiles",
                         BFLOAT16_CASES)
@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="NumPy bfloat16 bits through the internals: simulator only "
                    "(on a GPU bfloat16 is checked through torch, test_gpu_*)")
def test_bfloat16_equals_reference(monkeypatch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, deterministic,
                                   sm_scale, tiles):
    if tiles:
        monkeypatch.setattr(backward_mma, "SIMULATOR_CONFIG", dataclasses.replace(backward_mma.SIMULATOR_CONFIG,
                                                                                  **tiles))
    inputs, exact = _case(seqlen_q * 100 + seqlen_k, heads, kv_heads, seqlen_q, seqlen_k, head_dim, "bfloat16",
                          causal, sm_scale)
    _check(_bits_backward(inputs, causal, sm_scale, deterministic, "bfloat16"), exact, causal, sm_scale, "bfloat16")


def _transposed(x):
    """The same values as a strided view: memory (batch, seqlen, heads, headdim), axes 1 and 2 swapped back."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def test_strided_inputs_and_deterministic_repeats(poisoned_outputs):
    # rows of 16-bit elements 2 heads apart, headdim 12 (not whole 16-byte pieces): the element-wise loaders
    inputs, exact = _case(3, 2, 2, 7, 9, 12, "float16", True)
    views = [_transposed(x) for x in inputs[:5]]
    assert not any(x.flags.c_contiguous for x in views)
    first = numba_attn.flash_backward(*views, inputs[5], causal=True, deterministic=True, backend="mma")
    second = numba_attn.flash_backward(*views, inputs[5], causal=True, deterministic=True, backend="mma")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    _check(first, exact, True, None, "float16")


@pytest.mark.parametrize("deterministic", [False, True])
def test_empty_sequences_give_zero_gradients(poisoned_outputs, deterministic):
    # no query row: every key is still written (0); no key: dq = 0
    inputs, _ = _case(11, 2, 1, 0, 9, 16, "float16", False)
    dq, dk, dv = numba_attn.flash_backward(*inputs, deterministic=deterministic, backend="mma")
    assert dq.shape == (1, 2, 0, 16)
    np.testing.assert_array_equal(dk, 0.0)
    np.testing.assert_array_equal(dv, 0.0)
    inputs, _ = _case(12, 2, 2, 5, 0, 16, "float16", False)
    dq, dk, dv = numba_attn.flash_backward(*inputs[:5], np.full((1, 2, 5), -np.inf, np.float32),
                                           deterministic=deterministic, backend="mma")
    np.testing.assert_array_equal(dq, 0.0)
    assert dk.shape == dv.shape == (1, 2, 0, 16)


def test_backend_choice():
    from numba_attn.backward import wgmma

    hopper = not numba_attn.SIMULATOR and dispatch.WGMMA_BY_DEFAULT and wgmma.supports("bfloat16", 64)
    assert dispatch.choose_backend(None, "bfloat16", 64) == ("wgmma_ws" if hopper else "mma")
    assert dispatch.choose_backend(None, "bfloat16", 128) == ("wgmma_ws" if hopper else "mma")
    assert dispatch.choose_backend(None, "float32", 64) == ("simt" if numba_attn.SIMULATOR else "tf32")
    # under the simulator float16 stays on the (much faster there) SIMT kernels unless "mma" is asked for
    assert dispatch.choose_backend(None, "float16", 64) == ("simt" if numba_attn.SIMULATOR else
                                                             "wgmma_ws" if hopper else "mma")
    assert dispatch.choose_backend("mma", "float16", 256) == "mma"
    with pytest.raises(ValueError, match="'mma' takes float16 or bfloat16"):
        dispatch.choose_backend("mma", "float32", 64)
    with pytest.raises(ValueError, match="'simt' does not take bfloat16"):
        dispatch.choose_backend("simt", "bfloat16", 64)
    inputs, _ = _case(4, 1, 1, 4, 5, 8, "float16", False)
    with pytest.raises(ValueError, match="backend: expected one of simt, mma, tf32, wgmma, wgmma_ws or None"):
        numba_attn.flash_backward(*inputs, backend="tiles")


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_m=24), "block_m"),
    (dict(warps=0), "warps"),
    (dict(block_m=64, dq_row_tiles=3), "dq_row_tiles"),
    (dict(warps=2, block_m=128), "dq_row_tiles"),  # 8 m-tiles in 4 groups of 2: more groups than warps
])
def test_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        backward_mma.MmaBackwardConfig(**kwargs)


def test_shared_memory_of_the_gpu_tiles():
    # the GPU tiles fit an sm_80 block (163 KB) at every padded head dim they are picked for
    for d_pad in range(16, 257, 16):
        config = backward_mma.GPU_CONFIG_64 if d_pad <= 64 else (
            backward_mma.GPU_CONFIG_128 if d_pad <= 128 else backward_mma.GPU_CONFIG_256)
        assert config.shared_bytes(d_pad) <= 163 * 1024, d_pad


# -- realistic sizes, on a GPU only ---------------------------------------------------------------------------------
def _torch_error(inputs_exact, causal, dtype, refs):
    """Relative errors of torch's own SDPA backward (CUDA, ``dtype``) against the float64 gradients, or None."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dof, qf, kf, vf = inputs_exact
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    group = qf.shape[1] // kf.shape[1]
    q, k, v, do = (torch.tensor(x, device="cuda", dtype=tdt) for x in (qf, kf, vf, dof))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = None
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device="cuda").tril(lk - lq)
    out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=False)
    out.backward(do)
    errors = [rel_error(x.grad.float().cpu().numpy(), r) for x, r in zip((q, k, v), refs)]
    # (rows that see no key come out NaN from torch: no bound to take from it then)
    return errors if all(np.isfinite(errors)) else None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_against_reference_and_torch(dtype, head_dim, causal, deterministic):
    torch = pytest.importorskip("torch")
    inputs, exact = _case(15, 4, 2, 1000, 777, head_dim, dtype, causal, batch=2)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    tensors = [torch.tensor(_as_float(x, dtype), device="cuda", dtype=tdt) for x in inputs[:5]]
    tensors.append(torch.tensor(inputs[5], device="cuda"))
    grads = numba_attn.flash_backward(*tensors, causal=causal, deterministic=deterministic, backend="mma")
    grads = [g.float().cpu().numpy() for g in grads]
    refs = reference.attention_backward(*exact, causal=causal)
    theirs = _torch_error(exact, causal, dtype, refs)
    for name, g, ref, bound in zip(("dq", "dk", "dv"), grads, refs, theirs or [None] * 3):
        err = rel_error(g, ref)
        limit = 2 * bound if bound is not None else TOLERANCE[dtype]
        assert err <= limit, f"{name}: relative error {err:.3g} > {limit:.3g} (torch SDPA: {bound})"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 40, 80, 96, 160, 192, 256])
def test_gpu_other_head_dims(head_dim):
    inputs, exact = _case(16, 2, 1, 300, 513, head_dim, "float16", True)
    for deterministic in (False, True):
        grads = numba_attn.flash_backward(*inputs, causal=True, deterministic=deterministic, backend="mma")
        _check(grads, exact, True, None, "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [1, 2, 17, 127, 129, 1000, 2048])
def test_gpu_lengths_strides_and_repeats(seqlen):
    inputs, exact = _case(17, 4, 1, seqlen, seqlen + 3, 128, "float16", True)
    views = [_transposed(x) for x in inputs[:5]]
    first = numba_attn.flash_backward(*views, inputs[5], causal=True, deterministic=True, backend="mma")
    second = numba_attn.flash_backward(*views, inputs[5], causal=True, deterministic=True, backend="mma")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
    _check(first, exact, True, None, "float16")
    _check(numba_attn.flash_backward(*inputs, causal=True, backend="mma"), exact, True, None, "float16")
