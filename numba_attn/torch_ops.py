"""Training through numba_attn from torch: ``flash_forward``, ``causal_dot_product`` and ``linear_attention`` as
``torch.library`` custom ops linked by autograd to their backward ops.

The ops, registered once, when this module is first imported (on first use):

* ``numba_attn::flash_forward(Tensor q, Tensor k, Tensor v, bool causal, float? sm_scale, str? backend,
  bool allow_tf32, int[]? window=None, float? softcap=None) -> (Tensor out, Tensor lse)``
* ``numba_attn::flash_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal,
  float? sm_scale, bool deterministic, bool allow_tf32, int[]? window=None, float? softcap=None) -> (Tensor dq,
  Tensor dk, Tensor dv)``
* ``numba_attn::flash_forward_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
  int? max_seqlen_q, int? max_seqlen_k, bool causal, float? sm_scale, int[]? window, float? softcap, str? backend)
  -> (Tensor out, Tensor lse)`` and ``numba_attn::flash_backward_varlen(Tensor dout, Tensor q, Tensor k, Tensor v,
  Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k,
  bool causal, float? sm_scale, int[]? window, float? softcap, bool deterministic) -> (Tensor dq, Tensor dk,
  Tensor dv)`` (``cu_seqlens`` as int tensors: CPU ones are host offsets, checked; CUDA int32 ones device offsets)
* ``numba_attn::causal_dot_product(Tensor q, Tensor k, Tensor v, Tensor? initial_state, bool return_state,
  bool allow_tf32, str? backend) -> (Tensor out, Tensor final_state)`` (``final_state`` empty without
  ``return_state``)
* ``numba_attn::causal_dot_product_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? initial_state,
  Tensor? dstate, bool allow_tf32, str? backend) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dinitial_state)``
  (``dinitial_state`` empty without ``initial_state``)
* ``numba_attn::linear_attention(Tensor q, Tensor k, Tensor v, bool causal, float eps, bool allow_tf32,
  str? backend) -> Tensor``
* ``numba_attn::linear_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, bool causal, float eps,
  bool allow_tf32, str? backend) -> (Tensor dq, Tensor dk, Tensor dv)``

(a ``window`` travels as ``[left, right]`` with -1 for an unbounded side), each with a fake (meta) implementation, so that ``torch.compile`` traces them without running kernels, and each
backward registered as its forward's autograd formula. The public functions take this path by themselves for torch
tensors when grad mode is on and one of their tensors requires grad (``api``): the ops themselves inside a
``torch.compile`` trace, and in eager mode a ``torch.autograd.Function`` per forward op with the same formula that
calls the implementations directly (``_with_autograd``: torch's custom-op dispatch costs more host time than the
launches); a model calling them compiles with
``torch.compile(fullgraph=True)`` without a graph break. :func:`flash_attention` is the same as a plain
differentiable function. ``flash_forward``'s backward is ``flash_backward``'s default choice
(``numba_attn/backward/``: tensor cores on sm_80+, float32 as 3xTF32) with the forward's ``allow_tf32``;
``deterministic`` follows ``torch.are_deterministic_algorithms_enabled()``. The linear functions' backwards take every dtype of their
forwards and the forward's ``allow_tf32`` and ``backend``.

This module imports torch; ``import numba_attn`` does not import it.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import torch

from . import api as _api
from .forward.dispatch import BACKENDS
from .linear.dispatch import BACKENDS as LINEAR_BACKENDS
from .runtime.arguments import check_backend, check_eps, check_flag, check_sm_scale, check_softcap, check_window

__all__ = ["flash_attention", "ops"]

_FORWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float? sm_scale, str? backend, bool allow_tf32, "
                   "int[]? window=None, float? softcap=None) -> (Tensor out, Tensor lse)")
_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
                    "float? sm_scale, bool deterministic, bool allow_tf32, int[]? window=None, float? softcap=None) "
                    "-> (Tensor dq, Tensor dk, Tensor dv)")
_VARLEN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int? max_seqlen_q, "
                  "int? max_seqlen_k, bool causal, float? sm_scale, int[]? window, float? softcap, str? backend) "
                  "-> (Tensor out, Tensor lse)")
_VARLEN_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
                           "Tensor cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k, bool causal, float? sm_scale, "
                           "int[]? window, float? softcap, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)")
_CDP_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? initial_state, bool return_state, bool allow_tf32, "
               "str? backend) -> (Tensor out, Tensor final_state)")
_CDP_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? initial_state, Tensor? dstate, "
                        "bool allow_tf32, str? backend) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dinitial_state)")
_LINEAR_SCHEMA = ("(Tensor q, Tensor k, Tensor v, bool causal, float eps, bool allow_tf32, str? backend) "
                  "-> Tensor")
_LINEAR_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, bool causal, float eps, bool allow_tf32, "
                           "str? backend) -> (Tensor dq, Tensor dk, Tensor dv)")

_LOCK = threading.Lock()
_OPS = None


def ops() -> SimpleNamespace:
    """The registered ops (``torch.ops.numba_attn.*``): ``.flash_forward``, ``.flash_backward``,
    ``.causal_dot_product``, ``.causal_dot_product_backward``, ``.linear_attention``,
    ``.linear_attention_backward``."""
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


def window_argument(window):
    """A checked ``window`` as the ops take it: None, or ``[left, right]`` with -1 for an unbounded side."""
    return None if window is None else [-1 if side is None else int(side) for side in window]


def _window(argument):
    """The ops' ``window`` back as ``flash_forward`` takes it."""
    return None if argument is None else tuple(None if side < 0 else int(side) for side in argument)


#: op name -> its Python implementation, which the eager autograd functions call directly
_IMPLS = {}
#: forward op name -> a ``torch.autograd.Function`` with the op's autograd formula, for eager calls
_EAGER = {}


def _custom_op(name: str, schema: str):
    """``torch.library.custom_op`` for ``numba_attn::name`` that also keeps the implementation in ``_IMPLS``."""
    def register(fn):
        _IMPLS[name] = fn
        return torch.library.custom_op(f"numba_attn::{name}", mutates_args=(), schema=schema)(fn)

    return register


def _dispatched(name: str):
    """Calls op ``name`` through torch's dispatcher (what ``torch.compile`` records)."""
    return lambda *args: getattr(torch.ops.numba_attn, name)(*args)


def _direct(name: str):
    """Calls op ``name``'s implementation without the dispatcher (eager autograd)."""
    return lambda *args: _IMPLS[name](*args)


def _with_autograd(op, name: str, setup_context, make_backward) -> None:
    """The autograd formula ``setup_context`` / ``make_backward(call)`` of forward op ``name``, twice: registered on
    the op, its backward op called through the dispatcher (traced by ``torch.compile``), and as an eager
    ``torch.autograd.Function`` that calls both implementations directly: in eager mode the custom-op dispatcher
    (its schema and aliasing checks) costs more host time per call than the kernels' own launch path."""
    op.register_autograd(make_backward(_dispatched), setup_context=setup_context)

    def forward(ctx, *args):
        # (the formula's setup_context called here: a Function with a setup_context of its own binds its
        # arguments through inspect.signature on every call)
        output = _IMPLS[name](*args)
        setup_context(ctx, args, output)
        return output

    # (made by type(): autograd names the graph node after the class, Eager_<op>Backward)
    _EAGER[name] = type(f"Eager_{name}", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(make_backward(_direct))})


def _differentiable(name: str):
    """Forward op ``name`` as autograd should record it: the op itself inside a ``torch.compile`` trace, else the
    eager function (the same formula)."""
    if torch.compiler.is_compiling():
        return getattr(ops(), name)
    return _EAGER[name].apply


def _register() -> SimpleNamespace:
    @_custom_op("flash_forward", _FORWARD_SCHEMA)
    def flash_forward(q, k, v, causal, sm_scale, backend, allow_tf32, window=None, softcap=None):
        # detached: the call must not come back here through api.flash_forward's autograd check
        return _api.flash_forward(q.detach(), k.detach(), v.detach(), causal=causal, sm_scale=sm_scale,
                                  return_lse=True, backend=backend, allow_tf32=allow_tf32, window=_window(window),
                                  softcap=softcap)

    @flash_forward.register_fake
    def _(q, k, v, causal, sm_scale, backend, allow_tf32, window=None, softcap=None):
        _check_ranks(q, k, v)
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @_custom_op("flash_backward", _BACKWARD_SCHEMA)
    def flash_backward(dout, q, k, v, out, lse, causal, sm_scale, deterministic, allow_tf32, window=None,
                       softcap=None):
        return _api.flash_backward(dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                   causal=causal, sm_scale=sm_scale, deterministic=deterministic,
                                   allow_tf32=allow_tf32, window=_window(window), softcap=softcap)

    @flash_backward.register_fake
    def _(dout, q, k, v, out, lse, causal, sm_scale, deterministic, allow_tf32, window=None, softcap=None):
        _check_ranks(q, k, v)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, causal, sm_scale, _backend, allow_tf32 = inputs[:7]
        window, softcap = (tuple(inputs[7:]) + (None, None))[:2]
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.sm_scale, ctx.allow_tf32 = causal, sm_scale, allow_tf32
        ctx.window, ctx.softcap = window, softcap
        ctx.mark_non_differentiable(lse)

    def make_backward(call):
        flash_backward_op = call("flash_backward")

        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = flash_backward_op(dout, q, k, v, out, lse, ctx.causal, ctx.sm_scale,
                                           torch.are_deterministic_algorithms_enabled(), ctx.allow_tf32, ctx.window,
                                           ctx.softcap)
            need = ctx.needs_input_grad
            return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None,
                    None, None, None)

        return backward

    _with_autograd(flash_forward, "flash_forward", setup_context, make_backward)
    _register_varlen()
    _register_linear()
    names = ("flash_forward", "flash_backward", "flash_forward_varlen", "flash_backward_varlen", "causal_dot_product",
             "causal_dot_product_backward", "linear_attention", "linear_attention_backward")
    return SimpleNamespace(**{name: getattr(torch.ops.numba_attn, name) for name in names})


def _register_varlen() -> None:
    """``flash_forward_varlen`` / ``flash_backward_varlen`` as ops, and the first's autograd formula."""

    @_custom_op("flash_forward_varlen", _VARLEN_SCHEMA)
    def forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, window, softcap, backend):
        return _api.flash_forward_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_seqlen_q=max_q,
                                         max_seqlen_k=max_k, causal=causal, sm_scale=sm_scale, window=_window(window),
                                         softcap=softcap, return_lse=True, backend=backend)

    @forward_varlen.register_fake
    def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, window, softcap, backend):
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)

    @_custom_op("flash_backward_varlen", _VARLEN_BACKWARD_SCHEMA)
    def backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, sm_scale, window, softcap,
                        deterministic):
        return _api.flash_backward_varlen(dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(),
                                          lse.detach(), cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                                          causal=causal, sm_scale=sm_scale, window=_window(window), softcap=softcap,
                                          deterministic=deterministic)

    @backward_varlen.register_fake
    def _(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, sm_scale, window, softcap, deterministic):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, window, softcap, _backend = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.options = (max_q, max_k, causal, sm_scale, window, softcap)
        ctx.mark_non_differentiable(lse)

    def make_backward(call):
        backward_op = call("flash_backward_varlen")

        def backward(ctx, dout, _dlse):
            q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
            dq, dk, dv = backward_op(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.options,
                                     torch.are_deterministic_algorithms_enabled())
            need = ctx.needs_input_grad
            return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * 9

        return backward

    _with_autograd(forward_varlen, "flash_forward_varlen", setup_context, make_backward)


def _empty_float32(like):
    """The stand-in for an absent state output: an op returns a fixed number of tensors."""
    return like.new_empty((0,), dtype=torch.float32)


def _state_shape(q, v):
    return tuple(q.shape[:-2]) + (q.shape[-1], v.shape[-1])


def _register_linear() -> None:
    """The linear functions' ops and their autograd formulas."""

    @_custom_op("causal_dot_product", _CDP_SCHEMA)
    def causal_dot_product(q, k, v, initial_state, return_state, allow_tf32, backend):
        result = _api.causal_dot_product(q.detach(), k.detach(), v.detach(),
                                         initial_state=None if initial_state is None else initial_state.detach(),
                                         return_state=return_state, allow_tf32=allow_tf32, backend=backend)
        return result if return_state else (result, _empty_float32(q))

    @causal_dot_product.register_fake
    def _(q, k, v, initial_state, return_state, allow_tf32, backend):
        _check_ranks(q, k, v)
        final = q.new_empty(_state_shape(q, v), dtype=torch.float32) if return_state else _empty_float32(q)
        return q.new_empty(v.shape), final

    @_custom_op("causal_dot_product_backward", _CDP_BACKWARD_SCHEMA)
    def causal_dot_product_backward(dout, q, k, v, initial_state, dstate, allow_tf32, backend):
        states = {name: None if x is None else x.detach()
                  for name, x in (("initial_state", initial_state), ("dstate", dstate))}
        grads = _api.causal_dot_product_backward(dout.detach(), q.detach(), k.detach(), v.detach(), **states,
                                                 allow_tf32=allow_tf32, backend=backend)
        return grads if initial_state is not None else grads + (_empty_float32(q),)

    @causal_dot_product_backward.register_fake
    def _(dout, q, k, v, initial_state, dstate, allow_tf32, backend):
        _check_ranks(q, k, v)
        dinit = q.new_empty(_state_shape(q, v), dtype=torch.float32) if initial_state is not None \
            else _empty_float32(q)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dinit

    def cdp_setup_context(ctx, inputs, output):
        q, k, v, initial_state, return_state, allow_tf32, backend = inputs
        ctx.save_for_backward(q, k, v, initial_state)
        ctx.return_state, ctx.allow_tf32, ctx.backend = return_state, allow_tf32, backend
        if not return_state:
            ctx.mark_non_differentiable(output[1])

    def make_cdp_backward(call):
        backward_op = call("causal_dot_product_backward")

        def cdp_backward(ctx, dout, dfinal):
            q, k, v, initial_state = ctx.saved_tensors
            dstate = dfinal if ctx.return_state else None
            dq, dk, dv, dinit = backward_op(dout, q, k, v, initial_state, dstate, ctx.allow_tf32, ctx.backend)
            need = ctx.needs_input_grad
            return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                    dinit if need[3] else None, None, None, None)

        return cdp_backward

    _with_autograd(causal_dot_product, "causal_dot_product", cdp_setup_context, make_cdp_backward)

    @_custom_op("linear_attention", _LINEAR_SCHEMA)
    def linear_attention(q, k, v, causal, eps, allow_tf32, backend):
        return _api.linear_attention(q.detach(), k.detach(), v.detach(), causal=causal, eps=eps,
                                     allow_tf32=allow_tf32, backend=backend)

    @linear_attention.register_fake
    def _(q, k, v, causal, eps, allow_tf32, backend):
        _check_ranks(q, k, v)
        return q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))

    @_custom_op("linear_attention_backward", _LINEAR_BACKWARD_SCHEMA)
    def linear_attention_backward(dout, q, k, v, causal, eps, allow_tf32, backend):
        return _api.linear_attention_backward(dout.detach(), q.detach(), k.detach(), v.detach(), causal=causal,
                                              eps=eps, allow_tf32=allow_tf32, backend=backend)

    @linear_attention_backward.register_fake
    def _(dout, q, k, v, causal, eps, allow_tf32, backend):
        _check_ranks(q, k, v)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def linear_setup_context(ctx, inputs, output):
        q, k, v, causal, eps, allow_tf32, backend = inputs
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.eps, ctx.allow_tf32, ctx.backend = causal, eps, allow_tf32, backend

    def make_linear_backward(call):
        backward_op = call("linear_attention_backward")

        def linear_backward(ctx, dout):
            q, k, v = ctx.saved_tensors
            dq, dk, dv = backward_op(dout, q, k, v, ctx.causal, ctx.eps, ctx.allow_tf32, ctx.backend)
            need = ctx.needs_input_grad
            return dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None, None

        return linear_backward

    _with_autograd(linear_attention, "linear_attention", linear_setup_context, make_linear_backward)


def _check_ranks(q, k, v) -> None:
    """What the fake implementations need of the shapes (the real call checks the rest)."""
    if not (q.dim() == k.dim() == v.dim() and q.dim() in (2, 4)):
        raise ValueError("q, k, v: expected all (batch, heads, seqlen, headdim) or all (seqlen, headdim), got "
                         f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")


def flash_attention(q, k, v, causal=False, sm_scale=None, window=None, softcap=None):
    """``numba_attn.flash_forward(q, k, v, causal=causal, sm_scale=sm_scale, window=window, softcap=softcap)`` for
    torch tensors, always through the custom op: differentiable in q, k, v (those that require grad), traceable by
    ``torch.compile``."""
    return ops().flash_forward(q, k, v, check_flag(causal, "causal"), check_sm_scale(sm_scale), None, False,
                               window_argument(check_window(window)), check_softcap(softcap))[0]


def varlen_with_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale, window,
                     softcap, return_lse, out, backend):
    """``api.flash_forward_varlen`` (arguments checked there) for torch tensors of which one requires grad: recorded
    by autograd while grad mode is on (as :func:`forward_with_grad`); None when it is off (the plain path)."""
    if not torch.is_grad_enabled():
        return None
    if out is not None:
        raise ValueError("out: cannot be used when q, k or v requires grad; drop out=, or detach the inputs")
    offsets = [x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x)) for x in (cu_seqlens_q,
                                                                                              cu_seqlens_k)]
    result, lse = _differentiable("flash_forward_varlen")(q, k, v, *offsets, max_seqlen_q, max_seqlen_k, causal,
                                                          sm_scale, window_argument(window), softcap, backend)
    return (result, lse) if return_lse else result


def forward_with_grad(q, k, v, causal, sm_scale, return_lse, out, backend, allow_tf32, window=None, softcap=None):
    """``api.flash_forward`` for torch tensors of which one requires grad: recorded by autograd while grad mode is on
    (``_differentiable``: the custom op inside ``torch.compile``, its eager twin otherwise); None when grad mode is
    off (the caller takes the plain path)."""
    if not torch.is_grad_enabled():
        return None
    if out is not None:
        raise ValueError("out: cannot be used when q, k or v requires grad (an in-place output cannot be "
                         "differentiated); drop out=, or detach the inputs / use torch.no_grad()")
    causal, return_lse = check_flag(causal, "causal"), check_flag(return_lse, "return_lse")
    sm_scale, backend = check_sm_scale(sm_scale), check_backend(backend, BACKENDS)
    result, lse = _differentiable("flash_forward")(q, k, v, causal, sm_scale, backend,
                                                   check_flag(allow_tf32, "allow_tf32"), window_argument(window),
                                                   softcap)
    return (result, lse) if return_lse else result


def causal_dot_product_with_grad(q, k, v, initial_state, return_state, allow_tf32, backend):
    """``api.causal_dot_product`` for torch tensors of which one requires grad: recorded by autograd while grad mode
    is on (as :func:`forward_with_grad`); None when it is off (the caller takes the plain path)."""
    if not torch.is_grad_enabled():
        return None
    return_state = check_flag(return_state, "return_state")
    out, final = _differentiable("causal_dot_product")(q, k, v, initial_state, return_state,
                                                       check_flag(allow_tf32, "allow_tf32"),
                                                       check_backend(backend, LINEAR_BACKENDS))
    return (out, final) if return_state else out


def linear_attention_with_grad(q, k, v, causal, eps, allow_tf32, backend):
    """``api.linear_attention`` for torch tensors of which one requires grad (as
    :func:`causal_dot_product_with_grad`)."""
    if not torch.is_grad_enabled():
        return None
    return _differentiable("linear_attention")(q, k, v, check_flag(causal, "causal"), check_eps(eps),
                                               check_flag(allow_tf32, "allow_tf32"),
                                               check_backend(backend, LINEAR_BACKENDS))


_register_once()
