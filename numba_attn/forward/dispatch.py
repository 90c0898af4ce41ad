"""Which forward kernel runs a ``flash_forward`` call, with which tile configuration, and its launch.

Backends: "wgmma" (Hopper's warpgroup MMAs, sm_90: float16 / bfloat16, padded head dims up to 128, rows that copy
in aligned 16-byte pieces), "wgmma_ws" (the same, warp-specialised with TMA copies, FlashAttention-3's structure;
dense batches and packed sequences, ``forward.varlen.choose``), "mma" (tensor cores on sm_80+: float16 / bfloat16 on m16n8k16 -- any head dim up to
256, any strides --, float32 on tf32 m16n8k8 as 3xTF32, or one tf32 term with ``allow_tf32``) and "simt" (CUDA
cores, float16 / float32, any GPU). ``None`` picks "wgmma" where it applies, else "mma", else "simt"; under the
simulator float32 takes "simt" (no MMA emulation, much faster there) unless ``allow_tf32`` asks for tf32; on
Hopper "wgmma_ws" replaces "wgmma" at the padded head dims of ``WS_DEFAULT_HEAD_DIMS``. Every
backend takes a sliding window (a compile-time variant of its kernel). docs/benchmarks.md has the measurements
behind the order.
"""
from __future__ import annotations

import os

from ..runtime import autotune as _autotune
from ..runtime import launch as _launch
from ..runtime.arrays import BFLOAT16
from ..runtime.attention_args import AttentionArgs
from ..runtime.device import SIMULATOR, compute_capability, max_grid, multiprocessor_count
from ..runtime.views import lift
from . import mma as _flash_mma
from .common import runs_here
from . import simt as _flash_simt
from . import tf32 as _flash_tf32
from . import wgmma as _flash_wgmma
from . import wgmma_ws as _flash_ws

BACKENDS = ("simt", "mma", "wgmma", "wgmma_ws")

#: the shipped tables of tuned configurations, one file per GPU family (``sm90.json``; ``scripts/tune_defaults.py``)
TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
#: tile configurations of the float16 / bfloat16 tensor-core kernels per key: tuned by the user, else the shipped
#: table, else the default (``runtime.autotune``)
FLASH_MMA_TUNER = _autotune.Autotuner("flash_mma", _flash_mma.TUNING_CANDIDATES, _flash_mma.DEFAULT_CONFIG, TABLE_DIR)
FLASH_WGMMA_TUNER = _autotune.Autotuner("flash_wgmma", _flash_wgmma.TUNING_CANDIDATES, _flash_wgmma.DEFAULT_CONFIG,
                                        TABLE_DIR)
FLASH_WS_TUNER = _autotune.Autotuner("flash_wgmma_ws", _flash_ws.TUNING_CANDIDATES, _flash_ws.DEFAULT_CONFIG, TABLE_DIR)
TUNERS = (FLASH_MMA_TUNER, FLASH_WGMMA_TUNER, FLASH_WS_TUNER)

#: padded head dims (multiples of 16) at which ``flash_forward``'s default on Hopper is the warp-specialised kernel
#: instead of "wgmma" -- the one place to change it. H100, 2026-11-26, fp16, B4: at D128 H32 it ran 1.01-1.35x
#: "wgmma" at 1k-16k keys, causal or not; at D64 H48 only from 1k keys (``WS_MIN_SEQLEN_K_AT``)
WS_DEFAULT_HEAD_DIMS = frozenset({64, 128})
#: ... and only for calls whose rows see at least this many keys on average (``long_rows``). At D128 B4 H32 (sweep,
#: H100, 2026-11-26, fp16 / bf16, one call at a time, WS calls replayed) the WS kernel ran non-causal 512 at
#: 1.09-1.24x "wgmma" and causal 1k (512 on average) at 1.14-1.23x, but causal 512 (256) at 0.90-0.91x
WS_MIN_KEYS = 512
#: padded head dims whose threshold counts the keys, not the keys per row on average: the WS kernel is the default
#: there from this ``seqlen_k`` on, causal or not. D64 B4 H48, its persistent tuned forms (H100, 2026-11-27 13:12,
#: bf16, sweep and alternating rounds, forced backends): WS against "wgmma" causal 1k (512 keys on average) 1.20-1.22x,
#: non-causal 1k 1.22x, but non-causal 512 0.68x and causal 512 0.71x. (Before the persistent forms: causal 1k
#: 0.87-0.92x, so 1k keys on average were asked.)
WS_MIN_SEQLEN_K_AT = {64: 1024}


def ws_long_enough(seqlen_k: int, causal: bool, head_dim_pad: int) -> bool:
    """Whether a dense call at this padded head dim has keys enough for the WS kernel to be its default."""
    min_seqlen_k = WS_MIN_SEQLEN_K_AT.get(head_dim_pad)
    if min_seqlen_k is not None:
        return seqlen_k >= min_seqlen_k
    return long_rows(seqlen_k, causal, WS_MIN_KEYS)


def long_rows(seqlen_k: int, causal: bool, min_keys: int = WS_MIN_KEYS) -> bool:
    """Whether a dense call's rows see ``min_keys`` keys on average (bottom-right causal rows: half the keys); fp8
    calls pass their own threshold (``fp8_call.WS_MIN_KEYS``)."""
    return (seqlen_k // 2 if causal else seqlen_k) >= min_keys


def wgmma_applies(dtype: str, head_dim: int, *arrays) -> bool:
    """The warpgroup kernel takes these inputs on this GPU (under the simulator it runs only when asked for)."""
    return not SIMULATOR and _flash_wgmma.supports(dtype, head_dim, *arrays)


def ws_applies(dtype: str, head_dim: int, *arrays) -> bool:
    """The warp-specialised kernel is the default for these inputs on this GPU (``WS_DEFAULT_HEAD_DIMS``; never
    under the simulator)."""
    return (not SIMULATOR and _flash_ws.padded_head_dim(head_dim) in WS_DEFAULT_HEAD_DIMS
            and _flash_ws.supports(dtype, head_dim, *arrays))


def choose_backend(backend, dtype: str, allow_tf32: bool = False, wgmma_ok: bool = False, ws_ok: bool = False) -> str:
    """The kernel for ``flash_forward``; ``wgmma_ok``: the warpgroup kernel takes these inputs on this GPU;
    ``ws_ok``: the warp-specialised one is the default for them (``ws_applies``)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    mma_ok = dtype in _flash_mma.DTYPES + _flash_tf32.DTYPES and runs_here(_flash_mma.MIN_COMPUTE_CAPABILITY)
    if backend == "mma" and not mma_ok:
        raise ValueError(
            f"backend: 'mma' needs a GPU of compute capability >= 8.0 "
            f"(got {dtype} on {'the simulator' if SIMULATOR else compute_capability()})"
        )
    if backend in ("wgmma", "wgmma_ws") and dtype not in _flash_wgmma.DTYPES:
        raise ValueError(f"backend: {backend!r} takes float16 or bfloat16, got {dtype}")
    if backend in ("wgmma", "wgmma_ws") and not runs_here(_flash_wgmma.MIN_COMPUTE_CAPABILITY):
        raise ValueError(f"backend: {backend!r} needs a GPU of compute capability 9.0 (Hopper), got "
                         f"{compute_capability()}")
    if backend == "simt" and dtype == BFLOAT16:
        raise ValueError("backend: 'simt' does not take bfloat16; use 'mma' or None")
    if backend is None:
        wants_mma = dtype != "float32" or allow_tf32 or not SIMULATOR
        backend = ("wgmma_ws" if ws_ok and wgmma_ok else "wgmma" if wgmma_ok
                   else "mma" if mma_ok and wants_mma else "simt")
    if backend == "simt" and dtype == BFLOAT16:
        raise TypeError("q: bfloat16 needs the tensor-core kernel, which needs a GPU of compute capability >= 8.0")
    return backend


def check_seqlen_q(seqlen_q: int) -> None:
    """Query tiles go on the grid's y axis: at most ``max_grid(1)`` blocks of at least 64 rows."""
    limit = max_grid(1) * 64
    if seqlen_q > limit:
        raise ValueError(f"q: seqlen_q {seqlen_q} is longer than one launch handles ({limit})")


def backend_for(call, shape, backend, allow_tf32: bool, causal: bool = False) -> str:
    """The backend that runs this call (``backend`` as the caller passed it; raises where it cannot)."""
    arrays = tuple(call.inputs[name] for name in "qkv")
    wgmma_ok = wgmma_applies(call.dtype, shape.head_dim, *arrays)
    ws_ok = (backend is None and wgmma_ok
             and ws_long_enough(shape.seqlen_k, causal, _flash_ws.padded_head_dim(shape.head_dim))
             and ws_applies(call.dtype, shape.head_dim, *arrays))
    return choose_backend(backend, call.dtype, allow_tf32, wgmma_ok, ws_ok)


def run(call, shape, args: AttentionArgs, backend: str, allow_tf32: bool, lse_placeholder) -> None:
    """Launch ``backend``'s kernel (from ``backend_for``) for ``args`` on the call's stream."""
    variant = args.variant_options()
    if backend == "mma" and call.dtype == "float32":
        _flash_tf32.launch(*args.launch_args(), call.stream, tf32_only=allow_tf32, **variant)
    elif backend == "mma":
        config = _tuned_config(FLASH_MMA_TUNER, _flash_mma.launch, args, call, shape, lse_placeholder)
        _flash_mma.launch(*args.launch_args(), call.stream, config=config, dtype=call.dtype, **variant)
    elif backend == "wgmma":
        config = _tuned_config(FLASH_WGMMA_TUNER, _flash_wgmma.launch, args, call, shape, lse_placeholder)
        _flash_wgmma.launch(*args.launch_args(), call.stream, config=config, dtype=call.dtype, **variant)
    elif backend == "wgmma_ws":
        d_pad = _flash_ws.padded_head_dim(shape.head_dim)
        config = _tuned_config(FLASH_WS_TUNER, _flash_ws.launch, args, call, shape, lse_placeholder,
                               lambda c: _flash_ws.usable(c, d_pad),
                               lambda c: _flash_ws.for_window(c, d_pad, args.window))
        _flash_ws.launch(*args.launch_args(), call.stream, config=config, dtype=call.dtype, **variant)
    else:
        _flash_simt.launch(*args.launch_args(), call.stream, **variant)


def tuning_key(dtype: str, head_dim: int, causal: bool, batch: int, heads: int, seqlen_q: int,
               seqlen_k: int, variant: tuple = ()) -> _autotune.Key:
    """The tuners' key of a call on the current device: family and SM count; dtype, padded head dim, causal; size
    classes of ``batch * heads * seqlen_q`` and of ``seqlen_k``. ``variant``: the names of the call's compile-time
    variant (``"softcap"``, ``"window"``), one more exact field where there are any, so that tuning a windowed or
    capped call never sets the choice of the plain calls of its shape."""
    return _autotune.Key(
        "sm%d%d" % compute_capability(), multiprocessor_count(),
        (dtype, _flash_mma.padded_head_dim(head_dim), bool(causal)) + (("+".join(variant),) if variant else ()),
        (_autotune.size_class(batch * heads * seqlen_q), _autotune.size_class(seqlen_k)),
    )


def _tuned_config(tuner, launch, args: AttentionArgs, call, shape, lse_placeholder, usable=None, for_variant=None):
    """The tuner's configuration for this call (None under the simulator: the kernel's simulator configuration).
    In tuning mode a key new to the user's choices times every candidate on these inputs with ``launch``, writing
    into a scratch output, unless the call's stream is being captured into a CUDA graph. A windowed or capped call
    has keys of its own (``tuning_key``'s ``variant``); where the user has not tuned them, the plain calls' choice
    (the user's, else the shipped table's) answers, passed through ``for_variant`` where given."""
    if SIMULATOR:
        return None
    sizes = (shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k)
    variant = tuple(sorted(args.variant_options()))
    key = tuning_key(call.dtype, shape.head_dim, args.causal, *sizes, variant)
    plain_key = tuning_key(call.dtype, shape.head_dim, args.causal, *sizes) if variant else None

    def bench(config):
        if usable is not None and not usable(config):  # (tiles that do not fit this head dim: never chosen)
            return float("inf")
        scratch = args.writing(lift(call.scratch(shape.out_shape(), call.dtype), 4), lse_placeholder, False)
        return _autotune.time_on_stream(
            lambda: launch(*scratch.launch_args(), call.stream, config=config, dtype=call.dtype,
                           **scratch.variant_options()), call.stream)

    def capturing():
        return _launch.stream_capturing(_launch.stream_handle(call.stream))

    return tuner.choose(key, bench, capturing, plain_key, for_variant)
