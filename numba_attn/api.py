"""The public API of numba_attn: eight functions, each with the same signature as its float64 twin in `reference`.

| numba_attn              | reference                         |
|-------------------------|-----------------------------------|
| ``flash_forward``       | ``reference.attention``           |
| ``flash_forward_varlen`` | ``reference.attention_varlen``   |
| ``flash_backward``      | ``reference.flash_attention_v2_backward`` (``attention_backward``) |
| ``flash_backward_varlen`` | ``reference.attention_varlen_backward`` |
| ``flash_decode``        | ``reference.attention_with_kvcache`` (``reference.attention`` without cache options) |
| ``combine_lse``         | ``reference.combine_lse``         |
| ``causal_dot_product``  | ``reference.causal_dot_product``  |
| ``causal_dot_product_backward`` | ``reference.causal_dot_product_backward`` |
| ``linear_attention``    | ``reference.linear_attention``    |
| ``linear_attention_backward`` | ``reference.linear_attention_backward`` |

Every function takes NumPy arrays, CuPy arrays, Numba device arrays or torch tensors and returns the same kind
(see ``runtime.arrays``); device inputs are used in place and kernels run on the caller's current stream.

The contract, in full in README.md ("Contract"):

* inputs of any strides, read-only ones included (never written); the device arrays of a call from one library,
  on one device (the call runs there, whichever device is current);
* float16 / float32 (bfloat16 as torch tensors), one dtype per call, float32 accumulation;
* flags are ``bool``, numbers real numbers (``runtime.arguments``): a wrong type is a ``TypeError`` (also a
  ``ValueError``), a bad value a ``ValueError``, each naming the argument; defaults equal ``reference``'s;
* ``out=`` shares no memory with the inputs and has distinct elements;
* safe to call from several threads at once;
* NaN and inf as in ``reference``: a NaN or +inf score makes a row NaN (output and lse), -inf scores weigh 0, a
  row with no key (or only -inf scores) gives 0 and lse -inf; non-finite values at keys a row does not see may
  reach it (the kernels multiply whole tiles).
"""
from __future__ import annotations

import math

from .core.scores import kernel_scale
from .forward import dispatch as _forward
from .forward.dispatch import BACKENDS
from .runtime import replay as _replay
from .runtime import views as _views
from .runtime.arguments import (check_backend, check_flag, check_num_splits, check_sm_scale,
                                check_softcap, check_window)
from .runtime.arrays import prepare
from .runtime.attention_args import AttentionArgs, BackwardArgs
from .runtime.device import SIMULATOR, DeviceView, on_device
from .runtime.shapes import attention_shape, check_array
from .runtime.lazy import lazy_exports, lazy_module
from .runtime.views import lift
from .runtime.serving import one_call_at_a_time_under_the_simulator as _one_call_at_a_time_under_the_simulator
from .runtime.serving import served as _served

# the families a program may never call load on first use (``runtime.lazy``: import time)
_backward = lazy_module(".backward.dispatch", __package__)
_backward_varlen = lazy_module(".backward.varlen", __package__)
_decode_plan = lazy_module(".decode.cached", __package__)
_decode = lazy_module(".decode.dispatch", __package__)
_decode_simt = lazy_module(".decode.simt", __package__)
_varlen = lazy_module(".forward.varlen", __package__)
_fp8 = lazy_module(".forward.fp8_call", __package__)
#: the linear-attention functions (``linear.api``) and their backends, re-exported on first read
__getattr__ = lazy_exports(__package__, {
    **{name: ".linear.api" for name in ("causal_dot_product", "causal_dot_product_backward", "linear_attention",
                                        "linear_attention_backward")},
    "LINEAR_BACKENDS": ".linear.dispatch:BACKENDS"})

__all__ = [
    "flash_forward", "flash_forward_varlen", "flash_backward", "flash_backward_varlen", "flash_decode", "combine_lse",
    "causal_dot_product", "causal_dot_product_backward", "linear_attention", "linear_attention_backward", "BACKENDS",
    "LINEAR_BACKENDS",
]


_NO_LSE = None


#: dtype -> whether it is a float8 one (a dict lookup per input instead of ``str(dtype)``: host time per call)
_FLOAT8_DTYPES: dict = {}


def _is_float8(x) -> bool:
    dtype = getattr(x, "dtype", None)
    try:
        known = _FLOAT8_DTYPES.get(dtype)
    except TypeError:  # an unhashable dtype attribute: the checks say what is wrong with it
        return "float8" in str(dtype)
    if known is None:
        known = _FLOAT8_DTYPES[dtype] = "float8" in str(dtype)
    return known


def _lse_placeholder(call):
    """The lse argument of kernels launched without ``return_lse``, which never write it: on a GPU a null view
    (nothing to allocate, so a first call inside a CUDA-graph capture allocates nothing outside the graph); under
    the simulator a one-element array, made once."""
    global _NO_LSE
    if _NO_LSE is None:
        _NO_LSE = call.scratch((1, 1, 1), "float32") if SIMULATOR else DeviceView(0, (1, 1, 1), (4, 4, 4),
                                                                                   "float32", None)
    return _NO_LSE


def flash_forward(q, k, v, *, causal=False, sm_scale=None, return_lse=False, out=None, backend=None,
                  allow_tf32=False, window=None, softcap=None, descale_q=None, descale_k=None, descale_v=None,
                  out_dtype=None, input_dtype=None):
    """Exact attention ``softmax(sm_scale * q k^T) v`` without materialising the scores.

    Args:
        q: ``(batch, heads, seqlen_q, headdim)`` or ``(seqlen_q, headdim)``; float16, float32 or bfloat16 (torch
            bfloat16 tensors).
        k, v: ``(batch, kv_heads, seqlen_k, headdim)``; ``heads`` must be a multiple of ``kv_heads``
            (grouped-query attention: q head ``h`` reads kv head ``h // (heads // kv_heads)``).
        causal: mask aligned bottom-right, query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``.
        sm_scale: score scale, default ``1 / sqrt(headdim)``; a finite real number with ``sm_scale * log2(e)``
            finite in float32.
        return_lse: also return ``lse``, the natural-log log-sum-exp of each row's scaled scores,
            ``(batch, heads, seqlen_q)`` float32.
        out: optional output array of q's shape, dtype and kind (and device), with distinct elements and no
            memory shared with q, k or v.
        backend: ``"wgmma"`` (Hopper's warpgroup MMAs, compute capability 9.0: float16 / bfloat16, headdim up to
            128 with headdim % 8 == 0, a unit-stride last axis and 16-byte aligned rows), ``"wgmma_ws"`` (the same
            inputs on Hopper's warp-specialised kernel: TMA copies, a producer warp, two consumer warpgroups;
            chosen only when asked for), ``"mma"`` (tensor
            cores, GPUs of compute capability >= 8.0: float16 / bfloat16 products, any headdim up to 256 and any
            strides; float32 as 3xTF32 -- each operand split into two tf32 parts, three products, float32
            accuracy), ``"simt"`` (CUDA cores: float16 / float32, any GPU) or None: "wgmma" where it applies, else
            "mma" (for float32 under the simulator only with ``allow_tf32=True``), else "simt".
        allow_tf32: float32 inputs only: one plain tf32 product on the tensor cores instead of three (about 3x less
            tensor-core work, relative error about 1e-3 instead of 1e-6). Ignored for 16-bit inputs and by ``backend="simt"``, which computes in float32
            throughout.
        window: a sliding window ``(left, right)`` around the same bottom-right diagonal: query ``i`` sees keys
            ``i' - left <= j <= i' + right``, ``i' = i + seqlen_k - seqlen_q``; each side an int >= 0 or None
            (unbounded); with ``causal`` the right side is ``min(right, 0)``. None (default): no window. Every
            backend takes one (a compile-time variant of its kernel; key tiles wholly outside the window are
            skipped); differentiable (``flash_backward`` takes it too).
        softcap: None (default) or 0: no capping; a finite ``c > 0``: the scores become ``c * tanh(sm_scale * q.k /
            c)`` before the mask and the softmax (FlashAttention's soft-capping, as ``reference.attention``'s), and
            ``lse`` is that of the capped scores. A compile-time variant of every kernel (one specialisation per
            value of ``c``); ``tanh.approx`` in the float16 / bfloat16 tensor-core kernels, ``tanh`` in the float32
            ones; differentiable (``flash_backward`` takes it too).
        descale_q, descale_k, descale_v, out_dtype, input_dtype: float8 e4m3 inputs (Hopper; backend "wgmma_ws" by
            default at padded head dim 128 for rows that see >= 1024 keys, else "wgmma"): q, k, v as torch
            ``float8_e4m3fn`` tensors, or uint8 arrays of e4m3 bit patterns with ``input_dtype="float8_e4m3fn"``; the
            descale factors take them back to the tensors they quantise (None: 1; a number or size-1 array per
            tensor; a float32 ``(batch, kv_heads)`` array as FlashAttention-3's, or ``(batch, heads)``, per head;
            finite and > 0); the output is ``out_dtype`` "bfloat16" (default) or "float16". headdim % 16 == 0 up
            to 128; window and softcap as above; not with autograd (``forward.fp8_call``).

    Returns:
        ``out`` (q's shape and dtype), or ``(out, lse)``. Rows that see no key (or whose scores are all -inf) give 0
        and ``lse = -inf``; a NaN or +inf score gives the row NaN output and lse.

    Torch tensors of which one requires grad, in grad mode, go through the ``numba_attn::flash_forward`` custom op
    (``torch_ops``): autograd records the call (its backward is ``flash_backward``), ``lse`` is not differentiable,
    ``out=`` is a ValueError, and ``torch.compile(fullgraph=True)`` traces the call without a graph break.
    """
    # (checked here, not in ``checked``: a list is no replay plan's key, and 50 and 50.0 are one cap)
    if window is not None:
        window = check_window(window)
    if softcap is not None:
        softcap = check_softcap(softcap)
    # (fp8_call loads only when a call may be an fp8 one: an fp8 option, or a float8 dtype on an input)
    if (input_dtype is not None or descale_q is not None or descale_k is not None or descale_v is not None
            or out_dtype is not None or _is_float8(q) or _is_float8(k) or _is_float8(v)):
        fp8_options = {"descale_q": descale_q, "descale_k": descale_k, "descale_v": descale_v,
                       "out_dtype": out_dtype}
        if _fp8.wanted(q, k, v, input_dtype, fp8_options):
            return _flash_forward_fp8(q, k, v, causal, sm_scale, return_lse, out, backend, allow_tf32, window,
                                      softcap, fp8_options)
    if type(q).__module__.startswith("torch") and (
            q.requires_grad or getattr(k, "requires_grad", False) or getattr(v, "requires_grad", False)):
        from . import torch_ops  # (torch is imported by now: q is a tensor)

        result = torch_ops.forward_with_grad(q, k, v, causal, sm_scale, return_lse, out, backend, allow_tf32, window,
                                             softcap)
        if result is not None:
            return result
    return _flash_forward(q, k, v, causal, sm_scale, return_lse, out, backend, allow_tf32, window, softcap)


@_one_call_at_a_time_under_the_simulator
def _flash_forward_fp8(q, k, v, causal, sm_scale, return_lse, out, backend, allow_tf32, window, softcap, options):
    def checked():
        return _fp8.run(q, k, v, causal=causal, sm_scale=check_sm_scale(sm_scale), return_lse=return_lse, out=out,
                        backend=check_backend(backend, BACKENDS), allow_tf32=allow_tf32, window=window,
                        softcap=softcap, lse_placeholder=_lse_placeholder, **options)

    if out is not None:
        return checked()
    # device descale arrays are inputs of the plan (read by the kernel when it runs); numbers and the values of host
    # arrays (read, checked and copied by the checked path) are options
    descales = tuple(options[name] for name in ("descale_q", "descale_k", "descale_v"))
    host = tuple(_replay.host_values(x) if hasattr(x, "shape") else None for x in descales)
    arrays = (q, k, v) + tuple(x for x, values in zip(descales, host) if hasattr(x, "shape") and values is None)
    kinds = tuple(values if values is not None else "array" if hasattr(x, "shape") else x
                  for x, values in zip(descales, host))
    return _served("flash_forward_fp8", arrays, (causal, sm_scale, return_lse, backend, allow_tf32, window, softcap,
                                                 options["out_dtype"], kinds), checked)


@_one_call_at_a_time_under_the_simulator
def _flash_forward(q, k, v, causal, sm_scale, return_lse, out, backend, allow_tf32, window=None, softcap=None):
    def checked():
        return _attention(q, k, v, check_flag(causal, "causal"), check_sm_scale(sm_scale),
                          check_flag(return_lse, "return_lse"), out, num_splits=None, decode=False,
                          backend=check_backend(backend, BACKENDS), allow_tf32=check_flag(allow_tf32, "allow_tf32"),
                          window=window, softcap=softcap)

    if out is not None:  # (plans make their outputs)
        return checked()
    return _served("flash_forward", (q, k, v), (causal, sm_scale, return_lse, backend, allow_tf32, window, softcap),
                   checked)


@_one_call_at_a_time_under_the_simulator
def flash_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                         sm_scale=None, window=None, softcap=None, return_lse=False, out=None, backend=None):
    """``flash_forward`` of a batch of packed sequences of different lengths (FlashAttention's varlen layout):
    ``reference.attention_varlen``, no padding work.

    Args:
        q: ``(total_q, heads, headdim)``, the queries of all sequences one after the other.
        k, v: ``(total_k, kv_heads, headdim)``, likewise; ``heads`` a multiple of ``kv_heads``.
        cu_seqlens_q, cu_seqlens_k: ``batch + 1`` offsets ``[0, len_0, len_0 + len_1, ..., total]``: sequence ``b``
            is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` against ``k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``
            (sequences may be empty). Host arrays (NumPy, lists, torch CPU tensors; any integer dtype) are checked:
            1-d, starting at 0, non-decreasing, ending at ``total_q`` / ``total_k``, the same length (ValueError
            naming the argument). Device arrays (int32, q's library and device) are not read back: their values
            are the caller's contract, unchecked, as FlashAttention's (offsets out of range read and write out of
            bounds).
        max_seqlen_q, max_seqlen_k: None or the longest sequence's length (FlashAttention's arguments). With device
            offsets ``max_seqlen_q`` bounds the grid (a smaller value than the real one leaves rows unwritten: a
            contract); with host offsets a value below the real one is a ValueError. ``max_seqlen_k`` is checked
            only.
        causal, sm_scale, window, softcap: as ``flash_forward``, each sequence aligned bottom-right at its own
            lengths (query ``i`` of a sequence sees keys ``j <= i + len_k - len_q``).
        return_lse: also return ``lse``, ``(heads, total_q)`` float32 (FlashAttention's varlen layout).
        out: optional output of q's shape, dtype and kind.
        backend: as ``flash_forward`` ("wgmma", "mma", "simt" or None); every kernel takes packed sequences, each
            with its default tiles (the autotuner is not asked).

    Returns:
        ``out`` ``(total_q, heads, headdim)``, or ``(out, lse)``. Rows that see no key give 0 and ``lse = -inf``.

    Repeated calls replay the first call's launches (``runtime.replay``): with device offsets the schedule is made
    on the device, so no value is read on the host; host offsets make the schedule on the host, so their values are
    part of the plan's key (a call with other offsets takes the checked path and records a plan of its own; the
    plan keeps its schedule on the device, with no copy per call). Torch tensors of which one requires grad, in grad mode, go through the
    ``numba_attn::flash_forward_varlen`` custom op, whose backward is
    ``flash_backward_varlen`` (``torch_ops``; ``out=`` is then a ValueError).
    """
    causal, return_lse = check_flag(causal, "causal"), check_flag(return_lse, "return_lse")
    sm_scale, window, softcap = check_sm_scale(sm_scale), check_window(window), check_softcap(softcap)
    backend = check_backend(backend, BACKENDS)
    if type(q).__module__.startswith("torch") and any(getattr(x, "requires_grad", False) for x in (q, k, v)):
        from . import torch_ops

        result = torch_ops.varlen_with_grad(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                            sm_scale, window, softcap, return_lse, out, backend)
        if result is not None:
            return result

    def checked():
        return _varlen.run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale, window,
                           softcap, return_lse, out, backend, _lse_placeholder)

    if out is not None:  # (plans make their outputs)
        return checked()
    arrays, offsets = _packed_key((q, k, v), cu_seqlens_q, cu_seqlens_k)
    return _served("flash_forward_varlen", arrays,
                   (max_seqlen_q, max_seqlen_k, causal, sm_scale, return_lse, backend, window, softcap) + offsets,
                   checked)


def _packed_key(arrays: tuple, cu_seqlens_q, cu_seqlens_k) -> tuple:
    """``(arrays, options)`` of a varlen call's plan key: device offsets are arrays of the key (the schedule is made
    on the device from whatever they hold when the kernels run); host offsets make the schedule on the host, so
    the key holds their values (``replay.host_values``: another value, another plan -- never a stale schedule)."""
    host_q, host_k = _replay.host_values(cu_seqlens_q), _replay.host_values(cu_seqlens_k)
    if host_q is None and host_k is None:
        return arrays + (cu_seqlens_q, cu_seqlens_k), ()
    if host_q is None or host_k is None:  # (one on the host, one not: the checked path says so)
        return arrays + (cu_seqlens_q, cu_seqlens_k), ([],)
    return arrays, (host_q, host_k)


@_one_call_at_a_time_under_the_simulator
def flash_backward(dout, q, k, v, out, lse, *, causal=False, sm_scale=None, deterministic=False, backend=None,
                   window=None, softcap=None, allow_tf32=False):
    """Gradients ``(dq, dk, dv)`` of ``flash_forward``'s output: FlashAttention-2's backward, which recomputes the
    attention weights from the forward's ``lse`` instead of keeping them.

    Args:
        dout: the gradient of the loss with respect to ``out``, ``out``'s (= q's) shape and dtype.
        q, k, v, causal, sm_scale, window, softcap: as passed to ``flash_forward`` (grouped-query heads; causal and
            the sliding window aligned bottom-right; ``sm_scale`` default ``1 / sqrt(headdim)``; with ``softcap`` the
            gradient goes through the cap, ``dS (1 - tanh^2)``, recomputed with the forward kernels' ``tanh``);
            float16, bfloat16 (torch tensors) or float32.
        out, lse: what ``flash_forward(q, k, v, causal=causal, sm_scale=sm_scale, window=window, softcap=softcap,
            return_lse=True)`` returned:
            ``out`` q's shape and dtype, ``lse`` ``(batch, heads, seqlen_q)`` (``(seqlen_q,)`` for 2-D inputs)
            float32, natural log; rows with ``lse = -inf`` (they see no key) contribute nothing.
        deterministic: compute ``dq`` in a second kernel over query blocks instead of adding each key block's part
            with float32 atomics: bitwise the same result on every call, one more pass over K and V.
        backend: ``"wgmma"`` (Hopper warpgroup MMAs, sm_90: float16 / bfloat16, headdim up to 128, rows in
            aligned 16-byte pieces; other inputs and the deterministic ``dq`` run on "mma"), ``"wgmma_ws"`` (its
            warp-specialised TMA variant, opt-in), ``"mma"`` (tensor cores, GPUs of compute capability >= 8.0:
            float16 / bfloat16, headdim up to 256, any strides), ``"tf32"`` (tensor cores, compute capability >=
            8.0: float32 as 3xTF32, headdim up to 256 where its tiles fit the shared memory), ``"simt"`` (CUDA
            cores: float16 / float32, any GPU) or None: "wgmma" where it applies, else "mma" for 16-bit and "tf32"
            for float32 inputs where they apply (under the simulator only for bfloat16, and for float32 with
            ``allow_tf32``), else "simt". A window, soft-capping or packed sequences run on "mma" / "simt".
        allow_tf32: float32 inputs only: one plain tf32 product on the tensor cores instead of three (a third of
            the tensor-core work, relative error about 1e-3 instead of 1e-6). Ignored for 16-bit inputs and by
            ``backend="simt"``.

    Returns:
        ``(dq, dk, dv)`` in the inputs' dtype and kind, the shapes of q, k, v; ``dk`` and ``dv`` summed over each kv
        head's group of query heads. Accumulated in float32 (``numba_attn/backward/``; the tensor-core kernels round
        ``P`` and ``dS`` to the inputs' dtype for their products, as FlashAttention-2 does).

    Repeated calls with torch or CuPy arrays of one kind replay the first call's launches (``runtime.replay``), as
    ``flash_forward``'s do. Called directly it is not hooked into autograd: ``flash_forward`` with torch tensors that require grad records it as its backward
    (``torch_ops``, custom op ``numba_attn::flash_backward``).
    """
    # (checked here, not in ``checked``: a list is no replay plan's key, and 50 and 50.0 are one cap)
    window, softcap = check_window(window), check_softcap(softcap)

    def checked():
        return _flash_backward(dout, q, k, v, out, lse, check_flag(causal, "causal"), check_sm_scale(sm_scale),
                               check_flag(deterministic, "deterministic"), check_backend(backend, _backward.BACKENDS),
                               window, softcap, check_flag(allow_tf32, "allow_tf32"))

    return _served("flash_backward", (dout, q, k, v, out, lse),
                   (causal, sm_scale, deterministic, backend, window, softcap, allow_tf32), checked)


def _flash_backward(dout, q, k, v, out, lse, causal, sm_scale, deterministic, backend, window, softcap, allow_tf32):
    shape = attention_shape(q, k, v)
    for name, x in (("dout", dout), ("out", out)):
        check_array(name, x)
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name}: expected q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    check_array("lse", lse)
    if tuple(lse.shape) != shape.lse_shape():
        raise ValueError(f"lse: expected shape {shape.lse_shape()} (batch, heads, seqlen_q), the forward's lse, "
                         f"got {tuple(lse.shape)}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(shape.head_dim)
    if softcap is not None:
        kernel_scale(sm_scale, softcap)  # ValueError where the kernels' float32 scales would not be finite
    call = prepare({"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse},
                   own_dtype={"lse": ("float32",)})
    asked = backend
    backend = _backward.choose_backend(backend, call.dtype, shape.head_dim, allow_tf32)
    backend = _backward.variant_backend(backend, asked, window is not None or softcap is not None)
    with on_device(call.device_id):
        dq = call.output(shape.out_shape(), name="dq")
        dk = call.output(shape.kv_shape(), name="dk")
        dv = call.output(shape.kv_shape(), name="dv")
        if shape.batch * shape.heads > 0 and shape.head_dim > 0:
            args = BackwardArgs(*(lift(call.inputs[name], 4) for name in ("dout", "q", "k", "v", "out")),
                                lift(call.inputs["lse"], 3), lift(dq.view, 4), lift(dk.view, 4), lift(dv.view, 4),
                                sm_scale, causal, window, softcap)
            _backward.run(call, args, backend, deterministic, allow_tf32)
        return call.result(dq), call.result(dk), call.result(dv)


@_one_call_at_a_time_under_the_simulator
def flash_backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                          max_seqlen_k=None, causal=False, sm_scale=None, window=None, softcap=None,
                          deterministic=False, backend=None):
    """Gradients ``(dq, dk, dv)`` of ``flash_forward_varlen``'s output (``reference.attention_varlen_backward``):
    ``flash_backward`` of each packed sequence, in one call, no padding work.

    Args:
        dout: ``(total_q, heads, headdim)``, the gradient of the output.
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, sm_scale, window, softcap: as passed
            to ``flash_forward_varlen`` (host offsets checked, device offsets the caller's contract).
        out, lse: what ``flash_forward_varlen(..., return_lse=True)`` returned (``lse`` ``(heads, total_q)``
            float32).
        deterministic, backend: as ``flash_backward``'s.

    Returns:
        ``(dq, dk, dv)`` of the shapes of q, k, v; keys no row sees get 0, rows that see no key ``dq = 0``.

    Repeated calls replay the first call's launches (host offsets: of the same values), as
    ``flash_forward_varlen``'s.
    """
    causal, deterministic = check_flag(causal, "causal"), check_flag(deterministic, "deterministic")
    sm_scale, window, softcap = check_sm_scale(sm_scale), check_window(window), check_softcap(softcap)
    backend = check_backend(backend, _backward.BACKENDS)

    def checked():
        return _backward_varlen.run(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal, sm_scale, window, softcap, deterministic, backend)

    # (host offsets by their values, device offsets as arrays: as ``flash_forward_varlen``)
    arrays, offsets = _packed_key((dout, q, k, v, out, lse), cu_seqlens_q, cu_seqlens_k)
    return _served("flash_backward_varlen", arrays,
                   (max_seqlen_q, max_seqlen_k, causal, sm_scale, window, softcap, deterministic, backend) + offsets,
                   checked)


@_one_call_at_a_time_under_the_simulator
def flash_decode(q, k_cache, v_cache, *, cache_seqlens=None, block_table=None, window=None, softcap=None,
                 causal=False, sm_scale=None, num_splits=None, return_lse=False):
    """Attention for a few query rows against a long key/value sequence (the KV-cache case), split over keys:
    ``reference.attention_with_kvcache`` (``reference.attention`` without the cache options).

    The keys are cut into ``num_splits`` contiguous ranges handled by separate thread blocks (flash-decoding), each
    producing a normalised partial output and its ``lse``; these merge with ``combine_lse`` weights, in a second
    kernel or, for pooled plans (below), in the split kernel's last block of each row tile.
    ``num_splits=None`` picks the ranges from the number of (batch, head) blocks and SMs so that the whole GPU
    streams the cache (on the tensor-core path, ``decode_mma.plan_splits``: one wave of ranges and, where a row tile
    has several, a pool of its last keys that its blocks take tile by tile, so that faster SMs take more; otherwise,
    for long caches, short tail ranges behind the wave that go to the SMs that finish first); an integer asks for that
    many equal ranges. The ranges depend on the cache's capacity (or a window's width), never on ``cache_seqlens``.

    Args:
        q: ``(batch, heads, seqlen_q, headdim)`` (or ``(seqlen_q, headdim)`` without ``cache_seqlens`` and
            ``block_table``), typically ``seqlen_q`` 1..16; float16, float32 or bfloat16 (torch tensors).
        k_cache, v_cache: a dense cache ``(batch, kv_heads, capacity, headdim)`` (this package's layout, as
            ``flash_forward``'s k and v; FlashAttention's ``(batch, capacity, kv_heads, headdim)`` is
            ``k.transpose(1, 2)``), or with ``block_table`` a pool of pages ``(num_pages, page_size, kv_heads,
            headdim)`` (FlashAttention's paged layout; any page size; rows 16-byte aligned read fastest).
        cache_seqlens: the valid keys of each batch row, ``(batch,)`` int32: row ``b`` sees keys ``0 ..
            cache_seqlens[b] - 1``, its queries the last ``seqlen_q`` positions of its sequence. A device array of
            the inputs' library is read by the kernels when they run (no copy, no synchronisation; a captured CUDA
            graph follows lengths that change between replays); its values must lie in ``[0, capacity]`` (not
            checked). A host array (or an int for every row) is checked and copied each call. None: every row is
            full (``capacity`` keys).
        block_table: ``(batch, max_pages)`` int32 page indices (host arrays: any integer dtype): key ``p`` of row
            ``b`` is row ``p % page_size`` of page ``block_table[b, p // page_size]``; a row's capacity is
            ``max_pages * page_size``. The entries a row reads must lie in ``[0, num_pages)`` (checked for host
            arrays; the rest are never read).
        window, softcap: a sliding window ``(left, right)`` as ``flash_forward``'s, each row aligned at its own
            length; soft-capping ``softcap * tanh(scores / softcap)`` (None or 0: none).
        causal, sm_scale, return_lse: as ``flash_forward``'s (causal aligned bottom-right at each row's length).

    Returns:
        ``out`` (q's shape and dtype), or ``(out, lse)`` (``(batch, heads, seqlen_q)`` float32); rows that see no
        key (``cache_seqlens[b] = 0``, an empty window) give 0 and ``lse = -inf``.

    Repeated calls with torch or CuPy arrays of one kind (library, dtype, device, shapes -- the cache length may
    change --, query strides, alignment, options) skip the argument checks after the first (``_decode_plan``). A
    decoding step can also be captured in a torch CUDA graph after one call outside the capture.
    """
    causal, return_lse = check_flag(causal, "causal"), check_flag(return_lse, "return_lse")
    options = (causal, check_sm_scale(sm_scale), check_num_splits(num_splits), return_lse)
    cache = cache_seqlens is not None or block_table is not None or window is not None or softcap is not None
    if cache:
        options += (check_window(window), check_softcap(softcap))
    key, plan, layouts = _decode_plan.find(q, k_cache, v_cache, options, cache_seqlens, block_table)
    if plan is not None:
        result = plan.run(layouts)
        if result is not None:
            return result
    if cache:
        return _decode.checked_with_cache(q, k_cache, v_cache, cache_seqlens, block_table, causal, options[1],
                                          options[4], options[5], return_lse, options[2], _lse_placeholder, key)
    return _attention(q, k_cache, v_cache, causal, options[1], return_lse, None, num_splits=options[2], decode=True,
                      backend=None, plan_key=key)


def _attention(q, k, v, causal, sm_scale, return_lse, out, num_splits, decode, backend, allow_tf32=False,
               plan_key=None, window=None, softcap=None):
    shape = attention_shape(q, k, v)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(shape.head_dim)
    if not decode:
        _forward.check_seqlen_q(shape.seqlen_q)
    if softcap is not None:
        kernel_scale(sm_scale, softcap)  # ValueError where the kernels' float32 scales would not be finite
    call = prepare({"q": q, "k": k, "v": v})
    with on_device(call.device_id):
        return _run_attention(call, shape, causal, sm_scale, return_lse, out, num_splits, decode, backend,
                              allow_tf32, plan_key, window, softcap)


def _run_attention(call, shape, causal, sm_scale, return_lse, out, num_splits, decode, backend, allow_tf32,
                   plan_key, window=None, softcap=None):
    out = call.output(shape.out_shape(), out=out)
    lse = call.output(shape.lse_shape(), "float32") if return_lse else None
    if decode:
        _decode.check_dtype(call.dtype)
    else:
        backend = _forward.backend_for(call, shape, backend, allow_tf32, causal)
    if shape.seqlen_q > 0 and shape.batch * shape.heads > 0:
        args = AttentionArgs(
            lift(call.inputs["q"], 4), lift(call.inputs["k"], 4), lift(call.inputs["v"], 4), lift(out.view, 4),
            lift(lse.view, 3) if return_lse else _lse_placeholder(call), return_lse, sm_scale, causal, window,
            softcap)
        if decode:
            _decode.run(call, shape, args, num_splits, plan_key)
        else:
            _forward.run(call, shape, args, backend, allow_tf32, _lse_placeholder(call))
    if return_lse:
        return call.result(out), call.result(lse)
    return call.result(out)


@_one_call_at_a_time_under_the_simulator
def combine_lse(o_parts, lse_parts):
    """Merge partial attention results computed over disjoint key sets (split-K, ring / context parallelism).

    Args:
        o_parts: ``(num_splits, batch, heads, seqlen_q, headdim)`` (or ``(num_splits, seqlen_q, headdim)``),
            each part normalised over its own keys; float16 or float32.
        lse_parts: ``(num_splits, batch, heads, seqlen_q)`` (or ``(num_splits, seqlen_q)``) float32, ``-inf`` for
            a part that saw no key.

    Returns:
        ``(out, lse)``: ``out = sum_s exp(lse_s - lse) o_s`` in o_parts' dtype and ``lse = log(sum_s exp(lse_s))``
        float32. If every part is empty: 0 and ``-inf``, never NaN. A NaN or +inf part lse gives the row NaN; an
        empty part has weight 0, so its o must be finite (0 * NaN is NaN), as ``reference.combine_lse``.
    """
    return _served("combine_lse", (o_parts, lse_parts), (), lambda: _combine_lse(o_parts, lse_parts))


def _combine_lse(o_parts, lse_parts):
    check_array("o_parts", o_parts)
    check_array("lse_parts", lse_parts)
    o_ndim = len(o_parts.shape)
    if o_ndim not in (3, 5):
        raise ValueError(
            "o_parts: expected shape (num_splits, batch, heads, seqlen_q, headdim) or "
            f"(num_splits, seqlen_q, headdim), got {tuple(o_parts.shape)}"
        )
    if tuple(lse_parts.shape) != tuple(o_parts.shape[:-1]):
        raise ValueError(
            f"lse_parts: expected shape {tuple(o_parts.shape[:-1])} (o_parts without headdim), "
            f"got {tuple(lse_parts.shape)}"
        )
    if o_parts.shape[0] < 1:
        raise ValueError("o_parts: needs at least one part (num_splits >= 1)")
    call = prepare(
        {"o_parts": o_parts, "lse_parts": lse_parts},
        dtypes=("float16", "float32"),
        own_dtype={"lse_parts": ("float32",)},
    )
    with on_device(call.device_id):
        return _run_combine(call, o_parts.shape, o_ndim)


def _run_combine(call, parts_shape: tuple, o_ndim: int):
    out = call.output(tuple(parts_shape[1:]))
    lse = call.output(tuple(parts_shape[1:-1]), "float32")
    if math.prod(parts_shape[1:]) > 0:
        unit_axes = 2 if o_ndim == 3 else 0  # (num_splits, seqlen, d) -> (num_splits, 1, 1, seqlen, d)
        _decode_simt.launch_combine(
            _views.with_unit_axes(call.inputs["o_parts"], 1, unit_axes),
            _views.with_unit_axes(call.inputs["lse_parts"], 1, unit_axes),
            lift(out.view, 4),
            lift(lse.view, 3),
            call.stream,
        )
    return call.result(out), call.result(lse)
