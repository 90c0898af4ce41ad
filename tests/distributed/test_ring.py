"""numba_attn.distributed.ring_attention against reference.attention, over torch.distributed (gloo, CPU).

The multi-rank tests spawn 2 and 4 processes once each; every process group runs several cases in sequence (the
simulator and the processes' start-up are slow). The parent writes the whole inputs, each rank shards them, runs
``ring_attention`` and gathers; rank 0 saves the results, which the parent compares with the float64 reference
of the (rounded) inputs.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import socket
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import reference  # noqa: E402
from kernel_checks import TOLERANCE, assert_close_lse, rel_error  # noqa: E402
from numba_attn.distributed import gather, ring_attention, ring_attention_backward, shard, unshard  # noqa: E402
from numba_attn.distributed.agreement import _device, _who  # noqa: E402
from numba_attn.distributed.ring import _merge_into  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

# (name, dtype, causal, layout, heads, kv_heads, total seqlen, headdim, sm_scale, group ranks or None)
CASES = {
    2: [
        ("zigzag_gqa_f32", "float32", True, "zigzag", 2, 1, 16, 8, None, None),
        ("zigzag_f16", "float16", True, None, 2, 2, 16, 16, None, None),  # None: the causal default, zigzag
        ("contiguous_f32", "float32", True, "contiguous", 2, 2, 16, 8, 0.7, None),
        ("noncausal_gqa_f16", "float16", False, None, 2, 1, 16, 8, None, None),
        ("noncausal_zigzag_f32", "float32", False, "zigzag", 2, 2, 16, 8, None, None),
        ("zigzag_window_f32", "float32", True, "zigzag", 2, 1, 16, 8, None, None),
    ],
    4: [
        ("zigzag_gqa_f32", "float32", True, "zigzag", 2, 1, 32, 8, None, None),
        ("zigzag_f16", "float16", True, "zigzag", 2, 2, 32, 16, None, None),
        ("contiguous_gqa_f16", "float16", True, "contiguous", 2, 1, 32, 8, None, None),
        ("noncausal_f32", "float32", False, "contiguous", 2, 2, 32, 8, None, None),
        ("subgroup_zigzag_f32", "float32", True, "zigzag", 2, 1, 16, 8, None, [1, 3]),
        ("zigzag_window_f16", "float16", True, "zigzag", 2, 2, 32, 8, None, None),
        ("contiguous_band_f32", "float32", False, "contiguous", 2, 1, 32, 8, None, None),
    ],
}

#: the window and soft-capping of the cases that have them (global positions; a window narrower than a chunk, one
#: that spans chunks, a band with both sides)
BAND = {"zigzag_window_f32": {"window": (3, None), "softcap": 2.0},
        "zigzag_window_f16": {"window": (5, None)},
        "contiguous_band_f32": {"window": (2, 9), "softcap": 1.5}}


#: cases whose gradients are checked too (autograd through ``ring_attention``, ``ring_attention_backward``)
BACKWARD = {"zigzag_gqa_f32", "zigzag_f16", "contiguous_f32", "noncausal_gqa_f16", "contiguous_gqa_f16",
            "zigzag_window_f32", "contiguous_band_f32"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(worker, args, nprocs, timeout):
    """``torch.multiprocessing.spawn`` with a deadline: ranks still running after ``timeout`` seconds (a hang)
    are killed and the test fails instead of blocking CI."""
    context = torch.multiprocessing.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):  # raises if a rank raised
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{nprocs} ranks still running after {timeout} s: hung")


def _worker(rank, world, port, folder, cases):
    """One rank: run every case, rank 0 (of the case's group) saves the gathered results."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, dtype, causal, layout, _, _, _, _, sm_scale, ranks in cases:
            group = dist.new_group(ranks) if ranks is not None else None  # (collective: every rank calls it)
            if ranks is not None and rank not in ranks:
                continue
            group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
            inputs = np.load(os.path.join(folder, f"{name}_inputs.npz"))
            used = layout or ("zigzag" if causal else "contiguous")
            q, k, v = (shard(torch.from_numpy(inputs[x]).to(getattr(torch, dtype)), group_rank, group_size, used)
                       for x in "qkv")
            band = BAND.get(name, {})
            out, lse = ring_attention(q, k, v, group=group, causal=causal, sm_scale=sm_scale, return_lse=True,
                                      layout=layout, **band)
            only_out = ring_attention(q, k, v, group=group, causal=causal, sm_scale=sm_scale, layout=layout) \
                if name.startswith("contiguous_f32") else out
            assert out.dtype == q.dtype and out.shape == q.shape, (out.dtype, out.shape)
            assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1], (lse.dtype, lse.shape)
            assert torch.equal(only_out, out)
            whole_out, whole_lse = gather(out, used, group), gather(lse, used, group)
            grads = {}
            if name in BACKWARD:  # autograd through the ring: the backward's gradients, gathered
                dout = shard(torch.from_numpy(inputs["dout"]).to(getattr(torch, dtype)), group_rank, group_size, used)
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                ring_attention(*leaves, group=group, causal=causal, sm_scale=sm_scale, layout=layout,
                               **band).backward(dout)
                grads = {f"d{x}": gather(t.grad, used, group).float().numpy() for x, t in zip("qkv", leaves)}
            if group_rank == 0:
                np.savez(os.path.join(folder, f"{name}_result.npz"), out=whole_out.float().numpy(),
                         lse=whole_lse.numpy(), **grads)
        if world == 2:  # an odd zigzag shard: every rank refuses before any transfer
            q = torch.zeros(1, 2, 3, 8)
            try:
                ring_attention(q, q, q, causal=True)
            except ValueError as error:
                assert str(error).startswith("q: zigzag"), error
            else:
                raise AssertionError("an odd zigzag shard was accepted")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_reference(world, tmp_path):
    cases = CASES[world]
    rng = np.random.default_rng(world)
    for name, dtype, _, _, heads, kv_heads, seqlen, headdim, _, _ in cases:
        arrays = {"q": rng.standard_normal((1, heads, seqlen, headdim)),
                  "k": rng.standard_normal((1, kv_heads, seqlen, headdim)),
                  "v": rng.standard_normal((1, kv_heads, seqlen, headdim)),
                  "dout": rng.standard_normal((1, heads, seqlen, headdim))}
        np.savez(tmp_path / f"{name}_inputs.npz", **{x: a.astype(dtype) for x, a in arrays.items()})
    _spawn(_worker, (world, _free_port(), str(tmp_path), cases), world, timeout=900)
    for name, dtype, causal, _, _, _, _, _, sm_scale, _ in cases:
        inputs = np.load(tmp_path / f"{name}_inputs.npz")
        result = np.load(tmp_path / f"{name}_result.npz")
        ref_out, ref_lse = reference.attention(inputs["q"], inputs["k"], inputs["v"], causal=causal,
                                               sm_scale=sm_scale, return_lse=True, **BAND.get(name, {}))
        error = rel_error(result["out"], ref_out)
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.3g}"
        assert_close_lse(result["lse"], ref_lse, tol=1e-5)
        if name in BACKWARD:
            ref_grads = reference.attention_backward(inputs["dout"], inputs["q"], inputs["k"], inputs["v"],
                                                     causal=causal, sm_scale=sm_scale, **BAND.get(name, {}))
            for x, ref in zip(("dq", "dk", "dv"), ref_grads):
                error = rel_error(result[x], ref)
                assert error < TOLERANCE[dtype], f"{name} {x}: relative error {error:.3g}"


def test_one_rank_is_plain_attention():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rng = np.random.default_rng(5)
        q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, 7, 8)).astype(np.float32)) for _ in range(3))
        for layout in ("contiguous", "zigzag"):  # one rank: both are the identity, odd lengths included
            out, lse = ring_attention(q, k, v, causal=True, layout=layout, return_lse=True)
            ref_out, ref_lse = reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, return_lse=True)
            assert rel_error(out, ref_out) < TOLERANCE["float32"]
            assert_close_lse(lse, ref_lse, tol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_shard_unshard_round_trip(world, layout, kind):
    x = np.arange(2 * 3 * 24 * 2).reshape(2, 3, 24, 2)
    x = torch.from_numpy(x) if kind == "torch" else x
    shards = [shard(x, rank, world, layout) for rank in range(world)]
    back = unshard(shards, layout)
    assert type(back) is type(x) and np.array_equal(np.asarray(back), np.asarray(x))
    chunk = 24 // (2 * world if layout == "zigzag" else world)
    for rank, part in enumerate(shards):  # rank r holds chunk r (and, zigzag, chunk 2 * world - 1 - r)
        rows = np.asarray(part)[0, 0, :, 0] // 2
        expected = list(range(rank * chunk, (rank + 1) * chunk))
        if layout == "zigzag":
            other = 2 * world - 1 - rank
            expected += list(range(other * chunk, (other + 1) * chunk))
        assert rows.tolist() == expected
    # another axis
    y = np.arange(12 * 5).reshape(12, 5)
    assert np.array_equal(unshard([shard(y, r, 2, layout, dim=0) for r in range(2)], layout, dim=0), y)


def test_shard_bad_inputs():
    x = np.zeros((1, 1, 6, 2))
    with pytest.raises(ValueError, match="^x: sequence length 6 .* divisible by 4"):
        shard(x, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="^x: sequence length 6 .* divisible by 4"):
        shard(x, 0, 4, "contiguous")
    with pytest.raises(ValueError, match="^rank"):
        shard(x, 2, 2)
    with pytest.raises(TypeError, match="^world"):
        shard(x, 0, 2.0)
    with pytest.raises(ValueError, match="^layout"):
        shard(x, 0, 2, "ring")
    with pytest.raises(ValueError, match="^shards"):
        unshard([x, x[:, :, :4]])
    with pytest.raises(ValueError, match="^shards: zigzag"):
        unshard([x[:, :, :3], x[:, :, :3]], "zigzag")


def _qkv(heads=2, kv_heads=2, length=4, headdim=8, dtype=torch.float32):
    return (torch.zeros(1, heads, length, headdim, dtype=dtype), torch.zeros(1, kv_heads, length, headdim, dtype=dtype),
            torch.zeros(1, kv_heads, length, headdim, dtype=dtype))


def test_ring_attention_bad_inputs():
    q, k, v = _qkv()
    cases = [
        (TypeError, "^q: expected a torch.Tensor", (q.numpy(), k, v), {}),
        (TypeError, "^v: expected a torch.Tensor", (q, k, [1.0]), {}),
        (ValueError, "^k: expected shape", (q, k[0], v), {}),
        (ValueError, "^v: expected k's shape", (q, k, v[:, :, :3]), {}),
        (ValueError, "^k: expected .* got \\(1, 2, 3, 8\\)", (q, k[:, :, :3], v[:, :, :3]), {}),
        (ValueError, "^k: expected", (q, k[..., :4], v[..., :4]), {}),
        (ValueError, "^k: kv_heads \\(3\\) must divide", (q,) + _qkv(kv_heads=3)[1:], {}),
        (TypeError, "^k: dtype", (q, k.half(), v.half()), {}),
        (TypeError, "^v: dtype", (q, k, v.half()), {}),
        (RuntimeError, "^group: torch.distributed is not initialised", (q.requires_grad_(), k, v), {}),  # autograd
        (TypeError, "^causal", (q.detach(), k, v), {"causal": 1}),
        (TypeError, "^return_lse", (q.detach(), k, v), {"return_lse": None}),
        (ValueError, "^layout", (q.detach(), k, v), {"layout": "ring"}),
        (ValueError, "^sm_scale", (q.detach(), k, v), {"sm_scale": float("inf")}),
        (ValueError, "^window: left must be an int >= 0", (q.detach(), k, v), {"window": (-1, None)}),
        (ValueError, "^softcap", (q.detach(), k, v), {"softcap": -1.0}),
        (RuntimeError, "^group: torch.distributed is not initialised", (q.detach(), k, v), {}),
    ]
    assert not dist.is_initialized()
    for error, message, args, kwargs in cases:
        with pytest.raises(error, match=message):
            ring_attention(*args, **kwargs)
    with torch.no_grad():  # grad mode off: requires_grad inputs are fine (nothing to differentiate)
        with pytest.raises(RuntimeError, match="^group"):
            ring_attention(q.requires_grad_(), k, v)


#: calls whose arguments differ across the 2 ranks: (name, rank 1's changes, the message every rank raises).
#: Rank 0 calls ``ring_attention(q, k, v, layout="contiguous")`` on (1, 2, 4, 8) float32 shards, kv_heads 2.
MISMATCHES = [
    ("batch", {"batch": 2}, r"^q: batch \(dim 0\) differs across ranks: rank 0 has 1, rank 1 has 2 \(every rank"),
    ("heads", {"heads": 4}, r"^q: heads \(dim 1\) differs across ranks: rank 0 has 2, rank 1 has 4"),
    ("kv_heads", {"kv_heads": 1}, r"^k: kv_heads \(dim 1\) differs across ranks: rank 0 has 2, rank 1 has 1"),
    ("seqlen", {"length": 6}, r"^q: seqlen / world \(dim 2, the shard length\) differs across ranks: rank 0 has 4, "
                              r"rank 1 has 6"),
    ("headdim", {"headdim": 16}, r"^q: headdim \(dim 3\) differs across ranks: rank 0 has 8, rank 1 has 16; "
                                 r"sm_scale differs"),  # the default scale follows the head dim
    ("dtype", {"dtype": torch.float16}, r"^q: dtype differs across ranks: rank 0 has float32, rank 1 has float16"),
    ("causal", {"causal": True}, r"^causal differs across ranks: rank 0 has False, rank 1 has True"),
    ("layout", {"layout": "zigzag"}, r"^layout differs across ranks: rank 0 has 'contiguous', rank 1 has 'zigzag'"),
    ("sm_scale", {"sm_scale": 0.5}, r"^sm_scale differs across ranks: rank 0 has 0\.35355339059327\d*, rank 1 has "
                                    r"0\.5"),
    ("window", {"window": (2, None)}, r"^window: left side differs across ranks: rank 0 has None, rank 1 has 2"),
    ("softcap", {"softcap": 3.0}, r"^softcap differs across ranks: rank 0 has 0\.0, rank 1 has 3\.0"),
    ("differentiable", {"requires_grad": True}, r"^q, k, v: differentiable \(grad mode on and an input that requires "
                                                r"grad\) differs across ranks: rank 0 has False, rank 1 has True"),
    ("call", {"call": "backward"}, r"^call differs across ranks: rank 0 has ring_attention, rank 1 has "
                                   r"ring_attention_backward"),
    ("backward_causal", {"call": "backward", "causal": True, "rank0_call": "backward"},
     r"^causal differs across ranks: rank 0 has False, rank 1 has True"),
    # rank 1 refuses its own arguments: it raises its error, rank 0 one naming rank 1 and the argument
    ("refused", {"kv_heads": 3}, r"^k: rank 1 refused its k \(its own error says why\), so every rank"),
]
REFUSED_OWN = r"^k: kv_heads \(3\) must divide q's heads \(2\)"


def _mismatch_call(changes, rank):
    """Rank ``rank``'s call of a MISMATCHES case (rank 0 the base call, rank 1 with ``changes``)."""
    changes = changes if rank == 1 else {"call": changes.get("rank0_call", "forward")}
    batch, heads, kv_heads = changes.get("batch", 1), changes.get("heads", 2), changes.get("kv_heads", 2)
    length, headdim, dtype = changes.get("length", 4), changes.get("headdim", 8), changes.get("dtype", torch.float32)
    q = torch.zeros(batch, heads, length, headdim, dtype=dtype).requires_grad_(changes.get("requires_grad", False))
    k, v = (torch.zeros(batch, kv_heads, length, headdim, dtype=dtype) for _ in range(2))
    options = {"causal": changes.get("causal", False), "sm_scale": changes.get("sm_scale"),
               "layout": changes.get("layout", "contiguous"), "window": changes.get("window"),
               "softcap": changes.get("softcap")}
    if changes.get("call") == "backward":
        lse = torch.zeros(batch, heads, length)
        return lambda: ring_attention_backward(q.detach(), q.detach(), k, v, q.detach(), lse, **options)
    return lambda: ring_attention(q, k, v, **options)


def _mismatch_worker(rank, world, port, folder):
    """Every MISMATCHES case in turn (a rank records what each call raised), then a call whose arguments agree
    (rank 1 passes the default scale, ``1 / sqrt(headdim)``, explicitly), checked against the reference: the group still works."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    # a hang in a collective fails within the timeout instead of waiting 30 minutes
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    raised = {}
    try:
        for name, changes, _ in MISMATCHES:
            try:
                _mismatch_call(changes, rank)()
            except Exception as error:  # noqa: BLE001 - recorded, checked by the parent
                raised[name] = [type(error).__name__, str(error)]
            else:
                raised[name] = None
        rng = np.random.default_rng(11)
        q, k, v = (torch.from_numpy(rng.standard_normal((1, 1, 8, 8)).astype(np.float32)) for _ in range(3))
        ref = reference.attention(q.numpy(), k.numpy(), v.numpy())
        out = ring_attention(*(shard(x, rank, world) for x in (q, k, v)), sm_scale=None if rank == 0 else 1 / math.sqrt(8))
        raised["agreeing_error"] = rel_error(out, shard(ref, rank, world))
        dist.barrier()
    finally:
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as file:
            json.dump(raised, file)
        dist.destroy_process_group()


def test_mismatched_ranks_raise_on_every_rank(tmp_path):
    _spawn(_mismatch_worker, (2, _free_port(), str(tmp_path)), 2, timeout=180)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for name, _, message in MISMATCHES:
        for rank, raised in enumerate(ranks):
            assert raised[name] is not None, f"{name}: rank {rank} raised nothing"
            kind, text = raised[name]
            expected = REFUSED_OWN if (name, rank) == ("refused", 1) else message
            assert kind == "ValueError" and re.search(expected, text), f"{name}, rank {rank}: {kind}: {text}"
    for rank, raised in enumerate(ranks):
        assert raised["agreeing_error"] < TOLERANCE["float32"], (rank, raised["agreeing_error"])


def test_who_groups_ranks_by_value():
    assert _who([0, 1], [4, 6], str) == "rank 0 has 4, rank 1 has 6"
    assert _who([0, 1, 2, 3], [4, 6, 4, 4], str) == "ranks [0, 2, 3] have 4, rank 1 has 6"
    assert _who([1, 3], [8, 8], str) == "ranks [1, 3] have 8"


@pytest.mark.parametrize("backend, where", [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("undefined", "cpu"),
                                            ("nccl", "meta"), ("cuda:nccl", "meta")])
def test_check_runs_on_the_cpu_when_the_group_can(backend, where):
    # the check's all_gather avoids the GPU (and its wait for queued work) unless the group is GPU-only
    class Dist:
        Backend = dist.Backend

        @staticmethod
        def get_backend(group=None):
            return backend

    q = torch.empty(1, device="meta")  # stands for a GPU tensor: its device is used for GPU-only groups
    assert _device(torch, Dist, None, q).type == where


def test_check_off_makes_no_collective(monkeypatch):
    # NUMBA_ATTN_RING_CHECK=0: the rank and size only, no all_gather (no host sync on NCCL groups)
    from numba_attn.distributed import agreement

    class Dist:
        Backend = dist.Backend

        @staticmethod
        def is_available():
            return True

        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def get_rank(group=None):
            return 1

        @staticmethod
        def get_world_size(group=None):
            return 2

        @staticmethod
        def get_backend(group=None):
            return "gloo"

        @staticmethod
        def all_gather_into_tensor(*args, **kwargs):
            raise AssertionError("all_gather called with the check off")

    monkeypatch.setenv(agreement.CHECK_ENV, "0")
    assert agreement.check_ranks_agree(torch, Dist, None, (0,) * len(agreement.FIELDS)) == (1, 2)
    monkeypatch.setenv(agreement.CHECK_ENV, "1")
    with pytest.raises(AssertionError, match="all_gather called"):
        agreement.check_ranks_agree(torch, Dist, None, (0,) * len(agreement.FIELDS))


def test_merge_equals_reference_combine_lse():
    # running merges of float32 parts (empty rows, a part that reaches no row, one reaching a row alone)
    rng = np.random.default_rng(3)
    o_parts = rng.standard_normal((3, 2, 5, 4)).astype(np.float32)
    lse_parts = (rng.standard_normal((3, 2, 5)) * 4).astype(np.float32)
    lse_parts[:, 0, 0] = -np.inf  # a row no part reaches
    lse_parts[1:, 1, 2] = -np.inf  # a row only part 0 reaches
    lse_parts[2, 1] = -np.inf  # a part that reaches no row
    o_parts[lse_parts == -np.inf] = 0.0
    out, lse = torch.zeros(2, 5, 4), torch.full((2, 5), -np.inf)
    for o, l in zip(o_parts, lse_parts):
        _merge_into(out, lse, torch.from_numpy(o), torch.from_numpy(l))
    ref_out, ref_lse = reference.combine_lse(o_parts, lse_parts)
    assert rel_error(out, ref_out) < 1e-6
    assert_close_lse(lse, ref_lse, tol=1e-6)
    assert torch.equal(out[0, 0], torch.zeros(4)) and torch.isneginf(lse[0, 0])
    # NaN and +inf part lse make the row NaN, as reference.combine_lse
    for bad in (np.nan, np.inf):
        merged, merged_lse = out.clone(), lse.clone()
        _merge_into(merged, merged_lse, torch.zeros(2, 5, 4), torch.full((2, 5), bad))
        assert torch.isnan(merged).all() and torch.isnan(merged_lse).all()
    # a float16 part (as flash_forward returns it) is read as it is, into the float32 accumulator
    half = torch.from_numpy(o_parts[0]).half()
    merged, merged_lse = torch.zeros(2, 5, 4), torch.full((2, 5), -np.inf)
    _merge_into(merged, merged_lse, half, torch.from_numpy(lse_parts[0]))
    reached = torch.from_numpy(np.isfinite(lse_parts[0]))
    assert merged.dtype == torch.float32 and torch.equal(merged[reached], half.float()[reached])


def test_band_block_is_the_band():
    # every (rows, keys, lo, hi) small enough to enumerate: the sub-block and the flash_forward arguments
    # band_block gives (sides >= 0, bottom-right aligned) mask exactly the band lo <= j - i <= hi
    from numba_attn.distributed.blocks import band_block

    bounds = [None] + list(range(-7, 8))
    for rows in range(1, 6):
        for keys in range(1, 6):
            i, j = np.arange(rows)[:, None], np.arange(keys)[None, :]
            for lo in bounds:
                for hi in bounds:
                    if lo is not None and hi is not None and hi < lo:
                        continue
                    want = ((lo is None) | (j - i >= (lo or 0))) & ((hi is None) | (j - i <= (hi or 0)))
                    block = band_block(rows, keys, lo, hi)
                    got = np.zeros((rows, keys), bool)
                    if block is not None:
                        (r0, r1), (k0, k1), causal, window = block
                        left, right = window if window is not None else (None, None)
                        assert (left is None or left >= 0) and (right is None or right >= 0), block
                        ii, jj = np.arange(r1 - r0)[:, None] + (k1 - k0) - (r1 - r0), np.arange(k1 - k0)[None, :]
                        seen = ~((causal & (jj > ii)) | ((left is not None) & (jj < ii - (left or 0)))
                                 | ((right is not None) & (jj > ii + (right or 0))))
                        got[r0:r1, k0:k1] = seen
                        assert want[r0:r1].any(axis=1).all() and want[:, k0:k1].any(axis=0).all(), block
                    assert np.array_equal(got, want), (rows, keys, lo, hi, block)


class _FakeRing:
    """torch.distributed for rank ``rank`` of a ring of ``world`` in one process: the shard that arrives at step
    ``i`` is rank ``rank - i - 1``'s (copied in at ``wait``); records the order of issues, kernels and waits."""

    def __init__(self, rank, world, kv_shards, events):
        self.rank, self.world, self.kv_shards, self.events, self.step = rank, world, kv_shards, events, 0

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return self.world

    def get_backend(self, group=None):
        return "cpu:fake"

    def all_gather_into_tensor(self, output, tensor, group=None, async_op=False):  # the check: all pass the same
        output.copy_(tensor.repeat(self.world))
        self.events.append(("gather",))

        class Done:
            def wait(self):
                pass

        return Done() if async_op else None

    def isend(self, *args):
        raise AssertionError("isend must go through batch_isend_irecv")

    irecv = isend

    def P2POp(self, op, tensor, peer, group=None):  # noqa: N802 (torch's name)
        return op, tensor, peer

    def batch_isend_irecv(self, ops):
        # k and v travel as two messages each way: sends first, then the receives, in the same order
        step, self.step = self.step, self.step + 1
        self.events.append(("issue", step))
        assert len(ops) == 4 and [op[0] for op in ops] == [self.isend] * 2 + [self.irecv] * 2, ops
        assert {op[2] for op in ops[:2]} == {(self.rank + 1) % self.world}
        assert {op[2] for op in ops[2:]} == {(self.rank - 1) % self.world}
        sent, received = [op[1] for op in ops[:2]], [op[1] for op in ops[2:]]
        assert torch.equal(torch.stack(sent), self.kv_shards[(self.rank - step) % self.world])  # the shard held
        fake = self

        class Request:
            done = False

            def wait(self):  # (may be waited for twice: by the next transfer, then by the kernels)
                if not self.done:
                    for buffer, arrived in zip(received, fake.kv_shards[(fake.rank - step - 1) % fake.world]):
                        buffer.copy_(arrived)
                    fake.events.append(("wait", step))
                    self.done = True

        return [Request()]


@pytest.mark.parametrize("world, layout", [(3, "zigzag"), (3, "contiguous"), (4, "zigzag")])
def test_ring_order_and_result(world, layout, monkeypatch):
    # rank by rank in one process (an odd world too): the agreement is read after the own shard's kernels and
    # before any transfer; each transfer is waited for just before its kernels; from step 3 a transfer is issued
    # after the kernels of the step that read its buffer
    import numba_attn.api
    from numba_attn.distributed import ring

    rng = np.random.default_rng(7)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, heads, 24, 8)).astype(np.float32)) for heads in (2, 1, 1))
    kv_shards = [torch.stack((shard(k, r, world, layout), shard(v, r, world, layout))) for r in range(world)]
    flash_forward, events = numba_attn.api.flash_forward, []

    def logged(*args, **kwargs):
        events.append(("kernel",))
        return flash_forward(*args, **kwargs)

    monkeypatch.setattr(numba_attn.api, "flash_forward", logged)
    outs, lses = [], []
    for rank in range(world):
        del events[:]
        monkeypatch.setattr(ring, "_torch", lambda: (torch, _FakeRing(rank, world, kv_shards, events)))
        out, lse = ring_attention(shard(q, rank, world, layout), *kv_shards[rank], causal=True, layout=layout,
                                  return_lse=True)
        outs.append(out), lses.append(lse)
        # the check's gather; the own shard's kernels (queued before the check is read); the first transfer, then
        # (once it is in) the second; step 1's kernels; (world 4: the third transfer once the second is in);
        # the last steps wait for their shard, then their kernels
        blocks = [["kernel"] * (0 if layout == "contiguous" and step > rank else 1) for step in range(world)]
        expected = ["gather"] + blocks[0] + ["issue", "wait", "issue"] + blocks[1]
        expected += ["wait"] + blocks[2] if world == 3 else ["wait", "issue"] + blocks[2] + ["wait"] + blocks[3]
        assert [event[0] for event in events] == expected, events
    ref_out, ref_lse = reference.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, return_lse=True)
    assert rel_error(unshard(outs, layout), ref_out) < TOLERANCE["float32"]
    assert_close_lse(unshard(lses, layout), ref_lse, tol=1e-5)
