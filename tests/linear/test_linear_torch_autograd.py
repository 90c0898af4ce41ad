"""Training through the linear functions from torch (``numba_attn.torch_ops``): ``causal_dot_product`` and
``linear_attention`` under autograd, their custom ops (opcheck), torch.compile(fullgraph=True).

Torch CPU tensors under the CUDA simulator, tiny shapes, mostly on the recurrent walks (``backend="recurrent"``
reaches the backward too; the chunked kernels cost the simulator seconds a walk and have their own tests in
test_linear_backward.py). Gradients are compared with ``reference`` (float64) by ‖g − ref‖ / ‖ref‖
(kernel_checks.TOLERANCE). Skipped where torch is not installed (CI).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_attn  # noqa: E402
import reference  # noqa: E402
from kernel_checks import TOLERANCE, rel_error  # noqa: E402

pytestmark = pytest.mark.simulator


def _tensors(seed, shapes, dtype=torch.float32, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_(requires_grad) for s in shapes]


def _numpy(x):
    return None if x is None else x.detach().double().numpy()


def test_causal_dot_product_autograd_with_states():
    """The initial state and the final state take part: d(final)/d(k, v, initial_state) flows back as dstate (the
    chunked kernels: states)."""
    q, k, v, s0 = _tensors(1, [(1, 1, 6, 4), (1, 1, 6, 4), (1, 1, 6, 4), (1, 1, 4, 4)], torch.float16)
    s0 = s0.detach().float().requires_grad_()
    dout, dstate = _tensors(2, [(1, 1, 6, 4), (1, 1, 4, 4)], requires_grad=False)
    out, final = numba_attn.causal_dot_product(q, k, v, initial_state=s0, return_state=True)
    assert out.grad_fn is not None and final.grad_fn is not None and final.dtype == torch.float32
    grads = torch.autograd.grad((out, final), (q, k, v, s0), (dout.half(), dstate))
    refs = reference.causal_dot_product_backward(*(_numpy(x) for x in (dout.half(), q, k, v)),
                                                 initial_state=_numpy(s0), dstate=_numpy(dstate))
    for name, g, ref, x in zip(("dq", "dk", "dv", "ds0"), grads, refs, (q, k, v, s0)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert rel_error(g, ref) < TOLERANCE["float16"], name


@pytest.mark.parametrize("wanted", [(True, False, True), (False, True, False)])
def test_causal_dot_product_gradients_reach_only_what_requires_them(wanted):
    q, k, v = _tensors(3, [(1, 2, 5, 4), (1, 2, 5, 4), (1, 2, 5, 6)])
    for x, want in zip((q, k, v), wanted):
        x.requires_grad_(want)
    dout = torch.randn(1, 2, 5, 6)
    numba_attn.causal_dot_product(q, k, v, backend="recurrent").backward(dout)
    refs = reference.causal_dot_product_backward(*(_numpy(x) for x in (dout, q, k, v)))
    for x, ref, want in zip((q, k, v), refs, wanted):
        assert (x.grad is not None) == want
        if want:
            assert rel_error(x.grad, ref) < TOLERANCE["float32"]


@pytest.mark.parametrize("causal,seqlen_k", [(True, 7), (False, 9)])
def test_linear_attention_autograd(causal, seqlen_k):
    q, k, v = _tensors(4, [(1, 2, 7, 4), (1, 2, seqlen_k, 4), (1, 2, seqlen_k, 5)])
    dout = torch.randn(1, 2, 7, 5)
    out = numba_attn.linear_attention(q, k, v, causal=causal, eps=0.1, backend="recurrent")
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = reference.linear_attention_backward(*(_numpy(x) for x in (dout, q, k, v)), causal=causal, eps=0.1)
    for g, ref in zip(grads, refs):
        assert rel_error(g, ref) < TOLERANCE["float32"]


def test_two_dimensional_inputs():
    q, k, v = _tensors(5, [(6, 4), (6, 4), (6, 3)])
    dout = torch.randn(6, 3)
    grads = torch.autograd.grad(numba_attn.linear_attention(q, k, v, causal=True, backend="recurrent"), (q, k, v),
                                dout)
    refs = reference.linear_attention_backward(*(_numpy(x) for x in (dout, q, k, v)), causal=True)
    for g, ref in zip(grads, refs):
        assert g.shape == ref.shape and rel_error(g, ref) < TOLERANCE["float32"]


def test_calls_without_grad_are_unchanged():
    q, k, v = _tensors(6, [(1, 1, 5, 4)] * 3)
    with torch.no_grad():
        out = numba_attn.causal_dot_product(q, k, v, backend="recurrent")
    assert out.grad_fn is None and not out.requires_grad
    plain = numba_attn.causal_dot_product(q.detach(), k.detach(), v.detach(), backend="recurrent")
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


# -- the custom ops ------------------------------------------------------------------------------------------------
def test_opcheck():
    from numba_attn.torch_ops import ops

    q, k, v = _tensors(7, [(1, 1, 3, 4)] * 3)
    s0, dstate = _tensors(8, [(1, 1, 4, 4)] * 2, requires_grad=False)
    dout = torch.randn(1, 1, 3, 4)
    torch.library.opcheck(ops().causal_dot_product, (q, k, v, None, False, False, "recurrent"))
    torch.library.opcheck(ops().causal_dot_product_backward,
                          (dout, q.detach(), k.detach(), v.detach(), s0, dstate, False, "recurrent"))
    torch.library.opcheck(ops().linear_attention, (q, k, v, True, 1e-6, False, "recurrent"))
    torch.library.opcheck(ops().linear_attention_backward,
                          (dout, q.detach(), k.detach(), v.detach(), False, 1e-6, False, "recurrent"))


def test_state_outputs_of_the_ops():
    """Without ``return_state`` / ``initial_state`` the state outputs are empty float32 tensors (an op returns a
    fixed number of tensors); the fake implementations give the real shapes."""
    from numba_attn.torch_ops import ops

    q, k, v = (x.detach() for x in _tensors(9, [(1, 1, 3, 4), (1, 1, 3, 4), (1, 1, 3, 2)]))
    out, final = ops().causal_dot_product(q, k, v, None, False, False, "recurrent")
    assert out.shape == (1, 1, 3, 2) and final.shape == (0,) and final.dtype == torch.float32
    grads = ops().causal_dot_product_backward(out, q, k, v, None, None, False, "recurrent")
    assert [tuple(g.shape) for g in grads] == [(1, 1, 3, 4), (1, 1, 3, 4), (1, 1, 3, 2), (0,)]
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        _, fake_final = ops().causal_dot_product(fq, fk, fv, None, True, False, None)
        assert fake_final.shape == (1, 1, 4, 2) and fake_final.dtype == torch.float32


# -- torch.compile -------------------------------------------------------------------------------------------------
def test_compile_fullgraph_matches_eager():
    q, k, v = _tensors(10, [(1, 2, 6, 4), (1, 2, 6, 4), (1, 2, 6, 4)])
    dout = torch.randn(1, 2, 6, 4)

    def fn(q, k, v):
        layer = numba_attn.linear_attention(q * 1.5, k, v, causal=True, backend="recurrent")
        return layer.sin() + numba_attn.causal_dot_product(q, k, v, backend="recurrent")

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    out_eager = fn(q, k, v)
    grads_eager = torch.autograd.grad(out_eager, (q, k, v), dout)
    torch.testing.assert_close(out, out_eager, rtol=0, atol=0)
    for g, g_eager in zip(grads, grads_eager):
        torch.testing.assert_close(g, g_eager, rtol=1e-6, atol=1e-7)


def test_bad_arguments_are_named_on_the_grad_path():
    q, k, v = _tensors(11, [(1, 1, 3, 4)] * 3)
    with pytest.raises(TypeError, match="return_state:"):
        numba_attn.causal_dot_product(q, k, v, return_state=1)
    with pytest.raises(ValueError, match="eps:"):
        numba_attn.linear_attention(q, k, v, eps=-1.0)
    with pytest.raises(ValueError, match="backend:"):
        numba_attn.linear_attention(q, k, v, backend="flash")
    np.testing.assert_equal(q.grad, None)
