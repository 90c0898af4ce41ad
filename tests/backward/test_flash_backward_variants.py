"""numba_attn.flash_backward with a sliding window and soft-capping, and flash_backward_varlen (packed sequences),
against reference.attention_backward / reference.attention_varlen_backward (float64).

Simulator tests run both backward kernels' real code on their tiny tiles (SIMT: 8-key / 8-row tiles, mma: 16) with
every output and scratch array starting as NaN; window sides None / 0 / k, caps that bend the scores, Lq != Lk,
packed batches with empty sequences and sequences that start on odd rows, host and device offsets. Tile skipping is
checked by poisoning the tiles a window excludes. The ``gpu`` tests take realistic shapes: errors within twice
torch's own in the same dtype where torch can compute the variant (the window as a boolean mask to SDPA), else the
dtype's bound against float64.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error

SIM = pytest.mark.skipif(not numba_attn.SIMULATOR, reason="the gpu tests cover this on a GPU")


def _dense(seed, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, options, scale=1.0):
    rng = np.random.default_rng(seed)
    q = (scale * rng.standard_normal((1, heads, seqlen_q, head_dim))).astype(dtype)
    k = (scale * rng.standard_normal((1, kv_heads, seqlen_k, head_dim))).astype(dtype)
    v = rng.standard_normal((1, kv_heads, seqlen_k, head_dim)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    return dout, q, k, v, out.astype(dtype), lse.astype(np.float32)


def _assert_gradients(grads, refs, inputs, dtype):
    for name, g, ref, x in zip(("dq", "dk", "dv"), grads, refs, inputs):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert not np.isnan(g).any(), f"{name} has NaN (an element left unwritten?)"
        err = rel_error(g, ref)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3g}"


# (backend, dtype, heads, kv_heads, seqlen_q, seqlen_k, head_dim, options, deterministic)
DENSE = [
    ("simt", "float32", 2, 1, 21, 19, 8, dict(window=(3, 2)), False),  # both sides bounded, GQA
    ("simt", "float32", 1, 1, 19, 33, 8, dict(causal=True, window=(5, None)), True),  # Lq < Lk
    ("simt", "float32", 1, 1, 27, 9, 8, dict(causal=True, window=(0, 0)), False),  # Lq > Lk: rows see no key
    ("simt", "float32", 2, 2, 13, 17, 8, dict(window=(None, 0), softcap=2.0), True),
    ("simt", "float16", 1, 1, 17, 17, 8, dict(causal=True, softcap=1.5, sm_scale=-0.4), False),  # negative scale
    ("simt", "float32", 1, 1, 9, 40, 8, dict(window=(2, 0), softcap=5.0), False),  # most key tiles skipped
    ("mma", "float16", 2, 1, 13, 19, 16, dict(causal=True, window=(7, 0), softcap=2.0), False),
    ("mma", "float16", 1, 1, 19, 13, 16, dict(window=(3, 9)), True),
]


@SIM
@pytest.mark.parametrize("backend,dtype,heads,kv_heads,seqlen_q,seqlen_k,head_dim,options,deterministic", DENSE)
def test_window_and_softcap_gradients_equal_reference(poisoned_outputs, backend, dtype, heads, kv_heads, seqlen_q,
                                                      seqlen_k, head_dim, options, deterministic):
    dout, q, k, v, out, lse = _dense(seqlen_q * 7 + seqlen_k, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype,
                                     options, scale=1.5)
    grads = numba_attn.flash_backward(dout, q, k, v, out, lse, deterministic=deterministic, backend=backend,
                                      **options)
    refs = reference.attention_backward(dout, q, k, v, **options)
    _assert_gradients(grads, refs, (q, k, v), dtype)


@SIM
@pytest.mark.parametrize("deterministic", [False, True])
def test_tiles_outside_the_window_are_never_read(deterministic):
    """NaN in the rows and keys a window excludes from whole tiles: a kernel that visits such a tile (and so
    multiplies NaN by a masked 0) gives NaN; one that skips it gives the clean gradients there."""
    n, window = 48, (3, 0)
    dout, q, k, v, out, lse = _dense(11, 1, 1, n, n, 8, "float32", dict(causal=True, window=window))
    refs = reference.attention_backward(dout, q, k, v, causal=True, window=window)
    # rows 32.. see keys 29.. only: key blocks 0..2 (keys 0..23) never meet query tiles 4.. (rows 32..); the
    # query blocks of rows 0..15 never meet key tiles 3.. (keys 24..)
    for x in (dout, q):
        x[:, :, 32:] = np.nan
    for x in (k, v):
        x[:, :, 24:] = np.nan
    dq, dk, dv = numba_attn.flash_backward(dout, q, k, v, out, lse, causal=True, window=window, backend="simt",
                                           deterministic=deterministic)
    for got, ref in ((dq[:, :, :16], refs[0][:, :, :16]), (dk[:, :, :24], refs[1][:, :, :24]),
                     (dv[:, :, :24], refs[2][:, :, :24])):
        assert not np.isnan(got).any()
        assert rel_error(got, ref) < TOLERANCE["float32"]


def _packed(seed, lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, options):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = (np.r_[0, np.cumsum(lengths)].astype(np.int32) for lengths in (lengths_q, lengths_k))
    q = (1.5 * rng.standard_normal((cu_q[-1], heads, head_dim))).astype(dtype)
    k = (1.5 * rng.standard_normal((cu_k[-1], kv_heads, head_dim))).astype(dtype)
    v = rng.standard_normal((cu_k[-1], kv_heads, head_dim)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    return dout, q, k, v, out.astype(dtype), lse.astype(np.float32), cu_q, cu_k


# (backend, dtype, lengths_q, lengths_k, heads, kv_heads, head_dim, options, deterministic, device offsets): empty
# query and key sequences, Lq != Lk per sequence, sequences starting on odd rows, lengths no tile divides
VARLEN = [
    ("simt", "float32", [5, 0, 11, 3, 9], [7, 4, 0, 9, 9], 2, 1, 8, dict(causal=True), False, False),
    ("simt", "float32", [13, 6], [9, 17], 2, 2, 8, dict(window=(3, 1), softcap=2.0), True, False),
    ("simt", "float16", [1, 19, 4], [19, 1, 0], 1, 1, 8, dict(causal=True, window=(2, None)), False, True),
    ("simt", "float32", [3, 17], [17, 3], 2, 1, 8, dict(softcap=3.0), True, True),
    ("mma", "float16", [5, 0, 11], [7, 4, 9], 2, 1, 16, dict(causal=True, softcap=2.0), False, False),
    ("mma", "float16", [3, 13], [13, 3], 1, 1, 16, dict(window=(4, 2)), True, True),
]


@SIM
@pytest.mark.parametrize("backend,dtype,lengths_q,lengths_k,heads,kv_heads,head_dim,options,deterministic,device",
                         VARLEN)
def test_varlen_gradients_equal_reference(poisoned_outputs, backend, dtype, lengths_q, lengths_k, heads, kv_heads,
                                          head_dim, options, deterministic, device):
    from numba import cuda

    dout, q, k, v, out, lse, cu_q, cu_k = _packed(sum(lengths_q) + 3, lengths_q, lengths_k, heads, kv_heads,
                                                  head_dim, dtype, options)
    arrays, offsets = (dout, q, k, v, out, lse), (cu_q, cu_k)
    if device:  # the planning kernel makes both schedules; the results come back as device arrays
        arrays, offsets = [cuda.to_device(x) for x in arrays], [cuda.to_device(x) for x in offsets]
    grads = numba_attn.flash_backward_varlen(*arrays, *offsets, backend=backend, deterministic=deterministic,
                                             **options)
    if device:
        grads = [g.copy_to_host() for g in grads]
    refs = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **options)
    _assert_gradients(grads, refs, (q, k, v), dtype)


@SIM
def test_varlen_equals_flash_backward_of_each_sequence():
    """A packed sequence's gradients are those of flash_backward on that sequence alone (the same sums)."""
    options = dict(causal=True, window=(4, None))
    lengths_q, lengths_k = [5, 9], [7, 4]
    dout, q, k, v, out, lse, cu_q, cu_k = _packed(5, lengths_q, lengths_k, 2, 1, 8, "float32", options)
    dq, dk, dv = numba_attn.flash_backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, backend="simt", **options)
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [x[rows].transpose(1, 0, 2)[None] for x in (dout, q)] + \
              [x[keys].transpose(1, 0, 2)[None] for x in (k, v)] + [out[rows].transpose(1, 0, 2)[None]]
        alone = numba_attn.flash_backward(*seq, np.ascontiguousarray(lse[:, rows])[None], backend="simt", **options)
        for got, want in zip((dq[rows], dk[keys], dv[keys]), alone):
            np.testing.assert_allclose(got, want[0].transpose(1, 0, 2), rtol=1e-5, atol=1e-6)


def _varlen_arguments():
    q, k, v = np.zeros((5, 2, 8), np.float32), np.zeros((6, 1, 8), np.float32), np.zeros((6, 1, 8), np.float32)
    return dict(dout=q, q=q, k=k, v=v, out=q, lse=np.zeros((2, 5), np.float32), cu_seqlens_q=[0, 3, 5],
                cu_seqlens_k=[0, 4, 6])


BAD = [
    ("window", dict(window=(-1, 0)), None),
    ("softcap", dict(softcap=-1.0), None),
    ("lse", dict(lse=np.zeros((5, 2), np.float32)), None),
    ("dout", dict(dout=np.zeros((5, 2, 4), np.float32)), None),
    ("cu_seqlens_q", dict(cu_seqlens_q=[0, 4, 3]), None),
    ("cu_seqlens_k", dict(cu_seqlens_k=[0, 4, 7]), None),
    ("max_seqlen_q", dict(max_seqlen_q=2), None),
    ("k", dict(k=np.zeros((6, 3, 8), np.float32), v=np.zeros((6, 3, 8), np.float32)), None),
]


@pytest.mark.parametrize("name,change,_", BAD, ids=[b[0] for b in BAD])
def test_bad_varlen_arguments_raise_naming_them(name, change, _):
    arguments = _varlen_arguments()
    arguments.update(change)
    options = {key: arguments.pop(key) for key in ("window", "softcap", "max_seqlen_q") if key in arguments}
    with pytest.raises(ValueError, match=f"^{name}"):
        numba_attn.flash_backward_varlen(*arguments.values(), **options)


def test_bad_window_and_softcap_of_flash_backward_raise():
    q = np.zeros((1, 1, 4, 8), np.float32)
    lse = np.zeros((1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="^window"):
        numba_attn.flash_backward(q, q, q, q, q, lse, window=(1, -2))
    with pytest.raises(ValueError, match="^softcap"):
        numba_attn.flash_backward(q, q, q, q, q, lse, softcap=1e-44)


# -- GPU ----------------------------------------------------------------------------------------------------------------
def _torch_error_bound(torch, q, k, v, dout, mask, refs, dtype):
    """Twice the error of torch SDPA's own backward (math / efficient backends, the window as a boolean mask) in
    ``dtype`` against the float64 gradients, per gradient; None where torch cannot run it."""
    import torch.nn.functional as F

    try:
        qt, kt, vt = (x.detach().clone().requires_grad_() for x in (q, k, v))
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(qt, kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1),
                                             attn_mask=mask)
        grads = torch.autograd.grad(out, (qt, kt, vt), dout)
    except Exception:  # noqa: BLE001  (no torch path for this case)
        return None
    return [2 * rel_error(g.float().cpu().numpy(), r) for g, r in zip(grads, refs)]


# (dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, options, deterministic): every kernel specialisation
# compiles in 5-10 s, so each case is one
GPU_DENSE = [
    ("float16", 2, 8, 2, 1024, 1537, 128, dict(causal=True, window=(256, 0)), False),
    ("bfloat16", 1, 8, 8, 2048, 2048, 64, dict(window=(300, 100)), True),
    ("float16", 1, 4, 4, 1000, 700, 128, dict(causal=True, softcap=30.0), False),
    ("bfloat16", 1, 4, 2, 777, 1024, 96, dict(softcap=5.0, window=(None, 64)), False),
    ("float16", 1, 4, 1, 512, 512, 256, dict(causal=True, window=(100, 0), softcap=20.0), True),
    ("float32", 1, 4, 4, 700, 900, 64, dict(window=(128, 128), softcap=10.0), False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,batch,heads,kv_heads,seqlen_q,seqlen_k,head_dim,options,deterministic", GPU_DENSE)
def test_gpu_variant_gradients(dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, options, deterministic):
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(seqlen_q + head_dim)
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", generator=g).to(tdtype)
    k, v = (torch.randn(batch, kv_heads, seqlen_k, head_dim, device="cuda", generator=g).to(tdtype) for _ in "kv")
    dout = torch.randn_like(q)
    out, lse = numba_attn.flash_forward(q, k, v, return_lse=True, **options)
    grads = numba_attn.flash_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    host = [x.float().cpu().numpy().astype(np.float64) for x in (dout, q, k, v)]
    refs = reference.attention_backward(*host, **options)
    bounds = [TOLERANCE[dtype]] * 3
    if "softcap" not in options:  # torch has no cap; a window is a boolean mask to SDPA
        mask = None
        if "window" in options or options.get("causal"):
            from reference._masks import mask_band

            band = mask_band(options.get("causal", False), options.get("window"))
            mask = torch.from_numpy(band.visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k)).cuda()
        torch_bounds = _torch_error_bound(torch, q, k, v, dout, mask, refs, dtype)
        if torch_bounds is not None:
            bounds = [b if np.isfinite(b) else TOLERANCE[dtype] for b in torch_bounds]
    for name, got, ref, bound in zip(("dq", "dk", "dv"), grads, refs, bounds):
        err = rel_error(got.float().cpu().numpy(), ref)
        assert err <= bound, f"{name}: relative error {err:.3g} > {bound:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,options,deterministic,device_offsets", [
    ("float16", dict(causal=True), False, True), ("bfloat16", dict(window=(128, 0)), True, False),
    ("float16", dict(causal=True, softcap=30.0), False, False), ("float32", dict(causal=True, window=(64, 64)), False,
                                                                 True)])
def test_gpu_varlen_gradients(dtype, options, deterministic, device_offsets):
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype)
    lengths = [1, 700, 0, 1500, 33, 2048]
    cu = np.r_[0, np.cumsum(lengths)].astype(np.int32)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(int(cu[-1]), 8, 128, device="cuda", generator=g).to(tdtype)
    k, v = (torch.randn(int(cu[-1]), 2, 128, device="cuda", generator=g).to(tdtype) for _ in "kv")
    dout = torch.randn_like(q)
    offsets = torch.from_numpy(cu).cuda() if device_offsets else cu
    out, lse = numba_attn.flash_forward_varlen(q, k, v, offsets, offsets, return_lse=True, **options)
    grads = numba_attn.flash_backward_varlen(dout, q, k, v, out, lse, offsets, offsets, deterministic=deterministic,
                                             **options)
    host = [x.float().cpu().numpy().astype(np.float64) for x in (dout, q, k, v)]
    refs = reference.attention_varlen_backward(*host, cu, cu, **options)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        err = rel_error(got.float().cpu().numpy(), ref)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3g}"
