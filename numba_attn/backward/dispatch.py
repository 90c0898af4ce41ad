"""Which backward kernels run a ``flash_backward`` call, and their launches in order.

Backends: "mma" (tensor cores on sm_80+, float16 / bfloat16, ``backward.mma``) and "simt" (CUDA cores, float16 /
float32, any GPU). ``None`` picks "mma" where it applies, else "simt"; float32 always runs on "simt" (a 3xTF32
backward is not there), and under the simulator float16 takes "simt" too (much faster there) unless "mma" is asked
for. bfloat16 needs "mma".

A call is three or four launches on the caller's stream: ``preprocess`` (``D = rowsum(dout * out)`` -- for "mma" with
the lse as ``(lse log2(e), D)`` pairs --, and the float32 ``dq`` accumulator zeroed), the key-block kernel (``dk``,
``dv``; ``dq`` by float32 atomics; "mma" above head dim 128: two launches), then either the cast of the accumulator
into ``dq`` (16-bit ``dq``; float32 ``dq`` is accumulated in place) or, with ``deterministic``, the query-block
kernel that computes ``dq`` without atomics.

Both backends take the forward's compile-time variants: a sliding window, soft-capping and packed sequences
(``flash_backward_varlen``: ``backward.varlen`` makes the schedules, the key blocks' and the forward's).
"""
from __future__ import annotations

from ..runtime.arrays import BFLOAT16
from ..runtime.attention_args import BackwardArgs
from ..runtime.device import SIMULATOR, compute_capability
from ..runtime.views import restride
from . import convert as _convert
from . import mma as _mma
from . import preprocess as _preprocess
from . import simt as _simt

BACKENDS = ("simt", "mma")


def choose_backend(backend, dtype: str, head_dim: int) -> str:
    """The backend for a call of this dtype and head dim (``backend``: None or one of ``BACKENDS``, checked);
    raises where the asked-for backend (or, for None, every backend) cannot take it."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    mma_ok = _mma.supports(dtype, head_dim)
    if backend == "mma" and not mma_ok:
        if dtype not in _mma.DTYPES:
            raise ValueError(f"backend: 'mma' takes float16 or bfloat16, got {dtype} (float32: backend='simt')")
        where = "the simulator" if SIMULATOR else f"compute capability {compute_capability()}"
        raise ValueError(f"backend: 'mma' does not take headdim {head_dim} on {where} (it needs compute capability "
                         ">= 8.0 and the shared memory of its tiles)")
    if backend == "simt" and dtype == BFLOAT16:
        raise ValueError("backend: 'simt' does not take bfloat16; use 'mma' or None")
    if backend is None:
        backend = "mma" if mma_ok and (dtype == BFLOAT16 or not SIMULATOR) else "simt"
    if backend == "simt" and dtype == BFLOAT16:
        raise TypeError("q: bfloat16 needs the tensor-core backward, which needs a GPU of compute capability >= 8.0")
    if backend == "simt" and not _simt.supports(dtype, head_dim):
        raise TypeError(f"q: dtype {dtype} with headdim {head_dim} is not supported by the backward kernels")
    return backend


def _schedule(packed, which: str, block: int) -> dict:
    """The ``schedule=`` launch keyword of packed sequences: ``packed.keys(block_n)`` or ``packed.rows(block_m)``."""
    return {} if packed is None else {"schedule": getattr(packed, which)(block)}


def run(call, args: BackwardArgs, backend: str, deterministic: bool, packed=None) -> None:
    """Launch ``backend``'s kernels for ``args`` (4-D views; ``dq``, ``dk``, ``dv`` written whole). ``packed``: None,
    or the schedules of packed sequences (``backward.varlen.Schedules``; the views are then ``(1, heads, total,
    headdim)``)."""
    if backend == "mma":
        _run_mma(call, args, deterministic, packed)
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


def _run_mma(call, args: BackwardArgs, deterministic: bool, packed) -> None:
    batch, heads, seqlen_q, head_dim = args.q.shape
    config, options = _mma.default_config(head_dim, packed is not None), args.variant_options()
    bf16 = call.dtype == BFLOAT16
    stats = call.scratch((batch, heads, _mma.stats_rows(seqlen_q, config) // 2, 4), "float32")
    dq_acc = None
    if not deterministic:
        # as wide as the padded head dim: whole column pairs for the vector reductions
        dq_acc = call.scratch((batch, heads, seqlen_q, _mma.padded_head_dim(head_dim)), "float32")
    if seqlen_q > 0:
        _preprocess.launch(args.out, args.dout, stats, dq_acc, call.stream, bf16=bf16, lse=args.lse)
    if args.k.shape[2] > 0:
        _mma.launch_dkdv(args.q, args.k, args.v, args.dout, stats, dq_acc, args.dk, args.dv, args.sm_scale,
                         args.causal, call.stream, config=config, dtype=call.dtype, **options,
                         **_schedule(packed, "keys", config.block_n))
    if seqlen_q == 0:
        return
    if deterministic:
        _mma.launch_dq(args.q, args.k, args.v, args.dout, stats, args.dq, args.sm_scale, args.causal, call.stream,
                       config=config, dtype=call.dtype, **options, **_schedule(packed, "rows", config.dq_block_m))
    else:
        _convert.launch(restride(dq_acc, tuple(args.dq.shape), dq_acc.strides), args.dq, call.stream, bf16=bf16)
