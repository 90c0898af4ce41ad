"""The ring's one-pass LSE merge kernel (``numba_attn.distributed.merge``) against ``reference.combine_lse`` and the
torch merge it replaces (``ring._merge_into``), and ``ring_attention`` merging with it.

Under the simulator the kernel runs on NumPy / Numba device arrays (``launch``: no torch needed) and on torch CPU
tensors (``merge_into``: the simulator's device memory is host memory); the ``gpu`` test runs it on CUDA tensors.
Shapes are tiny (a simulated block of 8 threads costs ~10 ms); head dim 40 takes five passes of 8 columns there.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference
from kernel_checks import TOLERANCE, assert_close_lse, device_view_in_layout, rel_error
from numba_attn.distributed import merge

try:
    import torch
except ImportError:  # pragma: no cover - CI without torch runs the NumPy tests only
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
# the simulator computes inf - inf in NumPy scalars, which warns; the results are the point of these tests
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

SHAPE = (2, 2, 3, 40)  # (batch, heads, rows, headdim): 12 rows, headdim not a power of two


def _parts(count, shape=SHAPE, seed=0):
    """``count`` float32 parts and their lse, with rows no part reaches, rows one part reaches alone and a part
    that reaches no row (empty parts are 0, as flash_forward writes them)."""
    rng = np.random.default_rng(seed)
    o_parts = rng.standard_normal((count,) + shape).astype(np.float32)
    lse_parts = (rng.standard_normal((count,) + shape[:-1]) * 4).astype(np.float32)
    lse_parts[:, 0, 0, 0] = -np.inf  # a row no part reaches
    lse_parts[1:, -1, -1, -1] = -np.inf  # a row only part 0 reaches
    lse_parts[0, 0, 0, 1] = -np.inf  # a row part 0 misses (the accumulator starts empty there)
    lse_parts[count - 1, -1, -1] = -np.inf  # a part that reaches none of a head's rows
    o_parts[lse_parts == -np.inf] = 0.0
    return o_parts, lse_parts


def _bf16_bits(x):
    """float32 -> bfloat16 bits (round to nearest even; finite values)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits):
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _stored(x, dtype):
    """(array as the kernel stores it, its float32 values) for a NumPy dtype name (bfloat16: uint16 bits)."""
    if dtype == "bfloat16":
        bits = _bf16_bits(x)
        return bits, _bf16_value(bits)
    stored = x.astype(dtype)
    return stored, stored.astype(np.float32)


# -- the kernel on device arrays (no torch) ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_kernel_on_device_arrays_equals_reference(dtype):
    # the ring's sequence of merges: the first part as the accumulator in its own dtype, widened to float32 by the
    # first merge (into a poisoned array), one merge in place, the last into a poisoned array of the parts' dtype
    from numba import cuda

    o_parts, lse_parts = _parts(4)
    stored, values = zip(*(_stored(o, dtype) for o in o_parts))
    acc = cuda.to_device(stored[0])
    lse = cuda.to_device(lse_parts[0].copy())
    wide = cuda.to_device(np.full(SHAPE, np.nan, np.float32))
    final = cuda.to_device(np.full(SHAPE, 0xFFFF if dtype == "bfloat16" else np.nan, stored[0].dtype))
    merge.launch(acc, lse, cuda.to_device(stored[1]), cuda.to_device(lse_parts[1]), wide, 0)
    merge.launch(wide, lse, cuda.to_device(stored[2]), cuda.to_device(lse_parts[2]), wide, 0)
    merge.launch(wide, lse, cuda.to_device(stored[3]), cuda.to_device(lse_parts[3]), final, 0)
    got = final.copy_to_host()
    got = _bf16_value(got) if dtype == "bfloat16" else got.astype(np.float32)
    ref_out, ref_lse = reference.combine_lse(np.stack(values), lse_parts)
    assert not np.isnan(got).any()
    assert rel_error(got, ref_out) < TOLERANCE[dtype]
    assert rel_error(wide.copy_to_host(), reference.combine_lse(np.stack(values[:3]), lse_parts[:3])[0]) < 1e-6
    assert_close_lse(lse.copy_to_host(), ref_lse, tol=1e-6)
    assert (got[0, 0, 0] == 0).all() and np.isneginf(lse.copy_to_host()[0, 0, 0])
    np.testing.assert_array_equal(acc.copy_to_host(), stored[0])  # only read


def test_kernel_on_device_arrays_strided_rows():
    # rows sliced out of longer shards (accumulator, lse and destination), a part in (batch, rows, heads, headdim)
    # memory: rows outside the slice stay as they were
    from numba import cuda

    o_parts, lse_parts = _parts(2, shape=(1, 2, 4, 9), seed=1)
    acc_mem = np.full((1, 2, 7, 9), 5.0, np.float32)
    acc_mem[:, :, 2:6] = o_parts[0]
    lse_mem = np.full((1, 2, 7), 7.0, np.float32)
    lse_mem[:, :, 2:6] = lse_parts[0]
    part = device_view_in_layout(o_parts[1], "blhd")
    acc, lse = cuda.to_device(acc_mem), cuda.to_device(lse_mem)
    merge.launch(acc[:, :, 2:6], lse[:, :, 2:6], part, cuda.to_device(lse_parts[1]), acc[:, :, 2:6], 0)
    got, got_lse = acc.copy_to_host(), lse.copy_to_host()
    ref_out, ref_lse = reference.combine_lse(o_parts, lse_parts)
    assert rel_error(got[:, :, 2:6], ref_out) < 1e-6
    assert_close_lse(got_lse[:, :, 2:6], ref_lse, tol=1e-6)
    assert (got[:, :, :2] == 5).all() and (got[:, :, 6:] == 5).all()
    assert (got_lse[:, :, :2] == 7).all() and (got_lse[:, :, 6:] == 7).all()


# -- merge_into on torch tensors -------------------------------------------------------------------------------------
def _torch_dtype(name):
    return getattr(torch, name)


def _torch_merges(o_parts, lse_parts):
    """The torch path: a float32 accumulator, ``_merge_into`` per part."""
    from numba_attn.distributed.ring import _merge_into

    out, lse = o_parts[0].float().clone(), lse_parts[0].clone()
    for o, l in zip(o_parts[1:], lse_parts[1:]):
        _merge_into(out, lse, o, l)
    return out, lse


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_merge_into_equals_torch_merge_and_reference(dtype):
    o_np, lse_np = _parts(4, seed=2)
    o_parts = torch.from_numpy(o_np).to(_torch_dtype(dtype))
    lse_parts = torch.from_numpy(lse_np)
    acc, lse = o_parts[0].clone(), lse_parts[0].clone()  # the first part as it comes, in its dtype
    wide = torch.full(SHAPE, float("nan"))
    assert merge.merge_into(acc, lse, o_parts[1], lse_parts[1], final_out=wide) is wide
    assert torch.equal(acc, o_parts[0])  # only read with final_out
    merge.merge_into(wide, lse, o_parts[2], lse_parts[2])
    final = torch.full(SHAPE, float("nan"), dtype=_torch_dtype(dtype))
    merge.merge_into(wide, lse, o_parts[3], lse_parts[3], final_out=final)
    ref_out, ref_lse = reference.combine_lse(o_parts.float().numpy(), lse_np)
    torch_out, torch_lse = _torch_merges(o_parts, lse_parts)
    assert not torch.isnan(final).any()
    assert rel_error(final, ref_out) < TOLERANCE[dtype]
    assert_close_lse(lse, ref_lse, tol=1e-6)
    assert rel_error(wide, _torch_merges(o_parts[:3], lse_parts[:3])[0]) < 1e-6  # float32 accumulators: rounding
    torch.testing.assert_close(lse, torch_lse, rtol=1e-6, atol=1e-6)
    # the cast fused into the last merge: at most one unit in the last place of the dtype from torch's cast
    ulp = {"float32": 1e-6, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]  # float32: a few roundings apart
    torch.testing.assert_close(final.float(), torch_out.to(final.dtype).float(), rtol=ulp, atol=1e-6)
    assert torch.equal(final[0, 0, 0], torch.zeros(SHAPE[-1], dtype=final.dtype)) and torch.isneginf(lse[0, 0, 0])


@needs_torch
def test_merge_into_nan_and_inf_lse_as_torch_merge():
    # NaN / +inf lse on either side make the row NaN; an empty part of NaN values makes it NaN too (0 * NaN), and an
    # empty part of finite values leaves the row as it was, bit for bit
    shape = (1, 2, 4, 8)
    rng = np.random.default_rng(4)
    out = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    part = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    lse = torch.from_numpy(rng.standard_normal(shape[:-1]).astype(np.float32))
    part_lse = torch.from_numpy(rng.standard_normal(shape[:-1]).astype(np.float32))
    lse[0, 0, 0], part_lse[0, 0, 1] = np.nan, np.nan
    lse[0, 0, 2], part_lse[0, 0, 3] = np.inf, np.inf
    lse[0, 1, 0], part_lse[0, 1, 0] = np.inf, -np.inf
    part_lse[0, 1, 1] = -np.inf  # empty part, finite values: the row unchanged
    part_lse[0, 1, 2], part[0, 1, 2] = -np.inf, np.nan  # empty part of NaN: NaN, as reference.combine_lse
    lse[0, 1, 3], part_lse[0, 1, 3] = -np.inf, -np.inf  # both empty: 0 and -inf
    got, got_lse = out.clone(), lse.clone()
    merge.merge_into(got, got_lse, part, part_lse)
    want, want_lse = out.clone(), lse.clone()
    from numba_attn.distributed.ring import _merge_into

    _merge_into(want, want_lse, part, part_lse)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isnan(got_lse), torch.isnan(want_lse))
    assert torch.isnan(got[0, 0]).all() and torch.isnan(got[0, 1, :3]).any(dim=-1)[[0, 2]].all()
    torch.testing.assert_close(got.nan_to_num(7.0), want.nan_to_num(7.0), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0, 1, 1], out[0, 1, 1]) and got_lse[0, 1, 1] == lse[0, 1, 1]
    assert torch.equal(got[0, 1, 3], torch.zeros(8)) and torch.isneginf(got_lse[0, 1, 3])
    ref_out, ref_lse = reference.combine_lse(np.stack([out.numpy(), part.numpy()]),
                                             np.stack([lse.numpy(), part_lse.numpy()]))
    np.testing.assert_array_equal(np.isnan(got.numpy()), np.isnan(ref_out))  # reference.combine_lse's rules
    np.testing.assert_array_equal(np.isnan(got_lse.numpy()), np.isnan(ref_lse))


@needs_torch
def test_merge_into_strided_rows_and_final_out_views():
    # bfloat16 shards whose rows [2:5] are merged: in place, and into a slice of a poisoned float32 array; rows outside
    # the slices are untouched (bit for bit), the part is a (batch, rows, heads, headdim) memory view
    o_np, lse_np = _parts(2, shape=(1, 2, 3, 40), seed=5)
    o_parts = torch.from_numpy(o_np).bfloat16()
    acc_mem = torch.full((1, 2, 6, 40), 3.0, dtype=torch.bfloat16)
    acc_mem[:, :, 2:5] = o_parts[0]
    lse_mem = torch.full((1, 2, 6), 9.0)
    lse_mem[:, :, 2:5] = torch.from_numpy(lse_np[0])
    part = o_parts[1].transpose(1, 2).contiguous().transpose(1, 2)
    wide_mem = torch.full((1, 2, 6, 40), float("nan"))
    lse_copy = lse_mem.clone()
    merge.merge_into(acc_mem[:, :, 2:5], lse_copy[:, :, 2:5], part, torch.from_numpy(lse_np[1]),
                     final_out=wide_mem[:, :, 2:5])
    merge.merge_into(acc_mem[:, :, 2:5], lse_mem[:, :, 2:5], part, torch.from_numpy(lse_np[1]))
    ref_out, ref_lse = reference.combine_lse(o_parts.float().numpy(), lse_np)
    assert rel_error(wide_mem[:, :, 2:5], ref_out) < 1e-6
    assert rel_error(acc_mem[:, :, 2:5], ref_out) < TOLERANCE["bfloat16"]
    torch.testing.assert_close(acc_mem[:, :, 2:5], wide_mem[:, :, 2:5].bfloat16(), rtol=0, atol=0)
    assert torch.isnan(wide_mem[:, :, :2]).all() and torch.isnan(wide_mem[:, :, 5:]).all()
    assert (acc_mem[:, :, :2] == 3).all() and (acc_mem[:, :, 5:] == 3).all()
    for got_lse in (lse_mem, lse_copy):
        assert_close_lse(got_lse[:, :, 2:5], ref_lse, tol=1e-6)
        assert (got_lse[:, :, :2] == 9).all() and (got_lse[:, :, 5:] == 9).all()


@needs_torch
def test_merge_into_bad_inputs():
    out, lse = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    part, part_lse = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3)
    cases = [
        ((out.numpy(), lse, part, part_lse), {}, TypeError, "out: expected a torch.Tensor"),
        ((out[0], lse, part, part_lse), {}, ValueError, "out: expected shape"),
        ((out, lse, part[:, :, :2], part_lse), {}, ValueError, "part_out: expected out's shape"),
        ((out, lse[:, :1], part, part_lse), {}, ValueError, "lse: expected out's shape without headdim"),
        ((out, lse, part, part_lse[..., None]), {}, ValueError, "part_lse: expected"),
        ((out, lse, part, part_lse), {"final_out": torch.zeros(1, 2, 3, 5)}, ValueError, "final_out: expected"),
        ((out, lse.half(), part, part_lse), {}, TypeError, "lse: dtype float16; expected float32"),
        ((out, lse, part, part_lse.double()), {}, TypeError, "part_lse: dtype float64"),
        ((out, lse, part.double(), part_lse), {}, TypeError, "part_out: dtype float64 is not supported"),
        ((out.half(), lse, part.bfloat16(), part_lse), {}, TypeError, "out: dtype float16; expected float32 or "
                                                                        "part_out's dtype bfloat16"),
        ((out, lse, part.half(), part_lse), {"final_out": torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)}, TypeError,
         "final_out: dtype bfloat16"),
        ((out, lse, part, part_lse), {"final_out": out}, ValueError, "final_out: shares memory with out"),
        ((out, lse, out, part_lse), {}, ValueError, "out: shares memory with part_out"),
        ((out, part_lse, part, part_lse), {}, ValueError, "lse: shares memory with part_lse"),
        ((out, torch.zeros(1, 1, 1).expand(1, 2, 3), part, part_lse), {}, ValueError, "lse: its elements overlap"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            merge.merge_into(*args, **kwargs)


@needs_torch
def test_merge_into_no_rows_launches_nothing():
    out, part = torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, 4)
    assert merge.merge_into(out, torch.zeros(1, 2, 0), part, torch.zeros(1, 2, 0)) is out


def test_merge_choice(monkeypatch):
    monkeypatch.delenv(merge.MERGE_ENV, raising=False)
    assert merge.merge_choice() == "kernel"
    monkeypatch.setenv(merge.MERGE_ENV, "torch")
    assert merge.merge_choice() == "torch"
    monkeypatch.setenv(merge.MERGE_ENV, "fast")
    with pytest.raises(ValueError, match="NUMBA_ATTN_RING_MERGE: expected 'kernel' or 'torch', got 'fast'"):
        merge.merge_choice()


# -- ring_attention merging with the kernel ---------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("world, layout", [(2, "zigzag"), (3, "zigzag"), (3, "contiguous")])
def test_ring_merges_with_the_kernel(world, layout, monkeypatch):
    # the fake ring of test_ring (one process, rank by rank) with the kernel merges on CPU tensors (simulator):
    # float16 inputs, so that the first part is widened, merged in place, and written back in float16 with the cast
    # fused (zigzag: steps that cover only the second half of the rows); equal to the torch merges and the reference
    from numba_attn.distributed import ring, shard, unshard
    from test_ring import _FakeRing

    rng = np.random.default_rng(11)
    length = 4 * world
    q, k, v = (torch.from_numpy(rng.standard_normal((1, heads, length, 8)).astype(np.float32)).half()
               for heads in (2, 1, 1))
    kv_shards = [torch.stack((shard(k, r, world, layout), shard(v, r, world, layout))) for r in range(world)]
    calls = []
    merge_into = merge.merge_into

    def spy(*args, **kwargs):
        calls.append(kwargs.get("final_out") is not None)
        return merge_into(*args, **kwargs)

    monkeypatch.setattr(merge, "merge_into", spy)
    results = {}
    for path in ("kernel", "torch"):
        monkeypatch.setattr(ring, "_merge_kernel_applies", lambda q, path=path: path == "kernel")
        outs, lses = [], []
        for rank in range(world):
            monkeypatch.setattr(ring, "_torch", lambda: (torch, _FakeRing(rank, world, kv_shards, [])))
            out, lse = ring.ring_attention(shard(q, rank, world, layout), *kv_shards[rank], causal=True,
                                           layout=layout, return_lse=True, backend="simt")  # (the fastest simulated)
            assert out.dtype == torch.float16 and lse.dtype == torch.float32
            outs.append(out), lses.append(lse)
        results[path] = unshard(outs, layout), unshard(lses, layout)
        if path == "kernel":
            merges = sum(bool(ring._blocks(r, (r - s) % world, length // world, True, layout))
                         for r in range(world) for s in range(1, world))
            assert len(calls) == merges and (world == 2 or any(calls)), calls
    (out, lse), (torch_out, torch_lse) = results["kernel"], results["torch"]
    ref_out, ref_lse = reference.attention(q.float().numpy(), k.float().numpy(), v.float().numpy(), causal=True,
                                           return_lse=True)
    assert rel_error(out, ref_out) < TOLERANCE["float16"]
    assert_close_lse(lse, ref_lse, tol=1e-5)
    torch.testing.assert_close(out.float(), torch_out.float(), rtol=2.0**-10, atol=1e-6)
    torch.testing.assert_close(lse, torch_lse, rtol=1e-6, atol=1e-6)


# -- on a GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [40, 128, 256, 300])
def test_gpu_merge_into_equals_torch_merge(dtype, head_dim):
    # CUDA tensors on torch's current stream (a side stream here): strided rows of longer shards, the first part
    # widened into float32, merged in place, and the last merge into a poisoned array of the parts' dtype
    device = torch.device("cuda")
    o_np, lse_np = _parts(4, shape=(2, 3, 333, head_dim), seed=head_dim)
    o_parts = torch.from_numpy(o_np).to(device, _torch_dtype(dtype))
    lse_parts = torch.from_numpy(lse_np).to(device)
    rows = slice(100, 433)
    acc_mem = torch.zeros(2, 3, 500, head_dim, device=device, dtype=_torch_dtype(dtype))
    acc_mem[:, :, rows] = o_parts[0]
    lse_mem = torch.full((2, 3, 500), 5.0, device=device)
    lse_mem[:, :, rows] = lse_parts[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wide = torch.full((2, 3, 500, head_dim), float("nan"), device=device)
        merge.merge_into(acc_mem[:, :, rows], lse_mem[:, :, rows], o_parts[1], lse_parts[1],
                         final_out=wide[:, :, rows])
        merge.merge_into(wide[:, :, rows], lse_mem[:, :, rows], o_parts[2], lse_parts[2])
        final = torch.full((2, 3, 500, head_dim), float("nan"), device=device, dtype=_torch_dtype(dtype))
        merge.merge_into(wide[:, :, rows], lse_mem[:, :, rows], o_parts[3], lse_parts[3], final_out=final[:, :, rows])
    torch.cuda.current_stream().wait_stream(side)
    torch_out, torch_lse = _torch_merges(o_parts, lse_parts)
    assert torch.isnan(final[:, :, :100]).all() and torch.isnan(final[:, :, 433:]).all()
    assert (lse_mem[:, :, :100] == 5).all() and (lse_mem[:, :, 433:] == 5).all()
    got = final[:, :, rows]
    ref_out, ref_lse = reference.combine_lse(o_parts.float().cpu().numpy(), lse_np)
    assert rel_error(got, ref_out) < TOLERANCE[dtype]
    assert rel_error(wide[:, :, rows], _torch_merges(o_parts[:3], lse_parts[:3])[0].cpu()) < 1e-6
    torch.testing.assert_close(lse_mem[:, :, rows], torch_lse, rtol=1e-6, atol=1e-6)
    assert_close_lse(lse_mem[:, :, rows], ref_lse, tol=1e-6)
    ulp = {"float32": 1e-6, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]  # float32: a few roundings apart
    torch.testing.assert_close(got.float(), torch_out.to(got.dtype).float(), rtol=ulp, atol=1e-6)


# -- the vector kernel (contiguous, aligned rows) and the host's choice of kernel ---------------------------------------
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def _aligned(shape, dtype, fill, offset=0):
    """A C-contiguous array of ``shape`` whose first element lies ``offset`` bytes past a 64-byte boundary."""
    itemsize = np.dtype(dtype).itemsize
    count = int(np.prod(shape))
    raw = np.empty(count * itemsize + 64 + offset, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    x = raw[start:start + count * itemsize].view(dtype).reshape(shape)
    x[...] = fill
    return x


def _poison(dtype):
    return 0xFFFF if dtype == "bfloat16" else np.nan


def _values(x, dtype):
    return _bf16_value(x) if dtype == "bfloat16" else np.asarray(x, np.float32)


def _spy_kernels(monkeypatch):
    """Which kernel factories ``launch`` calls: a list of ``"vector"`` / ``"scalar"``."""
    used = []
    vector, scalar = merge.merge_vector_kernel, merge.merge_kernel
    monkeypatch.setattr(merge, "merge_vector_kernel", lambda *a: used.append("vector") or vector(*a))
    monkeypatch.setattr(merge, "merge_kernel", lambda *a: used.append("scalar") or scalar(*a))
    return used


def _merge_case(acc_dtype, part_dtype, dest_dtype, head_dim, config, seed=0):
    """Rows [1:4] of (1, 2, 5, head_dim) shards (accumulator, lse and, unless merged in place, a poisoned
    destination) merged with a part; lse with NaN, +inf and empty rows. Returns (dest memory, lse memory, the
    inputs' float32 values and lse, the accumulator memory as it was)."""
    rng = np.random.default_rng(seed)
    shape, mem = (1, 2, 3, head_dim), (1, 2, 5, head_dim)
    o = rng.standard_normal((2,) + shape).astype(np.float32)
    lse = (rng.standard_normal((2,) + shape[:-1]) * 4).astype(np.float32)
    lse[0, 0, 0, 0], lse[1, 0, 1, 1] = np.nan, np.inf  # NaN rows
    lse[:, 0, 0, 2] = -np.inf  # both empty: 0 and -inf
    lse[1, 0, 1, 0] = -np.inf  # an empty part: the row as it was
    acc_mem = _aligned(mem, _STORAGE[acc_dtype], 0x3F80 if acc_dtype == "bfloat16" else 1.0)
    acc_mem[:, :, 1:4] = _stored(o[0], acc_dtype)[0]
    part = _aligned(shape, _STORAGE[part_dtype], 0)
    part[...] = _stored(o[1], part_dtype)[0]
    values = np.stack([_values(acc_mem[:, :, 1:4], acc_dtype), _values(part, part_dtype)])
    lse_mem = np.full(mem[:-1], 7.0, np.float32)
    lse_mem[:, :, 1:4] = lse[0]
    in_place = acc_dtype == dest_dtype and acc_dtype != part_dtype or acc_dtype == dest_dtype == "bfloat16"
    dest_mem = acc_mem if in_place else _aligned(mem, _STORAGE[dest_dtype], _poison(dest_dtype))
    before = acc_mem.copy()
    merge.launch(acc_mem[:, :, 1:4], lse_mem[:, :, 1:4], part, lse[1].copy(), dest_mem[:, :, 1:4], 0, config)
    return dest_mem, lse_mem, values, lse, before, in_place


#: the kernel on NumPy arrays: under the simulator only (a GPU launch would copy them)
sim_only = pytest.mark.skipif(not merge.SIMULATOR, reason="NumPy arrays as device memory: simulator only")

DTYPE_CASES = [  # (accumulator, part, destination): the ring's merges (widen, in place, final cast) and more
    ("float32", "float32", "float32"), ("float32", "bfloat16", "float32"), ("bfloat16", "bfloat16", "float32"),
    ("float32", "float16", "float16"), ("bfloat16", "bfloat16", "bfloat16"), ("float16", "float16", "float16"),
]


@sim_only
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=["-".join(c) for c in DTYPE_CASES])
def test_vector_kernel_equals_scalar_kernel_and_reference(dtypes, head_dim, monkeypatch):
    # strided rows of longer, aligned shards: the vector kernel, bit for bit what the scalar kernel writes (the same
    # float32 arithmetic), reference.combine_lse's values and NaN rules; rows outside the slice untouched
    acc_dtype, part_dtype, dest_dtype = dtypes
    used = _spy_kernels(monkeypatch)
    dest, lse, values, lse_in, before, in_place = _merge_case(*dtypes, head_dim, merge.SIMULATOR_CONFIG)
    scalar = merge.MergeConfig(lanes=4, rows=2, max_cols=8, vector=False)
    dest_s, lse_s, *_ = _merge_case(*dtypes, head_dim, scalar)
    assert used == ["vector", "scalar"]
    np.testing.assert_array_equal(dest, dest_s)  # (bits: NaN == NaN)
    np.testing.assert_array_equal(lse, lse_s)
    got = _values(dest[:, :, 1:4], dest_dtype)
    ref_out, ref_lse = reference.combine_lse(values, lse_in)
    nan = np.isnan(ref_out)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(np.isnan(lse[:, :, 1:4]), np.isnan(ref_lse))
    rows_nan = np.zeros((1, 2, 3), bool)
    rows_nan[0, 0, 0] = rows_nan[0, 1, 1] = True
    np.testing.assert_array_equal(nan, np.broadcast_to(rows_nan[..., None], nan.shape))
    assert (got[0, 0, 2] == 0).all() and np.isneginf(lse[0, 0, 3])
    np.testing.assert_array_equal(got[0, 1, 0], _stored(values[0, 0, 1, 0], dest_dtype)[1])  # an empty part: as it was
    assert rel_error(np.where(nan, 0, got), np.where(nan, 0, ref_out)) < TOLERANCE[dest_dtype]
    assert_close_lse(np.where(np.isnan(ref_lse), 0, lse[:, :, 1:4]), np.where(np.isnan(ref_lse), 0, ref_lse),
                     tol=1e-6)
    outside = before if in_place else np.full_like(dest, _poison(dest_dtype))
    for rows in (slice(0, 1), slice(4, 5)):
        np.testing.assert_array_equal(dest[:, :, rows], outside[:, :, rows])
        assert (lse[:, :, rows] == 7).all()
    if not in_place:
        np.testing.assert_array_equal(before, _merge_case(*dtypes, head_dim, scalar)[4])  # acc only read


@sim_only
@pytest.mark.parametrize("dtypes, head_dim", [(("bfloat16", "bfloat16", "bfloat16"), 36),
                                              (("float32", "float16", "float16"), 42)])
def test_head_dim_off_the_vector_width_takes_the_scalar_kernel(dtypes, head_dim, monkeypatch):
    # 36 is no multiple of 8 (all 16-bit: 16-byte vectors of 8), 42 none of 4 (a float32 array: vectors of 4)
    used = _spy_kernels(monkeypatch)
    dest, lse, values, lse_in, *_ = _merge_case(*dtypes, head_dim, merge.SIMULATOR_CONFIG, seed=3)
    assert used == ["scalar"]
    got = _values(dest[:, :, 1:4], dtypes[2])
    ref_out, ref_lse = reference.combine_lse(values, lse_in)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref_out))
    nan = np.isnan(ref_out)
    assert rel_error(np.where(nan, 0, got), np.where(nan, 0, ref_out)) < TOLERANCE[dtypes[2]]


def test_vector_plan_picks_the_vector_kernel_for_aligned_contiguous_rows():
    gpu = merge.GPU_CONFIG
    bf16 = _aligned((2, 8, 6, 128), np.uint16, 0)
    f32 = _aligned((2, 8, 6, 128), np.float32, 0)
    # (width, lanes, rows a block, vectors a lane and pass): two rows a warp, 16-byte vectors of 8 in bfloat16, two
    # vectors of 4 (16 bytes of float32, 8 of bfloat16) with a float32 array
    assert merge.vector_plan(bf16, bf16, bf16, gpu) == (8, 16, 16, 1)
    assert merge.vector_plan(f32, bf16, f32, gpu) == (4, 16, 16, 2)
    assert merge.vector_plan(f32, bf16, bf16, gpu) == (4, 16, 16, 2)
    assert merge.vector_plan(bf16[..., :64], bf16[..., :64], bf16[..., :64], gpu) == (8, 8, 32, 1)  # padded rows
    h16, h64 = _aligned((1, 2, 6, 64), np.float16, 0), _aligned((1, 2, 6, 256), np.float32, 0)
    assert merge.vector_plan(h16, h16, h16, gpu) == (8, 8, 32, 1)
    assert merge.vector_plan(h64, h64, h64, gpu) == (4, 32, 8, 2)
    assert merge.vector_plan(h64, h64, h64, merge.SIMULATOR_CONFIG) == (4, 4, 2, 2)
    assert merge.vector_plan(bf16[:, :, 1:5], bf16[:, 2:], bf16[1:], gpu) is not None  # sliced rows, heads, batch
    # the scalar kernel: columns not contiguous, a misaligned start or row stride, a head dim off the width,
    # or vectors switched off
    assert merge.vector_plan(bf16[..., ::2], bf16[..., ::2], bf16[..., ::2], gpu) is None
    shifted = _aligned((2, 8, 6, 128), np.uint16, 0, offset=8)
    assert merge.vector_plan(bf16, shifted, bf16, gpu) is None
    assert merge.vector_plan(f32, shifted, f32, gpu) is not None  # 8-byte vectors of a float32 kernel: aligned
    padded = _aligned((1, 2, 6, 44), np.uint16, 0)[..., :40]  # rows 88 bytes apart
    assert merge.vector_plan(padded, padded, padded, gpu) is None
    assert merge.vector_plan(_aligned((1, 2, 6, 40), np.float32, 0), padded, padded, gpu) == (4, 8, 32, 2)
    odd = _aligned((1, 2, 6, 36), np.uint16, 0)
    assert merge.vector_plan(odd, odd, odd, gpu) is None
    assert merge.vector_plan(bf16, bf16, bf16, merge.MergeConfig(vector=False)) is None
