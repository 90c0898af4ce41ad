"""torch's ``scaled_dot_product_attention`` with one backend forced at a time.

``sdpa_kernel(backend)`` restricts SDPA to that backend; if the backend cannot take the inputs (dtype, head dim,
GPU generation) SDPA raises, and the sweep records the provider as skipped with torch's reason (torch explains
the refusal in a warning, which the sweep appends to the error text).

Masking: torch's ``is_causal`` aligns the mask top-left and numba_attn bottom-right; both agree when
``seqlen_q == seqlen_k``, the only causal case the sweep runs. Other causal shapes are refused here rather than
silently computing something different.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["BACKENDS", "backend_context", "attention", "backward_prepared", "forward_backward", "decode", "providers"]

#: provider suffix -> SDPBackend member name
BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def backend_context(name: str):
    """A context manager that forces SDPA backend ``name`` (a key of ``BACKENDS``) and disables autograd."""
    backend = getattr(SDPBackend, BACKENDS[name])

    @contextlib.contextmanager
    def context():
        with torch.no_grad(), sdpa_kernel(backend):
            yield

    return context


def attention(q, k, v, causal: bool, sm_scale: float | None = None):
    """SDPA on ``(batch, heads, seqlen, headdim)`` tensors; k/v may have fewer heads (GQA via ``enable_gqa``)."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("torch SDPA aligns the causal mask top-left; only seqlen_q == seqlen_k matches numba_attn")
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    if k.shape[1] != q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def decode(q, k, v, sm_scale: float | None = None):
    """Non-causal attention of a few query rows against a long cache, GQA packed.

    The ``group = heads // kv_heads`` query heads sharing a kv head are reshaped into ``group * seqlen_q`` query
    rows of one kv head (a free view of a contiguous q): every backend then sees plain multi-head attention and
    reads each K/V head once, which is how decoding with GQA is normally fed to these kernels.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads = k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    packed = q.reshape(batch, kv_heads, (heads // kv_heads) * seqlen_q, head_dim)
    out = F.scaled_dot_product_attention(packed, k, v, is_causal=False, scale=scale)
    return out.reshape(batch, heads, seqlen_q, head_dim)


# --------------------------------------------------------------------------------------------------------------------
# The sweep's plug-in hook (bench/peers/__init__.py)
# --------------------------------------------------------------------------------------------------------------------
def backward_prepared(q, k, v, dout, causal: bool, name: str):
    """``(fn, post)``: the backward of one SDPA forward recorded now (backend ``name`` forced while recording, which
    is when SDPA picks it): ``fn()`` returns ``(dq, dk, dv)`` by ``torch.autograd.grad`` (nothing accumulates
    into ``.grad``), ``post`` picks ``dq``. Inputs are detached aliases: the shared input tensors stay untouched."""
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(getattr(SDPBackend, BACKENDS[name])):
        out = attention(qq, kk, vv, causal)
    return (lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True)), (lambda grads: grads[0])


def forward_backward(q, k, v, dout, causal: bool, name: str):
    """The timed call of ``flash_fwdbwd``: the forward with backend ``name`` forced, then ``(dq, dk, dv)`` by
    ``torch.autograd.grad`` (the graph freed as in a training step)."""
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    backend = getattr(SDPBackend, BACKENDS[name])

    def step():
        with sdpa_kernel(backend):
            out = attention(qq, kk, vv, causal)
        return torch.autograd.grad(out, (qq, kk, vv), dout)

    return step


def providers(opts) -> dict:
    """``torch-sdpa-<backend>`` for flash, flash_bwd (the backward of a forward recorded when prepared), flash_fwdbwd
    (forward and backward in one call) and decode, one per forced backend (math: not for decode, and within the
    budget)."""
    from ..providers import Prepared, Provider, all_checks, naive_check, torch_only  # the sweep's, not the wrappers'

    flash, flash_bwd, flash_fwdbwd, decode_ = {}, {}, {}, {}
    for backend in BACKENDS:
        context = backend_context(backend)

        def prep_flash(case, x, env, context=context):
            return Prepared(lambda: attention(x["q"], x["k"], x["v"], case.causal), context=context)

        def prep_decode(case, x, env, context=context):
            return Prepared(lambda: decode(x["q"], x["k"], x["v"]), context=context)

        def prep_backward(case, x, env, backend=backend):
            fn, post = backward_prepared(x["q"], x["k"], x["v"], x["dout"], case.causal, backend)
            return Prepared(fn, post=post)

        def prep_step(case, x, env, backend=backend):
            step = forward_backward(x["q"], x["k"], x["v"], x["dout"], case.causal, backend)
            return Prepared(step, post=lambda grads: grads[0])

        check = torch_only
        if backend == "math":
            check = all_checks(torch_only, naive_check(opts.naive_mem_bytes))
        flash[f"torch-sdpa-{backend}"] = Provider(prep_flash, check=check, note=f"SDPA, {backend} backend forced")
        flash_bwd[f"torch-sdpa-{backend}"] = Provider(
            prep_backward, check=check, note=f"SDPA backward ({backend} backend forced for the recorded forward)")
        flash_fwdbwd[f"torch-sdpa-{backend}"] = Provider(
            prep_step, check=check, note=f"SDPA forward + backward through autograd ({backend} backend forced)")
        if backend != "math":
            decode_[f"torch-sdpa-{backend}"] = Provider(
                prep_decode, check=torch_only, note=f"SDPA, {backend} backend forced, GQA heads packed as rows")
    return {"flash": flash, "flash_bwd": flash_bwd, "flash_fwdbwd": flash_fwdbwd, "decode": decode_}
