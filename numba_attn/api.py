"""The public API of numba_attn: five functions, each with the same signature as its float64 twin in `reference`.

| numba_attn              | reference                         |
|-------------------------|-----------------------------------|
| ``flash_forward``       | ``reference.attention``           |
| ``flash_decode``        | ``reference.attention`` (via split-KV + ``combine_lse``) |
| ``combine_lse``         | ``reference.combine_lse``         |
| ``causal_dot_product``  | ``reference.causal_dot_product``  |
| ``linear_attention``    | ``reference.linear_attention``    |

Every function takes NumPy arrays, CuPy arrays, Numba device arrays or torch tensors and returns the same kind
(see ``_arrays``); device inputs are used in place and kernels run on the caller's current stream.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .runtime import arrays as _arrays
from .runtime import autotune as _autotune
from .decode import cached as _decode_plan
from .runtime.arrays import attention_shape, lift, prepare
from .runtime.device import SIMULATOR, compute_capability, multiprocessor_count
from .decode import simt as _decode
from .decode import mma as _decode_mma
from .forward import mma as _flash_mma
from .forward import simt as _flash_simt
from .forward import tf32 as _flash_tf32
from .forward import wgmma as _flash_wgmma
from .linear import chunked as _chunked
from .linear import recurrent as _linear

__all__ = [
    "flash_forward", "flash_decode", "combine_lse", "causal_dot_product", "linear_attention", "BACKENDS",
    "LINEAR_BACKENDS",
]


def _check_sm_scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(sm_scale, numbers.Real) or not math.isfinite(float(sm_scale)):
        raise ValueError(f"sm_scale: expected a finite real number or None, got {sm_scale!r}")
    return float(sm_scale)


_LSE_PLACEHOLDERS: dict = {}


def _lse_placeholder(call):
    """A one-element lse array for kernels launched without ``return_lse`` (they never write it), made once per
    device: allocating it on every call would cost more host time than some kernels take."""
    key = max(call.device_id, 0)
    if key not in _LSE_PLACEHOLDERS:
        _LSE_PLACEHOLDERS[key] = call.scratch((1, 1, 1), "float32") if SIMULATOR else _device_array_float32((1, 1, 1))
    return _LSE_PLACEHOLDERS[key]


def _device_array_float32(shape):
    from .runtime.device import cuda

    return cuda.device_array(shape, dtype="float32")


#: Kernels behind ``flash_forward``: "wgmma" (Hopper's warpgroup MMAs, sm_90: float16 / bfloat16, padded head dims
#: up to 128, rows that copy in aligned 16-byte pieces), "mma" (tensor cores on sm_80+: float16 / bfloat16 with
#: m16n8k16 -- any head dim up to 256, any strides --, float32 with tf32 m16n8k8 -- 3xTF32, float32 accuracy, or one
#: tf32 term with ``allow_tf32=True``) and "simt" (CUDA cores, float16 / float32, any GPU). ``backend=None`` picks
#: "wgmma" where it applies (H100, 2026-11-22, docs/benchmarks.md, B4 fp16 / bf16 at 2k-16k keys: 1.07-1.29x the
#: speed of torch SDPA's FlashAttention-2 backend, against 0.78-1.04x for "mma"), else "mma", else "simt". For float32 "mma" ran at 43-56
#: TFLOP/s, 1.0-1.6x torch SDPA's float32 path and 2.3-2.8x the SIMT kernel, with errors of 3e-7 .. 1.4e-6. Under
#: the simulator float32 takes "simt", which needs no MMA emulation (much faster there), and 16-bit inputs "mma"
#: (the warpgroup emulation is slower still); ``allow_tf32=True`` still picks "mma".
BACKENDS = ("simt", "mma", "wgmma")


def _wgmma_applies(dtype: str, head_dim: int, *arrays) -> bool:
    return (dtype in _flash_wgmma.DTYPES and not SIMULATOR
            and compute_capability() >= _flash_wgmma.MIN_COMPUTE_CAPABILITY
            and _flash_wgmma.supports(head_dim, *arrays))


def _flash_backend(backend, dtype: str, allow_tf32: bool = False, wgmma_ok: bool = False) -> str:
    """The kernel for ``flash_forward``; ``wgmma_ok``: the warpgroup kernel takes these inputs on this GPU."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    mma_ok = dtype in _flash_mma.DTYPES + _flash_tf32.DTYPES and (
        SIMULATOR or compute_capability() >= _flash_mma.MIN_COMPUTE_CAPABILITY
    )
    if backend == "mma" and not mma_ok:
        raise ValueError(
            f"backend: 'mma' needs a GPU of compute capability >= 8.0 "
            f"(got {dtype} on {'the simulator' if SIMULATOR else compute_capability()})"
        )
    if backend == "wgmma" and dtype not in _flash_wgmma.DTYPES:
        raise ValueError(f"backend: 'wgmma' takes float16 or bfloat16, got {dtype}")
    if backend == "wgmma" and not (SIMULATOR or compute_capability() >= _flash_wgmma.MIN_COMPUTE_CAPABILITY):
        raise ValueError(f"backend: 'wgmma' needs a GPU of compute capability 9.0 (Hopper), got {compute_capability()}")
    if backend == "simt" and dtype == _arrays.BFLOAT16:
        raise ValueError("backend: 'simt' does not take bfloat16; use 'mma' or None")
    if backend is None:
        # float32 under the simulator: the SIMT kernel (no MMA emulation), unless the caller asked for tf32
        wants_mma = dtype != "float32" or allow_tf32 or not SIMULATOR
        backend = "wgmma" if wgmma_ok else "mma" if mma_ok and wants_mma else "simt"
    if backend == "simt" and dtype == _arrays.BFLOAT16:
        raise TypeError("q: bfloat16 needs the tensor-core kernel, which needs a GPU of compute capability >= 8.0")
    return backend


def flash_forward(q, k, v, *, causal=False, sm_scale=None, return_lse=False, out=None, backend=None,
                  allow_tf32=False):
    """Exact attention ``softmax(sm_scale * q k^T) v`` without materialising the scores.

    Args:
        q: ``(batch, heads, seqlen_q, headdim)`` or ``(seqlen_q, headdim)``; float16, float32 or bfloat16 (torch
            bfloat16 tensors).
        k, v: ``(batch, kv_heads, seqlen_k, headdim)``; ``heads`` must be a multiple of ``kv_heads``
            (grouped-query attention: q head ``h`` reads kv head ``h // (heads // kv_heads)``).
        causal: mask aligned bottom-right, query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``.
        sm_scale: score scale, default ``1 / sqrt(headdim)``.
        return_lse: also return ``lse``, the natural-log log-sum-exp of each row's scaled scores,
            ``(batch, heads, seqlen_q)`` float32.
        out: optional output array of q's shape, dtype and kind.
        backend: ``"wgmma"`` (Hopper's warpgroup MMAs, compute capability 9.0: float16 / bfloat16, headdim up to
            128 with headdim % 8 == 0, a unit-stride last axis and 16-byte aligned rows), ``"mma"`` (tensor
            cores, GPUs of compute capability >= 8.0: float16 / bfloat16 products, any headdim up to 256 and any
            strides; float32 as 3xTF32 -- each operand split into two tf32 parts, three products, float32
            accuracy), ``"simt"`` (CUDA cores: float16 / float32, any GPU) or None: "wgmma" where it applies, else
            "mma" (for float32 under the simulator only with ``allow_tf32=True``), else "simt".
        allow_tf32: float32 inputs only: one plain tf32 product on the tensor cores instead of three (about 3x less
            tensor-core work, relative error about 1e-3 instead of 1e-6). Ignored for 16-bit inputs and by ``backend="simt"``, which computes in float32
            throughout.

    Returns:
        ``out`` (q's shape and dtype), or ``(out, lse)``. Rows that see no key give 0 and ``lse = -inf``.
    """
    return _attention(q, k, v, causal, sm_scale, return_lse, out, num_splits=None, decode=False, backend=backend,
                      allow_tf32=_check_flag(allow_tf32, "allow_tf32"))


def flash_decode(q, k, v, *, causal=False, sm_scale=None, num_splits=None, return_lse=False):
    """Attention for a few query rows against a long key/value sequence (the KV-cache case), split over keys.

    The keys are cut into ``num_splits`` contiguous ranges handled by separate thread blocks (flash-decoding), each
    producing a normalised partial output and its ``lse``; these merge with ``combine_lse`` weights, in a second
    kernel or, for pooled plans (below), in the split kernel's last block of each row tile.
    ``num_splits=None`` picks the ranges from the number of (batch, head) blocks and SMs so that the whole GPU
    streams the cache (on the tensor-core path, ``decode_mma.plan_splits``: one wave of ranges and, where a row tile
    has several, a pool of its last keys that its blocks take tile by tile, so that faster SMs take more; otherwise,
    for long caches, short tail ranges behind the wave that go to the SMs that finish first); an integer asks for that
    many equal ranges.

    Args and returns as ``flash_forward`` (float16, float32, or bfloat16 torch tensors); ``q`` is typically
    ``(batch, heads, 1..16, headdim)``.

    Repeated calls with torch or CuPy arrays of one kind (library, dtype, device, shapes -- the cache length may
    change --, query strides, alignment, options) skip the argument checks after the first (``_decode_plan``). A
    decoding step can also be captured in a torch CUDA graph after one call outside the capture.
    """
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 1
    ):
        raise ValueError(f"num_splits: expected an integer >= 1 or None, got {num_splits!r}")
    key = None
    if sm_scale is None or (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)):
        key, plan, layouts = _decode_plan.find(q, k, v, causal, sm_scale, num_splits, return_lse)
        if plan is not None:
            result = plan.run(q, k, v, layouts)
            if result is not None:
                return result
    return _attention(q, k, v, causal, sm_scale, return_lse, None, num_splits=num_splits, decode=True, backend=None,
                      plan_key=key)


_MAX_SEQLEN_Q = 65535 * 64


def _attention(q, k, v, causal, sm_scale, return_lse, out, num_splits, decode, backend, allow_tf32=False,
               plan_key=None):
    shape = attention_shape(q, k, v)
    sm_scale = _check_sm_scale(sm_scale, shape.head_dim)
    if not decode and shape.seqlen_q > _MAX_SEQLEN_Q:
        # query tiles go on the grid's y axis (at most 65535 blocks of at least 64 rows)
        raise ValueError(f"q: seqlen_q {shape.seqlen_q} is longer than one launch handles ({_MAX_SEQLEN_Q})")
    call = prepare({"q": q, "k": k, "v": v})
    out = call.output(shape.out_shape(), out=out)
    lse = call.output(shape.lse_shape(), "float32") if return_lse else None
    if not decode:
        wgmma_ok = _wgmma_applies(call.dtype, shape.head_dim, *(call.inputs[name] for name in "qkv"))
        backend = _flash_backend(backend, call.dtype, allow_tf32, wgmma_ok)
    elif call.dtype == _arrays.BFLOAT16 and not SIMULATOR and compute_capability() < (8, 0):
        raise TypeError("q: bfloat16 decoding needs a GPU of compute capability >= 8.0 (its output is rounded by "
                        "cvt.rn.bf16x2)")
    if shape.seqlen_q > 0 and shape.batch * shape.heads > 0:
        args = (
            lift(call.inputs["q"], 4),
            lift(call.inputs["k"], 4),
            lift(call.inputs["v"], 4),
            lift(out.view, 4),
            lift(lse.view, 3) if return_lse else _lse_placeholder(call),
            bool(return_lse),
            sm_scale,
            bool(causal),
        )
        grouped = _decode_on_tensor_cores(call.dtype, shape, args, causal) if decode else None
        if grouped is not None:
            q_rows, out_rows, lse_rows = grouped
            decode_launch = _decode_mma.DecodeLaunch(
                q_rows, out_rows, args[5], sm_scale, num_splits, multiprocessor_count(), dtype=call.dtype,
                vector_loads=_decode_mma.vector_loads_ok(q_rows, args[1], args[2]),
                device_id=call.device_id if call.device_id >= 0 else None)
            decode_launch(q_rows, args[1], args[2], out_rows, lse_rows, call.stream, call.scratch)
            if plan_key is not None and shape.seqlen_k > 0:  # later calls like this one skip the checks
                _decode_plan.register(plan_key, _decode_plan.DecodePlan(
                    call, shape.out_shape(), shape.lse_shape() if return_lse else None, q_rows, out_rows,
                    lse_rows, decode_launch))
        elif decode:
            if num_splits is None:
                num_splits = _decode.choose_num_splits(
                    shape.batch, shape.heads, shape.kv_heads, shape.seqlen_q, shape.seqlen_k, multiprocessor_count()
                )
            _decode.launch(*args, num_splits, call.stream, scratch=call.scratch, dtype=call.dtype)
        elif backend == "mma" and call.dtype == "float32":
            _flash_tf32.launch(*args, call.stream, tf32_only=allow_tf32)
        elif backend == "mma":
            config = _tuned_config(FLASH_MMA_TUNER, _flash_mma.launch, args, call, shape, causal)
            _flash_mma.launch(*args, call.stream, config=config, dtype=call.dtype)
        elif backend == "wgmma":
            config = _tuned_config(FLASH_WGMMA_TUNER, _flash_wgmma.launch, args, call, shape, causal)
            _flash_wgmma.launch(*args, call.stream, config=config, dtype=call.dtype)
        else:
            _flash_simt.launch(*args, call.stream)
    if return_lse:
        return call.result(out), call.result(lse)
    return call.result(out)


#: tile configurations of the float16 / bfloat16 tensor-core kernels, chosen per key by timing (``_autotune``)
FLASH_MMA_TUNER = _autotune.Autotuner("flash_mma", _flash_mma.TUNING_CANDIDATES, _flash_mma.DEFAULT_CONFIG)
FLASH_WGMMA_TUNER = _autotune.Autotuner("flash_wgmma", _flash_wgmma.TUNING_CANDIDATES, _flash_wgmma.DEFAULT_CONFIG)


def _tuned_config(tuner, launch, args, call, shape, causal: bool):
    """The autotuner's configuration for this call (None: tuning off, the kernel's default). A new key times every
    candidate on these inputs with ``launch``, writing into a scratch output."""
    if not _autotune.enabled():
        return None
    key = (
        "sm%d%d" % compute_capability(), multiprocessor_count(), call.dtype, _flash_mma.padded_head_dim(shape.head_dim),
        bool(causal), _autotune.size_class(shape.batch * shape.heads * shape.seqlen_q),
        _autotune.size_class(shape.seqlen_k),
    )

    def bench(config):
        scratch_out = lift(call.scratch(shape.out_shape(), call.dtype), 4)
        bench_args = args[:3] + (scratch_out, _lse_placeholder(call), False) + args[6:]
        return _autotune.time_on_stream(lambda: launch(*bench_args, call.stream, config=config, dtype=call.dtype),
                                        call.stream)

    return tuner.choose(key, bench)


#: ``flash_decode`` takes the tensor-core split kernel (``decode_mma.DecodeLaunch``) for GQA groups of at least this
#: many query heads per kv head (float16 / bfloat16, sm_80+, rows that regroup without a copy), else the SIMT split
#: kernel. 1: multi-head caches too -- its cp.async tiles stream faster (H100, B8 H32 D128 fp16, one query row, 16k /
#: 64k keys: 2837 / 2937 GB/s, 94 / 98 % of the copy bandwidth, against 2459 / 2563 for the SIMT kernel)
_DECODE_MMA_MIN_GROUP = 1


def _decode_on_tensor_cores(dtype: str, shape, args, causal: bool):
    """The regrouped ``(q, out, lse)`` views when ``flash_decode`` takes the tensor-core kernel, else None."""
    if dtype not in ("float16", "bfloat16") or shape.heads // shape.kv_heads < _DECODE_MMA_MIN_GROUP:
        return None
    if not (SIMULATOR or compute_capability() >= _decode_mma.MIN_COMPUTE_CAPABILITY):
        return None
    q, _, _, out, lse, write_lse = args[:6]
    return _decode_mma.grouped_views(q, out, lse, write_lse, shape.kv_heads, causal)


def combine_lse(o_parts, lse_parts):
    """Merge partial attention results computed over disjoint key sets (split-K, ring / context parallelism).

    Args:
        o_parts: ``(num_splits, batch, heads, seqlen_q, headdim)`` (or ``(num_splits, seqlen_q, headdim)``),
            each part normalised over its own keys; float16 or float32.
        lse_parts: ``(num_splits, batch, heads, seqlen_q)`` (or ``(num_splits, seqlen_q)``) float32, ``-inf`` for
            a part that saw no key.

    Returns:
        ``(out, lse)``: ``out = sum_s exp(lse_s - lse) o_s`` in o_parts' dtype and ``lse = log(sum_s exp(lse_s))``
        float32. If every part is empty: 0 and ``-inf``, never NaN.
    """
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
    out = call.output(tuple(o_parts.shape[1:]))
    lse = call.output(tuple(lse_parts.shape[1:]), "float32")
    if math.prod(o_parts.shape[1:]) > 0:
        unit_axes = 2 if o_ndim == 3 else 0  # (num_splits, seqlen, d) -> (num_splits, 1, 1, seqlen, d)
        _decode.launch_combine(
            _arrays.with_unit_axes(call.inputs["o_parts"], 1, unit_axes),
            _arrays.with_unit_axes(call.inputs["lse_parts"], 1, unit_axes),
            lift(out.view, 4),
            lift(lse.view, 3),
            call.stream,
        )
    return call.result(out), call.result(lse)


#: Kernels behind ``causal_dot_product`` and ``linear_attention``: "chunked" (tensor cores, sm_80+: float16,
#: bfloat16, float32) and "recurrent" (the sequential walk of "Transformers are RNNs": float16, float32, any GPU).
LINEAR_BACKENDS = ("chunked", "recurrent")
#: ``backend=None`` takes the chunked kernel from this many rows on (and always for bfloat16 or a state in / out),
#: per input dtype. Measured on an H100 (2026-11-22, B=4, H=8, E=M=64, scripts/sweep.py and scripts/tune_linear.py,
#: after the launcher and the wave-sized segments): float16 at 1k rows: sequential 0.41 vs chunked 0.28 ms; float32
#: at 1k: 0.22 vs 0.33 ms, at 2k: 0.45 vs 0.25 ms. Shorter float16 sequences were not measured and stay sequential.
CHUNKED_MIN_SEQLEN = {"float16": 1024, "bfloat16": 1, "float32": 2048}


def _linear_backend(backend, dtype: str, seqlen: int, stateful: bool) -> str:
    if backend is not None and backend not in LINEAR_BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(LINEAR_BACKENDS)} or None, got {backend!r}")
    chunked_ok = SIMULATOR or compute_capability() >= _chunked.MIN_COMPUTE_CAPABILITY
    if backend == "chunked" and not chunked_ok:
        raise ValueError(f"backend: 'chunked' needs a GPU of compute capability >= 8.0, got {compute_capability()}")
    if backend == "recurrent" and stateful:
        raise ValueError("backend: 'recurrent' takes no initial_state / return_state; use 'chunked' or None")
    if backend == "recurrent" and dtype == _arrays.BFLOAT16:
        raise ValueError("backend: 'recurrent' does not take bfloat16; use 'chunked' or None")
    if backend is None:
        wants_chunked = stateful or seqlen >= CHUNKED_MIN_SEQLEN[dtype]
        backend = "chunked" if chunked_ok and wants_chunked else "recurrent"
    if backend == "recurrent" and (stateful or dtype == _arrays.BFLOAT16):
        raise TypeError("bfloat16 inputs and initial_state / return_state need a GPU of compute capability >= 8.0")
    return backend


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


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
    """
    return_state = _check_flag(return_state, "return_state")
    allow_tf32 = _check_flag(allow_tf32, "allow_tf32")
    shape = _arrays.linear_shape(q, k, v)
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
    stateful = initial_state is not None or return_state
    backend = _linear_backend(backend, call.dtype, shape.seqlen, stateful)
    out = call.output(shape.out_shape())
    final = call.output(state_shape, "float32", name="final_state") if return_state else None
    views = [lift(call.inputs[name], 4) for name in ("q", "k", "v")] + [lift(out.view, 4)]
    if shape.batch * shape.heads > 0 and (shape.seqlen > 0 or return_state):
        if backend == "chunked":
            _chunked.launch_causal(
                *views, call.stream,
                initial_state=lift(call.inputs["initial_state"], 4) if initial_state is not None else None,
                final_state=lift(final.view, 4) if return_state else None,
                tf32=allow_tf32, dtype=call.dtype, scratch=call.scratch,
            )
        else:
            _linear.launch_causal_dot_product(*views, call.stream)
    if return_state:
        return call.result(out), call.result(final)
    return call.result(out)


def linear_attention(q, k, v, *, causal=True, eps=1e-6, allow_tf32=False, backend=None):
    """The linear-attention layer of "Transformers are RNNs" with the ``elu(x) + 1`` feature map ``phi``.

    ``out_i = phi(q_i)^T S_i / (phi(q_i) . z_i + eps)`` with ``S_i = sum_j phi(k_j) v_j^T`` and
    ``z_i = sum_j phi(k_j)``, the sums over ``j <= i`` when ``causal`` and over all ``j`` otherwise.

    Args:
        q, k: ``(batch, heads, seqlen, E)``; v: ``(batch, heads, seqlen, M)`` (or without batch, heads);
            float16, bfloat16 (torch tensors) or float32.
        eps: added to the normaliser's denominator.
        allow_tf32, backend: as :func:`causal_dot_product`.

    Returns:
        ``(batch, heads, seqlen, M)`` in the inputs' dtype.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(float(eps)) or eps < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    causal = _check_flag(causal, "causal")
    allow_tf32 = _check_flag(allow_tf32, "allow_tf32")
    shape = _arrays.linear_shape(q, k, v)
    call = prepare({"q": q, "k": k, "v": v})
    backend = _linear_backend(backend, call.dtype, shape.seqlen, False)
    out = call.output(shape.out_shape())
    if shape.seqlen > 0 and shape.batch * shape.heads > 0:
        views = [lift(call.inputs[name], 4) for name in ("q", "k", "v")] + [lift(out.view, 4)]
        if backend == "chunked" and causal:
            _chunked.launch_causal(*views, call.stream, normalise=True, eps=float(eps), tf32=allow_tf32,
                                   dtype=call.dtype, scratch=call.scratch)
        elif backend == "chunked":
            _chunked.launch_noncausal(*views, float(eps), call.stream, tf32=allow_tf32, dtype=call.dtype,
                                      scratch=call.scratch)
        else:
            _linear.launch_linear_attention(*views, causal, float(eps), call.stream, scratch=call.scratch)
    return call.result(out)
