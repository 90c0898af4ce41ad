"""The linear-attention functions of the public API (re-exported by ``numba_attn.api``): ``causal_dot_product``,
``causal_dot_product_backward``, ``linear_attention``, ``linear_attention_backward`` -- each checks its arguments
and dispatches to ``linear.dispatch``, as ``api`` does for the softmax-attention functions."""
from __future__ import annotations

from ..runtime.arguments import check_backend, check_eps, check_flag
from ..runtime.arrays import prepare
from ..runtime.device import on_device
from ..runtime.serving import one_call_at_a_time_under_the_simulator as _one_call_at_a_time_under_the_simulator
from ..runtime.serving import served as _served
from ..runtime.serving import wants_grad as _wants_grad
from ..runtime.shapes import check_array, linear_shape
from . import chunked_backward as _chunked_backward
from . import dispatch as _linear
from . import layer_backward as _layer_backward
from .dispatch import BACKENDS as LINEAR_BACKENDS

__all__ = ["causal_dot_product", "causal_dot_product_backward", "linear_attention", "linear_attention_backward"]


def causal_dot_product(q, k, v, *, initial_state=None, return_state=False, allow_tf32=False, backend=None):
    """``out_i = sum_{j <= i} (q_i . k_j) v_j  (+ q_i^T S_0)``, the causal numerator of linear attention
    ("Transformers are RNNs"); fla's ``chunk_linear_attn`` with ``scale=1, normalize=False``.

    Args:
        q, k: ``(batch, heads, seqlen, E)``; v: ``(batch, heads, seqlen, M)`` (or without batch, heads);
            E, M <= 256 may differ; float16, bfloat16 (torch tensors) or float32. The state ``sum k_j v_j^T`` is
            accumulated in float32.
        initial_state: ``S_0``, float32 ``(batch, heads, E, M)`` (``(E, M)`` without batch, heads), added to
            the state before the first row; pass a returned state to continue a sequence in pieces.
        return_state: also return the final state ``S_0 + K^T V`` (float32, the shape of ``initial_state``).
        allow_tf32: float32 inputs on the chunked kernel in one tf32 term (faster, ~1e-3 relative error) instead
            of three (float32 accuracy).
        backend: ``"chunked"`` (tensor cores, compute capability >= 8.0), ``"recurrent"`` (sequential walk; no
            state in / out, no bfloat16) or None to pick by shape and device.

    Returns:
        ``out`` ``(batch, heads, seqlen, M)`` in the inputs' dtype, or ``(out, final_state)``.

    Torch tensors of which one requires grad, in grad mode, go through the ``numba_attn::causal_dot_product``
    custom op (``torch_ops``): autograd records the call, its backward is :func:`causal_dot_product_backward` (with
    this call's ``allow_tf32`` and ``backend``; ``final_state`` differentiable too), and ``torch.compile(fullgraph=
    True)`` traces it without a graph break.
    """
    if _wants_grad(q, k, v, initial_state):
        from .. import torch_ops  # (torch is imported by now: q is a tensor)

        result = torch_ops.causal_dot_product_with_grad(q, k, v, initial_state, return_state, allow_tf32, backend)
        if result is not None:
            return result
    return _causal_dot_product_served(q, k, v, initial_state, return_state, allow_tf32, backend)


@_one_call_at_a_time_under_the_simulator
def _causal_dot_product_served(q, k, v, initial_state, return_state, allow_tf32, backend):
    arrays = (q, k, v) if initial_state is None else (q, k, v, initial_state)
    return _served("causal_dot_product", arrays, (return_state, allow_tf32, backend),
                   lambda: _causal_dot_product(q, k, v, initial_state, return_state, allow_tf32, backend))


def _causal_dot_product(q, k, v, initial_state, return_state, allow_tf32, backend):
    return_state = check_flag(return_state, "return_state")
    allow_tf32 = check_flag(allow_tf32, "allow_tf32")
    backend = check_backend(backend, LINEAR_BACKENDS)
    shape = linear_shape(q, k, v)
    state_shape = shape.state_shape()
    arrays = {"q": q, "k": k, "v": v}
    if initial_state is not None:
        if not hasattr(initial_state, "shape"):
            raise TypeError(f"initial_state: expected an array of shape {state_shape}, got {type(initial_state).__name__}")
        if tuple(initial_state.shape) != state_shape:
            raise ValueError(f"initial_state: expected shape {state_shape} (batch, heads, E, M), "
                             f"got {tuple(initial_state.shape)}")
        arrays["initial_state"] = initial_state
    call = prepare(arrays, own_dtype={"initial_state": ("float32",)})
    with on_device(call.device_id):
        return _run_causal_dot_product(call, shape, initial_state is not None, return_state, allow_tf32, backend)


def _run_causal_dot_product(call, shape, has_initial_state: bool, return_state: bool, allow_tf32: bool, backend):
    state_shape = shape.state_shape()
    stateful = has_initial_state or return_state
    backend = _linear.choose_backend(backend, call.dtype, shape.seqlen, stateful)
    out = call.output(shape.out_shape())
    final = call.output(state_shape, "float32", name="final_state") if return_state else None
    if shape.batch * shape.heads > 0 and (shape.seqlen > 0 or return_state):
        _linear.run_causal_dot_product(call, backend, out, final, allow_tf32)
    if return_state:
        return call.result(out), call.result(final)
    return call.result(out)


def _state_argument(name: str, x, state_shape: tuple) -> None:
    """A state argument (``initial_state``, ``dstate``): an array of the state's shape (its dtype: ``prepare``)."""
    if not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected an array of shape {state_shape}, got {type(x).__name__}")
    check_array(name, x)
    if tuple(x.shape) != state_shape:
        raise ValueError(f"{name}: expected shape {state_shape} (batch, heads, E, M), got {tuple(x.shape)}")


@_one_call_at_a_time_under_the_simulator
def causal_dot_product_backward(dout, q, k, v, *, initial_state=None, dstate=None, allow_tf32=False, backend=None):
    """Gradients of :func:`causal_dot_product`'s output (and final state): ``reference.causal_dot_product_backward``.

    With ``S_i = S_0 + sum_{j <= i} k_j v_j^T`` and ``R_j = dstate + sum_{i >= j} q_i dout_i^T``: ``dq_i = S_i
    dout_i``, ``dk_j = R_j v_j``, ``dv_j = R_j^T k_j`` and ``dinitial_state = R_0 = dstate + Q^T dout``.

    Args:
        dout: the gradient of the loss with respect to the output, the output's shape ``(batch, heads, seqlen, M)``
            (v's) and q's dtype.
        q, k, v, initial_state: as passed to :func:`causal_dot_product`: float16, bfloat16 (torch tensors) or
            float32; E, M <= 256 may differ; ``initial_state`` float32 ``(batch, heads, E, M)`` (``(E, M)`` for
            2-D inputs) or None.
        dstate: the gradient of the returned final state, float32 of the state's shape, or None (the final state
            was not used).
        allow_tf32, backend: as :func:`causal_dot_product` (extras beyond ``reference``'s signature):
            ``"chunked"`` runs the forward's chunked tensor-core kernels three times on rearranged operands
            (``linear/chunked_backward.py``: ``dq`` forward over the sequence, ``dk`` and ``dv`` from the last
            row), ``"recurrent"`` three sequential walks on CUDA cores (``linear/recurrent_backward.py``; float16,
            float32), None picks as the forward does. float32 is float32-accurate (3xTF32) unless ``allow_tf32``.

    Returns:
        ``(dq, dk, dv)`` in the inputs' dtype and kind with the shapes of q, k, v, and ``dinitial_state`` (float32,
        the state's shape) as a fourth element when ``initial_state`` is given. States and sums are float32.

    Torch and CuPy calls are replayed from the plan their first call of a kind recorded (``runtime.replay``), as the
    forward's are. :func:`causal_dot_product` with torch tensors that require grad records it as its backward
    (``torch_ops``).
    """
    arrays = (dout, q, k, v) + tuple(x for x in (initial_state, dstate) if x is not None)
    # which states were given is part of the key (two arrays of one layout could be either); so are the backward's
    # switches, which change the launches
    options = (initial_state is not None, dstate is not None, allow_tf32, backend, _chunked_backward.FUSED,
               _chunked_backward.SPLIT_3XTF32)
    return _served("causal_dot_product_backward", arrays, options,
                   lambda: _causal_dot_product_backward(dout, q, k, v, initial_state, dstate, allow_tf32, backend))


def _causal_dot_product_backward(dout, q, k, v, initial_state, dstate, allow_tf32, backend):
    allow_tf32 = check_flag(allow_tf32, "allow_tf32")
    backend = check_backend(backend, LINEAR_BACKENDS)
    shape = linear_shape(q, k, v)
    check_array("dout", dout)
    if tuple(dout.shape) != shape.out_shape():
        raise ValueError(f"dout: expected the output's shape {shape.out_shape()} (v's), got {tuple(dout.shape)}")
    state_shape = shape.state_shape()
    arrays = {"q": q, "k": k, "v": v, "dout": dout}
    for name, x in (("initial_state", initial_state), ("dstate", dstate)):
        if x is not None:
            _state_argument(name, x, state_shape)
            arrays[name] = x
    call = prepare(arrays, own_dtype={"initial_state": ("float32",), "dstate": ("float32",)})
    stateful = initial_state is not None or dstate is not None
    backend = _linear.choose_backend(backend, call.dtype, shape.seqlen, stateful, states_ok=True, backward=True)
    with on_device(call.device_id):
        dq = call.output(tuple(q.shape), name="dq")
        dk = call.output(tuple(k.shape), name="dk")
        dv = call.output(tuple(v.shape), name="dv")
        dinit = None if initial_state is None else call.output(state_shape, "float32", name="dinitial_state")
        if shape.batch * shape.heads > 0 and (shape.seqlen > 0 or dinit is not None):
            _linear.run_causal_dot_product_backward(call, backend, dq, dk, dv, dinit, allow_tf32)
        grads = (call.result(dq), call.result(dk), call.result(dv))
        return grads if dinit is None else grads + (call.result(dinit),)


def linear_attention(q, k, v, *, causal=False, eps=1e-6, allow_tf32=False, backend=None):
    """The linear-attention layer of "Transformers are RNNs" with the ``elu(x) + 1`` feature map ``phi``.

    ``out_i = phi(q_i)^T S_i / (phi(q_i) . z_i + eps)`` with ``S_i = sum_j phi(k_j) v_j^T`` and
    ``z_i = sum_j phi(k_j)``, the sums over ``j <= i`` when ``causal`` and over all ``j`` otherwise.

    Args:
        q: ``(batch, heads, seqlen_q, E)``; k: ``(batch, heads, seqlen_k, E)``; v: ``(batch, heads, seqlen_k, M)``
            (or without batch, heads); ``seqlen_k == seqlen_q`` when causal; float16, bfloat16 (torch tensors) or
            float32.
        causal: sums over ``j <= i`` (default False, as ``reference.linear_attention``).
        eps: added to the normaliser's denominator; a finite number >= 0.
        allow_tf32, backend: as :func:`causal_dot_product`.

    Returns:
        ``(batch, heads, seqlen_q, M)`` in the inputs' dtype.

    Torch tensors of which one requires grad, in grad mode, go through the ``numba_attn::linear_attention`` custom op
    (``torch_ops``), with :func:`linear_attention_backward` as its backward; ``torch.compile(fullgraph=True)``
    traces it without a graph break.
    """
    if _wants_grad(q, k, v):
        from .. import torch_ops  # (torch is imported by now: q is a tensor)

        result = torch_ops.linear_attention_with_grad(q, k, v, causal, eps, allow_tf32, backend)
        if result is not None:
            return result
    return _linear_attention_served(q, k, v, causal, eps, allow_tf32, backend)


@_one_call_at_a_time_under_the_simulator
def _linear_attention_served(q, k, v, causal, eps, allow_tf32, backend):
    return _served("linear_attention", (q, k, v), (causal, eps, allow_tf32, backend),
                   lambda: _linear_attention(q, k, v, causal, eps, allow_tf32, backend))


def _linear_attention(q, k, v, causal, eps, allow_tf32, backend):
    eps = check_eps(eps)
    causal = check_flag(causal, "causal")
    allow_tf32 = check_flag(allow_tf32, "allow_tf32")
    backend = check_backend(backend, LINEAR_BACKENDS)
    shape = linear_shape(q, k, v, same_length=causal)
    call = prepare({"q": q, "k": k, "v": v})
    with on_device(call.device_id):
        return _run_linear_attention(call, shape, causal, eps, allow_tf32, backend)


def _run_linear_attention(call, shape, causal: bool, eps: float, allow_tf32: bool, backend):
    backend = _linear.choose_backend(backend, call.dtype, max(shape.seqlen, shape.seqlen_k), False)
    out = call.output(shape.out_shape())
    if shape.seqlen > 0 and shape.batch * shape.heads > 0:
        _linear.run_linear_attention(call, backend, out, causal, eps, allow_tf32)
    return call.result(out)


@_one_call_at_a_time_under_the_simulator
def linear_attention_backward(dout, q, k, v, *, causal=False, eps=1e-6, allow_tf32=False, backend=None):
    """Gradients ``(dq, dk, dv)`` of :func:`linear_attention`'s output: ``reference.linear_attention_backward``.

    Args:
        dout: the gradient of the loss with respect to the output, its shape ``(batch, heads, seqlen_q, M)`` and
            q's dtype.
        q, k, v, causal, eps: as passed to :func:`linear_attention` (``elu + 1`` feature map); float16, bfloat16
            (torch tensors) or float32.
        allow_tf32, backend: as :func:`linear_attention` (extras beyond ``reference``'s signature). The products run
            in float32 on the kernels of the causal dot product's backward (``backend="chunked"``: tensor cores;
            ``"recurrent"``: CUDA cores), as 3xTF32, or in one tf32 term for bfloat16 inputs or with
            ``allow_tf32`` (``linear/layer_backward.py``).

    Returns:
        ``(dq, dk, dv)`` in the inputs' dtype and kind with the shapes of q, k, v. A row whose denominator is 0 (no
        keys and ``eps = 0``) passes no gradient back, as in ``reference``.

    Torch and CuPy calls are replayed from the plan their first call of a kind recorded (``runtime.replay``);
    :func:`linear_attention` with torch tensors that require grad records it as its backward (``torch_ops``).
    """
    return _served("linear_attention_backward", (dout, q, k, v), (causal, eps, allow_tf32, backend,
                                                                  _chunked_backward.FUSED,
                                                                  _chunked_backward.SPLIT_3XTF32,
                                                                  _layer_backward.NONCAUSAL_KEY_SUMS),
                   lambda: _linear_attention_backward(dout, q, k, v, causal, eps, allow_tf32, backend))


def _linear_attention_backward(dout, q, k, v, causal, eps, allow_tf32, backend):
    eps = check_eps(eps)
    causal = check_flag(causal, "causal")
    allow_tf32 = check_flag(allow_tf32, "allow_tf32")
    backend = check_backend(backend, LINEAR_BACKENDS)
    shape = linear_shape(q, k, v, same_length=causal)
    check_array("dout", dout)
    if tuple(dout.shape) != shape.out_shape():
        raise ValueError(f"dout: expected the output's shape {shape.out_shape()}, got {tuple(dout.shape)}")
    call = prepare({"q": q, "k": k, "v": v, "dout": dout})
    backend = _linear.choose_backend(backend, call.dtype, max(shape.seqlen, shape.seqlen_k), False, backward=True)
    with on_device(call.device_id):
        dq = call.output(tuple(q.shape), name="dq")
        dk = call.output(tuple(k.shape), name="dk")
        dv = call.output(tuple(v.shape), name="dv")
        if shape.batch * shape.heads > 0 and max(shape.seqlen, shape.seqlen_k) > 0:
            _linear.run_linear_attention_backward(call, backend, dq, dk, dv, causal, eps, allow_tf32)
        return call.result(dq), call.result(dk), call.result(dv)
