"""numba_attn.distributed.ring_attention on GPUs over NCCL: equal to single-GPU ``flash_forward`` of the whole
sequence (and to ``reference.attention`` where the sequence is small enough for float64).

One process per GPU (2 to 4 of them), spawned once; each runs every case: the whole inputs come from one seed
on every rank, each rank shards them, runs ``ring_attention`` (K/V shards over NCCL on a side stream) and gathers;
rank 0 saves the gathered result and the single-GPU ``flash_forward`` of the whole sequence, which the parent
compares.
"""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import reference  # noqa: E402
from kernel_checks import TOLERANCE, assert_close_lse, rel_error  # noqa: E402

pytestmark = pytest.mark.gpu

# (name, dtype, causal, layout, heads, kv_heads, total seqlen per rank, headdim)
CASES = [
    ("zigzag_gqa_bf16", "bfloat16", True, "zigzag", 8, 2, 1000, 128),  # 500-row chunks: no block divides them
    ("zigzag_f16_d64", "float16", True, "zigzag", 4, 4, 2048, 64),
    ("contiguous_f16", "float16", True, "contiguous", 4, 1, 777, 128),
    ("noncausal_f32", "float32", False, "contiguous", 2, 2, 512, 64),
    ("noncausal_zigzag_bf16", "bfloat16", False, "zigzag", 4, 2, 1024, 128),
    ("zigzag_window_bf16", "bfloat16", True, "zigzag", 4, 2, 1000, 128),
    ("contiguous_band_f16", "float16", False, "contiguous", 4, 4, 640, 64),
]

#: the window and soft-capping of the cases that have them (global positions): a window narrower than a 500-row
#: chunk (zigzag: most chunk pairs skipped), a band with both sides across shards
BAND = {"zigzag_window_bf16": {"window": (300, None), "softcap": 30.0},
        "contiguous_band_f16": {"window": (700, 200)}}


#: dtypes whose gradients are checked too
BACKWARD_DTYPES = ("float16", "bfloat16", "float32")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _inputs(name, dtype, heads, kv_heads, seqlen, headdim, device):
    generator = torch.Generator(device="cpu").manual_seed(sum(map(ord, name)))
    shapes = ((1, heads, seqlen, headdim), (1, kv_heads, seqlen, headdim), (1, kv_heads, seqlen, headdim))
    return [torch.randn(shape, generator=generator).to(device=device, dtype=getattr(torch, dtype))
            for shape in shapes]


def _worker(rank, world, port, folder):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    import numba_attn
    from numba_attn.distributed import gather, ring_attention, shard
    try:
        for name, dtype, causal, layout, heads, kv_heads, per_rank, headdim in CASES:
            q, k, v = _inputs(name, dtype, heads, kv_heads, per_rank * world, headdim, device)
            shards = [shard(x, rank, world, layout).contiguous() for x in (q, k, v)]
            band = BAND.get(name, {})
            out, lse = ring_attention(*shards, causal=causal, layout=layout, return_lse=True, **band)
            again = ring_attention(*shards, causal=causal, layout=layout, **band)  # same transfers, same sums
            assert out.dtype == q.dtype and out.shape == shards[0].shape
            assert torch.equal(out, again), f"{name}: two calls differ"
            whole_out, whole_lse = gather(out, layout), gather(lse, layout)
            grads = {}
            if dtype in BACKWARD_DTYPES:  # autograd through the ring, gathered
                dout = _inputs(name + "dout", dtype, heads, heads, per_rank * world, headdim, device)[0]
                leaves = [x.clone().requires_grad_() for x in shards]
                ring_attention(*leaves, causal=causal, layout=layout, **band).backward(shard(dout, rank, world,
                                                                                             layout))
                grads = {f"d{x}": gather(t.grad, layout).float().cpu().numpy() for x, t in zip("qkv", leaves)}
                grads["dout"] = dout.float().cpu().numpy()
            if rank == 0:
                single_out, single_lse = numba_attn.flash_forward(q, k, v, causal=causal, return_lse=True, **band)
                np.savez(os.path.join(folder, f"{name}.npz"), out=whole_out.float().cpu().numpy(),
                         lse=whole_lse.cpu().numpy(), single_out=single_out.float().cpu().numpy(),
                         single_lse=single_lse.cpu().numpy(), **grads,
                         **{x: t.float().cpu().numpy() for x, t in zip("qkv", (q, k, v))})
        # a rank with another causal: the same ValueError on every rank (the check's all_gather runs on the GPU
        # for an NCCL-only group), and the group still works after it
        x = torch.zeros(1, 2, 8, 64, device=device, dtype=torch.float16)
        try:
            ring_attention(x, x, x, causal=rank == 1, layout="contiguous")
        except ValueError as error:
            assert str(error).startswith("causal differs across ranks"), error
        else:
            raise AssertionError(f"rank {rank}: ranks with another causal were accepted")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ring_attention_on_gpus_equals_single_gpu(tmp_path):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2 or not dist.is_nccl_available():
        pytest.skip("needs two GPUs and NCCL")
    world = min(count, 4)
    torch.multiprocessing.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world)
    for name, dtype, causal, _, _, _, _, _ in CASES:
        saved = np.load(tmp_path / f"{name}.npz")
        # against the single-GPU kernel: the same kernels on parts of the keys, merged in float32
        assert rel_error(saved["out"], saved["single_out"]) < TOLERANCE[dtype], name
        assert_close_lse(saved["lse"], saved["single_lse"], tol=1e-4)
        band = BAND.get(name, {})
        ref_out, ref_lse = reference.attention(saved["q"], saved["k"], saved["v"], causal=causal, return_lse=True,
                                               **band)
        error = rel_error(saved["out"], ref_out)
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.3g} against float64"
        assert_close_lse(saved["lse"], ref_lse, tol=1e-4)
        if "dq" in saved:
            refs = reference.attention_backward(saved["dout"], saved["q"], saved["k"], saved["v"], causal=causal,
                                                **band)
            for x, ref in zip(("dq", "dk", "dv"), refs):
                error = rel_error(saved[x], ref)
                assert error < TOLERANCE[dtype], f"{name} {x}: relative error {error:.3g} against float64"
