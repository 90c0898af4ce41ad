"""torch SDPA on jagged nested tensors (``torch.nested``, layout ``torch.jagged``): torch's own varlen path.

The packed ``(total, heads, dim)`` arrays and their offsets become nested tensors ``(batch, j, heads, dim)`` without
a copy (``nested_tensor_from_jagged``, given the longest length so that no call reads it back), transposed to SDPA's
``(batch, heads, j, dim)``; the flash, memory-efficient and cuDNN backends are forced one at a time, as in
``torch_sdpa`` (the math backend would pad every sequence: left out). Causal masks agree with numba_attn's: every
sequence has as many queries as keys.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .torch_sdpa import backend_context

__all__ = ["BACKENDS", "jagged", "packed", "providers"]

#: the SDPA backends tried on nested tensors (keys of ``torch_sdpa.BACKENDS``)
BACKENDS = ("flash", "efficient", "cudnn")


def jagged(x, offsets, longest: int):
    """``(total, heads, dim)`` -> a jagged nested tensor ``(batch, heads, j, dim)`` over the same memory."""
    kwargs = {}
    if "max_seqlen" in inspect.signature(torch.nested.nested_tensor_from_jagged).parameters:
        kwargs["max_seqlen"] = longest  # (else torch computes it from the offsets on every call)
    return torch.nested.nested_tensor_from_jagged(x, offsets, **kwargs).transpose(1, 2)


def packed(q, k, v, offsets, longest: int, causal: bool):
    """``(fn, post)``: SDPA on the nested views of packed arrays; ``post`` gives the packed ``(total, heads, dim)``
    output back (the values of the nested result)."""
    qn, kn, vn = (jagged(x, offsets, longest) for x in (q, k, v))
    return (lambda: F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)), (
        lambda out: out.transpose(1, 2).values())


# --------------------------------------------------------------------------------------------------------------------
# The sweep's plug-in hook (bench/peers/__init__.py)
# --------------------------------------------------------------------------------------------------------------------
def providers(opts) -> dict:
    """``torch-nested-<backend>`` for varlen; torch tensors only."""
    from ..providers import Prepared, Provider, torch_only  # the sweep's, not the wrappers'

    varlen = {}
    for backend in BACKENDS:
        def prepare(case, x, env, context=backend_context(backend)):
            offsets = x["cu_seqlens"].to(torch.int64)
            fn, post = packed(x["q"], x["k"], x["v"], offsets, max(case.lengths), case.causal)
            return Prepared(fn, post=post, context=context)

        varlen[f"torch-nested-{backend}"] = Provider(
            prepare, check=torch_only, note=f"SDPA on jagged nested tensors, {backend} backend forced")
    return {"varlen": varlen}
