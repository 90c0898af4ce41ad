"""The peers the sweep benchmarks numba_attn against: one plug-in module each, and the list that orders them.

Each module wraps one outside implementation behind a small function on ``(batch, heads, seqlen, dim)`` arrays and
imports its library at the top, so importing the module is the availability test (see :func:`load`):

* ``torch_sdpa``   -- ``torch.nn.functional.scaled_dot_product_attention`` with one backend forced at a time;
* ``triton_flash`` -- our own FlashAttention-2 forward in Triton (online softmax, exp2, causal tile skipping,
  autotuned tiles), and ``triton_flash_backward`` its backward (dK/dV and dQ kernels, autotuned);
* ``naive``        -- materialised attention / causal dot product for NumPy or CuPy;
* ``fla_linear``   -- flash-linear-attention's chunked and fused-recurrent linear attention;
* ``torch_flex``   -- FlexAttention, compiled, with a document(-causal) block mask over packed sequences (varlen)
  and a sliding-window one (window);
* ``torch_nested`` -- SDPA on jagged nested tensors (varlen), one backend forced at a time.

Each also ends with ``providers(opts) -> {sweep: {name: Provider}}`` (``bench.providers.Provider``), which the
registry (``bench.providers.build_registry``) calls on a GPU; a module that fails to import, or whose
``providers`` raises, is reported as unavailable with the reason. A new peer is one module here with such a
function: :func:`plugins` picks it up after the ones in :data:`PEERS`. Nothing here times or checks anything.
"""
from __future__ import annotations

import importlib
import pkgutil

__all__ = ["PEERS", "plugins", "load"]

#: label (as reported when unavailable) -> module, in the order their providers join the tables
PEERS = {"torch-sdpa": "torch_sdpa", "triton-fa2": "triton_flash", "triton-fa2-backward": "triton_flash_backward",
         "cupy-naive": "naive", "fla": "fla_linear", "torch-flex": "torch_flex", "torch-nested": "torch_nested"}


def plugins() -> dict:
    """``{label: module}``: :data:`PEERS`, then any other module here (not ``_private``) under its own name."""
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return {**PEERS, **{name: name for name in found if name not in PEERS.values()}}


def load(name: str):
    """``(module, None)`` for peer module ``name``, or ``(None, reason)`` when it (or its library) cannot be imported."""
    try:
        return importlib.import_module(f"{__name__}.{name}"), None
    except Exception as exc:  # noqa: BLE001  (a broken install must not stop the sweep)
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
