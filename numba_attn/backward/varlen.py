"""The backward of packed sequences (``flash_backward_varlen``): argument checks, the schedules, the launch.

The arrays are ``flash_forward_varlen``'s (``forward.varlen``): packed ``(total, heads, headdim)`` tokens seen by the
kernels as ``(1, heads, total, headdim)`` views, ``lse`` ``(heads, total_q)`` as ``(1, heads, total_q)``. The
preprocessing runs over all rows at once (``D`` of a row is its own); the two kernels run over schedules of
``SCHEDULE_WORDS`` int32 words per thread block, made where the ``cu_seqlens`` are, as the forward's:

* the key-block kernel (``dK``, ``dV``, and ``dQ`` by atomics) over a key schedule: one entry per ``block_n`` keys of
  every sequence, ``block_info.KEY_SCHEDULE`` (first key, key end, row start, row end) -- the forward's entry with
  keys and rows swapped, so device offsets take the forward's planning kernel with ``cu_seqlens_k`` and
  ``cu_seqlens_q`` swapped; host schedules put the blocks that see the most rows first;
* the query-block kernel (``deterministic=True``'s ``dQ``) over the forward's schedule of its ``dq_block_m``-row
  blocks.

Every key of every sequence belongs to one key block, so ``dk`` and ``dv`` are written whole (0 for keys no row
sees); ``dq`` is zeroed by the preprocessing (atomics) or written by every query block (deterministic).
"""
from __future__ import annotations

import math

import numpy as np

from ..core.scores import kernel_scale
from ..forward import varlen as _varlen
from ..runtime.arrays import prepare
from ..runtime.attention_args import BackwardArgs
from ..runtime.device import on_device
from ..runtime.shapes import check_array
from ..runtime.views import restride
from . import dispatch as _dispatch


def host_key_schedule(cu_q: np.ndarray, cu_k: np.ndarray, block_n: int, causal: bool, window) -> np.ndarray:
    """The key schedule of checked host offsets (``block_info.KEY_SCHEDULE`` entries, int32, flat), the key blocks
    that see the most query rows first (``mask.visible_rows``, in packed positions)."""
    lengths = np.diff(cu_k)
    blocks = -(-lengths // block_n)
    seq = np.repeat(np.arange(lengths.size), blocks)
    first = np.arange(seq.size) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    n0 = cu_k[seq] + first * block_n
    key_end, row_start, row_end = cu_k[seq + 1], cu_q[seq], cu_q[seq + 1]
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    diag = key_end - row_end
    last_key = np.minimum(n0 + block_n, key_end) - 1
    begin = row_start if right is None else np.clip(n0 - diag - right, row_start, row_end)
    end = row_end if left is None else np.clip(last_key + 1 - diag + left, row_start, row_end)
    order = np.argsort(-(end - begin), kind="stable")
    return np.stack([n0, key_end, row_start, row_end], axis=1)[order].astype(np.int32).reshape(-1)


class Schedules:
    """The schedules of one call, made on its stream when a launch asks: ``keys(block_n)`` (key-block kernel) and
    ``rows(block_m)`` (query-block kernel); from checked host ``offsets`` ``(cu_q, cu_k)``, or, when they are None,
    by the planning kernel from the call's device ``cu_seqlens``."""

    def __init__(self, call, offsets, batch: int, total_q: int, total_k: int, causal: bool, window,
                 max_seqlen_q, max_seqlen_k):
        self.call, self.offsets, self.batch = call, offsets, batch
        self.total_q, self.total_k, self.causal, self.window = total_q, total_k, causal, window
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k

    def keys(self, block_n: int):
        if self.offsets is not None:
            cu_q, cu_k = self.offsets
            return self.call.upload(host_key_schedule(cu_q, cu_k, block_n, self.causal, self.window))
        entries = _varlen.device_entries(self.total_k, self.batch, block_n, self.max_seqlen_k)
        inputs = self.call.inputs
        return _varlen.device_schedule(self.call, inputs["cu_seqlens_k"], inputs["cu_seqlens_q"], self.batch, entries,
                                       block_n)

    def rows(self, block_m: int):
        if self.offsets is not None:
            return self.call.upload(_varlen.host_schedule(*self.offsets, block_m, self.causal, self.window))
        entries = _varlen.device_entries(self.total_q, self.batch, block_m, self.max_seqlen_q)
        inputs = self.call.inputs
        return _varlen.device_schedule(self.call, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], self.batch, entries,
                                       block_m)


def run(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: bool, sm_scale,
        window, softcap, deterministic: bool, backend):
    """``flash_backward_varlen`` with its scalar arguments checked (``api``): the arrays' checks, the schedules and
    the launches."""
    total_q, total_k, heads, kv_heads, head_dim = _varlen.packed_shape(q, k, v)
    for name, x in (("dout", dout), ("out", out)):
        check_array(name, x)
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"{name}: expected q's shape {tuple(q.shape)}, got {tuple(x.shape)}")
    check_array("lse", lse)
    if tuple(lse.shape) != (heads, total_q):
        raise ValueError(f"lse: expected shape {(heads, total_q)} (heads, total_q), the forward's lse, got "
                         f"{tuple(lse.shape)}")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if softcap is not None:
        kernel_scale(sm_scale, softcap)  # ValueError where the kernels' float32 scales would not be finite
    max_seqlen_q = _varlen.check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _varlen.check_max_seqlen(max_seqlen_k, "max_seqlen_k")
    offsets = _varlen.check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k)
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    if offsets is None:  # device offsets: checked for place and dtype with the arrays
        arrays.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    call = prepare(arrays, own_dtype={"lse": ("float32",), "cu_seqlens_q": ("int32",),
                                      "cu_seqlens_k": ("int32",)})
    chosen = _dispatch.variant_backend(_dispatch.choose_backend(backend, call.dtype, head_dim), backend, True)
    with on_device(call.device_id):
        dq = call.output((total_q, heads, head_dim), name="dq")
        dk = call.output((total_k, kv_heads, head_dim), name="dk")
        dv = call.output((total_k, kv_heads, head_dim), name="dv")
        if heads > 0 and total_q + total_k > 0:
            views = [_varlen.batched(call.inputs[name], (total_q, heads, head_dim)) for name in ("dout", "q")]
            views += [_varlen.batched(call.inputs[name], (total_k, kv_heads, head_dim)) for name in "kv"]
            views.append(_varlen.batched(call.inputs["out"], (total_q, heads, head_dim)))
            lse_view = call.inputs["lse"]
            lse3 = restride(lse_view, (1, heads, total_q), (0,) + tuple(lse_view.strides))
            grads = [_varlen.batched(dq.view, (total_q, heads, head_dim))]
            grads += [_varlen.batched(g.view, (total_k, kv_heads, head_dim)) for g in (dk, dv)]
            batch = (len(offsets[0]) if offsets is not None else cu_seqlens_q.shape[0]) - 1
            schedules = Schedules(call, offsets, batch, total_q, total_k, causal, window, max_seqlen_q, max_seqlen_k)
            args = BackwardArgs(*views, lse3, *grads, sm_scale, causal, window, softcap)
            _dispatch.run(call, args, chosen, deterministic, packed=schedules)
        return call.result(dq), call.result(dk), call.result(dv)
