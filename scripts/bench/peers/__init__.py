"""Peer implementations that ``scripts/sweep.py`` benchmarks numba_attn against.

Each module wraps one outside implementation behind a small function on ``(batch, heads, seqlen, dim)`` arrays and
imports its library at the top, so importing the module is the availability test (see :func:`load`):

* ``torch_sdpa``   -- ``torch.nn.functional.scaled_dot_product_attention`` with one backend forced at a time;
* ``triton_flash`` -- our own FlashAttention-2 forward in Triton (online softmax, exp2, causal tile skipping,
  autotuned tiles);
* ``naive``        -- materialised attention / causal dot product for NumPy or CuPy;
* ``fla_linear``   -- flash-linear-attention's chunked and fused-recurrent linear attention.

The sweep turns these into providers (its registry); nothing here times or checks anything.
"""
from __future__ import annotations

import importlib

__all__ = ["load"]


def load(name: str):
    """``(module, None)`` for peer module ``name``, or ``(None, reason)`` when it (or its library) cannot be imported."""
    try:
        return importlib.import_module(f"{__name__}.{name}"), None
    except Exception as exc:  # noqa: BLE001  (a broken install must not stop the sweep)
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
