"""The chunked backward of the causal dot product (``backend="chunked"``, ``linear/chunked_backward.py``) and the
linear-attention layer's backward (``linear_attention_backward``, ``linear/layer_backward.py``) against the float64
references.

Simulator cases are tiny (one head or two, seqlen 1..17, E, M 4..9; 16-row chunks, so 17 rows make two
segments and the ``STATES`` pass runs) and few: a chunked walk of float32 inputs costs seconds there (3xTF32 most).
The error metric is ‖g − ref‖ / ‖ref‖ per gradient (kernel_checks.TOLERANCE; ``allow_tf32``: ROUNDED_TF32_TOLERANCE); 16-bit
inputs are compared with the float64 gradients of the rounded inputs. The ``gpu`` tests run realistic sizes (up to
16k rows, E = M = 64 / 128) against float64 references, next to torch autograd's own error through a naive
implementation in the same dtype; ``scripts/check_linear_backward.py`` times them against fla.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, rel_error, to_host
from numba_attn.linear import chunked_backward
from numba_attn.linear import launch as lc
from numba_attn.linear import layer_backward as lb

#: allow_tf32: operands rounded to tf32 (mma_f32.ROUND_SCALE), as in test_linear_chunked
TF32_TOLERANCE = 1e-3
#: the layer with allow_tf32: its gradients through the numerator and the normaliser cancel in part (layer_backward),
#: which takes the relative error to 1e-3..2e-3 (test_linear_chunked's bound for plain tf32)
LAYER_TF32_TOLERANCE = 5e-3


def _case(seed, shape, e, m, dtype, with_initial_state=False, with_dstate=False, seqlen_k=None):
    """``(dout, q, k, v, initial_state, dstate)`` rounded to ``dtype`` (float32 states or None); ``shape``: the
    leading axes and seqlen (``seqlen_k``: k's and v's, when it differs)."""
    rng = np.random.default_rng(seed)
    shape_k = shape if seqlen_k is None else shape[:-1] + (seqlen_k,)
    q = rng.standard_normal(shape + (e,)).astype(dtype)
    k = rng.standard_normal(shape_k + (e,)).astype(dtype)
    v = rng.standard_normal(shape_k + (m,)).astype(dtype)
    dout = rng.standard_normal(shape + (m,)).astype(dtype)
    state_shape = shape[:-1] + (e, m)
    initial_state = rng.standard_normal(state_shape).astype(np.float32) if with_initial_state else None
    dstate = rng.standard_normal(state_shape).astype(np.float32) if with_dstate else None
    return dout, q, k, v, initial_state, dstate


def _check(grads, refs, likes, bound):
    assert len(grads) == len(refs)
    for name, g, ref, like in zip(("dq", "dk", "dv", "dinitial_state"), grads, refs, likes):
        g = to_host(g)
        assert g.shape == like.shape, name
        assert not np.isnan(np.asarray(g, np.float64)).any(), f"{name} has NaN"
        err = rel_error(g, ref)
        assert err < bound, f"{name}: relative error {err:.3g}"


def _check_product(grads, dout, q, k, v, initial_state, dstate, bound):
    refs = reference.causal_dot_product_backward(*(_float(x) for x in (dout, q, k, v)), initial_state=initial_state,
                                                 dstate=dstate)
    _check(grads, refs, (q, k, v, initial_state), bound)


def _float(x):
    return to_host(x).astype(np.float64) if type(x).__module__.startswith("torch") else x


# -- causal_dot_product_backward on the chunked kernels ------------------------------------------------------------
# (seqlen, E, M, dtype, allow_tf32, initial_state, dstate)
CASES = [
    (17, 8, 4, "float16", False, True, True),  # two segments: the STATES pass of every walk
    (5, 4, 8, "float32", False, False, True),  # 3xTF32
    (1, 4, 4, "float32", True, True, False),  # one row, one tf32 term
]


@pytest.mark.parametrize("seqlen,e,m,dtype,tf32,with_initial_state,with_dstate", CASES)
def test_chunked_product_backward(seqlen, e, m, dtype, tf32, with_initial_state, with_dstate, poisoned_outputs):
    arrays = _case(seqlen * 10 + e, (1, 1, seqlen), e, m, dtype, with_initial_state, with_dstate)
    dout, q, k, v, initial_state, dstate = arrays
    grads = numba_attn.causal_dot_product_backward(dout, q, k, v, initial_state=initial_state, dstate=dstate,
                                                   allow_tf32=tf32, backend="chunked")
    assert all(g.dtype == x.dtype for g, x in zip(grads, (q, k, v, initial_state)))
    _check_product(grads, *arrays, TF32_TOLERANCE if tf32 else TOLERANCE[dtype])


def test_chunked_product_backward_on_the_shared_state_kernel_with_strided_views():
    """The shared-memory-state kernel (E > 128 on a GPU) runs the three walks here; inputs are strided views with a
    negative row stride (the reversed walks flip them back), states transposed views."""
    arrays = _case(3, (1, 1, 7), 4, 6, "float16", True, True)

    def strided(x):
        return np.ascontiguousarray(np.swapaxes(x, -1, -2)[..., ::-1]).swapaxes(-1, -2)[..., ::-1, :]

    views = [strided(x) for x in arrays]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lc, "launch_causal", functools.partial(lc.launch_causal, kernel="shared"))
        mp.setattr(chunked_backward, "FUSED", False)
        grads = numba_attn.causal_dot_product_backward(views[0], *views[1:4], initial_state=views[4],
                                                       dstate=views[5], backend="chunked")
    _check_product(grads, *arrays, TOLERANCE["float16"])


@pytest.mark.parametrize("dtype,split", [("float16", False), ("float32", True)])
def test_fused_walks(dtype, split, poisoned_outputs):
    """The three walks as problems of one pair of launches (``chunked_backward.FUSED``, opt-in, where E = M),
    the ``dk`` walk from the ``dv`` walk's transposed increments: two segments, both states, E = 6 padded to 16 and
    staged element by element; ``split``: one walking launch per walk after the shared STATES launch
    (``SPLIT_3XTF32``). (Several M tiles, where the transposed increments come from several ``dv`` blocks: the
    float32 GPU tests, 32-column tiles at E = M = 64.)"""
    arrays = _case(6, (1, 1, 17), 6, 6, dtype, True, True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunked_backward, "FUSED", True)
        mp.setattr(chunked_backward, "SPLIT_3XTF32", split)
        grads = numba_attn.causal_dot_product_backward(arrays[0], *arrays[1:4], initial_state=arrays[4],
                                                       dstate=arrays[5], backend="chunked")
    _check_product(grads, *arrays, TOLERANCE[dtype])


def test_chunked_product_backward_of_bfloat16_tensors():
    torch = pytest.importorskip("torch")
    arrays = _case(4, (1, 1, 5), 4, 4, "float32", True, True)
    tensors = [torch.from_numpy(x).to(torch.bfloat16) for x in arrays[:4]]
    grads = numba_attn.causal_dot_product_backward(*tensors, initial_state=torch.from_numpy(arrays[4]),
                                                   dstate=torch.from_numpy(arrays[5]))  # None: chunked for bf16
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3 + [torch.float32]
    _check_product(grads, *tensors, arrays[4], arrays[5], TOLERANCE["bfloat16"])


def test_chunked_product_backward_of_no_rows():
    """No rows: empty dq, dk, dv; dinitial_state is dstate (zeros without it)."""
    for with_dstate in (False, True):
        arrays = _case(5, (1, 2, 0), 4, 3, "float32", True, with_dstate)
        grads = numba_attn.causal_dot_product_backward(arrays[0], *arrays[1:4], initial_state=arrays[4],
                                                       dstate=arrays[5], backend="chunked")
        assert [g.shape for g in grads[:3]] == [(1, 2, 0, 4), (1, 2, 0, 4), (1, 2, 0, 3)]
        np.testing.assert_array_equal(grads[3], arrays[5] if with_dstate else np.zeros((1, 2, 4, 3), np.float32))


def test_backward_dispatch():
    """backend=None: chunked from the backward's own thresholds (long, bfloat16, states); the recurrent walk takes
    states too, but no bfloat16."""
    from numba_attn.linear import dispatch

    threshold = dispatch.CHUNKED_MIN_SEQLEN_BACKWARD
    choose = functools.partial(dispatch.choose_backend, states_ok=True, backward=True)
    for dtype in ("float16", "float32"):
        assert threshold[dtype] <= dispatch.CHUNKED_MIN_SEQLEN[dtype]
        assert choose(None, dtype, threshold[dtype] - 1, False) == "recurrent"
        assert choose(None, dtype, threshold[dtype], False) == "chunked"
    assert choose(None, "float32", 1, True) == "chunked"
    assert choose(None, "bfloat16", 1, False) == "chunked"
    assert choose("recurrent", "float32", 1, True) == "recurrent"  # states on the recurrent walks
    with pytest.raises(ValueError, match="backend: 'recurrent' does not take bfloat16"):
        choose("recurrent", "bfloat16", 1, False)
    with pytest.raises(ValueError, match="backend: 'recurrent' takes no initial_state"):
        dispatch.choose_backend("recurrent", "float32", 1, True)  # the forward's walk takes none


# -- linear_attention_backward -------------------------------------------------------------------------------------
def _check_layer(grads, dout, q, k, v, causal, eps, bound):
    refs = reference.linear_attention_backward(*(_float(x) for x in (dout, q, k, v)), causal=causal, eps=eps)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype
    _check(grads, refs, (q, k, v), bound)


# (seqlen_q, seqlen_k, E, M, dtype, causal, eps, backend, allow_tf32)
LAYER_CASES = [
    # the chunked products in one tf32 term: 3xTF32 (the default) costs the simulator 2.5x as long; the walks of
    # float32 inputs in 3xTF32 are checked above
    (9, 9, 8, 4, "float32", True, 1e-6, "chunked", True),
    (7, 9, 4, 6, "float32", False, 1e-6, "chunked", True),  # non-causal, Lq != Lk, the plain products
    (13, 13, 6, 5, "float16", True, 0.5, "recurrent", False),
    (9, 4, 5, 7, "float32", False, 1e-6, "recurrent", False),
]


@pytest.mark.parametrize("seqlen_q,seqlen_k,e,m,dtype,causal,eps,backend,tf32", LAYER_CASES)
def test_layer_backward(seqlen_q, seqlen_k, e, m, dtype, causal, eps, backend, tf32, poisoned_outputs):
    dout, q, k, v, _, _ = _case(seqlen_q + 7 * e, (1, 1, seqlen_q), e, m, dtype, seqlen_k=seqlen_k)
    grads = numba_attn.linear_attention_backward(dout, q, k, v, causal=causal, eps=eps, backend=backend,
                                                 allow_tf32=tf32)
    _check_layer(grads, dout, q, k, v, causal, eps, LAYER_TF32_TOLERANCE if tf32 else TOLERANCE[dtype])


def test_layer_backward_rows_by_warps():
    """The GPU's ``rows`` kernel (a warp per row, shuffles summing ``dout . n``), two rows per block, M > 32."""
    config = lb.LayerBackwardConfig(threads=64, row_threads=32, rows_per_block=2)
    dout, q, k, v, _, _ = _case(11, (1, 1, 3), 4, 40, "float32")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lb, "default_config", lambda: config)
        grads = numba_attn.linear_attention_backward(dout, q, k, v, causal=True, backend="recurrent")
    _check_layer(grads, dout, q, k, v, True, 1e-6, TOLERANCE["float32"])


@pytest.mark.parametrize("seqlen_q,seqlen_k,eps", [(0, 5, 1e-6), (5, 0, 0.0), (5, 0, 1e-6)])
def test_layer_backward_without_rows_or_keys(seqlen_q, seqlen_k, eps):
    """No query rows: dk, dv are zeros; no keys: out is 0 (and with eps = 0 the denominator too): all zeros."""
    dout, q, k, v, _, _ = _case(12, (1, 1, seqlen_q), 4, 4, "float32", seqlen_k=seqlen_k)
    grads = numba_attn.linear_attention_backward(dout, q, k, v, eps=eps, backend="recurrent")
    refs = reference.linear_attention_backward(dout, q, k, v, eps=eps)
    for g, ref in zip(grads, refs):
        np.testing.assert_allclose(g, ref, atol=1e-6)


def test_layer_backward_two_dimensional_inputs():
    dout, q, k, v, _, _ = _case(13, (6,), 4, 3, "float32")
    grads = numba_attn.linear_attention_backward(dout, q, k, v, causal=True, backend="recurrent")
    assert [g.shape for g in grads] == [(6, 4), (6, 4), (6, 3)]
    _check_layer(grads, dout, q, k, v, True, 1e-6, TOLERANCE["float32"])


@pytest.mark.parametrize("kwargs,error,match", [
    ({"dout": np.zeros((1, 1, 4, 4), np.float32)}, ValueError, r"dout: expected the output's shape \(1, 1, 4, 3\)"),
    ({"dout": np.zeros((1, 1, 4, 3), np.float16)}, TypeError, "dout: dtype float16 differs"),
    ({"eps": -1.0}, ValueError, "eps:"),
    ({"causal": 1}, TypeError, "causal:"),
    ({"allow_tf32": "yes"}, TypeError, "allow_tf32:"),
    ({"backend": "mma"}, ValueError, "backend:"),
    ({"k": np.zeros((1, 1, 5, 4), np.float32), "causal": True}, ValueError, "k:"),
])
def test_layer_backward_bad_arguments_are_named(kwargs, error, match):
    arrays = dict(zip(("dout", "q", "k", "v"), _case(14, (1, 1, 4), 4, 3, "float32")[:4]))
    arrays.update(kwargs)
    with pytest.raises(error, match=match):
        numba_attn.linear_attention_backward(arrays.pop("dout"), arrays.pop("q"), arrays.pop("k"), arrays.pop("v"),
                                             **arrays)


def test_layer_backward_signature_extends_the_references():
    import inspect

    ours = list(inspect.signature(numba_attn.linear_attention_backward).parameters.values())
    theirs = list(inspect.signature(reference.linear_attention_backward).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
        [(p.name, p.kind, p.default) for p in theirs]
    assert [p.name for p in ours[len(theirs):]] == ["allow_tf32", "backend"]


# -- realistic sizes, on a GPU only ----------------------------------------------------------------------------------
def _torch_errors(fn, tensors, dout, refs):
    """Relative errors of torch autograd through ``fn`` in the tensors' dtype against ``refs``."""
    import torch

    leaves = [x.detach().clone().requires_grad_(True) for x in tensors]
    grads = torch.autograd.grad(fn(*leaves), leaves, dout)
    return [rel_error(g, r) for g, r in zip(grads, refs)]


def _naive_product(q, k, v):
    import torch

    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return (q @ k.transpose(-1, -2)).masked_fill(~mask, 0) @ v


def _naive_layer(q, k, v, causal, eps=1e-6):
    import torch

    phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    if causal:
        return _naive_product(phi_q, phi_k, v) / ((phi_q * phi_k.cumsum(-2)).sum(-1, keepdim=True) + eps)
    return phi_q @ (phi_k.transpose(-1, -2) @ v) / ((phi_q * phi_k.sum(-2, keepdim=True)).sum(-1, keepdim=True) + eps)


def _within(errs, torch_errs, bound):
    """Each error within the usual bound or twice torch's (when finite: a naive float16 normaliser overflows)."""
    return all(e <= (max(bound, 2 * t) if np.isfinite(t) else bound) for e, t in zip(errs, torch_errs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("seqlen,e,m", [(16384, 64, 64), (4097, 128, 128)])
def test_gpu_chunked_product_backward(dtype, seqlen, e, m):
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype)
    q, k = (torch.randn(1, 2, seqlen, e, device="cuda").to(tdtype) for _ in range(2))
    v, dout = (torch.randn(1, 2, seqlen, m, device="cuda").to(tdtype) for _ in range(2))
    grads = numba_attn.causal_dot_product_backward(dout, q, k, v, backend="chunked")
    host = [to_host(x).astype(np.float64) for x in (dout, q, k, v)]
    refs = reference.causal_dot_product_backward_chunked(*host, chunk_size=256)
    errs = [rel_error(g, r) for g, r in zip(grads, refs)]
    torch_errs = _torch_errors(_naive_product, (q, k, v), dout, refs)
    assert _within(errs, torch_errs, TOLERANCE[dtype]), (errs, torch_errs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_chunked_product_backward_with_states(dtype):
    torch = pytest.importorskip("torch")
    arrays = _case(20, (2, 4, 3000), 64, 64, dtype, True, True)
    tensors = [torch.from_numpy(x).cuda() for x in arrays]
    grads = numba_attn.causal_dot_product_backward(*tensors[:4], initial_state=tensors[4], dstate=tensors[5])
    _check_product(grads, *arrays, TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("causal,seqlen_q,seqlen_k", [(True, 4096, 4096), (False, 3000, 5000)])
def test_gpu_layer_backward(dtype, causal, seqlen_q, seqlen_k):
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype)
    q = torch.randn(1, 2, seqlen_q, 64, device="cuda").to(tdtype)
    k = torch.randn(1, 2, seqlen_k, 64, device="cuda").to(tdtype)
    v = torch.randn(1, 2, seqlen_k, 64, device="cuda").to(tdtype)
    dout = torch.randn(1, 2, seqlen_q, 64, device="cuda").to(tdtype)
    grads = numba_attn.linear_attention_backward(dout, q, k, v, causal=causal)
    refs = reference.linear_attention_backward(*(to_host(x).astype(np.float64) for x in (dout, q, k, v)),
                                               causal=causal)
    errs = [rel_error(g, r) for g, r in zip(grads, refs)]
    torch_errs = _torch_errors(functools.partial(_naive_layer, causal=causal), (q, k, v), dout, refs)
    assert _within(errs, torch_errs, TOLERANCE[dtype]), (errs, torch_errs)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gpu_replayed_backwards_match_the_references(dtype, fused):
    """Repeated calls are replayed from the first call's plan (``runtime.replay``): new inputs each call, the same
    gradients as the references; an ``initial_state`` and a ``dstate`` of one layout make plans of their own; the
    layer's backward too."""
    torch = pytest.importorskip("torch")
    from numba_attn.runtime import replay

    replay.clear()
    used = []
    original = replay.Plan.run
    try:
        replay.Plan.run = lambda self, layouts: used.append(1) or original(self, layouts)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(chunked_backward, "FUSED", fused)
            for call in range(3):
                for states in ((True, False), (False, True), (False, False)):
                    arrays = _case(30 + call, (2, 2, 1500), 64, 64, dtype, *states)
                    t = [None if x is None else torch.from_numpy(x).cuda() for x in arrays]
                    grads = numba_attn.causal_dot_product_backward(*t[:4], initial_state=t[4], dstate=t[5])
                    _check_product(grads, *arrays, TOLERANCE[dtype])
                t = [torch.from_numpy(x).cuda() for x in _case(40 + call, (1, 2, 700), 64, 64, dtype)[:4]]
                _check_layer(numba_attn.linear_attention_backward(*t, causal=True), *t, True, 1e-6, TOLERANCE[dtype])
    finally:
        replay.Plan.run = original
    assert len(used) == 2 * 4, f"{len(used)} replayed calls, expected 8 (every call after the first of each kind)"


def test_fused_plans_pay_for_segments():
    """Three walks' groups at 16k rows (B4 H8, 2 blocks on 132 SMs): without a cost per segment the wave rule took
    128 segments of 2 chunks (each walking block then sums up to 127 increments; 10.5 ms on an H100), with
    ``FUSED_SEGMENT_COST`` the 8 that a single walk gets."""
    from numba_attn.linear.chunk_plan import _fewest_steps
    from numba_attn.linear.register_launch import FUSED_SEGMENT_COST

    assert _fewest_steps(96, 256, 128, 264, 0.35, 0.0) == 128
    assert _fewest_steps(96, 256, 128, 264, 0.35, FUSED_SEGMENT_COST) == 8
    assert _fewest_steps(32, 256, 128, 264, 0.35, 0.0) == 8
