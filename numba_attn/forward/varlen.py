"""Packed sequences of different lengths (``flash_forward_varlen``): argument checks, the schedule, the launch.

The tokens of all sequences lie one after the other, ``q`` ``(total_q, heads, headdim)``, ``k`` and ``v``
``(total_k, kv_heads, headdim)``, sequence ``b`` owning rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of ``q`` and
``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` of ``k`` and ``v`` (``reference.attention_varlen``). The forward kernels
see the packed arrays as views ``(1, heads, total, headdim)`` (no copy) and run one thread block per (query block of
one sequence, head): the ``block_info.PACKED`` grid over a *schedule*, an int32 array of ``SCHEDULE_WORDS`` words per
block -- its first row, its sequence's end row, its sequence's first and end key -- so that no block works on
padding and a sequence's blocks start on its first row. Its keys, masks and diagonal are the sequence's own
(``block_info.sequence_bounds_of``). The ``cp.async`` kernels never read rows and keys of other sequences; the
warp-specialised one (``wgmma_ws``, taken where a dense call would take it: ``choose``) copies whole TMA boxes over
the packed arrays, so a block's last tiles run into the next sequence's rows and keys (zeros past the arrays' end):
the masks hide those keys (probability 0 against finite values of V) and the stores stop at the sequence's end.

The schedule is made where ``cu_seqlens`` are:

* host arrays (NumPy, lists, torch CPU tensors) are checked here (1-d, start at 0, non-decreasing, end at the token
  counts, one length) and the schedule is built with NumPy, its blocks ordered by decreasing work (keys visited), then
  copied to the device;
* device arrays (int32, on q's device and library) are not read back (no synchronisation): a one-block kernel
  (``plan_kernel``) scans their lengths into the schedule on the device. Their values are the caller's contract (as
  in FlashAttention): offsets outside the arrays read and write out of bounds. The grid then has room for the most
  blocks any lengths could need, ``(total_q + batch (block_m - 1)) // block_m`` (at most ``batch`` more than needed;
  fewer with ``max_seqlen_q``), and the blocks past the real ones get an empty sequence: they load nothing and write
  nothing.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
from numba import int32

from ..core.block_info import SCHEDULE_WORDS
from ..core.scores import kernel_scale
from ..runtime.arguments import ArgumentTypeError
from ..runtime.arrays import prepare
from ..runtime.attention_args import AttentionArgs
from ..runtime.device import SIMULATOR, cuda, kernel_jit, on_device
from ..runtime.launch import launch as device_launch
from ..runtime.shapes import MAX_HEAD_DIM, check_array
from ..runtime.views import restride
from . import dispatch as _dispatch
from . import mma as _mma
from . import simt as _simt
from . import tf32 as _tf32
from . import wgmma as _wgmma
from . import wgmma_ws as _wgmma_ws

#: threads of the planning kernel (a block-wide scan over the sequences, then one entry per thread at a time)
PLAN_THREADS = 32 if SIMULATOR else 256
#: padded head dims at which packed sequences take the warp-specialised kernel by default (rows seeing at least
#: ``WS_MIN_KEYS`` keys on average): dense calls take it at 128 only, but on packed sequences it also beat
#: ``wgmma`` at 64 (H100, 2026-11-26 03:31, 16 sequences of 512..16k causal, D64 H32: 263 against 208 TFLOP/s)
WS_HEAD_DIMS = frozenset({64, 128})
#: ... for batches whose rows see at least this many keys on average (``mean_keys``); measured at 512..16k-token
#: sequences, so kept at the dense rule's earlier value when that one went down to 512 (``dispatch.WS_MIN_KEYS``)
WS_MIN_KEYS = 1024


# -- checks ------------------------------------------------------------------------------------------------------------
def on_host(x) -> bool:
    """Whether ``cu_seqlens`` came from the host (NumPy, a list or tuple, a torch CPU tensor)."""
    if isinstance(x, (np.ndarray, list, tuple)):
        return True
    module = type(x).__module__
    return module.startswith("torch") and not x.is_cuda


def host_offsets(cu_seqlens, name: str, total: int, array_name: str) -> np.ndarray:
    """``cu_seqlens`` from the host as int64 offsets ``[0, ..., total]``, non-decreasing; ValueError naming it."""
    if type(cu_seqlens).__module__.startswith("torch"):
        cu_seqlens = cu_seqlens.numpy()
    offsets = np.asarray(cu_seqlens)
    if offsets.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name}: expected integers (cumulative sequence lengths), got dtype {offsets.dtype}")
    offsets = offsets.astype(np.int64)
    if offsets.ndim != 1 or offsets.size < 1:
        raise ValueError(f"{name}: expected a 1-d array of batch + 1 offsets, got shape {offsets.shape}")
    if offsets[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {offsets[:8].tolist()}")
    if (np.diff(offsets) < 0).any():
        bad = int(np.argmax(np.diff(offsets) < 0))
        raise ValueError(f"{name}: must be non-decreasing, got {name}[{bad}] = {offsets[bad]} > "
                         f"{name}[{bad + 1}] = {offsets[bad + 1]}")
    if offsets[-1] != total:
        raise ValueError(f"{name}: must end at {array_name}'s number of tokens ({total}), got {int(offsets[-1])}")
    if total > np.iinfo(np.int32).max:
        raise ValueError(f"{name}: {total} tokens; the kernels index tokens with int32")
    return offsets


def check_device_offsets(cu_seqlens, name: str) -> None:
    """A device ``cu_seqlens``: 1-d, at least one entry (its dtype and place: ``arrays.prepare``)."""
    if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-d array of batch + 1 offsets, got shape {tuple(cu_seqlens.shape)}")


def check_max_seqlen(value, name: str):
    """``max_seqlen_q`` / ``max_seqlen_k``: None or an integer >= 0 (not a bool)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an integer >= 0 or None, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected an integer >= 0 or None, got {value!r}")
    return int(value)


# -- the schedule ------------------------------------------------------------------------------------------------------
def host_schedule(cu_q: np.ndarray, cu_k: np.ndarray, block_m: int, causal: bool, window) -> np.ndarray:
    """The schedule of checked host offsets: ``SCHEDULE_WORDS`` int32 per query block of every sequence (first row,
    the sequence's end row, first key, end key), the blocks that visit the most keys first (under a causal mask or a
    window the last blocks of the longest sequences), so that the longest blocks do not start last."""
    lengths = np.diff(cu_q)
    blocks = -(-lengths // block_m)
    seq = np.repeat(np.arange(lengths.size), blocks)
    first = np.arange(seq.size) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    m0 = cu_q[seq] + first * block_m
    row_end, key_start, key_end = cu_q[seq + 1], cu_k[seq], cu_k[seq + 1]
    # the keys a block's rows see (mask.visible_start / visible_end_in, in the packed positions)
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    diag = key_end - row_end
    last_row = np.minimum(m0 + block_m, row_end)
    begin = key_start if left is None else np.clip(m0 + diag - left, key_start, key_end)
    end = key_end if right is None else np.clip(last_row + diag + right, key_start, key_end)
    order = np.argsort(-(end - begin), kind="stable")
    return np.stack([m0, row_end, key_start, key_end], axis=1)[order].astype(np.int32).reshape(-1)


def device_entries(total_q: int, batch: int, block_m: int, max_seqlen_q: int | None) -> int:
    """How many schedule entries device offsets may need: ``sum(ceil(len / block_m))`` is at most ``(total_q + batch
    (block_m - 1)) // block_m``, and at most ``batch * ceil(max_seqlen_q / block_m)``."""
    entries = (total_q + batch * (block_m - 1)) // block_m
    if max_seqlen_q is not None:
        entries = min(entries, batch * -(-max_seqlen_q // block_m))
    return entries


def plan_kernel(block_m: int):
    """``plan(cu_q, cu_k, schedule, batch, entries)``: the schedule of device offsets, in one block of
    ``PLAN_THREADS`` threads: each round scans the block counts of ``PLAN_THREADS`` sequences (Hillis-Steele in
    shared memory) into their first entries, kept past the entries (``schedule[SCHEDULE_WORDS * entries + b]``, b <=
    batch); then each entry finds its sequence by bisection over them, a sequence's blocks in reverse order (its
    last block first). Entries past the real ones get an empty sequence."""
    return _plan_kernel(block_m, PLAN_THREADS)


def _plan_kernel(block_m: int, threads: int):
    BLOCK_M = block_m
    NT = threads
    WORDS = SCHEDULE_WORDS

    @kernel_jit()
    def plan(cu_q, cu_k, schedule, batch, entries):
        tid = cuda.threadIdx.x
        counts = cuda.shared.array(NT, int32)
        starts = WORDS * entries  # where the first entry of each sequence is kept
        carry = 0
        for base in range(0, batch, NT):
            b = base + tid
            n = 0
            if b < batch:
                n = max(0, (cu_q[b + 1] - cu_q[b] + BLOCK_M - 1) // BLOCK_M)
            counts[tid] = n
            cuda.syncthreads()
            step = 1
            while step < NT:
                x = counts[tid - step] if tid >= step else 0
                cuda.syncthreads()
                counts[tid] += x
                cuda.syncthreads()
                step *= 2
            if b < batch:
                schedule[starts + b] = carry + counts[tid] - n
            carry += counts[NT - 1]
            cuda.syncthreads()  # everyone has read counts[NT - 1] before the next round writes it
        if tid == 0:
            schedule[starts + batch] = carry
        cuda.syncthreads()  # the first entries (global memory) are visible to the whole block
        for e in range(tid, entries, NT):
            at = WORDS * e
            if e < carry:
                lo = 0  # schedule[starts + lo] <= e < schedule[starts + hi]
                hi = batch
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if schedule[starts + mid] <= e:
                        lo = mid
                    else:
                        hi = mid
                # a sequence's blocks last first: under a causal mask the ones that visit the most keys start
                # first, and a grid's last blocks are short ones (as the host schedule's order does it)
                schedule[at] = cu_q[lo] + (schedule[starts + lo + 1] - 1 - e) * BLOCK_M
                schedule[at + 1] = cu_q[lo + 1]
                schedule[at + 2] = cu_k[lo]
                schedule[at + 3] = cu_k[lo + 1]
            else:
                schedule[at] = 0
                schedule[at + 1] = 0
                schedule[at + 2] = 0
                schedule[at + 3] = 0

    return plan


_PLANS: dict = {}


def device_schedule(call, cu_q, cu_k, batch: int, entries: int, block_m: int):
    """The schedule of device offsets, made on the call's stream: ``entries`` entries and the ``batch + 1`` first
    entries of the sequences after them (scratch of the planning kernel)."""
    buffer = call.scratch((SCHEDULE_WORDS * entries + batch + 1,), "int32")
    plan = _PLANS.get(block_m)
    if plan is None:
        plan = _PLANS[block_m] = plan_kernel(block_m)
    device_launch(plan, (1,), (PLAN_THREADS,), call.stream, 0, cu_q, cu_k, buffer, np.int32(batch),
                  np.int32(entries))
    return restride(buffer, (SCHEDULE_WORDS * entries,), tuple(buffer.strides))  # the entries (no copy)


# -- one call ----------------------------------------------------------------------------------------------------------
def packed_shape(q, k, v) -> tuple:
    """``(total_q, total_k, heads, kv_heads, head_dim)`` of packed ``q``, ``k``, ``v``; ValueError naming the array."""
    for name, x, what in (("q", q, "total_q, heads"), ("k", k, "total_k, kv_heads"), ("v", v, "total_k, kv_heads")):
        check_array(name, x)
        if len(x.shape) != 3:
            raise ValueError(f"{name}: expected shape ({what}, headdim), got {tuple(x.shape)}")
    total_q, heads, head_dim = (int(n) for n in q.shape)
    total_k, kv_heads, _ = (int(n) for n in k.shape)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"k: number of heads {kv_heads} must divide q's {heads} (grouped-query attention)")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q: headdim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}")
    if k.shape[2] != head_dim:
        raise ValueError(f"k: headdim must equal q's headdim {head_dim}, got {k.shape[2]}")
    return total_q, total_k, heads, kv_heads, head_dim


def batched(view, shape: tuple):
    """``(total, heads, ...)`` -> ``(1, heads, total, ...)``: the kernels' layout of a packed array, no copy."""
    strides = tuple(view.strides)
    return restride(view, (1, shape[1], shape[0]) + tuple(shape[2:]), (0, strides[1], strides[0]) + strides[2:])


#: the 16-bit mma kernel's tiles for packed sequences above head dim 64: their bounds are run-time values (a
#: sequence's rows and keys start anywhere), and with the default 2 m-tiles per warp ptxas spilled 180-210 bytes at
#: head dims 128 and 256; 8 warps of 1 m-tile (a tuning candidate, the same 128 rows) spill nothing
PACKED_MMA_CONFIG = _mma.MmaConfig(warps=8, m_tiles=1)


def mean_keys(offsets, total_k: int, batch: int, causal: bool) -> float:
    """The keys a query row sees on average, as ``dispatch.backend_for`` counts them for a dense call (``seqlen_k``,
    halved when causal): from host offsets the rows' mean ``sum(Lq Lk) / sum(Lq)``, from device offsets (never read
    back) the batch's mean key length ``total_k / batch``."""
    if offsets is None:
        keys = total_k / max(batch, 1)
    else:
        lengths_q, lengths_k = np.diff(offsets[0]), np.diff(offsets[1])
        keys = float(np.dot(lengths_q, lengths_k)) / max(int(lengths_q.sum()), 1)
    return keys / 2 if causal else keys


def choose(backend, call, views, head_dim: int, offsets, batch: int, causal: bool) -> str:
    """The kernel of a packed call: ``dispatch.choose_backend`` as for a dense call of as many keys per row on
    average (``mean_keys``), with ``"wgmma_ws"`` at the padded head dims of ``WS_HEAD_DIMS``; ``"wgmma"`` in its
    place when no tensor map can be had now (``wgmma_ws.tensor_maps``: the schedule is made for the kernel that
    runs)."""
    wgmma_ok = _dispatch.wgmma_applies(call.dtype, head_dim, *views)
    ws_ok = (backend is None and wgmma_ok and _wgmma_ws.padded_head_dim(head_dim) in WS_HEAD_DIMS
             and _wgmma_ws.supports(call.dtype, head_dim, *views)
             and mean_keys(offsets, int(views[1].shape[2]), batch, causal) >= WS_MIN_KEYS)
    chosen = _dispatch.choose_backend(backend, call.dtype, False, wgmma_ok, ws_ok)
    if chosen == "wgmma_ws" and _wgmma_ws.supports(call.dtype, head_dim, *views) \
            and _wgmma_ws.tensor_maps(*views, _wgmma_ws.default_config(), call.stream) is None:
        chosen = "wgmma"
    return chosen


def kernel_config(backend: str, dtype: str, head_dim: int):
    """The tiles a packed call runs with (no tuning): the kernel's default, but ``PACKED_MMA_CONFIG`` for the
    16-bit mma kernel above head dim 64 on a GPU. Its ``block_m`` is the schedule's block size."""
    if backend == "wgmma_ws":
        return _wgmma_ws.default_config()
    if backend == "wgmma":
        return _wgmma.default_config()
    if backend == "mma" and dtype == "float32":
        return _tf32.default_config(head_dim)
    if backend == "mma":
        if not SIMULATOR and _mma.padded_head_dim(head_dim) > 64:
            return PACKED_MMA_CONFIG
        return _mma.default_config(head_dim)
    return _simt.default_config(head_dim)


def run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: bool, sm_scale, window, softcap,
        return_lse: bool, out, backend, lse_placeholder):
    """``flash_forward_varlen`` with its scalar arguments checked (``api``): the arrays' checks, the schedule and
    the launch. ``lse_placeholder(call)``: the lse view kernels take when they write none."""
    total_q, total_k, heads, kv_heads, head_dim = packed_shape(q, k, v)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if softcap is not None:
        kernel_scale(sm_scale, softcap)  # ValueError where the kernels' float32 scales would not be finite
    max_seqlen_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q")
    offsets = check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                       check_max_seqlen(max_seqlen_k, "max_seqlen_k"))
    arrays = {"q": q, "k": k, "v": v}
    if offsets is None:  # device offsets: checked for place and dtype with the arrays
        arrays.update(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    call = prepare(arrays, own_dtype={"cu_seqlens_q": ("int32",), "cu_seqlens_k": ("int32",)})
    with on_device(call.device_id):
        q4 = batched(call.inputs["q"], (total_q, heads, head_dim))
        k4, v4 = (batched(call.inputs[name], (total_k, kv_heads, head_dim)) for name in "kv")
        batch = (cu_seqlens_q.shape[0] if offsets is None else len(offsets[0])) - 1
        chosen = choose(backend, call, (q4, k4, v4), head_dim, offsets, batch, causal)
        result = call.output((total_q, heads, head_dim), out=out)
        lse = call.output((heads, total_q), "float32", name="lse") if return_lse else None
        if total_q > 0 and heads > 0:
            config = kernel_config(chosen, call.dtype, head_dim)
            block_m = config.block_m
            if offsets is not None:
                schedule = call.upload(host_schedule(*offsets, block_m, causal, window))
            else:
                entries = device_entries(total_q, batch, block_m, max_seqlen_q)
                schedule = device_schedule(call, call.inputs["cu_seqlens_q"], call.inputs["cu_seqlens_k"], batch,
                                           entries, block_m) if entries else None
            if schedule is not None and schedule.shape[0]:
                lse_view = restride(lse.view, (1, heads, total_q), (0,) + tuple(lse.view.strides)) if return_lse \
                    else lse_placeholder(call)
                args = AttentionArgs(q4, k4, v4, batched(result.view, (total_q, heads, head_dim)), lse_view,
                                     return_lse, sm_scale, causal, window, softcap)
                _launch(chosen, call, args, config, schedule)
        if return_lse:
            return call.result(result), call.result(lse)
        return call.result(result)


def check_offsets(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q, max_seqlen_k):
    """Checked host offsets ``(cu_q, cu_k)`` (int64), or None for device offsets after their shape checks."""
    host = on_host(cu_seqlens_q)
    if on_host(cu_seqlens_k) != host:
        raise ValueError("cu_seqlens_k: must live where cu_seqlens_q lives (both on the host or both on the device)")
    if not host:
        for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            check_array(name, x)
            check_device_offsets(x, name)
        if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
            raise ValueError(f"cu_seqlens_k: describes {cu_seqlens_k.shape[0] - 1} sequences but cu_seqlens_q "
                             f"{cu_seqlens_q.shape[0] - 1}")
        return None
    cu_q = host_offsets(cu_seqlens_q, "cu_seqlens_q", total_q, "q")
    cu_k = host_offsets(cu_seqlens_k, "cu_seqlens_k", total_k, "k")
    if cu_k.size != cu_q.size:
        raise ValueError(f"cu_seqlens_k: describes {cu_k.size - 1} sequences but cu_seqlens_q {cu_q.size - 1}")
    for name, given, offsets in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_k", max_seqlen_k, cu_k)):
        longest = int(np.diff(offsets).max(initial=0))
        if given is not None and given < longest:
            raise ValueError(f"{name}: {given} is shorter than the longest sequence ({longest})")
    return cu_q, cu_k


def _launch(backend: str, call, args, config, schedule) -> None:
    """The kernel of ``backend`` with ``config`` (``kernel_config``: the tiles that sized the schedule) over packed
    views."""
    options = dict(args.variant_options(), schedule=schedule)
    if backend == "mma" and call.dtype == "float32":
        _tf32.launch(*args.launch_args(), call.stream, config=config, **options)
    elif backend in ("mma", "wgmma", "wgmma_ws"):
        launch = {"mma": _mma.launch, "wgmma": _wgmma.launch, "wgmma_ws": _wgmma_ws.launch}[backend]
        launch(*args.launch_args(), call.stream, config=config, dtype=call.dtype, **options)
    else:
        _simt.launch(*args.launch_args(), call.stream, config=config, **options)
