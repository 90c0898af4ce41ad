"""Which kernel runs a ``causal_dot_product`` or ``linear_attention`` call, and its launch.

Backends: "chunked" (tensor cores, sm_80+: float16, bfloat16, float32; a state in and out) and "recurrent" (the
sequential walk of "Transformers are RNNs": float16, float32, any GPU). ``None`` takes the chunked kernel from
``CHUNKED_MIN_SEQLEN`` rows on (always for bfloat16 or a state in / out); docs/benchmarks.md has the measurements
behind the thresholds.

``causal_dot_product_backward`` has the same two backends: "chunked" (``chunked_backward``: the chunked forward
kernels run three times on rearranged operands; float16, bfloat16, float32) and "recurrent" (``recurrent_backward``:
three sequential walks; float16, float32), both taking states in and out. ``backend=None`` picks the chunked one
from ``CHUNKED_MIN_SEQLEN_BACKWARD`` rows: the recurrent backward walks the sequence three times, one row after the
other, so it loses to the chunked kernels at shorter sequences than the forward's single walk does (float32 at 1k
rows, B4 H8 E=M=64, H100: 0.81 ms recurrent against 0.58 ms chunked at 4k). The layer's backward
(``layer_backward``) is built on them and picks the same way.
"""
from __future__ import annotations

from ..runtime.arrays import BFLOAT16
from ..runtime.device import SIMULATOR, compute_capability
from ..runtime.views import lift
from . import chunked_backward as _chunked_backward
from . import launch as _chunked  # the chunked backend's entry
from . import layer_backward as _layer_backward
from . import recurrent as _recurrent
from . import recurrent_backward as _recurrent_backward

BACKENDS = ("chunked", "recurrent")
#: rows from which ``backend=None`` takes the chunked kernel, per input dtype
CHUNKED_MIN_SEQLEN = {"float16": 1024, "bfloat16": 1, "float32": 2048}
#: ... for the backwards (``causal_dot_product_backward``, ``linear_attention_backward``)
CHUNKED_MIN_SEQLEN_BACKWARD = {"float16": 512, "bfloat16": 1, "float32": 512}


def choose_backend(backend, dtype: str, seqlen: int, stateful: bool, states_ok: bool = False,
                   backward: bool = False) -> str:
    """The backend of a call: ``backend`` checked, or None's choice. ``states_ok``: the recurrent kernels of this
    function take states in and out (the backward's do, the forward's do not); ``backward``: a backward's call
    (its own thresholds)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    chunked_ok = SIMULATOR or compute_capability() >= _chunked.MIN_COMPUTE_CAPABILITY
    if backend == "chunked" and not chunked_ok:
        raise ValueError(f"backend: 'chunked' needs a GPU of compute capability >= 8.0, got {compute_capability()}")
    if backend == "recurrent" and stateful and not states_ok:
        raise ValueError("backend: 'recurrent' takes no initial_state / return_state; use 'chunked' or None")
    if backend == "recurrent" and dtype == BFLOAT16:
        raise ValueError("backend: 'recurrent' does not take bfloat16; use 'chunked' or None")
    if backend is None:
        threshold = (CHUNKED_MIN_SEQLEN_BACKWARD if backward else CHUNKED_MIN_SEQLEN)[dtype]
        wants_chunked = stateful or seqlen >= threshold
        backend = "chunked" if chunked_ok and wants_chunked else "recurrent"
    if backend == "recurrent" and not _recurrent.supports(dtype, stateful and not states_ok):
        raise TypeError("bfloat16 inputs and initial_state / return_state need a GPU of compute capability >= 8.0")
    return backend


def run_causal_dot_product(call, backend: str, out, final, allow_tf32: bool) -> None:
    """Launch the causal product of ``call``'s q, k, v (and ``initial_state``) into ``out`` (and ``final``)."""
    views = [lift(call.inputs[name], 4) for name in ("q", "k", "v")] + [lift(out.view, 4)]
    if backend == "chunked":
        initial = call.inputs.get("initial_state")
        _chunked.launch_causal(
            *views, call.stream,
            initial_state=lift(initial, 4) if initial is not None else None,
            final_state=lift(final.view, 4) if final is not None else None,
            tf32=allow_tf32, dtype=call.dtype, scratch=call.scratch,
        )
    else:
        _recurrent.launch_causal_dot_product(*views, call.stream)


def run_linear_attention(call, backend: str, out, causal: bool, eps: float, allow_tf32: bool) -> None:
    """Launch the normalised layer of ``call``'s q, k, v into ``out``."""
    views = [lift(call.inputs[name], 4) for name in ("q", "k", "v")] + [lift(out.view, 4)]
    if backend == "chunked" and causal:
        _chunked.launch_causal(*views, call.stream, normalise=True, eps=eps, tf32=allow_tf32, dtype=call.dtype,
                               scratch=call.scratch)
    elif backend == "chunked":
        _chunked.launch_noncausal(*views, eps, call.stream, tf32=allow_tf32, dtype=call.dtype, scratch=call.scratch)
    else:
        _recurrent.launch_linear_attention(*views, causal, eps, call.stream, scratch=call.scratch)


def run_causal_dot_product_backward(call, backend: str, dq, dk, dv, dinitial_state, allow_tf32: bool) -> None:
    """Launch the backward of ``call``'s dout, q, k, v (and ``initial_state``, ``dstate``) into ``dq``, ``dk``,
    ``dv`` (and ``dinitial_state``: an Output, or None)."""
    views = [lift(call.inputs[name], 4) for name in ("dout", "q", "k", "v")] + [lift(x.view, 4) for x in (dq, dk, dv)]
    states = {name: lift(call.inputs[name], 4) if name in call.inputs else None
              for name in ("initial_state", "dstate")}
    dinit = None if dinitial_state is None else lift(dinitial_state.view, 4)
    if backend == "chunked":
        _chunked_backward.launch_causal_backward(*views, call.stream, **states, dinitial_state=dinit,
                                                 tf32=allow_tf32, dtype=call.dtype, scratch=call.scratch)
    else:
        _recurrent_backward.launch_causal_dot_product_backward(*views, call.stream, **states, dinitial_state=dinit)


def run_linear_attention_backward(call, backend: str, dq, dk, dv, causal: bool, eps: float, allow_tf32: bool) -> None:
    """Launch the layer's backward of ``call``'s dout, q, k, v into ``dq``, ``dk``, ``dv``."""
    views = [lift(call.inputs[name], 4) for name in ("dout", "q", "k", "v")] + [lift(x.view, 4) for x in (dq, dk, dv)]
    _layer_backward.launch_linear_attention_backward(*views, call.stream, causal=causal, eps=eps,
                                                     chunked=backend == "chunked", tf32=allow_tf32, dtype=call.dtype,
                                                     scratch=call.scratch)
