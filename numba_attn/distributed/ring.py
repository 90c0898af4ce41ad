"""Ring (context-parallel) attention over ``torch.distributed``: each rank holds one shard of the sequence.

Every rank of the group holds its query shard ``q`` and its key/value shards ``k``, ``v``, each
``(batch, heads, seqlen / world, headdim)`` (``k``, ``v`` may have fewer heads: grouped-query attention). The
key/value shards travel around the ring, rank ``r`` sending to ``r + 1`` and receiving from ``r - 1`` (mod
``world``), so that at step ``i`` rank ``r`` holds the shard of rank ``s = (r - i) mod world``. A call

1. checks that every rank passed the same shapes, dtype and options: one small all_gather (``agreement.py``),
   issued first and read after step 0's kernels are queued;
2. queues ``numba_attn.flash_forward(q_rows, k_keys, v_keys, return_lse=True)`` on its own shard (step 0: no
   transfer needed), so that the GPU computes while the host reads the agreement;
3. issues the transfers of steps 1 and 2 (``isend`` of the shard held, ``irecv`` of the next, batched with
   ``batch_isend_irecv``; on CUDA tensors under a side stream, NCCL's kernels beside the attention kernel), the
   second one after the first has arrived;
4. then at each step ``i >= 1``: waits for its shard, runs the kernels on it (or the part the mask lets through,
   below), issues the transfer of step ``i + 2`` (into the buffer these kernels read: it waits for them), and
   merges the partial output and lse into the running ``(out, lse)`` (``merge.merge_into``, one kernel, for CUDA
   tensors; :func:`_merge_into`, torch ops, for CPU tensors).

``k`` and ``v`` travel as they are, two messages per step (no stacked copy); two receive buffers alternate, so the
second transfer needs no kernel to finish first. Transfers beside the attention kernel get SMs as its blocks retire
when NCCL's streams have high priority (``TORCH_NCCL_HIGH_PRIORITY=1``; at normal priority a transfer issued
after a kernel may wait for that kernel's blocks to drain: ``docs/design/distributed.md``).

**Merge.** Partial attention over disjoint key sets merges exactly by its log-sum-exps (``combine_lse``):
``lse = log(exp(lse_a) + exp(lse_b))``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``. It is done as a
running merge in torch float32 after each step rather than one ``numba_attn.combine_lse`` over all parts at the
end: the result is the same convex combination (each step rounds the float32 accumulator once, ~1e-7 relative,
far below the float32 tolerance of 1e-5), it keeps one output-sized accumulator instead of ``world`` parts, and it
needs no extra kernel launch. The first step (the own shard, every row) is copied into the accumulator rather
than merged with an empty one. It follows ``reference.combine_lse``'s rules: a part with ``lse = -inf`` has weight
0, a row that no part reaches gives 0 and ``-inf`` (never NaN), a NaN or ``+inf`` lse makes the row NaN. The
partials come back from ``flash_forward`` in the inputs' dtype (float16 partials carry one float16 rounding each),
are read as they are and merged in float32, and the result is cast to the inputs' dtype once at the end; ``lse`` is
float32. On CUDA tensors each merge is one kernel (``merge.py``: the accumulator row and the part read once, the
merged row written once); there the first part stays in the inputs' dtype until the first merge widens it to
float32, and the last merge writes the inputs' dtype itself (the final cast fused into it; rows it does not cover
are cast by a copy). ``NUMBA_ATTN_RING_MERGE=torch`` selects the torch ops instead (A/B timing).

**Causal masking.** With ``causal=True`` the whole sequence is causal (query ``i`` sees key ``j <= i``, global
positions). Split into chunks, a (query chunk, key chunk) pair is *full* when the key chunk comes first,
*diagonal* (``flash_forward(causal=True)``: equal lengths, so the bottom-right alignment is the diagonal) when it
is the same chunk, and *masked* (skipped) when it comes later.

``layout="contiguous"``: rank ``r`` holds chunk ``r`` of ``world``. The own shard is diagonal, a shard from an
earlier rank (``s < r``) is full, one from a later rank (``s > r``) is masked and skipped. Rank ``r`` computes
``r + 1`` blocks, so the last rank does ``world`` times the work of the first.

``layout="zigzag"`` (the load-balanced sharding of Llama 3's context parallelism and of ring-flash-attention):
the sequence is cut into ``2 * world`` chunks and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r`` (its
"first" and "second" half, each ``c = seqlen / world / 2`` rows). For the shard of rank ``s`` at rank ``r``
(``q0``, ``q1``: the query halves; ``k0``, ``k1``: the key halves)::

    source     | q0 = chunk r                 | q1 = chunk 2w-1-r           | call
    -----------+------------------------------+-----------------------------+----------------------------------
    s == r     | k0 diagonal, k1 masked       | k0 full,     k1 diagonal    | whole shard, causal=True
    s <  r     | k0 full,     k1 masked       | k0 full,     k1 masked      | q (both halves) x k0, v0, unmasked
    s >  r     | k0 masked,   k1 masked       | k0 full,     k1 full        | q1 x k (both halves), unmasked

(``s < r``: ``k0 = s < r`` comes before both query chunks and ``k1 = 2w-1-s > 2w-1-r`` after both;
``s > r``: ``k0 = s > r`` but ``s <= w-1 < 2w-1-r``, ``k1 = 2w-1-s < 2w-1-r`` but ``>= w > r``.) The own step,
causal over the local ``[q0, q1] x [k0, k1]``, is exactly the two diagonal blocks plus ``q1 x k0``. Every other
step is one unmasked ``2c x c`` (or ``c x 2c``) block, the same work on every rank: rank ``r`` computes
``2c x 2c`` (causal) plus ``world - 1`` blocks of ``2c x c``, whatever ``r``.

Without ``causal`` every block is full and the layout only says how the caller sharded the sequence (attention
is the same for any order of the keys, and each query row's output is its own).

The default layout is ``"zigzag"`` when ``causal``, else ``"contiguous"``; it must match how the shards were
made (:func:`shard`). Backward: ``ring_backward.ring_attention_backward`` (the same table, the key/value
gradients travelling with the shards); ``ring_attention`` on inputs that require grad records it for autograd.

Tested on the CPU with gloo (``tests/distributed/test_ring.py``) and on two GPUs with NCCL
(``tests/distributed/test_ring_gpu.py``); scaling and the comparison with torch's context parallel in
``docs/design/distributed.md`` (``scripts/bench_ring.py``).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..runtime.arguments import ArgumentTypeError, check_flag, check_sm_scale, check_softcap, check_window
import functools

from .agreement import pack, start_checked_on_every_rank
from .blocks import _blocks
from .agreement import group_rank_and_size as _group_rank_and_size

__all__ = ["LAYOUTS", "ring_attention", "shard", "unshard", "gather"]

LAYOUTS = ("contiguous", "zigzag")


def _torch():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as error:  # pragma: no cover - CI without torch skips these tests
        raise ImportError("numba_attn.distributed needs torch (torch.distributed)") from error
    return torch, dist


def _check_layout(layout, causal: bool) -> str:
    if layout is None:
        return "zigzag" if causal else "contiguous"
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'contiguous', 'zigzag' or None, got {layout!r}")
    return layout


def _check_options(q, causal: bool, layout, sm_scale) -> tuple:
    """``(layout, sm_scale)`` checked, with their defaults (zigzag when causal; ``1 / sqrt(headdim)``)."""
    layout = _check_layout(layout, causal)
    sm_scale = check_sm_scale(sm_scale)
    return layout, 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale


def _check_int(value, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an int, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name}: expected an int {bound}, got {value}")
    return value


def _check_dim(dim, ndim: int, name: str) -> int:
    dim = _check_int(dim, "dim", -ndim, ndim) if ndim else _check_int(dim, "dim", 0, 0)
    return dim % ndim


def _chunks(layout: str, world: int) -> int:
    return 2 * world if layout == "zigzag" else world


def _take(x, dim: int, start: int, stop: int):
    index = [slice(None)] * len(x.shape)
    index[dim] = slice(start, stop)
    return x[tuple(index)]


def _concatenate(parts, dim: int):
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=dim)
    torch, _ = _torch()
    return torch.cat(parts, dim=dim)


def shard(x, rank, world, layout="contiguous", dim=2):
    """Rank ``rank``'s shard of ``x`` (a torch tensor or NumPy array) along ``dim`` for ``world`` ranks.

    ``"contiguous"``: chunk ``rank`` of ``world`` equal chunks (a view). ``"zigzag"``: chunks ``rank`` and
    ``2 * world - 1 - rank`` of ``2 * world``, concatenated (a copy). ``x.shape[dim]`` must be divisible by
    ``world`` (``2 * world`` for zigzag).
    """
    if not hasattr(x, "shape") or not hasattr(x, "__getitem__"):
        raise TypeError(f"x: expected a torch tensor or NumPy array, got {type(x).__name__}")
    world = _check_int(world, "world", 1)
    rank = _check_int(rank, "rank", 0, world)
    layout = _check_layout(layout, False)
    dim = _check_dim(dim, len(x.shape), "x")
    length, chunks = x.shape[dim], _chunks(layout, world)
    if length % chunks:
        raise ValueError(f"x: sequence length {length} (dim {dim}) is not divisible by {chunks} "
                         f"({'2 * world' if layout == 'zigzag' else 'world'}, world = {world}, layout {layout!r})")
    size = length // chunks
    if layout == "contiguous":
        return _take(x, dim, rank * size, (rank + 1) * size)
    other = chunks - 1 - rank
    return _concatenate([_take(x, dim, rank * size, (rank + 1) * size),
                         _take(x, dim, other * size, (other + 1) * size)], dim)


def unshard(shards, layout="contiguous", dim=2):
    """The whole sequence from the shards of ranks ``0 .. world - 1`` (a list, in rank order): inverse of
    :func:`shard`."""
    shards = list(shards)
    if not shards:
        raise ValueError("shards: expected one shard per rank, got none")
    layout = _check_layout(layout, False)
    shape = tuple(shards[0].shape)
    for index, part in enumerate(shards):
        if tuple(part.shape) != shape:
            raise ValueError(f"shards: shard {index} has shape {tuple(part.shape)}, shard 0 {shape}")
    dim = _check_dim(dim, len(shape), "shards")
    if layout == "contiguous":
        return _concatenate(shards, dim)
    world, length = len(shards), shape[dim]
    if length % 2:
        raise ValueError(f"shards: zigzag shards hold two chunks each, got an odd length {length} (dim {dim})")
    half = length // 2
    chunks = [None] * (2 * world)
    for rank, part in enumerate(shards):
        chunks[rank] = _take(part, dim, 0, half)
        chunks[2 * world - 1 - rank] = _take(part, dim, half, length)
    return _concatenate(chunks, dim)


def gather(x, layout="contiguous", group=None, dim=2):
    """All-gather every rank's shard ``x`` (torch tensor) of ``group`` and :func:`unshard` them: the whole
    sequence, on every rank. For tests and debugging."""
    torch, dist = _torch()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    _group_rank_and_size(dist, group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return unshard(parts, layout, dim)


def _check_inputs(torch, q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: expected shape (batch, heads, seqlen / world, headdim), got {tuple(x.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    (batch, heads, length, headdim), kv_heads = q.shape, k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, length, headdim):
        raise ValueError(f"k: expected (batch, kv_heads, seqlen, headdim) = ({batch}, kv_heads, {length}, "
                         f"{headdim}) as q {tuple(q.shape)} (shards of one sequence), got {tuple(k.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"k: kv_heads ({kv_heads}) must divide q's heads ({heads})")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {x.dtype} differs from q's {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: on {x.device}, q on {q.device}")


def _check_zigzag(layout: str, length: int, world: int) -> None:
    if world > 1 and layout == "zigzag" and length % 2:
        raise ValueError(f"q: zigzag shards hold two chunks (seqlen divisible by 2 * world = {2 * world}), got a "
                         f"shard of {length} rows")


def _merge_into(out, lse, part_out, part_lse) -> None:
    """Running LSE merge, in place, of float32 ``(out, lse)`` with a part over other keys (``reference.combine_lse``
    of the two, the same -inf / NaN rules). The weights come from the lse-sized tensors; the output-sized work is
    two in-place passes that read the part in its own dtype (scale ``out``, add the scaled part): about 22 bytes
    moved per output element, where a chain of temporaries (cast, two products, sum, quotient, copy back) moved ~52
    -- at long sequences the merges were a few percent of a ring step."""
    torch, _ = _torch()
    top = torch.maximum(lse, part_lse)  # NaN propagates
    base = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # both empty: exps of -inf, weights 0
    weight, part_weight = torch.exp(lse - base), torch.exp(part_lse - base)
    total = weight + part_weight
    scale = torch.where(total > 0, total, torch.ones_like(total))
    out.mul_((weight / scale)[..., None]).addcmul_(part_out, (part_weight / scale)[..., None])
    lse.copy_(base + torch.log(total))  # log(0) = -inf: still no key


def ring_attention(q, k, v, *, group=None, causal=False, sm_scale=None, return_lse=False, layout=None,
                   window=None, softcap=None, backend=None):
    """Exact attention over a sequence sharded across the ranks of ``group`` (default: the world).

    Args:
        q: this rank's query shard ``(batch, heads, seqlen / world, headdim)``, a torch tensor (float16, float32;
            bfloat16 on GPUs), sharded as ``layout`` says.
        k, v: this rank's key / value shards ``(batch, kv_heads, seqlen / world, headdim)``; ``kv_heads``
            divides ``heads``. All ranks pass the same shapes, dtype and options (checked before any transfer:
            a ``ValueError`` on every rank otherwise, ``agreement.check_ranks_agree``).
        group: the ``torch.distributed`` process group (initialised by the caller), default the world.
        causal: query ``i`` sees key ``j <= i`` (global positions).
        sm_scale: score scale, default ``1 / sqrt(headdim)``.
        return_lse: also return this shard's ``lse`` ``(batch, heads, seqlen / world)`` float32 (natural log).
        layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`shard`); default ``"zigzag"`` when ``causal``, else
            ``"contiguous"``. Zigzag shards have an even length (two chunks).
        window: ``flash_forward``'s sliding window ``(left, right)`` in global positions: query ``i`` sees keys
            ``i - left <= j <= i + right`` (None: unbounded side; with ``causal`` the right side is
            ``min(right, 0)``). Each (query chunk, key chunk) pair runs on the rows and keys the band reaches, pairs
            it misses are skipped (``blocks.band_block``). Default None.
        softcap: ``flash_forward``'s logit soft-capping (``c * tanh(scores / c)``); default None.
        backend: passed to ``numba_attn.flash_forward``.

    Returns:
        ``out`` (q's shard shape and dtype) or ``(out, lse)``; rows that see no key give 0 and ``lse = -inf``.
        Differentiable: with grad mode on and inputs that require grad, the backward runs over the ring too
        (``ring_backward``).
    """
    torch, dist = _torch()

    def check():
        _check_inputs(torch, q, k, v)
        flags = check_flag(causal, "causal"), check_flag(return_lse, "return_lse")
        options = _check_options(q, flags[0], layout, sm_scale)
        band = check_window(window), check_softcap(softcap)
        band = (None if band[0] == (None, None) else band[0], band[1])  # both sides open: no window
        differentiable = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        values = pack(torch, "ring_attention", q, k, flags[0], *options, differentiable, LAYOUTS, *band)
        return values, (*flags, *options, *band, differentiable)

    # the agreement is issued here and read in _forward once the own shard's kernels are queued (before the first
    # transfer): its host time and gather run beside them
    agreement = start_checked_on_every_rank(torch, dist, group, q, LAYOUTS, check)
    causal, return_lse, layout, sm_scale, window, softcap, differentiable = agreement.local
    _check_zigzag(layout, q.shape[2], agreement.world)
    if differentiable:
        from .ring_backward import RingAttention

        out, lse = RingAttention().apply(q, k, v, group, causal, sm_scale, layout, window, softcap, backend,
                                         agreement)
    else:
        out, lse = _forward(q, k, v, group, causal, sm_scale, layout, window, softcap, backend, agreement)
    return (out, lse) if return_lse else out


def _forward(q, k, v, group, causal: bool, sm_scale: float, layout: str, window, softcap, backend, agreement=None):
    """``(out, lse)`` of ``ring_attention`` for checked arguments; ``agreement`` (``agreement.Agreement``, issued by the
    caller; None when already read) is read after the own shard's kernels are queued and before any transfer."""
    from .. import api

    torch, dist = _torch()
    rank, world = _group_rank_and_size(dist, group)
    length = q.shape[2]

    def attend(q_part, k_part, v_part, part_causal, part_window):
        return api.flash_forward(q_part, k_part, v_part, causal=part_causal, sm_scale=sm_scale, return_lse=True,
                                 window=part_window, softcap=softcap, backend=backend)

    # the blocks of every step, worked out once on the host
    plan = [_blocks(rank, (rank - step) % world, length, causal, layout, window, world) for step in range(world)]

    def kernels(step, keys_values):
        k_held, v_held = keys_values
        return [(rows, attend(q[:, :, rows], k_held[:, :, keys], v_held[:, :, keys], part_causal, part_window))
                for rows, keys, part_causal, part_window in plan[step]]

    if world == 1:  # one rank: both layouts are the identity
        return attend(q, k, v, causal, window)

    def peer(group_rank):
        return group_rank if group is None else dist.get_global_rank(group, group_rank)

    send_to, receive_from = peer((rank + 1) % world), peer((rank - 1) % world)
    k, v = k.contiguous(), v.contiguous()  # sent as they are (no stacked copy)
    side = _side_stream(torch, q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if q.is_cuda else None
    inputs_ready = _event(torch, q)  # the caller's work on k, v so far: the first transfer waits for it alone
    # without a window the own shard's one block covers every row: it is the accumulator as it comes; with one, its
    # blocks may not (zigzag's two chunks lie apart), so every part is merged into an empty accumulator
    merged = [(step, index) for step in range(1 if window is None else 0, world) for index in range(len(plan[step]))]
    last_merge = merged[-1] if merged else None  # its merge writes q's dtype
    accumulator = (_KernelAccumulator if _merge_kernel_applies(q) else _TorchAccumulator)(torch, q)
    if window is not None:
        accumulator.empty()
    parts = kernels(0, (k, v))  # the own shard needs no transfer: queued first
    if agreement is not None:
        agreement.result()  # raises (on every rank) before any transfer when the ranks disagree
    # held[s]: the shard of step s; two receive buffers alternate (step s >= 3 receives into the one step s - 2 read)
    receive = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(min(2, world - 1))]
    held = [(k, v)] + [receive[(step - 1) % 2] for step in range(1, world)]
    requests, arrived = [None] * world, [None] * world

    def arrive(step, stream):
        """``stream`` (None: the host) waits for step ``step``'s shard. Each request is waited for once (a second
        ``wait`` of a finished gloo request does not return); later waits on GPUs wait for an event after it."""
        if arrived[step] is None:
            _wait(torch, stream, requests[step])
            arrived[step] = True if stream is None else _event(torch, q, stream)
        elif stream is not None:
            stream.wait_event(arrived[step])

    def transfer(step):
        """Issue the transfer that brings step ``step``'s shard: send ``held[step - 1]`` on, receive
        ``held[step]``. It waits (on the side stream) for the shard it sends to be there -- the caller's inputs or
        the previous transfer -- and, from step 3, for the kernels of step ``step - 2``, which read its buffer."""
        if step == 1:
            _after(torch, side, inputs_ready)
        else:
            arrive(step - 1, side)
        if step >= 3:
            _after(torch, side, _event(torch, q))  # (issued right after step - 2's kernels)
        requests[step] = _issue(torch, dist, held[step - 1], held[step], send_to, receive_from, group, side)

    # the first two transfers now: their NCCL kernels start beside the own shard's (with high-priority NCCL streams,
    # docs/design/distributed.md); from step 3 each transfer is issued after the kernels of step - 2 (its buffer's)
    for step in range(1, min(3, world)):
        transfer(step)
    for step in range(world):
        if step:
            arrive(step, torch.cuda.current_stream(q.device) if side is not None else None)
            parts = kernels(step, held[step])
        if step + 2 < world and step:
            transfer(step + 2)  # issued before this step's merges: it starts while they run
        for index, (rows, (part_out, part_lse)) in enumerate(parts):
            if step == 0 and window is None:  # the own shard, every row (``_blocks``): the first accumulator
                accumulator.first(part_out, part_lse)
            else:
                accumulator.merge(rows, part_out, part_lse, (step, index) == last_merge)
    return accumulator.result()


@functools.lru_cache(maxsize=None)
def _side_stream(torch, device_index: int):
    """The transfers' stream on a GPU (one per device, made once: a stream per call cost host time)."""
    return torch.cuda.Stream(device=device_index)


def _event(torch, q, stream=None):
    """An event recorded now on ``stream`` (default: the current stream of q's GPU); None on CPUs."""
    if not q.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(q.device) if stream is None else stream)
    return event


def _after(torch, side, event) -> None:
    if side is not None:
        side.wait_event(event)


def _issue(torch, dist, sends, receives, send_to, receive_from, group, side):
    """``isend`` each of ``sends`` to the next rank and ``irecv`` each of ``receives`` from the previous one, batched
    (on GPUs under ``side``: NCCL's stream waits for what ``side`` waits for)."""
    ops = ([dist.P2POp(dist.isend, x, send_to, group) for x in sends]
           + [dist.P2POp(dist.irecv, x, receive_from, group) for x in receives])
    if side is None:
        return dist.batch_isend_irecv(ops)
    with torch.cuda.stream(side):
        requests = dist.batch_isend_irecv(ops)
    for x in (*sends, *receives):
        x.record_stream(side)
    return requests


def _exchange(torch, dist, send, receive, send_to, receive_from, group, side):
    """Issue ``isend(send)`` to the next rank and ``irecv(receive)`` from the previous one (on GPUs on ``side``,
    after the current stream's work so far)."""
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(send.device))  # the shard (and the receive buffer) are ready
    return _issue(torch, dist, [send], [receive], send_to, receive_from, group, side)


def _wait(torch, stream, requests) -> None:
    """``stream`` (a CUDA stream; None: the host) waits for ``requests``."""
    if stream is None:
        for request in requests:
            request.wait()
        return
    with torch.cuda.stream(stream):
        for request in requests:
            request.wait()


def _merge_kernel_applies(q) -> bool:
    """Whether ``_forward`` merges with the kernel of ``merge.py``: CUDA tensors, unless ``NUMBA_ATTN_RING_MERGE`` is
    ``torch`` (CPU tensors, as in the gloo tests, always merge with torch ops)."""
    from .merge import merge_choice

    return merge_choice() == "kernel" and q.is_cuda


class _TorchAccumulator:
    """The running ``(out, lse)`` in torch float32: the first part copied in, :func:`_merge_into` per step, one cast to
    q's dtype at the end."""

    def __init__(self, torch, q):
        self.dtype = q.dtype
        self.out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        self.lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)

    def first(self, part_out, part_lse) -> None:
        self.out.copy_(part_out)
        self.lse.copy_(part_lse)

    def empty(self) -> None:
        self.out.zero_()
        self.lse.fill_(-math.inf)

    def merge(self, rows, part_out, part_lse, last: bool) -> None:
        _merge_into(self.out[:, :, rows], self.lse[:, :, rows], part_out, part_lse)

    def result(self):
        return self.out.to(self.dtype), self.lse


class _KernelAccumulator:
    """The running ``(out, lse)`` merged by ``merge.merge_into``, one kernel per merge. The first part (q's dtype, a
    fresh output of ``flash_forward``) is the accumulator as it comes; the first merge before the last widens it to
    float32 (the part read once, the float32 rows written once), later ones merge in place, and the last merge writes
    q's dtype (in place into the first part when no merge came between; else into a new array: the final cast fused
    into it). Rows a merge does not cover (zigzag's ``q0`` in the ``s > r`` steps) are copied across where a merge
    changes the array."""

    def __init__(self, torch, q):
        self.torch, self.dtype, self.length = torch, q.dtype, q.shape[2]
        self.shape, self.device = tuple(q.shape), q.device
        self.out = self.lse = None

    def first(self, part_out, part_lse) -> None:
        self.out, self.lse = part_out, part_lse

    def empty(self) -> None:
        """Start from no key: 0 and ``-inf`` in float32 (a windowed call merges every part into it)."""
        self.out = self.torch.zeros(self.shape, dtype=self.torch.float32, device=self.device)
        self.lse = self.torch.full(self.shape[:-1], -math.inf, dtype=self.torch.float32, device=self.device)

    def merge(self, rows, part_out, part_lse, last: bool) -> None:
        from .merge import merge_into

        torch, out = self.torch, self.out
        target = self.dtype if last else torch.float32
        if out.dtype == target:
            merge_into(out[:, :, rows], self.lse[:, :, rows], part_out, part_lse)
            return
        dest = torch.empty(out.shape, dtype=target, device=out.device)
        merge_into(out[:, :, rows], self.lse[:, :, rows], part_out, part_lse, final_out=dest[:, :, rows])
        start, stop, _ = rows.indices(self.length)
        for other in (slice(0, start), slice(stop, self.length)):
            if other.stop > other.start:
                dest[:, :, other].copy_(out[:, :, other])
        self.out = dest

    def result(self):
        return self.out.to(self.dtype), self.lse
