"""Training through numba_attn from torch (``numba_attn.torch_ops``): autograd, the custom ops, torch.compile.

Torch CPU tensors under the CUDA simulator, tiny shapes. Gradients are compared with ``reference.attention_backward``
(float64) by ‖g − ref‖ / ‖ref‖ (kernel_checks.TOLERANCE; float16 against the float64 gradients of the rounded
inputs). Skipped where torch is not installed (CI).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_attn  # noqa: E402
import reference  # noqa: E402
from kernel_checks import TOLERANCE, rel_error  # noqa: E402

pytestmark = pytest.mark.simulator

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _inputs(seed, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype, requires_grad=(True, True, True)):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, heads, seqlen_q, head_dim), (1, kv_heads, seqlen_k, head_dim), (1, kv_heads, seqlen_k, head_dim)]
    tensors = [torch.randn(s, generator=g).to(_DTYPES[dtype]).requires_grad_(r) for s, r in zip(shapes, requires_grad)]
    dout = torch.randn(shapes[0], generator=g).to(_DTYPES[dtype])
    return tensors, dout


def _numpy(x):
    return x.detach().numpy()


# (heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, dtype, sm_scale)
CASES = [
    (2, 2, 9, 13, 8, False, "float32", None),
    (2, 1, 13, 9, 16, True, "float32", 0.4),  # GQA 2:1, Lq > Lk: the first rows see no key
    (2, 2, 11, 6, 8, True, "float16", None),
    (2, 1, 5, 24, 16, False, "float16", None),
]


@pytest.mark.parametrize("heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal,dtype,sm_scale", CASES)
def test_autograd_grad_equals_reference(heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, dtype, sm_scale):
    (q, k, v), dout = _inputs(seqlen_q * 31 + seqlen_k, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype)
    out = numba_attn.flash_forward(q, k, v, causal=causal, sm_scale=sm_scale)
    assert out.grad_fn is not None and out.dtype == q.dtype and out.shape == q.shape
    loss = (out.float() * dout.float()).sum()  # d loss / d out = dout
    grads = torch.autograd.grad(loss, (q, k, v))
    refs = reference.attention_backward(_numpy(dout), _numpy(q), _numpy(k), _numpy(v), causal=causal,
                                        sm_scale=sm_scale)
    for name, g, ref, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        err = rel_error(g, ref)
        assert err < TOLERANCE[dtype], f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("wanted", [(False, True, False), (True, False, True)])
def test_gradients_reach_only_the_inputs_that_require_them(wanted):
    (q, k, v), dout = _inputs(3, 2, 1, 7, 10, 8, "float32", requires_grad=wanted)
    numba_attn.flash_forward(q, k, v, causal=True).backward(dout)
    refs = reference.attention_backward(_numpy(dout), _numpy(q), _numpy(k), _numpy(v), causal=True)
    for x, ref, want in zip((q, k, v), refs, wanted):
        if want:
            assert rel_error(x.grad, ref) < TOLERANCE["float32"]
        else:
            assert x.grad is None


def test_two_dimensional_inputs():
    (q, k, v), dout = _inputs(4, 1, 1, 6, 9, 8, "float32")
    q2, k2, v2 = (x.detach()[0, 0].requires_grad_() for x in (q, k, v))
    out, lse = numba_attn.flash_forward(q2, k2, v2, sm_scale=0.7, return_lse=True)
    assert out.shape == (6, 8) and lse.shape == (6,) and not lse.requires_grad
    grads = torch.autograd.grad(out, (q2, k2, v2), dout[0, 0])
    refs = reference.attention_backward(_numpy(dout), _numpy(q), _numpy(k), _numpy(v), sm_scale=0.7)
    for g, ref in zip(grads, refs):
        assert rel_error(g, ref[0, 0]) < TOLERANCE["float32"]


def test_explicit_flash_attention_function():
    from numba_attn.torch_ops import flash_attention

    (q, k, v), dout = _inputs(5, 2, 2, 8, 8, 8, "float32")
    out = flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = reference.attention_backward(_numpy(dout), _numpy(q), _numpy(k), _numpy(v), causal=True)
    for g, ref in zip(grads, refs):
        assert rel_error(g, ref) < TOLERANCE["float32"]


@pytest.mark.parametrize("options", [dict(causal=True, window=(3, None)), dict(window=(2, 1), softcap=2.0)])
def test_window_and_softcap_are_differentiable(options):
    (q, k, v), dout = _inputs(8, 2, 1, 11, 9, 8, "float32")
    out = numba_attn.flash_forward(q, k, v, **options)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = reference.attention_backward(_numpy(dout), _numpy(q), _numpy(k), _numpy(v), **options)
    for g, ref in zip(grads, refs):
        assert rel_error(g, ref) < TOLERANCE["float32"]
    with torch.no_grad():  # and without autograd, the plain path
        assert rel_error(numba_attn.flash_forward(q, k, v, **options), reference.attention(
            _numpy(q), _numpy(k), _numpy(v), **options)) < TOLERANCE["float32"]


def test_flash_forward_varlen_is_differentiable():
    g = torch.Generator().manual_seed(9)
    lengths_q, lengths_k = [3, 0, 9], [5, 4, 6]
    cu_q, cu_k = (np.r_[0, np.cumsum(lengths)].astype(np.int32) for lengths in (lengths_q, lengths_k))
    q = torch.randn(12, 2, 8, generator=g).requires_grad_()
    k, v = (torch.randn(15, 1, 8, generator=g).requires_grad_() for _ in "kv")
    dout = torch.randn(12, 2, 8, generator=g)
    options = dict(causal=True, window=(4, None), softcap=3.0)
    out, lse = numba_attn.flash_forward_varlen(q, k, v, cu_q, torch.from_numpy(cu_k), return_lse=True, **options)
    assert out.grad_fn is not None and not lse.requires_grad
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = reference.attention_varlen_backward(_numpy(dout), _numpy(q), _numpy(k), _numpy(v), cu_q, cu_k, **options)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert rel_error(got, ref) < TOLERANCE["float32"], name
    with pytest.raises(ValueError, match="^out"):
        numba_attn.flash_forward_varlen(q, k, v, cu_q, cu_k, out=torch.empty(12, 2, 8))


# -- the custom ops ----------------------------------------------------------------------------------------------------
def test_opcheck_forward_and_backward():
    from numba_attn.torch_ops import ops

    (q, k, v), dout = _inputs(6, 2, 1, 6, 7, 8, "float32")
    torch.library.opcheck(ops().flash_forward, (q, k, v, True, None, None, False))
    torch.library.opcheck(ops().flash_forward, (q[0, 0], k[0, 0], v[0, 0], False, 0.5, "simt", False))
    out, lse = ops().flash_forward(q.detach(), k.detach(), v.detach(), True, None, None, False)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 6)
    torch.library.opcheck(ops().flash_backward, (dout, q.detach(), k.detach(), v.detach(), out, lse, True, None,
                                                 False, False))
    torch.library.opcheck(ops().flash_forward, (q, k, v, True, None, None, False, [2, -1], 3.0))


def test_eager_calls_record_the_same_formula_without_the_dispatcher():
    """In eager mode autograd records the op's eager twin (the implementations called directly), whose gradients
    are the custom op's own, bit for bit."""
    from numba_attn.torch_ops import ops

    (q, k, v), dout = _inputs(6, 2, 1, 6, 7, 8, "float32")
    out = numba_attn.flash_forward(q, k, v, causal=True)
    assert type(out.grad_fn).__name__.startswith("Eager_flash_forward")
    eager = torch.autograd.grad(out, (q, k, v), dout)
    op_out = ops().flash_forward(q, k, v, True, None, None, False)[0]
    assert "Eager" not in type(op_out.grad_fn).__name__
    for got, want in zip(eager, torch.autograd.grad(op_out, (q, k, v), dout)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_follows_torch(monkeypatch, deterministic):
    from numba_attn import torch_ops

    seen, backward = [], torch_ops._api.flash_backward

    def recording(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return backward(*args, **kwargs)

    monkeypatch.setattr(torch_ops._api, "flash_backward", recording)
    (q, k, v), dout = _inputs(12, 2, 2, 5, 6, 8, "float32")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        numba_attn.flash_forward(q, k, v).backward(dout)
    finally:
        torch.use_deterministic_algorithms(before)
    assert seen == [deterministic]


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_backward_takes_the_forwards_allow_tf32(monkeypatch, allow_tf32):
    from numba_attn import torch_ops

    seen, backward = [], torch_ops._api.flash_backward

    def recording(*args, **kwargs):
        seen.append(kwargs["allow_tf32"])
        return backward(*args, **kwargs)

    monkeypatch.setattr(torch_ops._api, "flash_backward", recording)
    (q, k, v), dout = _inputs(13, 1, 1, 5, 6, 8, "float32")
    numba_attn.flash_forward(q, k, v, allow_tf32=allow_tf32).backward(dout)
    assert seen == [allow_tf32]
    refs = reference.attention_backward(_numpy(dout), _numpy(q), _numpy(k), _numpy(v))
    for x, ref in zip((q, k, v), refs):  # (one tf32 term each way: about 1e-3)
        assert rel_error(x.grad, ref) < (5e-3 if allow_tf32 else TOLERANCE["float32"])


# -- torch.compile -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_matches_eager(backend):
    (q, k, v), dout = _inputs(7, 2, 1, 7, 9, 8, "float32")

    def fn(q, k, v):
        return numba_attn.flash_forward(q * 1.5, k, v, causal=True).sin()

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)  # fullgraph: a graph break is an error
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    out_eager = fn(q, k, v)
    grads_eager = torch.autograd.grad(out_eager, (q, k, v), dout)
    torch.testing.assert_close(out, out_eager, rtol=0, atol=0)
    for g, g_eager in zip(grads, grads_eager):
        torch.testing.assert_close(g, g_eager, rtol=1e-6, atol=1e-7)


class _Attention(torch.nn.Module):
    """One attention layer (fused qkv projection, 2 heads of 8) and an output linear."""

    def __init__(self, attend, width=16, heads=2):
        super().__init__()
        self.attend, self.heads = attend, heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        batch, seqlen, width = x.shape
        q, k, v = self.qkv(x).view(batch, seqlen, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = self.attend(q, k, v)  # (batch, heads, seqlen, head_dim)
        return self.proj(out.transpose(1, 2).reshape(batch, seqlen, width))


def _train(model, x, target, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("compiled", [False, True])
def test_a_small_model_trains_like_torch_sdpa(compiled):
    torch.manual_seed(0)
    x, target = torch.randn(1, 10, 16), torch.randn(1, 10, 16)
    ours = _Attention(lambda q, k, v: numba_attn.flash_forward(q, k, v, causal=True))
    theirs = _Attention(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    theirs.load_state_dict(ours.state_dict())
    if compiled:
        torch._dynamo.reset()
        ours = torch.compile(ours, fullgraph=True, backend="aot_eager")
    ours_losses, theirs_losses = _train(ours, x, target, 4), _train(theirs, x, target, 4)
    assert ours_losses[-1] < ours_losses[0]
    np.testing.assert_allclose(ours_losses, theirs_losses, rtol=1e-5)


# -- calls without grad ------------------------------------------------------------------------------------------------
def test_calls_without_grad_are_unchanged():
    (q, k, v), _ = _inputs(8, 2, 1, 7, 9, 8, "float32")
    with_grad, lse = numba_attn.flash_forward(q, k, v, causal=True, return_lse=True)
    with torch.no_grad():
        no_grad_mode = numba_attn.flash_forward(q, k, v, causal=True)
    plain = numba_attn.flash_forward(q.detach(), k.detach(), v.detach(), causal=True)
    assert no_grad_mode.grad_fn is None and not no_grad_mode.requires_grad and not plain.requires_grad
    torch.testing.assert_close(no_grad_mode, plain, rtol=0, atol=0)
    torch.testing.assert_close(with_grad.detach(), plain, rtol=0, atol=0)
    ref_out, ref_lse = reference.attention(_numpy(q), _numpy(k), _numpy(v), causal=True, return_lse=True)
    assert rel_error(plain, ref_out) < TOLERANCE["float32"] and rel_error(lse, ref_lse) < TOLERANCE["float32"]


def test_no_torch_ops_import_without_grad():
    """``import numba_attn`` imports no torch; calls with tensors that do not require grad import no torch_ops."""
    code = (
        "import sys, numba_attn\n"
        "assert 'torch' not in sys.modules, 'import numba_attn imported torch'\n"
        "import torch\n"
        "q = torch.randn(1, 2, 5, 8)\n"
        "out = numba_attn.flash_forward(q, q, q, causal=True)\n"
        "with torch.no_grad():\n"
        "    numba_attn.flash_forward(q, q, q)\n"
        "assert 'numba_attn.torch_ops' not in sys.modules, 'numba_attn.torch_ops was imported'\n"
        "numba_attn.flash_forward(q.requires_grad_(), q, q)\n"
        "assert 'numba_attn.torch_ops' in sys.modules\n"
    )
    _run_alone(code)


def test_first_use_inside_torch_compile():
    """The ops register when ``torch_ops`` is first imported, which may happen inside a ``torch.compile`` trace."""
    _run_alone(
        "import sys, numba_attn, torch\n"
        "q = torch.randn(1, 2, 5, 8, requires_grad=True)\n"
        "f = torch.compile(lambda q: numba_attn.flash_forward(q, q, q).sum(), fullgraph=True, backend='aot_eager')\n"
        "assert 'numba_attn.torch_ops' not in sys.modules\n"
        "f(q).backward()\n"
        "assert q.grad is not None and 'numba_attn.torch_ops' in sys.modules\n"
    )


def _run_alone(code):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), root) if p)
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# -- what cannot be differentiated -------------------------------------------------------------------------------------
def test_out_with_grad_is_a_value_error():
    (q, k, v), _ = _inputs(9, 2, 2, 5, 5, 8, "float32")
    with pytest.raises(ValueError, match="out: .*requires grad"):
        numba_attn.flash_forward(q, k, v, out=torch.empty(q.shape))


def test_return_lse_with_grad_gives_a_non_differentiable_lse():
    (q, k, v), dout = _inputs(10, 2, 2, 6, 8, 8, "float32")
    out, lse = numba_attn.flash_forward(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad and lse.grad_fn is None
    _, ref_lse = reference.attention(_numpy(q), _numpy(k), _numpy(v), return_lse=True)
    assert rel_error(lse, ref_lse) < TOLERANCE["float32"]
    with pytest.raises(RuntimeError, match="does not require grad"):
        lse.sum().backward()
    (dq,) = torch.autograd.grad(out, (q,), dout)  # out stays differentiable
    assert rel_error(dq, reference.attention_backward(_numpy(dout), _numpy(q), _numpy(k), _numpy(v))[0]) < 1e-5


def test_bfloat16_forward_and_backward():
    (q, k, v), dout = _inputs(11, 2, 1, 6, 8, 8, "bfloat16")
    out = numba_attn.flash_forward(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and out.requires_grad
    exact = [x.detach().double().numpy() for x in (dout, q, k, v)]
    assert rel_error(out, reference.attention(*exact[1:], causal=True)) < TOLERANCE["bfloat16"]
    out.backward(dout)  # the tensor-core backward (also under the simulator: the only one for bfloat16)
    for x, ref in zip((q, k, v), reference.attention_backward(*exact, causal=True)):
        assert x.grad.dtype == torch.bfloat16
        assert rel_error(x.grad, ref) < TOLERANCE["bfloat16"]
