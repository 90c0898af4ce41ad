"""Which backward kernels run a ``flash_backward`` call, and their launches in order.

Backends: "wgmma" (Hopper warpgroup MMAs, sm_90, float16 / bfloat16, head dims up to 128, ``backward.wgmma``;
"wgmma_ws" its warp-specialised TMA version, opt-in), "mma" (tensor cores on sm_80+, float16 / bfloat16,
``backward.mma``), "tf32" (tensor cores on sm_80+, float32 as 3xTF32, or one tf32 term with ``allow_tf32``,
``backward.tf32``) and "simt" (CUDA cores, float16 / float32, any GPU). ``None`` picks "wgmma" where it applies
(``WGMMA_BY_DEFAULT``, on; "wgmma_ws" up to padded head dim ``WS_MAX_HEAD_DIM``), else "mma" for 16-bit inputs and "tf32" for float32 where they apply, else "simt"; under
the simulator float16 and float32 take "simt" (much faster there) unless a tensor-core backend is asked for
(float32: or ``allow_tf32``). bfloat16 needs "mma" or "wgmma". "simt" ignores ``allow_tf32``. "wgmma" gives inputs
whose rows do not copy in aligned 16-byte pieces, and the deterministic ``dq`` (the query-block kernel), to "mma".

A call is three or four launches on the caller's stream: ``preprocess`` (``D = rowsum(dout * out)`` -- for "mma" and
"tf32" with the lse as ``(lse log2(e), D)`` pairs --, and the float32 ``dq`` accumulator zeroed), the key-block kernel
(``dk``, ``dv``; ``dq`` by float32 atomics; "mma" and "tf32" above head dim 128: two launches), then either the cast
of the accumulator into ``dq`` ("simt": only for 16-bit ``dq``, float32 ``dq`` is accumulated in place; "mma",
"tf32": a copy from the padded accumulator) or, with ``deterministic``, the query-block kernel that computes ``dq``
without atomics.

"mma" and "simt" take the forward's compile-time variants: a sliding window, soft-capping and packed sequences
(``flash_backward_varlen``: ``backward.varlen`` makes the schedules, the key blocks' and the forward's). "tf32" and
"wgmma" take none of them yet: such calls run on "simt" (float32) or "mma" (``variant_backend``).
"""
from __future__ import annotations

from ..core import dq_tile
from ..runtime.arrays import BFLOAT16
from ..runtime.attention_args import BackwardArgs
from ..runtime.device import SIMULATOR, compute_capability
from ..runtime.views import restride
from . import convert as _convert
from . import mma as _mma
from . import preprocess as _preprocess
from . import simt as _simt
from . import tf32 as _tf32
from . import wgmma as _wgmma
from . import wgmma_ws as _wgmma_ws

BACKENDS = ("simt", "mma", "tf32", "wgmma", "wgmma_ws")
#: whether ``backend=None`` takes "wgmma" where it applies (sm_90, float16 / bfloat16, head dim <= 128, rows in
#: aligned 16-byte pieces): measured 1.0-1.2x "mma" on an H100 (docs/design/backward.md), so on
WGMMA_BY_DEFAULT = True
#: up to this padded head dim ``backend=None`` takes "wgmma_ws" instead of "wgmma" (its TMA copies and dQ writer warp;
#: with the key blocks of a head side by side in the grid, 1.23-1.39x "wgmma" at head dim 128 and a tie at 64 on an
#: H100, docs/design/backward.md)
WS_MAX_HEAD_DIM = 128


def choose_backend(backend, dtype: str, head_dim: int, allow_tf32: bool = False) -> str:
    """The backend for a call of this dtype and head dim (``backend``: None or one of ``BACKENDS``, checked);
    raises where the asked-for backend (or, for None, every backend) cannot take it."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    mma_ok = _mma.supports(dtype, head_dim)
    tf32_ok = _tf32.supports(dtype, head_dim)
    where = "the simulator" if SIMULATOR else f"compute capability {compute_capability()}"
    if backend in ("wgmma", "wgmma_ws"):
        if not _wgmma.supports(dtype, head_dim):
            raise ValueError(f"backend: '{backend}' takes float16 or bfloat16 with headdim <= {_wgmma.MAX_HEAD_DIM} "
                             f"on compute capability 9.0; got {dtype}, headdim {head_dim} on {where}")
        return backend
    if backend is None and WGMMA_BY_DEFAULT and _wgmma.supports(dtype, head_dim) and not SIMULATOR:
        return "wgmma_ws" if _wgmma.padded_head_dim(head_dim) <= WS_MAX_HEAD_DIM else "wgmma"
    if backend == "mma" and not mma_ok:
        if dtype not in _mma.DTYPES:
            raise ValueError(f"backend: 'mma' takes float16 or bfloat16, got {dtype} (float32: backend='tf32' or "
                             "'simt')")
        raise ValueError(f"backend: 'mma' does not take headdim {head_dim} on {where} (it needs compute capability "
                         ">= 8.0 and the shared memory of its tiles)")
    if backend == "tf32" and not tf32_ok:
        if dtype not in _tf32.DTYPES:
            raise ValueError(f"backend: 'tf32' takes float32, got {dtype} (16-bit: backend='mma')")
        raise ValueError(f"backend: 'tf32' does not take headdim {head_dim} on {where} (it needs compute capability "
                         ">= 8.0 and the shared memory of its tiles)")
    if backend == "simt" and dtype == BFLOAT16:
        raise ValueError("backend: 'simt' does not take bfloat16; use 'mma' or None")
    if backend is None:
        if dtype == "float32":
            backend = "tf32" if tf32_ok and (allow_tf32 or not SIMULATOR) else "simt"
        else:
            backend = "mma" if mma_ok and (dtype == BFLOAT16 or not SIMULATOR) else "simt"
    if backend == "simt" and dtype == BFLOAT16:
        raise TypeError("q: bfloat16 needs the tensor-core backward, which needs a GPU of compute capability >= 8.0")
    if backend == "simt" and not _simt.supports(dtype, head_dim):
        raise TypeError(f"q: dtype {dtype} with headdim {head_dim} is not supported by the backward kernels")
    return backend


def variant_backend(backend: str, asked, has_variant: bool) -> str:
    """``backend`` (chosen for the dtype) for a call with a window, soft-capping or packed sequences
    (``has_variant``): "tf32" and the warpgroup backends have no such variants yet, so such calls run on "simt"
    (float32) or "mma"; asking for one of them explicitly then is a ValueError."""
    if backend not in ("tf32", "wgmma", "wgmma_ws") or not has_variant:
        return backend
    if asked == backend:
        raise ValueError(f"backend: '{backend}' takes no window, softcap or packed sequences yet; use None")
    return "simt" if backend == "tf32" else "mma"


def _schedule(packed, which: str, block: int) -> dict:
    """The ``schedule=`` launch keyword of packed sequences: ``packed.keys(block_n)`` or ``packed.rows(block_m)``."""
    return {} if packed is None else {"schedule": getattr(packed, which)(block)}


def run(call, args: BackwardArgs, backend: str, deterministic: bool, allow_tf32: bool = False, packed=None) -> None:
    """Launch ``backend``'s kernels for ``args`` (4-D views; ``dq``, ``dk``, ``dv`` written whole); ``allow_tf32``:
    "tf32" takes one tf32 product per multiply. ``packed``: None, or the schedules of packed sequences
    (``backward.varlen.Schedules``; the views are then ``(1, heads, total, headdim)``; not with "tf32")."""
    if backend in ("wgmma", "wgmma_ws") and not _wgmma.supports(call.dtype, args.q.shape[3], args.q, args.k, args.v,
                                                                args.dout):
        backend = "mma"  # rows that do not copy in aligned 16-byte pieces: the element-wise loaders of "mma"
    if backend == "wgmma_ws" and not _wgmma_ws.supports(call.dtype, args.q.shape[3], args.q, args.k, args.v,
                                                        args.dout):
        backend = "wgmma"  # arrays no tensor map can describe: the cp.async copies of "wgmma"
    if backend in ("wgmma", "wgmma_ws"):
        _run_wgmma(call, args, deterministic, backend)
        return
    if backend in ("mma", "tf32"):
        _run_mma(call, args, deterministic, packed, backend == "tf32", allow_tf32)
        return
    if backend != "simt":
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    batch, heads, seqlen_q, head_dim = args.q.shape
    config, options = _simt.default_config(head_dim), args.variant_options()
    delta = call.scratch((batch, heads, seqlen_q), "float32")
    dq_acc = None
    if not deterministic:
        # float32 dq is its own accumulator; float16 needs a float32 one and a cast at the end
        dq_acc = args.dq if call.dtype == "float32" else call.scratch(tuple(args.q.shape), "float32")
    if seqlen_q > 0:
        _preprocess.launch(args.out, args.dout, delta, dq_acc, call.stream)
    if args.k.shape[2] > 0:
        _simt.launch_dkdv(args.q, args.k, args.v, args.dout, args.lse, delta, dq_acc, args.dk, args.dv,
                          args.sm_scale, args.causal, call.stream, config, **options,
                          **_schedule(packed, "keys", config.block_n))
    if seqlen_q == 0:
        return
    if deterministic:
        _simt.launch_dq(args.q, args.k, args.v, args.dout, args.lse, delta, args.dq, args.sm_scale, args.causal,
                        call.stream, config, **options, **_schedule(packed, "rows", config.dq_block_m))
    elif dq_acc is not args.dq:
        _convert.launch(dq_acc, args.dq, call.stream)


def _run_mma(call, args: BackwardArgs, deterministic: bool, packed, tf32: bool = False,
             allow_tf32: bool = False) -> None:
    """"mma" or (``tf32``) "tf32": the same launches, ``backward.mma`` or ``backward.tf32``'s kernels."""
    batch, heads, seqlen_q, head_dim = args.q.shape
    if tf32:
        if packed is not None or args.variant_options():
            raise ValueError("backend: 'tf32' takes no window, softcap or packed sequences yet")
        kernels, config, options = _tf32, _tf32.default_config(head_dim), dict(tf32_only=bool(allow_tf32))
    else:
        kernels, config = _mma, _mma.default_config(head_dim, packed is not None)
        options = dict(args.variant_options(), dtype=call.dtype)
    bf16 = call.dtype == BFLOAT16
    stats = call.scratch((batch, heads, kernels.stats_rows(seqlen_q, config) // 2, 4), "float32")
    dq_acc = None
    if not deterministic:
        # as wide as the padded head dim: whole column pairs for the vector reductions
        dq_acc = call.scratch((batch, heads, seqlen_q, kernels.padded_head_dim(head_dim)), "float32")
    if seqlen_q > 0:
        _preprocess.launch(args.out, args.dout, stats, dq_acc, call.stream, bf16=bf16, lse=args.lse)
    if args.k.shape[2] > 0:
        kernels.launch_dkdv(args.q, args.k, args.v, args.dout, stats, dq_acc, args.dk, args.dv, args.sm_scale,
                            args.causal, call.stream, config=config, **options,
                            **_schedule(packed, "keys", config.block_n))
    if seqlen_q == 0:
        return
    if deterministic:
        kernels.launch_dq(args.q, args.k, args.v, args.dout, stats, args.dq, args.sm_scale, args.causal,
                          call.stream, config=config, **options, **_schedule(packed, "rows", config.dq_block_m))
    else:
        _convert.launch(restride(dq_acc, tuple(args.dq.shape), dq_acc.strides), args.dq, call.stream, bf16=bf16)


def _run_wgmma(call, args: BackwardArgs, deterministic: bool, backend: str) -> None:
    """"wgmma" / "wgmma_ws": the warpgroup key-block kernels (``dq`` by atomics), or "mma"'s query-block kernel for
    ``dq`` when ``deterministic``."""
    batch, heads, seqlen_q, head_dim = args.q.shape
    config = _mma.default_config(head_dim)
    bf16 = call.dtype == BFLOAT16
    wg_config = _wgmma.default_config(head_dim)
    ws_config = _wgmma_ws.default_config(head_dim)
    rows = _wgmma.stats_rows(seqlen_q, config.block_m, config.dq_block_m, _wgmma.stats_multiple(wg_config),
                             ws_config.block_m)
    stats = call.scratch((batch, heads, rows // 2, 4), "float32")
    # whole-tile bulk reductions of dQ (core.dq_tile): rows padded to whole tiles, columns permuted
    tiled = not deterministic and (ws_config if backend == "wgmma_ws" else wg_config).dq_tiled
    d_pad = _wgmma.padded_head_dim(head_dim)
    dq_acc = None
    if not deterministic:
        # as wide as the padded head dim: whole column pairs for the vector reductions
        acc_rows = dq_tile.padded_rows(seqlen_q, ws_config.block_m if backend == "wgmma_ws" else wg_config.block_m)
        dq_acc = call.scratch((batch, heads, acc_rows if tiled else seqlen_q, d_pad), "float32")
    if seqlen_q > 0:
        _preprocess.launch(args.out, args.dout, stats, dq_acc, call.stream, bf16=bf16, lse=args.lse)
    if args.k.shape[2] > 0 and backend == "wgmma_ws":
        _wgmma_ws.launch_dkdv(args.q, args.k, args.v, args.dout, stats, dq_acc, args.dk, args.dv, args.sm_scale,
                              args.causal, call.stream, config=ws_config, dtype=call.dtype)
    elif args.k.shape[2] > 0:
        _wgmma.launch_dkdv(args.q, args.k, args.v, args.dout, stats, dq_acc, args.dk, args.dv, args.sm_scale,
                           args.causal, call.stream, config=wg_config, dtype=call.dtype)
    if seqlen_q == 0:
        return
    if deterministic:
        _mma.launch_dq(args.q, args.k, args.v, args.dout, stats, args.dq, args.sm_scale, args.causal, call.stream,
                       config=config, dtype=call.dtype)
    else:
        width = d_pad if tiled else head_dim  # (the tiled layout is read whole-row: its columns are permuted)
        _convert.launch(restride(dq_acc, (batch, heads, seqlen_q, width), dq_acc.strides), args.dq, call.stream,
                        bf16=bf16, tiled=tiled)
