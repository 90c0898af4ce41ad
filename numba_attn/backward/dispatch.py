"""Which backward kernels run a ``flash_backward`` call, and their launches in order.

Backends: "simt" (CUDA cores, float16 / float32, any GPU) -- the only one so far. The slot for "mma" (tensor cores,
float16 / bfloat16, issue #28) is ``choose_backend``: it would be picked where it applies, as the forward's is.

A call is three or four launches on the caller's stream: ``preprocess`` (``D = rowsum(dout * out)``, and the float32
``dq`` accumulator zeroed), the key-block kernel (``dk``, ``dv``; ``dq`` by float32 atomics), then either the cast
of the accumulator into ``dq`` (float16; float32 ``dq`` is accumulated in place) or, with ``deterministic``, the
query-block kernel that computes ``dq`` without atomics.
"""
from __future__ import annotations

from ..runtime.arrays import BFLOAT16
from ..runtime.attention_args import BackwardArgs
from . import convert as _convert
from . import preprocess as _preprocess
from . import simt as _simt

BACKENDS = ("simt",)


def choose_backend(dtype: str, head_dim: int) -> str:
    """The backend for a call of this dtype and head dim; a TypeError for bfloat16 (no tensor-core backward yet)."""
    if dtype == BFLOAT16:
        raise TypeError("q: bfloat16 is not supported by flash_backward yet: it needs the tensor-core backward, "
                        "which is not there yet (the SIMT backward takes float16 and float32)")
    # (the tensor-core backward, "mma", goes here: float16 / bfloat16 where it runs)
    if not _simt.supports(dtype, head_dim):
        raise TypeError(f"q: dtype {dtype} with headdim {head_dim} is not supported by the backward kernels")
    return "simt"


def run(call, args: BackwardArgs, backend: str, deterministic: bool) -> None:
    """Launch ``backend``'s kernels for ``args`` (4-D views; ``dq``, ``dk``, ``dv`` written whole)."""
    if backend != "simt":
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    batch, heads, seqlen_q, _ = args.q.shape
    delta = call.scratch((batch, heads, seqlen_q), "float32")
    dq_acc = None
    if not deterministic:
        # float32 dq is its own accumulator; float16 needs a float32 one and a cast at the end
        dq_acc = args.dq if call.dtype == "float32" else call.scratch(tuple(args.q.shape), "float32")
    if seqlen_q > 0:
        _preprocess.launch(args.out, args.dout, delta, dq_acc, call.stream)
    if args.k.shape[2] > 0:
        _simt.launch_dkdv(args.q, args.k, args.v, args.dout, args.lse, delta, dq_acc, args.dk, args.dv,
                          args.sm_scale, args.causal, call.stream)
    if seqlen_q == 0:
        return
    if deterministic:
        _simt.launch_dq(args.q, args.k, args.v, args.dout, args.lse, delta, args.dq, args.sm_scale, args.causal,
                        call.stream)
    elif dq_acc is not args.dq:
        _convert.launch(dq_acc, args.dq, call.stream)
