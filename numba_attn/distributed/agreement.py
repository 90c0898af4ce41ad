"""Cross-rank agreement of ring attention's arguments: one small all_gather per call, before any transfer.

Ring attention trusts every rank of the group to pass the same shapes, dtype and options. Without a check a rank
with another shard length, head count or dtype sends messages of another size (gloo / NCCL fail or hang), one with
another ``causal``, ``layout`` or ``sm_scale`` computes another attention (a silently wrong answer), and one that
records the backward (grad mode on, an input requiring grad) while another does not waits forever in the
backward's transfers. :func:`check_ranks_agree` packs what must agree into a few int64 (:func:`pack`),
all-gathers them over the group and raises the same ``ValueError`` on every rank when they differ, naming the
argument and each rank's value. A rank whose own arguments failed the local checks (a ``TypeError`` or
``ValueError``) takes part too, with its refusal marked: it raises its own error and the others a ``ValueError``
naming that rank and the argument, so that no rank is left waiting in a later collective.

Cost: one all_gather of ``len(FIELDS) + 1`` int64 per call, issued asynchronously
(:func:`start_checked_on_every_rank`) and read when the caller is about to issue what depends on it. It runs on the
CPU when the group has a CPU backend (gloo, or ``"cpu:gloo,cuda:nccl"``), else (NCCL only) on the group's GPU, on a
high-priority stream of its own: reading the result back waits for the gather, not for the work queued on the
caller's stream (which it used to drain).
``NUMBA_ATTN_RING_CHECK=0`` turns the check off (for callers that guarantee agreement and want no host sync; a
mismatch may then hang or answer wrongly).
"""
from __future__ import annotations

import contextlib
import functools
import os
import struct

CHECK_ENV = "NUMBA_ATTN_RING_CHECK"

#: what must agree: ``(label, how a value is shown)``; :func:`pack` gives the values in this order. Labels start
#: with the argument's name (the package's rule for messages).
FIELDS = (
    ("call", "call"),
    ("q: batch (dim 0)", "int"),
    ("q: heads (dim 1)", "int"),
    ("k: kv_heads (dim 1)", "int"),
    ("q: seqlen / world (dim 2, the shard length)", "int"),
    ("q: headdim (dim 3)", "int"),
    ("q: dtype", "dtype"),
    ("q: device type", "device"),
    ("causal", "bool"),
    ("layout", "layout"),
    ("sm_scale", "float"),
    ("q, k, v: differentiable (grad mode on and an input that requires grad)", "bool"),
    ("window: left side", "side"),
    ("window: right side", "side"),
    ("softcap", "float"),
)
CALLS = ("ring_attention", "ring_attention_backward")
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "meta")
#: the arguments a local refusal may name (its message starts with the name): the other ranks name it too
_ARGUMENTS = ("q", "k", "v", "dout", "out", "lse", "causal", "return_lse", "layout", "sm_scale", "deterministic",
              "backend", "window", "softcap")


def group_rank_and_size(dist, group):
    """This process's rank in ``group`` and the group's size; ``RuntimeError`` / ``ValueError`` when there is no
    initialised group or this process is not in it (raised on every such process alike: no collective waits)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised (call torch.distributed.init_process_group "
                           "first)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    return rank, dist.get_world_size(group)


@functools.lru_cache(maxsize=None)
def _dtypes(torch):
    # every torch dtype, in a fixed order (the same on every rank with the same torch)
    return tuple(sorted({x for x in vars(torch).values() if isinstance(x, torch.dtype)}, key=str))


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x + 0.0))[0]  # + 0.0: -0.0 and 0.0 scale alike


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def pack(torch, call, q, k, causal, layout, sm_scale, differentiable, layouts, window=None, softcap=None):
    """This rank's values of :data:`FIELDS` (ints) for validated arguments; ``sm_scale`` resolved (a float),
    ``window`` None or ``(left, right)`` (ints >= 0 or None), ``softcap`` None or a float."""
    device = q.device.type
    batch, heads, length, headdim = q.shape
    left, right = (None, None) if window is None else window
    return (CALLS.index(call), batch, heads, k.shape[1], length, headdim, _dtypes(torch).index(q.dtype),
            _DEVICE_TYPES.index(device) if device in _DEVICE_TYPES else len(_DEVICE_TYPES), int(causal),
            layouts.index(layout), _float_bits(float(sm_scale)), int(differentiable), _side(left), _side(right),
            _float_bits(0.0 if softcap is None else float(softcap)))


def _side(value) -> int:
    # a window side: -1 unbounded (None, also without a window: the same attention), else the int
    return -1 if value is None else int(value)


def _refusal_code(error) -> int:
    if error is None:
        return 0
    name = str(error).split(":", 1)[0]
    return 1 + (_ARGUMENTS.index(name) if name in _ARGUMENTS else len(_ARGUMENTS))


def _device(torch, dist, group, q):
    """Where the check's all_gather runs: the CPU if the group has a CPU backend (no wait for queued GPU work),
    else this rank's GPU."""
    devices = set()
    for part in str(dist.get_backend(group)).split(","):  # "gloo", "nccl", "cpu:gloo,cuda:nccl" or "undefined"
        device, _, name = part.rpartition(":")
        # "undefined" (init_process_group without a backend): torch's default map, gloo for the CPU
        devices.update([device] if device else ["cpu"] if name.lower() == "undefined" else
                       dist.Backend.backend_capability.get(name.lower(), ["cpu"]))
    if "cpu" in devices:
        return torch.device("cpu")
    if isinstance(q, torch.Tensor) and q.device.type != "cpu":
        return q.device
    return torch.device("cuda", torch.cuda.current_device())


def _show(kind, value, torch, layouts):
    if kind == "bool":
        return str(bool(value))
    if kind == "side":
        return "None" if value < 0 else str(value)
    if kind == "float":
        return repr(_bits_float(value))
    if kind == "call":
        return CALLS[value]
    if kind == "layout":
        return repr(layouts[value])
    if kind == "dtype":
        return str(_dtypes(torch)[value]).replace("torch.", "")
    if kind == "device":
        return _DEVICE_TYPES[value] if value < len(_DEVICE_TYPES) else "another device type"
    return str(value)


def _who(ranks, values, show) -> str:
    """``rank 0 has 8, rank 1 has 6``; ranks that agree with each other together (``ranks [0, 2] have 8``)."""
    holders = {}
    for rank, value in zip(ranks, values):
        holders.setdefault(value, []).append(rank)
    return ", ".join(f"rank {group[0]} has {show(value)}" if len(group) == 1 else
                     f"ranks {group} have {show(value)}" for value, group in holders.items())


def enabled() -> bool:
    """``NUMBA_ATTN_RING_CHECK`` (default on): whether calls check their ranks' agreement."""
    return os.environ.get(CHECK_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class Agreement:
    """A check issued and not yet read: :meth:`result` reads the gathered table (waiting for the gather) and raises
    the same error as every other rank where it shows a refusal or values that differ; else returns what the
    entry's own check gave (``local``) and ``(rank, world)``. Reading it once is enough (later calls return the same
    answer). Issue first, read later: the gather runs while the caller queues work that needs no other rank (ring
    attention: the own shard's kernels), and nothing that depends on the agreement (a transfer) is issued before it
    is read."""

    def __init__(self, read, local, rank: int, world: int):
        self._read, self.local, self.rank, self.world = read, local, rank, world

    def result(self):
        if self._read is not None:
            read, self._read = self._read, None
            read()
        return self.local, (self.rank, self.world)


def checked_on_every_rank(torch, dist, group, q, layouts, check):
    """``check()`` -> ``(values, result)``: an entry's own argument checks (``values`` from :func:`pack`). Runs them,
    then :func:`check_ranks_agree`; a rank whose check raises still takes part, so no rank is left waiting. Returns
    ``(result, world)``."""
    local, (_, world) = start_checked_on_every_rank(torch, dist, group, q, layouts, check).result()
    return local, world


def start_checked_on_every_rank(torch, dist, group, q, layouts, check) -> Agreement:
    """:func:`checked_on_every_rank` in two halves: runs ``check()`` and issues the gather now, and returns the
    :class:`Agreement` whose ``result()`` reads it. A rank whose own check refused reads at once (and raises)."""
    try:
        values, local = check()
        refused = None
    except (TypeError, ValueError) as error:
        values, local, refused = None, None, error
    agreement = start_check_ranks_agree(torch, dist, group, values, refused, q, layouts)
    agreement.local = local
    if refused is not None:
        agreement.result()  # raises
    return agreement


def check_ranks_agree(torch, dist, group, values, refused=None, q=None, layouts=()):
    """Raise the same error on every rank of ``group`` unless all passed the same ``values`` (:func:`pack`; None
    where this rank refused its arguments, ``refused`` the error it raised). Returns ``(rank, world)``.

    A refusing rank raises ``refused`` itself, after taking part in the all_gather. Ranks are named by their global
    rank. ``q`` (this rank's query, maybe not a tensor) picks the GPU for NCCL-only groups."""
    return start_check_ranks_agree(torch, dist, group, values, refused, q, layouts).result()[1]


def start_check_ranks_agree(torch, dist, group, values, refused=None, q=None, layouts=()) -> Agreement:
    """:func:`check_ranks_agree` in two halves: the all_gather issued now (asynchronously), read and judged by the
    returned :class:`Agreement`'s ``result()``."""
    if refused is not None and not (dist.is_available() and dist.is_initialized()):
        raise refused  # no group, so no rank waits in a collective
    rank, world = group_rank_and_size(dist, group)
    if world == 1 or not enabled():
        if refused is not None:
            raise refused
        return Agreement(None, None, rank, world)
    mine = (list(values) if refused is None else [0] * len(FIELDS)) + [_refusal_code(refused)]
    device = _device(torch, dist, group, q)
    # into one flat tensor, read back by a copy: no kernel after NCCL's own (on a GPU the list form's copy-out
    # kernels waited for the SMs an attention kernel queued meanwhile held, so the read waited for that kernel)
    with _own_stream(torch, device):
        gathered = torch.tensor(mine, dtype=torch.int64, device=device)
        table = torch.empty(world * len(mine), dtype=torch.int64, device=device)
        work = dist.all_gather_into_tensor(table, gathered, group=group, async_op=True)

    def read():
        with _own_stream(torch, device):
            if work is not None:
                work.wait()
            flat = table.cpu().tolist()
        rows = [flat[r * len(mine):(r + 1) * len(mine)] for r in range(world)]
        ranks = list(range(world)) if group is None else [dist.get_global_rank(group, r) for r in range(world)]
        _judge(rows, ranks, refused, torch, layouts)

    return Agreement(read, None, rank, world)


@functools.lru_cache(maxsize=None)
def _check_stream(torch, device_index: int):
    return torch.cuda.Stream(device=device_index, priority=-1)  # (high: what it queues goes before waiting blocks)


def _own_stream(torch, device):
    """On a GPU, a stream of the check's own (current while the gather is issued and read back): reading the table
    then waits for the gather, not for the work queued on the caller's stream. Nothing on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(_check_stream(torch, torch.cuda.current_device() if device.index is None
                                           else device.index))


def _judge(table, ranks, refused, torch, layouts) -> None:
    """Raise this rank's own refusal, else the same ``ValueError`` as every other rank where the gathered ``table``
    (a row per rank) shows a refusal or values that differ."""
    if refused is not None:
        raise refused
    refusals = [(peer, row[-1]) for peer, row in zip(ranks, table) if row[-1]]
    if refusals:
        names = [_ARGUMENTS[code - 1] if code <= len(_ARGUMENTS) else "arguments" for _, code in refusals]
        raise ValueError("; ".join(f"{name}: rank {peer} refused its {name} (its own error says why)"
                                   for name, (peer, _) in zip(names, refusals))
                         + ", so every rank of the group refuses the call")
    problems = []
    for column, (label, kind) in enumerate(FIELDS):
        column_values = [row[column] for row in table]
        if len(set(column_values)) > 1:
            show = functools.partial(_show, kind, torch=torch, layouts=layouts)
            problems.append(f"{label} differs across ranks: {_who(ranks, column_values, show)}")
    if problems:
        raise ValueError("; ".join(problems) + " (every rank of the group must pass the same shapes, dtype and "
                         "options)")
