"""torch's FlexAttention (``torch.nn.attention.flex_attention``), ``torch.compile``d, with the masks of the
real-batch sweeps as block masks: document-causal over packed sequences (varlen) and a causal sliding window
(window).

Packed sequences run as one sequence of all the tokens, ``(1, heads, total, dim)`` views of the packed arrays, with
a mask that keeps the pairs of one document (and, causal, the earlier keys), as FlexAttention's document masking
does; the block mask is made block by block (``_compile=True``: a dense ``total x total`` mask took 117 GiB in
``scripts/bench_issue29.py``) when the provider is prepared, untimed, as is the first call, which compiles.
"""
from __future__ import annotations

import inspect

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

__all__ = ["document_mask", "sliding_window_mask", "block_mask", "packed", "providers"]

# flex_attention is compiled for each shape; a sweep has more shapes than dynamo's default of 8 recompilations
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, max(256, getattr(torch._dynamo.config, _name)))

_compiled = None


def compiled_flex():
    """One ``torch.compile(flex_attention)`` for the run (its compilations are cached by shape)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def document_mask(lengths, causal: bool, device):
    """The mask_mod of packed sequences of ``lengths``: query and key in one document (and key <= query, causal:
    within a document of equal query and key lengths, the sweep's bottom-right mask)."""
    docs = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.tensor(list(lengths), device=device)).to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        same = docs[q_idx] == docs[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    return mask_mod


def sliding_window_mask(window: int):
    """The mask_mod of ``window=(window, 0)``: query i sees keys i - window .. i."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return mask_mod


def block_mask(mask_mod, seqlen: int, device, compile: bool = True):
    """The block mask of ``mask_mod`` over ``seqlen`` queries and keys, for every batch row and head."""
    kwargs = {"_compile": compile} if "_compile" in inspect.signature(create_block_mask).parameters else {}
    return create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device, **kwargs)


def packed(q, k, v, mask, compile: bool = True):
    """``(fn, post)``: FlexAttention on packed ``(total, heads, dim)`` arrays as one sequence (``(1, heads, total,
    dim)`` views); ``post`` gives the packed layout back."""
    flex = compiled_flex() if compile else flex_attention
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    return (lambda: flex(qt, kt, vt, block_mask=mask)), (lambda out: out[0].transpose(0, 1))


# --------------------------------------------------------------------------------------------------------------------
# The sweep's plug-in hook (bench/peers/__init__.py)
# --------------------------------------------------------------------------------------------------------------------
def providers(opts) -> dict:
    """``torch-flex`` for varlen (document mask) and window (sliding-window mask); torch tensors only."""
    from ..providers import Prepared, Provider, torch_only  # the sweep's, not the wrappers'

    def prep_varlen(case, x, env):
        mask = block_mask(document_mask(case.lengths, case.causal, x["q"].device), x["q"].shape[0], x["q"].device)
        fn, post = packed(x["q"], x["k"], x["v"], mask)
        return Prepared(fn, post=post, context=torch.no_grad)

    def prep_window(case, x, env):
        mask = block_mask(sliding_window_mask(case.window), case.seqlen_q, x["q"].device)
        flex = compiled_flex()
        return Prepared(lambda: flex(x["q"], x["k"], x["v"], block_mask=mask), context=torch.no_grad)

    return {"varlen": {"torch-flex": Provider(prep_varlen, check=torch_only,
                                              note="FlexAttention, compiled, document(-causal) block mask")},
            "window": {"torch-flex": Provider(prep_window, check=torch_only,
                                              note="FlexAttention, compiled, sliding-window causal block mask")}}
