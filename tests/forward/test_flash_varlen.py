"""numba_attn.flash_forward_varlen (packed sequences) against reference.attention_varlen and per-sequence flash_forward.

Simulator tests run each kernel's real code on its tiny tiles over a few short sequences of odd lengths (empty ones
included) with host offsets, device offsets (the planning kernel) and the argument checks; outputs start as NaN, so a
row no block writes fails. The ``gpu`` tests take realistic lengths on every kernel.
"""
from __future__ import annotations

import numpy as np
import pytest

import numba_attn
import reference
from kernel_checks import TOLERANCE, assert_close_lse, rel_error
from numba_attn.forward import varlen
from numba_attn.runtime.device import cuda
from numba_attn.runtime.launch import launch as device_launch

KERNELS = {"simt": ("simt", "float32"), "mma": ("mma", "float16"), "tf32": ("mma", "float32"),
           "wgmma": ("wgmma", "float16"), "wgmma_ws": ("wgmma_ws", "float16")}


def _packed(seed, lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, scale=1.0):
    rng = np.random.default_rng(seed)
    q = (scale * rng.standard_normal((sum(lengths_q), heads, head_dim))).astype(dtype)
    k = (scale * rng.standard_normal((sum(lengths_k), kv_heads, head_dim))).astype(dtype)
    v = rng.standard_normal((sum(lengths_k), kv_heads, head_dim)).astype(dtype)
    return q, k, v, np.r_[0, np.cumsum(lengths_q)].astype(np.int32), np.r_[0, np.cumsum(lengths_k)].astype(np.int32)


# (lengths_q, lengths_k, heads, kv_heads, head_dim, options, per_sequence): an empty query sequence, a sequence
# without keys (its rows give 0 and -inf), lengths no block divides, GQA; causal, a window, a cap; per_sequence: also
# compare with flash_forward of each sequence (bitwise; where it is cheap under the simulator)
CASES = {
    "simt": [([1, 17, 0, 9, 3], [5, 17, 4, 0, 12], 2, 1, 8, dict(causal=True), True),
             ([6, 11], [13, 4], 2, 2, 8, dict(window=(3, 2), softcap=2.0), True)],
    "mma": [([1, 20, 0, 3], [5, 18, 4, 0], 2, 1, 16, dict(causal=True), False),
            ([7, 18], [18, 7], 1, 1, 16, dict(window=(4, None), softcap=3.0), True)],
    "tf32": [([1, 10, 3], [9, 10, 0], 2, 1, 8, dict(causal=True, window=(5, 0)), False)],
    "wgmma": [([3, 18], [20, 5], 1, 1, 16, dict(causal=True, softcap=2.0), False)],
    # whole TMA boxes (64 rows of Q, 16-key tiles under the simulator) run into the next sequence's rows and keys
    # and past the arrays' end; GQA, Lq != Lk both ways, an empty query sequence, a sequence without keys
    "wgmma_ws": [([3, 18, 0, 2], [20, 5, 4, 0], 2, 1, 16, dict(causal=True), False),
                 ([17, 6], [6, 21], 1, 1, 24, dict(window=(4, 1), softcap=3.0), False)],
}


@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="the gpu tests cover this on a GPU")
@pytest.mark.parametrize("kernel,case", [(kernel, case) for kernel, cases in CASES.items() for case in cases])
def test_varlen_matches_reference_and_per_sequence_calls(poisoned_outputs, kernel, case):
    lengths_q, lengths_k, heads, kv_heads, head_dim, options, per_sequence = case
    backend, dtype = KERNELS[kernel]
    q, k, v, cu_q, cu_k = _packed(sum(lengths_q), lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, 1.5)
    out, lse = numba_attn.flash_forward_varlen(q, k, v, cu_q, cu_k, backend=backend, return_lse=True, **options)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **options)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_error(out, ref) < TOLERANCE[dtype]
    assert_close_lse(lse, ref_lse)
    # each sequence is the same computation as flash_forward of that sequence alone: the same bits
    for b in range(len(lengths_q) if per_sequence else 0):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lengths_q[b] == 0:
            continue
        one, one_lse = numba_attn.flash_forward(*(x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys])),
                                                backend=backend, return_lse=True, **options)
        np.testing.assert_array_equal(out[rows], one[0].transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, rows], one_lse[0])


@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="the gpu tests cover this on a GPU")
def test_warp_specialised_kernel_with_device_offsets(poisoned_outputs):
    # the planning kernel's schedule (blocks of 128 rows, a sequence's last block first) on the TMA kernel: the same
    # bits as with host offsets (an order of its own), and the reference's values
    lengths_q, lengths_k = [9, 0, 4], [3, 2, 20]
    q, k, v, cu_q, cu_k = _packed(8, lengths_q, lengths_k, 1, 1, 16, "float16")
    on_host = numba_attn.flash_forward_varlen(q, k, v, cu_q, cu_k, causal=True, backend="wgmma_ws")
    dq, dk, dv, dcu_q, dcu_k = (cuda.to_device(x) for x in (q, k, v, cu_q, cu_k))
    on_device = numba_attn.flash_forward_varlen(dq, dk, dv, dcu_q, dcu_k, causal=True, backend="wgmma_ws")
    np.testing.assert_array_equal(on_device.copy_to_host(), on_host)
    assert rel_error(on_host, reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True)) < TOLERANCE["float16"]


def test_mean_keys_counts_as_the_dense_dispatch_does():
    cu_q, cu_k = np.array([0, 1000, 1100]), np.array([0, 3000, 3100])
    assert varlen.mean_keys((cu_q, cu_k), 3100, 2, False) == (1000 * 3000 + 100 * 100) / 1100
    assert varlen.mean_keys((cu_q, cu_k), 3100, 2, True) == (1000 * 3000 + 100 * 100) / 2200
    assert varlen.mean_keys(None, 3100, 2, False) == 1550 and varlen.mean_keys(None, 3100, 2, True) == 775
    assert varlen.mean_keys((np.array([0]), np.array([0])), 0, 0, True) == 0


@pytest.mark.skipif(not numba_attn.SIMULATOR, reason="the gpu tests cover this on a GPU")
def test_device_offsets_plan_the_same_blocks(poisoned_outputs):
    lengths_q, lengths_k = [2, 9, 0, 1, 12], [9, 2, 3, 0, 12]
    q, k, v, cu_q, cu_k = _packed(3, lengths_q, lengths_k, 2, 2, 8, "float32")
    on_host = numba_attn.flash_forward_varlen(q, k, v, cu_q, cu_k, causal=True, backend="simt")
    dq, dk, dv, dcu_q, dcu_k = (cuda.to_device(x) for x in (q, k, v, cu_q, cu_k))
    on_device = numba_attn.flash_forward_varlen(dq, dk, dv, dcu_q, dcu_k, causal=True, backend="simt")
    np.testing.assert_array_equal(on_device.copy_to_host(), on_host)
    # with max_seqlen_q the grid holds exactly the blocks of the longest sequence times the batch
    tight = numba_attn.flash_forward_varlen(dq, dk, dv, dcu_q, dcu_k, causal=True, backend="simt", max_seqlen_q=12)
    np.testing.assert_array_equal(tight.copy_to_host(), on_host)


def test_planning_kernel_schedules_every_block_once():
    # 70 sequences: three rounds of the 32-thread scan; lengths 0..19, blocks of 8 rows
    rng = np.random.default_rng(4)
    lengths = rng.integers(0, 20, 70)
    cu_q = np.r_[0, np.cumsum(lengths)]
    cu_k = np.r_[0, np.cumsum(rng.integers(0, 5, 70))]
    block_m = 8
    host = varlen.host_schedule(cu_q, cu_k, block_m, False, None).reshape(-1, 4)
    entries = varlen.device_entries(int(cu_q[-1]), 70, block_m, None)
    assert entries >= len(host)
    plan = varlen._plan_kernel(block_m, 32)
    schedule = cuda.to_device(np.full(4 * entries + 71, -7, np.int32))
    device_launch(plan, (1,), (32,), 0 if numba_attn.SIMULATOR else cuda.default_stream(), 0,
                  cuda.to_device(cu_q.astype(np.int32)), cuda.to_device(cu_k.astype(np.int32)), schedule,
                  np.int32(70), np.int32(entries))
    device = schedule.copy_to_host()[:4 * entries].reshape(-1, 4)
    real = device[device[:, 1] > 0]  # idle entries: an empty sequence
    assert (device[len(host):] == 0).all()
    assert sorted(map(tuple, real)) == sorted(map(tuple, host))
    # sequences in order, each one's blocks last first
    first_rows = real[:, 0]
    assert (np.diff(real[:, 1]) >= 0).all() and all(
        (np.diff(first_rows[real[:, 1] == end]) == -block_m).all() for end in np.unique(real[:, 1]))
    # every row of every sequence lies in exactly one block
    covered = np.zeros(cu_q[-1], int)
    for m0, end, _, _ in host:
        covered[m0:min(m0 + block_m, end)] += 1
    assert (covered == 1).all()


def test_host_schedule_puts_the_longest_blocks_first():
    cu = np.array([0, 3, 300])
    schedule = varlen.host_schedule(cu, cu, 64, True, None).reshape(-1, 4)
    assert list(schedule[0]) == [3 + 4 * 64, 300, 3, 300]  # the causal block that sees the most keys
    assert list(schedule[-1][1:]) == [3, 0, 3]  # the 3-row sequence's block: 3 keys


@pytest.mark.parametrize("change,error,match", [
    (dict(cu_seqlens_q=[0, 3, 2, 5]), ValueError, "^cu_seqlens_q: must be non-decreasing"),
    (dict(cu_seqlens_q=[1, 3, 5]), ValueError, "^cu_seqlens_q: must start at 0"),
    (dict(cu_seqlens_k=[0, 2, 9]), ValueError, "^cu_seqlens_k: must end at k's number of tokens"),
    (dict(cu_seqlens_k=[0, 6]), ValueError, "^cu_seqlens_k: describes 1 sequences but cu_seqlens_q 2"),
    (dict(cu_seqlens_q=[[0, 5]]), ValueError, "^cu_seqlens_q: expected a 1-d array"),
    (dict(cu_seqlens_q=[0.0, 2.0, 5.0]), TypeError, "^cu_seqlens_q: expected integers"),
    (dict(q=np.zeros((5, 2, 8, 1), np.float32)), ValueError, r"^q: expected shape \(total_q, heads, headdim\)"),
    (dict(k=np.zeros((6, 3, 8), np.float32), v=np.zeros((6, 3, 8), np.float32)), ValueError,
     "^k: number of heads 3 must divide"),
    (dict(v=np.zeros((7, 1, 8), np.float32)), ValueError, "^v: expected k's shape"),
    (dict(k=np.zeros((6, 1, 4), np.float32), v=np.zeros((6, 1, 4), np.float32)), ValueError, "^k: headdim"),
    (dict(max_seqlen_q=2), ValueError, "^max_seqlen_q: 2 is shorter than the longest sequence"),
    (dict(max_seqlen_k=-1), ValueError, "^max_seqlen_k"),
    (dict(window=(1,)), ValueError, "^window"),
    (dict(softcap=-2.0), ValueError, "^softcap"),
    (dict(causal=1), TypeError, "^causal"),
])
def test_bad_inputs_raise(change, error, match):
    args = dict(q=np.zeros((5, 2, 8), np.float32), k=np.zeros((6, 1, 8), np.float32), v=np.zeros((6, 1, 8), np.float32),
                cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 4, 6]))
    args.update(change)
    arrays = [args.pop(name) for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    with pytest.raises(error, match=match):
        numba_attn.flash_forward_varlen(*arrays, **args)


def test_torch_cpu_tensors_and_offsets():
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = _packed(7, [3, 5], [4, 6], 2, 1, 8, "float32")
    out, lse = numba_attn.flash_forward_varlen(*(torch.from_numpy(x) for x in (q, k, v, cu_q, cu_k.astype(np.int64))),
                                               causal=True, backend="simt", return_lse=True)
    ref, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and rel_error(out, ref) < TOLERANCE["float32"]
    assert_close_lse(lse, ref_lse)


def test_device_offsets_must_be_int32_and_on_the_device():
    q, k, v, cu_q, cu_k = _packed(5, [2, 3], [3, 3], 1, 1, 8, "float32")
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    with pytest.raises(TypeError, match="^cu_seqlens_q: dtype int64"):
        numba_attn.flash_forward_varlen(dq, dk, dv, cuda.to_device(cu_q.astype(np.int64)), cuda.to_device(cu_k))
    with pytest.raises(ValueError, match="^cu_seqlens_q: is on the GPU but q is on the host"):
        numba_attn.flash_forward_varlen(q, k, v, cuda.to_device(cu_q), cuda.to_device(cu_k))
    with pytest.raises(ValueError, match="^cu_seqlens_k: must live where cu_seqlens_q lives"):
        numba_attn.flash_forward_varlen(dq, dk, dv, cu_q, cuda.to_device(cu_k))


# ---- realistic sizes on a GPU -----------------------------------------------------------------------------------------
GPU_KERNELS = ["simt16", "simt", "mma", "mma_bf16", "tf32", "wgmma", "wgmma_bf16", "wgmma_ws", "wgmma_ws_bf16"]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("device_offsets", [False, True])
@pytest.mark.parametrize("lengths_q,lengths_k,heads,kv_heads,head_dim,options", [
    ([1, 17, 128, 1000, 3], [1, 17, 128, 1000, 3], 8, 2, 128, dict(causal=True)),
    ([1, 17, 128, 1000, 3], [40, 5, 700, 1000, 0], 4, 1, 64, dict(window=(100, 20), softcap=30.0)),
    ([300, 0, 77], [1000, 9, 77], 4, 4, 80, dict(causal=True, window=(64, None))),
])
def test_gpu_varlen_every_kernel(kernel, device_offsets, lengths_q, lengths_k, heads, kv_heads, head_dim, options):
    torch = pytest.importorskip("torch")
    from numba_attn.runtime.device import compute_capability

    backend = {"simt16": "simt", "mma_bf16": "mma", "tf32": "mma", "wgmma_bf16": "wgmma",
               "wgmma_ws_bf16": "wgmma_ws"}.get(kernel, kernel)
    dtype = {"simt16": "float16", "simt": "float32", "tf32": "float32", "mma_bf16": "bfloat16",
             "wgmma_bf16": "bfloat16", "wgmma_ws_bf16": "bfloat16"}.get(kernel, "float16")
    if backend.startswith("wgmma") and (compute_capability() < (9, 0) or head_dim > 128):
        pytest.skip("wgmma needs compute capability 9.0")
    q, k, v, cu_q, cu_k = _packed(6, lengths_q, lengths_k, heads, kv_heads, head_dim, "float32")
    tq, tk, tv = (torch.from_numpy(x).to("cuda", getattr(torch, dtype)) for x in (q, k, v))
    qh, kh, vh = (t.float().cpu().numpy().astype(np.float64) for t in (tq, tk, tv))
    if device_offsets:
        cu_q, cu_k = torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda()
    out = tq.new_full(tq.shape, float("nan"))
    _, lse = numba_attn.flash_forward_varlen(tq, tk, tv, cu_q, cu_k, backend=backend, out=out, return_lse=True,
                                             max_seqlen_q=max(lengths_q), **options)
    ref, ref_lse = reference.attention_varlen(qh, kh, vh, np.r_[0, np.cumsum(lengths_q)],
                                              np.r_[0, np.cumsum(lengths_k)], return_lse=True, **options)
    host = out.float().cpu().numpy()
    assert not np.isnan(host).any()
    assert rel_error(host, ref) < TOLERANCE[dtype]
    assert_close_lse(lse.cpu().numpy(), ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("device_offsets", [False, True])
@pytest.mark.parametrize("lengths_q,lengths_k,heads,kv_heads,causal", [
    ([1, 17, 1000, 4096, 0, 130], [1, 17, 1000, 4096, 5, 130], 4, 2, True),
    ([1, 17, 1000, 4096, 300], [33, 1, 2000, 4000, 300], 6, 1, True),  # Lq != Lk per sequence, GQA 6
    ([4096, 1, 17, 1000], [1000, 4096, 17, 1], 2, 2, False),
])
def test_gpu_varlen_warp_specialised(dtype, head_dim, device_offsets, lengths_q, lengths_k, heads, kv_heads,
                                     causal):
    """The TMA kernel over packed sequences (boxes that run into the next sequence) against the reference per
    sequence; outputs start as NaN, so a row no block writes fails."""
    torch = pytest.importorskip("torch")
    from numba_attn.runtime.device import compute_capability

    if compute_capability() < (9, 0):
        pytest.skip("wgmma_ws needs compute capability 9.0")
    q, k, v, cu_q, cu_k = _packed(len(lengths_q) + head_dim, lengths_q, lengths_k, heads, kv_heads, head_dim,
                                  "float32")
    tq, tk, tv = (torch.from_numpy(x).to("cuda", getattr(torch, dtype)) for x in (q, k, v))
    qh, kh, vh = (t.float().cpu().numpy().astype(np.float64) for t in (tq, tk, tv))
    offsets = (torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda()) if device_offsets else (cu_q, cu_k)
    out = tq.new_full(tq.shape, float("nan"))
    _, lse = numba_attn.flash_forward_varlen(tq, tk, tv, *offsets, backend="wgmma_ws", out=out, return_lse=True,
                                             causal=causal)
    host, lse = out.float().cpu().numpy(), lse.cpu().numpy()
    assert not np.isnan(host).any()
    ref, ref_lse = reference.attention_varlen(qh, kh, vh, cu_q, cu_k, causal=causal, return_lse=True)
    assert rel_error(host, ref) < TOLERANCE[dtype]
    for b in range(len(lengths_q)):  # every sequence on its own (a short one's error hides in the total's)
        rows = slice(cu_q[b], cu_q[b + 1])
        if lengths_q[b]:
            assert rel_error(host[rows], ref[rows]) < TOLERANCE[dtype] or np.abs(ref[rows]).max() == 0, b
    assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
def test_gpu_varlen_default_dispatch(monkeypatch):
    """backend=None takes the warp-specialised kernel at the padded head dims of ``varlen.WS_HEAD_DIMS`` for rows
    seeing >= WS_MIN_KEYS keys on average, else wgmma; the results agree with the mma kernel's."""
    torch = pytest.importorskip("torch")
    from numba_attn.forward import wgmma, wgmma_ws
    from numba_attn.runtime.device import compute_capability

    if compute_capability() < (9, 0):
        pytest.skip("needs compute capability 9.0")
    calls = []
    for module, name in ((wgmma_ws, "wgmma_ws"), (wgmma, "wgmma")):
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda *a, _real=real, _name=name, **kw: (calls.append(_name),
                                                                                        _real(*a, **kw))[1])
    long = [4 * varlen.WS_MIN_KEYS, 2 * varlen.WS_MIN_KEYS, 100]
    short = [300, 200, 100]
    for head_dim, lengths, device_offsets, expected in ((128, long, False, "wgmma_ws"), (128, long, True, "wgmma_ws"),
                                                        (128, short, False, "wgmma"), (64, long, False, "wgmma_ws"),
                                                        (64, short, True, "wgmma"), (96, long, False, "wgmma")):
        q, k, v, cu_q, cu_k = _packed(head_dim, lengths, lengths, 4, 2, head_dim, "float32")
        tq, tk, tv = (torch.from_numpy(x).to("cuda", torch.float16) for x in (q, k, v))
        offsets = (torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda()) if device_offsets else (cu_q, cu_k)
        got = numba_attn.flash_forward_varlen(tq, tk, tv, *offsets, causal=True)
        assert calls[-1] == expected, (head_dim, lengths, device_offsets, calls)
        ref = numba_attn.flash_forward_varlen(tq, tk, tv, *offsets, causal=True, backend="mma")
        # (two float16 kernels, each within 2e-3 of float64)
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 4e-3
