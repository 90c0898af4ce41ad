"""Naive attention and causal dot product with the full score matrix materialised, for NumPy or CuPy (``xp``).

These are the "what you would write first" baselines: two matrix products and a softmax over an explicit
``(seqlen_q, seqlen_k)`` score matrix per head. On CuPy the products run in the input dtype on cuBLAS (half
inputs, float32 accumulation); the scores are then upcast to float32 for the softmax and the probabilities cast
back to the input dtype for the second product, as a framework would do it. NumPy has no fast half-precision
product, so there the inputs are upcast first. Memory grows as ``batch * heads * seqlen_q * seqlen_k * 6`` bytes
(half scores, then their float32 copy), so the sweep only runs these under a memory budget.
"""
from __future__ import annotations

import math

__all__ = ["causal_bias", "attention", "causal_dot_product", "score_bytes", "providers", "numpy_providers"]


def score_bytes(batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> int:
    """Peak bytes of the score matrices the naive attention materialises (input-dtype scores + float32 copy)."""
    return 6 * batch * heads * seqlen_q * seqlen_k


def causal_bias(xp, seqlen_q: int, seqlen_k: int):
    """``(seqlen_q, seqlen_k)`` float32: 0 where query i sees key j (``j <= i + seqlen_k - seqlen_q``), else -inf."""
    rows = xp.arange(seqlen_q)[:, None]
    cols = xp.arange(seqlen_k)[None, :]
    visible = cols <= rows + (seqlen_k - seqlen_q)
    return xp.where(visible, xp.float32(0.0), xp.float32(-xp.inf)).astype(xp.float32)


def _softmax_rows_inplace(xp, scores):
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def attention(xp, q, k, v, sm_scale: float | None = None, bias=None):
    """``softmax(sm_scale q k^T + bias) v`` on ``(batch, heads, seqlen, headdim)`` arrays; k/v may have fewer heads.

    ``bias`` (from :func:`causal_bias`, made once outside the timed region) applies the causal mask. Rows that see
    no key are not handled (the sweep never makes them). Grouped-query attention: without a mask the query heads of
    a group are stacked as extra query rows of their kv head (no copy of K or V); with a mask the group is a
    broadcast axis.
    """
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    if xp.__name__ == "numpy":
        q, k = q.astype(xp.float32), k.astype(xp.float32)
    if bias is None:
        qg, kg, vg = q.reshape(batch, kv_heads, group * seqlen_q, head_dim), k, v
    else:
        qg = q.reshape(batch, kv_heads, group, seqlen_q, head_dim)
        kg, vg = k[:, :, None], v[:, :, None]
    scores = xp.matmul(qg, kg.swapaxes(-1, -2)).astype(xp.float32)
    scores *= xp.float32(scale)
    if bias is not None:
        scores += bias
    probs = _softmax_rows_inplace(xp, scores).astype(v.dtype, copy=False)
    return xp.matmul(probs, vg).reshape(batch, heads, seqlen_q, head_dim)


def causal_dot_product(xp, q, k, v):
    """``out_i = sum_{j <= i} (q_i . k_j) v_j`` as ``(Q K^T * tril) V`` in float32; returns v's dtype."""
    seqlen = q.shape[-2]
    scores = xp.matmul(q.astype(xp.float32), k.astype(xp.float32).swapaxes(-1, -2))
    scores *= xp.tril(xp.ones((seqlen, seqlen), dtype=xp.float32))
    return xp.matmul(scores, v.astype(xp.float32)).astype(v.dtype)


# --------------------------------------------------------------------------------------------------------------------
# The sweep's plug-in hook (bench/peers/__init__.py)
# --------------------------------------------------------------------------------------------------------------------
def providers(opts) -> dict:
    """``cupy-naive`` for flash and decode (GPU runs; it launches on CuPy's stream, so no CUDA graph captures it)."""
    import cupy

    from ..providers import Prepared, Provider, naive_check  # the sweep's, not the wrappers'

    def as_cupy(x):
        if type(x).__module__.startswith("torch"):
            if "bfloat16" in str(x.dtype):
                raise TypeError("CuPy has no bfloat16")
            return cupy.asarray(x.detach())
        return x

    def prep(case, x, env):
        q, k, v = (as_cupy(x[n]) for n in ("q", "k", "v"))
        bias = causal_bias(cupy, case.seqlen_q, case.seqlen_k) if case.causal else None
        return Prepared(lambda: attention(cupy, q, k, v, bias=bias))

    note = "materialised scores: cuBLAS in the input dtype, float32 softmax, P in the input dtype"
    provider = Provider(prep, check=naive_check(opts.naive_mem_bytes), note=note, graphs=False)
    return {"flash": {"cupy-naive": provider}, "decode": {"cupy-naive": provider}}


def numpy_providers() -> dict:
    """``numpy-naive`` for every sweep: the simulator's only peer."""
    import numpy as np

    from ..providers import Prepared, Provider

    def prep_attention(case, x, env):
        bias = causal_bias(np, case.seqlen_q, case.seqlen_k) if case.causal else None
        return Prepared(lambda: attention(np, x["q"], x["k"], x["v"], bias=bias))

    def prep_linear(case, x, env):
        return Prepared(lambda: causal_dot_product(np, x["q"], x["k"], x["v"]))

    note = "NumPy on the host, materialised float32 scores"
    attention_ = Provider(prep_attention, note=note)
    return {"flash": {"numpy-naive": attention_}, "decode": {"numpy-naive": attention_},
            "linear": {"numpy-naive": Provider(prep_linear, note=note)}}
