"""Training through numba_attn from torch: ``flash_forward`` / ``flash_backward`` as ``torch.library`` custom ops
linked by autograd.

The ops, registered once, when this module is first imported (on first use):

* ``numba_attn::flash_forward(Tensor q, Tensor k, Tensor v, bool causal, float? sm_scale, str? backend,
  bool allow_tf32) -> (Tensor out, Tensor lse)``
* ``numba_attn::flash_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal,
  float? sm_scale, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)``

each with a fake (meta) implementation, so that ``torch.compile`` traces them without running kernels, and the
backward registered as the forward's autograd formula. ``numba_attn.flash_forward`` takes this path by itself for
torch tensors when grad mode is on and one of q, k, v requires grad (``api.flash_forward``); a model calling it
compiles with ``torch.compile(fullgraph=True)`` without a graph break. :func:`flash_attention` is the same as a
plain differentiable function. The backward is ``flash_backward``'s default choice (``numba_attn/backward/``: tensor cores for
float16 / bfloat16 on sm_80+, CUDA cores for float32); ``deterministic`` follows
``torch.are_deterministic_algorithms_enabled()``.

This module imports torch; ``import numba_attn`` does not import it.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from . import api as _api
from .forward.dispatch import BACKENDS
from .runtime.arguments import check_backend, check_flag, check_sm_scale

__all__ = ["flash_attention", "ops"]

_FORWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float? sm_scale, str? backend, bool allow_tf32) "
                   "-> (Tensor out, Tensor lse)")
_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
                    "float? sm_scale, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)")

_LOCK = threading.Lock()
_OPS = None


def ops() -> SimpleNamespace:
    """The registered ops: ``.flash_forward``, ``.flash_backward`` (``torch.ops.numba_attn.*``)."""
    return _OPS


def _register_once() -> SimpleNamespace:
    """Registers the ops unless done: once per process, whichever thread comes first. Called when this module is
    first imported (the first grad-requiring call, or the caller's import), never inside a ``torch.compile`` trace,
    which cannot trace the lock."""
    global _OPS
    with _LOCK:
        if _OPS is None:
            _OPS = _register()
    return _OPS


def _register() -> SimpleNamespace:
    @torch.library.custom_op("numba_attn::flash_forward", mutates_args=(), schema=_FORWARD_SCHEMA)
    def flash_forward(q, k, v, causal, sm_scale, backend, allow_tf32):
        # detached: the call must not come back here through api.flash_forward's autograd check
        return _api.flash_forward(q.detach(), k.detach(), v.detach(), causal=causal, sm_scale=sm_scale,
                                  return_lse=True, backend=backend, allow_tf32=allow_tf32)

    @flash_forward.register_fake
    def _(q, k, v, causal, sm_scale, backend, allow_tf32):
        _check_ranks(q, k, v)
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @torch.library.custom_op("numba_attn::flash_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
    def flash_backward(dout, q, k, v, out, lse, causal, sm_scale, deterministic):
        return _api.flash_backward(dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                   causal=causal, sm_scale=sm_scale, deterministic=deterministic)

    @flash_backward.register_fake
    def _(dout, q, k, v, out, lse, causal, sm_scale, deterministic):
        _check_ranks(q, k, v)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, causal, sm_scale, _backend, _allow_tf32 = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.numba_attn.flash_backward(dout, q, k, v, out, lse, ctx.causal, ctx.sm_scale,
                                                          torch.are_deterministic_algorithms_enabled())
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None, None)

    flash_forward.register_autograd(backward, setup_context=setup_context)
    return SimpleNamespace(flash_forward=torch.ops.numba_attn.flash_forward,
                           flash_backward=torch.ops.numba_attn.flash_backward)


def _check_ranks(q, k, v) -> None:
    """What the fake implementations need of the shapes (the real call checks the rest)."""
    if not (q.dim() == k.dim() == v.dim() and q.dim() in (2, 4)):
        raise ValueError("q, k, v: expected all (batch, heads, seqlen, headdim) or all (seqlen, headdim), got "
                         f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def flash_attention(q, k, v, causal=False, sm_scale=None):
    """``numba_attn.flash_forward(q, k, v, causal=causal, sm_scale=sm_scale)`` for torch tensors, always through the
    custom op: differentiable in q, k, v (those that require grad), traceable by ``torch.compile``."""
    return ops().flash_forward(q, k, v, check_flag(causal, "causal"), check_sm_scale(sm_scale), None, False)[0]


def forward_with_grad(q, k, v, causal, sm_scale, return_lse, out, backend, allow_tf32):
    """``api.flash_forward`` for torch tensors of which one requires grad: through the custom op while grad mode is
    on, so autograd records it; None when grad mode is off (the caller takes the plain path)."""
    if not torch.is_grad_enabled():
        return None
    if out is not None:
        raise ValueError("out: cannot be used when q, k or v requires grad (an in-place output cannot be "
                         "differentiated); drop out=, or detach the inputs / use torch.no_grad()")
    causal, return_lse = check_flag(causal, "causal"), check_flag(return_lse, "return_lse")
    sm_scale, backend = check_sm_scale(sm_scale), check_backend(backend, BACKENDS)
    result, lse = ops().flash_forward(q, k, v, causal, sm_scale, backend, check_flag(allow_tf32, "allow_tf32"))
    return (result, lse) if return_lse else result


_register_once()
