"""The backward of ring attention: gradients of ``ring_attention``'s output, with the key/value shards and their
gradients travelling around the ring, and the autograd function that links the two for torch users.

Rank ``r`` holds its shards of ``q``, ``k``, ``v``, of the forward's ``out`` and ``lse`` (natural log, the whole
sequence's) and of ``dout``. At step ``i`` it holds the key/value shard of rank ``s = (r - i) mod world`` and the
running ``(dk, dv)`` of that shard (float32), which earlier ranks have added to. On each block the mask lets through
(the forward's table, ``blocks._blocks``) it runs ``numba_attn.flash_backward`` with the global ``out`` and ``lse``:
``P = exp(S - lse)`` is the whole sequence's attention weight and ``D = rowsum(dout * out)`` its correction, so the
block's ``dq`` is this key shard's part of ``dq`` and its ``dk``, ``dv`` this rank's queries' part of the shard's
gradients. ``dq`` sums locally; ``dk``, ``dv`` are added to the travelling accumulator, which moves on with the
shard. After ``world`` steps each accumulator is back at its owner, complete.

Transfers per step: the next key/value shard is issued before the kernels (as in the forward); the accumulator of
the current shard can leave only after them, so it is sent then and received into the buffer the next step adds
to, waited for only when the next step's kernels are done. ``world`` accumulator messages (the last one brings each
rank its own gradients), ``world - 1`` key/value messages.
"""
from __future__ import annotations

from ..runtime.arguments import check_flag, check_softcap, check_window
from .agreement import checked_on_every_rank, pack
from .blocks import _blocks
from .ring import (LAYOUTS, _check_inputs, _check_options, _check_zigzag, _exchange, _group_rank_and_size,
                   _torch)

__all__ = ["ring_attention_backward", "RingAttention"]


def ring_attention_backward(dout, q, k, v, out, lse, *, group=None, causal=False, sm_scale=None, layout=None,
                            window=None, softcap=None, deterministic=False):
    """``(dq, dk, dv)`` of this rank's shards for ``ring_attention(q, k, v, causal=causal, ...)`` whose output was
    ``out`` and lse ``lse`` (``return_lse=True``); ``dout`` the gradient of the loss with respect to ``out``.

    Args as ``ring_attention`` (same group, layout, scale, window, softcap); ``deterministic`` as
    ``flash_backward``'s. Returns
    tensors of q's, k's and v's shard shapes and dtype; ``dk``, ``dv`` summed over every rank's queries (and over
    each kv head's group of query heads)."""
    torch, dist = _torch()

    def check():  # (as ring_attention's, run on every rank by checked_on_every_rank)
        _check_inputs(torch, q, k, v)
        for name, x in (("dout", dout), ("out", out)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(q.shape):
                raise ValueError(f"{name}: expected a torch.Tensor of q's shape {tuple(q.shape)}, got "
                                 f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(q.shape[:-1]):
            raise ValueError(f"lse: expected the forward's lse of shape {tuple(q.shape[:-1])}")
        flags = check_flag(causal, "causal"), check_flag(deterministic, "deterministic")
        options = _check_options(q, flags[0], layout, sm_scale)
        band = check_window(window), check_softcap(softcap)
        band = (None if band[0] == (None, None) else band[0], band[1])  # both sides open: no window
        values = pack(torch, "ring_attention_backward", q, k, flags[0], *options, False, LAYOUTS, *band)
        return values, (*flags, *options, *band)

    (causal, deterministic, layout, sm_scale, window, softcap), world = checked_on_every_rank(torch, dist, group, q,
                                                                                             LAYOUTS, check)
    _check_zigzag(layout, q.shape[2], world)
    return _backward(dout, q, k, v, out, lse, group, causal, sm_scale, layout, window, softcap, deterministic)


def _backward(dout, q, k, v, out, lse, group, causal: bool, sm_scale: float, layout: str, window, softcap,
              deterministic: bool):
    """``ring_attention_backward`` for checked arguments that every rank agrees on (autograd calls it directly:
    the forward checked them)."""
    from .. import api

    torch, dist = _torch()
    rank, world = _group_rank_and_size(dist, group)
    length = q.shape[2]
    lse = lse.float()

    def grads(rows, keys_k, keys_v, part_causal, part_window):
        return api.flash_backward(dout[:, :, rows], q[:, :, rows], keys_k, keys_v, out[:, :, rows],
                                  lse[:, :, rows], causal=part_causal, sm_scale=sm_scale, window=part_window,
                                  softcap=softcap, deterministic=deterministic)

    if world == 1:
        return grads(slice(0, length), k, v, causal, window)

    def peer(group_rank):
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    send_to, receive_from = peer((rank + 1) % world), peer((rank - 1) % world)
    side = torch.cuda.Stream(device=q.device) if q.is_cuda else None
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [torch.stack((k, v)), None]
    dkv = [torch.zeros((2,) + tuple(k.shape), dtype=torch.float32, device=k.device), None]
    dkv_requests = []  # the accumulator this step adds to, still arriving
    for step in range(world):
        current = kv[step % 2]
        kv_requests = []
        if step < world - 1:
            if kv[(step + 1) % 2] is None:
                kv[(step + 1) % 2] = torch.empty_like(current)
            kv_requests = _exchange(torch, dist, current, kv[(step + 1) % 2], send_to, receive_from, group, side)
        parts = []
        for rows, keys, part_causal, part_window in _blocks(rank, (rank - step) % world, length, causal, layout,
                                                            window, world):
            dq_part, dk_part, dv_part = grads(rows, current[0][:, :, keys], current[1][:, :, keys], part_causal,
                                              part_window)
            dq[:, :, rows] += dq_part.float()
            parts.append((keys, dk_part, dv_part))
        _wait(torch, q, side, dkv_requests)
        accumulator = dkv[step % 2]
        for keys, dk_part, dv_part in parts:
            accumulator[0][:, :, keys] += dk_part.float()
            accumulator[1][:, :, keys] += dv_part.float()
        if dkv[(step + 1) % 2] is None:
            dkv[(step + 1) % 2] = torch.empty_like(accumulator)
        dkv_requests = _exchange(torch, dist, accumulator, dkv[(step + 1) % 2], send_to, receive_from, group, side)
        _wait(torch, q, side, kv_requests)
    _wait(torch, q, side, dkv_requests)
    mine = dkv[world % 2]  # after world moves each accumulator is back at its owner
    return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


def _wait(torch, q, side, requests):
    for request in requests:
        request.wait()
    if side is not None and requests:
        torch.cuda.current_stream(q.device).wait_stream(side)


def _autograd_function():
    torch, _ = _torch()

    class _RingAttention(torch.autograd.Function):
        """``ring_attention`` with its backward over the ring."""

        @staticmethod
        def forward(ctx, q, k, v, group, causal, sm_scale, layout, window, softcap, backend, agreement):
            from .ring import _forward

            # arguments checked by the caller; its agreement read once the own shard's kernels are queued
            out, lse = _forward(q, k, v, group, causal, sm_scale, layout, window, softcap, backend, agreement)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options = (group, causal, sm_scale, layout, window, softcap)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            group, causal, sm_scale, layout, window, softcap = ctx.options
            dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, group, causal, sm_scale, layout, window,
                                   softcap, torch.are_deterministic_algorithms_enabled())
            return (dq, dk, dv) + (None,) * 9

    return _RingAttention


_FUNCTION = None


def RingAttention():  # noqa: N802 - the autograd.Function class, made on first use (torch is optional)
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _autograd_function()
    return _FUNCTION
