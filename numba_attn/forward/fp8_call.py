"""``flash_forward`` on float8 e4m3 inputs: the argument checks, the descale factors, the launch of ``wgmma_ws_fp8``
(the warp-specialised kernel: the default on Hopper at the padded head dims of ``WS_HEAD_DIMS`` -- 128 -- for rows
that see at least ``WS_MIN_KEYS`` keys on average; ``backend="wgmma_ws"`` asks for it) or
``wgmma_fp8`` (elsewhere, ``backend="wgmma"``).

Inputs are torch ``float8_e4m3fn`` tensors, or uint8 arrays of e4m3 bit patterns (NumPy, CuPy, Numba) with
``input_dtype="float8_e4m3fn"`` (``reference.attention``'s ``dtype`` is its output's). Descale factors (``descale_q``, ``descale_k``, ``descale_v``; default 1) take the e4m3
values back to the tensors they quantise: the scores are ``sm_scale * (descale_q q) . (descale_k k)``, the output
``softmax(...) (descale_v v)``. Each is a real number or a size-1 array (per tensor), or a float32 array of shape
``(batch, kv_heads)`` (FlashAttention-3's convention: one factor per kv head; for q, the factor of the kv head's
whole group of query heads) or ``(batch, heads)`` (one per query head). Factors must be finite and > 0 (host values
are checked; device arrays are read by the kernel as they are, a contract). The output is bfloat16 (default) or
float16 (``out_dtype``), of the caller's kind (NumPy and CuPy callers: bfloat16 as uint16 bit patterns).

Repeated calls replay recorded plans (``runtime.replay``, through ``api``; the warp-specialised kernel's tensor maps
and ``V^T`` scratch move with their arrays); none is hooked into autograd.
"""
from __future__ import annotations

import math

import numpy as np

from ..runtime import views as _views
from ..runtime.arguments import check_flag, check_real
from ..runtime.arrays import BFLOAT16, FLOAT8_E4M3, _dtype_name, _library_of, _placement, prepare
from ..runtime.device import SIMULATOR, compute_capability, on_device
from ..runtime.shapes import attention_shape
from ..runtime.views import lift
from . import wgmma_fp8, wgmma_ws_fp8
from .dispatch import check_seqlen_q, long_rows

OUT_DTYPES = ("bfloat16", "float16")
_FP8_ONLY = ("descale_q", "descale_k", "descale_v", "out_dtype")
#: padded head dims at which the warp-specialised kernel is the default: 128 (H100, B4, 03:52 UTC 2026-11-26: 0.96-1.29x
#: our bf16 forward, 1.25-1.58x wgmma_fp8 at 4k-16k); at 64 wgmma_fp8 was faster (333-409 vs 236-335 TFLOP/s)
WS_HEAD_DIMS = frozenset({128})
#: ... for rows seeing at least this many keys on average (causal: half the keys); measured at 1k-16k keys only, so
#: kept at the 16-bit rule's earlier value when that one went down to 512 (``dispatch.WS_MIN_KEYS``)
WS_MIN_KEYS = 1024


def _dtype_of(x) -> str | None:
    library = _library_of(x)
    if library == "unknown":
        return None
    return _dtype_name(x, library)


def wanted(q, k, v, dtype, options: dict) -> bool:
    """True when this call is an fp8 one: a torch ``float8_e4m3fn`` input or ``input_dtype="float8_e4m3fn"`` (``dtype``). ValueError,
    naming the argument, when fp8 inputs come mixed with others or fp8-only options come without fp8 inputs."""
    if dtype is not None and dtype != FLOAT8_E4M3:
        raise ValueError(f"input_dtype: expected None or {FLOAT8_E4M3!r} (uint8 arrays of e4m3 bit patterns), got {dtype!r}")
    names = [_dtype_of(x) for x in (q, k, v)]
    fp8 = dtype == FLOAT8_E4M3 or FLOAT8_E4M3 in names
    if not fp8:
        for name in _FP8_ONLY:
            if options.get(name) is not None:
                raise ValueError(f"{name}: only for float8_e4m3fn inputs (torch float8_e4m3fn tensors, or uint8 "
                                 "arrays with input_dtype='float8_e4m3fn'); got q of dtype " + str(names[0]))
        return False
    allowed = (FLOAT8_E4M3, "uint8") if dtype == FLOAT8_E4M3 else (FLOAT8_E4M3,)
    for name, got in zip("qkv", names):
        if got not in allowed:
            raise ValueError(f"{name}: an fp8 call needs q, k and v all float8_e4m3fn (or uint8 e4m3 bit patterns "
                             f"with input_dtype='float8_e4m3fn'), got {got}")
    return True


def _out_dtype(out_dtype) -> str:
    if out_dtype is None:
        return BFLOAT16
    name = out_dtype if isinstance(out_dtype, str) else str(out_dtype).replace("torch.", "")
    name = {"half": "float16", "<class 'numpy.float16'>": "float16"}.get(name, name)
    if name not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected 'bfloat16' or 'float16' (or the torch dtypes), got {out_dtype!r}")
    return name


def _host_factor(name: str, value) -> float:
    factor = float(value)
    if not (math.isfinite(factor) and factor > 0 and np.isfinite(np.float32(factor))):
        raise ValueError(f"{name}: descale factors must be finite and > 0, got {factor}")
    return factor


def _descale(call, name: str, value, shape):
    """``(factor, None)`` for a per-tensor factor read here, else ``(1.0, view)``: a float32 2-D device view
    ``(batch, H)`` the kernel reads (a size-1 device array broadcast with zero strides)."""
    if value is None:
        return 1.0, None
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: expected a real number or a float32 array, got {value!r}")
    if not hasattr(value, "shape"):
        return _host_factor(name, check_real(value, name)), None
    placement = _placement(name, value)
    dims = tuple(int(n) for n in value.shape)
    size = math.prod(dims)
    dtype = _dtype_name(value, placement.library)
    host = placement.kind == "host"
    if size == 1 and host:
        return _host_factor(name, np.asarray(value.cpu() if placement.library == "torch" else value).reshape(())), None
    if dtype != "float32":
        raise ValueError(f"{name}: expected float32 descale factors, got {dtype}")
    heads = {shape.heads, shape.kv_heads}
    if size != 1 and (len(dims) != 2 or dims[0] != shape.batch or dims[1] not in heads):
        raise ValueError(f"{name}: expected a number, a size-1 array, or shape (batch, kv_heads) = "
                         f"{(shape.batch, shape.kv_heads)} or (batch, heads) = {(shape.batch, shape.heads)}; got "
                         f"shape {dims}")
    if host:
        host_array = np.asarray(value.cpu() if placement.library == "torch" else value, dtype=np.float32)
        if not np.all(np.isfinite(host_array) & (host_array > 0)):
            raise ValueError(f"{name}: descale factors must be finite and > 0")
        view = call.upload(np.ascontiguousarray(host_array))
    else:
        if placement.library != call.library or placement.device_id != call.device_id:
            raise ValueError(f"{name}: must live where q, k, v live ({call.library}, device {call.device_id}), got "
                             f"{placement.library} on device {placement.device_id}")
        view = call._device_view(name, value, placement)
    if size == 1:
        return 1.0, _views.restride(view, (shape.batch, 1), (0, 0))
    return 1.0, view


def _warp_specialised(backend, shape, causal: bool, inputs) -> bool:
    """Whether the call runs on ``wgmma_ws_fp8``: asked for (where the TMA reads the inputs), or by default on a GPU
    at ``WS_HEAD_DIMS`` with rows that see at least ``WS_MIN_KEYS`` keys on average (seqlen_k, halved when
    causal)."""
    if backend == "wgmma" or not wgmma_ws_fp8.supports(shape.head_dim, *inputs):
        return False
    if backend == "wgmma_ws":
        return True
    return (not SIMULATOR and long_rows(shape.seqlen_k, causal, WS_MIN_KEYS)
            and wgmma_ws_fp8.padded_head_dim(shape.head_dim) in WS_HEAD_DIMS)


def run(q, k, v, *, causal, sm_scale, return_lse, out, backend, allow_tf32, window, softcap, descale_q, descale_k,
        descale_v, out_dtype, lse_placeholder):
    """The fp8 ``flash_forward`` (``wanted`` said so; window and softcap checked by the caller)."""
    causal, return_lse = check_flag(causal, "causal"), check_flag(return_lse, "return_lse")
    check_flag(allow_tf32, "allow_tf32")
    if backend not in (None, "wgmma", "wgmma_ws"):
        raise ValueError(f"backend: float8_e4m3fn inputs run on 'wgmma' or 'wgmma_ws' (or None) only, got "
                         f"{backend!r}")
    if type(q).__module__.startswith("torch") and any(getattr(x, "requires_grad", False) for x in (q, k, v)):
        raise ValueError("q, k, v: the fp8 forward is not hooked into autograd; detach the inputs")
    if not SIMULATOR and compute_capability() < wgmma_fp8.MIN_COMPUTE_CAPABILITY:
        raise ValueError("q: float8_e4m3fn inputs need a GPU of compute capability 9.0 (Hopper wgmma), got "
                         f"{compute_capability()}")
    out_name = _out_dtype(out_dtype)
    shape = attention_shape(q, k, v)
    check_seqlen_q(shape.seqlen_q)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(shape.head_dim)
    if shape.head_dim % 16 or not 16 <= shape.head_dim <= wgmma_fp8.MAX_HEAD_DIM:
        raise ValueError(f"q: the fp8 forward takes headdim % 16 == 0 up to {wgmma_fp8.MAX_HEAD_DIM}, got "
                         f"{shape.head_dim}")
    call = prepare({"q": q, "k": k, "v": v}, dtypes=(FLOAT8_E4M3, "uint8"))
    with on_device(call.device_id):
        factors, views = zip(*(_descale(call, name, value, shape) for name, value in
                               (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v))))
        if any(view is not None for view in views):  # per head: every factor read by the kernel
            descale = tuple(view if view is not None else _views.restride(
                call.upload(np.full((1, 1), factor, np.float32)), (shape.batch, 1), (0, 0))
                for factor, view in zip(factors, views))
        else:
            descale = factors
        result = call.output(shape.out_shape(), out_name, out=out)
        lse = call.output(shape.lse_shape(), "float32") if return_lse else None
        inputs = [lift(call.inputs[name], 4) for name in "qkv"]
        if not wgmma_fp8.supports(shape.head_dim, *inputs):
            raise ValueError("q, k, v: the fp8 forward needs a unit-stride last axis and 16-byte aligned rows")
        if shape.seqlen_q > 0 and shape.batch * shape.heads > 0:
            options = dict(descale=descale, out_dtype=out_name, window=window, softcap=softcap)
            if _warp_specialised(backend, shape, causal, inputs):  # (V^T in a scratch array of the caller's pool)
                launch, options["scratch"] = wgmma_ws_fp8.launch, call.scratch
            else:
                launch = wgmma_fp8.launch
            launch(*inputs, lift(result.view, 4), lift(lse.view, 3) if return_lse else lse_placeholder(call),
                   return_lse, sm_scale, causal, call.stream, **options)
        if return_lse:
            return call.result(result), call.result(lse)
        return call.result(result)
