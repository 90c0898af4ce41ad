"""Ring attention across the GPUs of one host: numba_attn's ``ring_attention`` against torch's own context
parallelism (``torch.distributed.tensor.experimental.context_parallel`` around SDPA), and scaling against one GPU.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node=2 scripts/bench_ring.py [--seqlens 131072,262144] [--heads 8]
        [--kv-heads 8] [--headdim 128] [--dtype bfloat16] [--causal/--no-causal] [--json FILE]

Per total sequence length N (B = 1, one call at a time, median of CUDA-event times after warm-up, the slowest rank's
time of each call):

* ``ring``: ``numba_attn.distributed.ring_attention`` on N / world rows per rank (zig-zag shards when causal);
* ``torch_cp``: SDPA inside ``context_parallel`` (torch's shards and rotation; its SDPA backend as torch picks it,
  and once more with each backend in ``--torch-backends``);
* ``single``: ``numba_attn.flash_forward`` of the whole sequence on rank 0's GPU alone (strong scaling), and of
  N / world rows (weak scaling: the per-GPU length of this run on one GPU).

TFLOP/s count ``4 B H N^2 D`` (halved when causal) for the whole sequence. Strong-scaling efficiency
``t_single(N) / (world * t_ring(N))``; weak-scaling efficiency: TFLOP/s per GPU of the ring at N over the single
GPU's TFLOP/s at N / world (the same rows per GPU, ``world`` times the keys).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _time(torch, dist, fn, budget_s: float, min_reps: int = 3, max_reps: int = 20):
    """Median over calls of the slowest rank's CUDA-event time (ms); the same number of calls on every rank."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    first = torch.tensor([start.elapsed_time(stop)], device="cuda")
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    reps = int(max(min_reps, min(max_reps, budget_s * 1e3 / max(first.item(), 1e-3))))
    times = []
    for _ in range(reps):
        dist.barrier()
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(stop)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def _tflops(batch, heads, seqlen, headdim, causal, ms):
    flops = 4.0 * batch * heads * seqlen * seqlen * headdim * (0.5 if causal else 1.0)
    return flops / (ms * 1e-3) / 1e12


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="131072,262144")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timed calls per case")
    parser.add_argument("--torch-backends", default="flash,cudnn", help="SDPA backends for torch_cp (',' list)")
    parser.add_argument("--no-single", action="store_true", help="skip the one-GPU runs")
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward (autograd) instead of the forward; FLOPs 3.5x the forward's")
    parser.add_argument("--steps", action="store_true",
                        help="also profile one forward ring call per length: each rank's kernels, merges and waits "
                             "by CUDA events, and the same kernels on each GPU alone (no transfers)")
    parser.add_argument("--group-backend", default="nccl",
                        help="init_process_group's backend: 'nccl', or 'cpu:gloo,cuda:nccl' (ring_attention's "
                             "argument check then runs on the CPU, without a host sync)")
    parser.add_argument("--nccl-high-priority", action="store_true",
                        help="TORCH_NCCL_HIGH_PRIORITY=1: NCCL's streams at high priority (for every provider)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.nccl_high_priority:
        os.environ["TORCH_NCCL_HIGH_PRIORITY"] = "1"

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(args.group_backend, device_id=device)
    import numba_attn
    from numba_attn.distributed import ring_attention, shard

    dtype, causal = getattr(torch, args.dtype), args.causal
    heads, kv_heads, headdim = args.heads, args.kv_heads or args.heads, args.headdim
    layout = "zigzag" if causal else "contiguous"
    rows = []

    def report(row):
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)

    for seqlen in (int(x) for x in args.seqlens.split(",")):
        generator = torch.Generator(device="cuda").manual_seed(seqlen)
        q = torch.randn((1, heads, seqlen, headdim), device=device, dtype=dtype, generator=generator)
        k, v = (torch.randn((1, kv_heads, seqlen, headdim), device=device, dtype=dtype, generator=generator)
                for _ in range(2))
        shards = [shard(x, rank, world, layout).contiguous() for x in (q, k, v)]
        base = {"seqlen": seqlen, "world": world, "heads": heads, "kv_heads": kv_heads, "headdim": headdim,
                "dtype": args.dtype, "causal": causal, "group_backend": args.group_backend,
                "nccl_high_priority": args.nccl_high_priority,
                "ring_merge": os.environ.get("NUMBA_ATTN_RING_MERGE", "kernel")}

        factor = 3.5 if args.backward else 1.0
        base["pass"] = "forward+backward" if args.backward else "forward"
        if args.backward:
            leaves = [x.requires_grad_() for x in shards]
            dout = torch.randn_like(shards[0])

            def ring():
                ring_attention(*leaves, causal=causal, layout=layout).backward(dout)
            ms = _time(torch, dist, ring, args.budget)
        else:
            with torch.no_grad():
                ms = _time(torch, dist, lambda: ring_attention(*shards, causal=causal, layout=layout), args.budget)
        report({**base, "provider": "ring", "ms": ms,
                "tflops": factor * _tflops(1, heads, seqlen, headdim, causal, ms)})
        if args.steps and not args.backward:
            report({**base, "provider": "ring_steps",
                    "ranks": _step_profile(torch, dist, shards, causal, layout, world, rank)})

        if not args.no_single and not args.backward:
            for length, kind in ((seqlen, "single"), (seqlen // world, "single_per_gpu")):
                def one_gpu(length=length):
                    if rank == 0:
                        numba_attn.flash_forward(q[:, :, :length], k[:, :, :length], v[:, :, :length],
                                                 causal=causal)
                ms = _time(torch, dist, one_gpu, args.budget)
                report({**base, "provider": kind, "seqlen": length, "ms": ms,
                        "tflops": _tflops(1, heads, length, headdim, causal, ms)})

        del shards
        for backend in [None] + [b for b in args.torch_backends.split(",") if b]:
            name = "torch_cp" + (f"_{backend}" if backend else "")
            try:
                ms = _torch_context_parallel(torch, dist, q, k, v, causal, world, backend, args.budget,
                                             args.backward)
            except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                report({**base, "provider": name, "error": f"{type(error).__name__}: {str(error)[:300]}"})
                continue
            report({**base, "provider": name, "ms": ms,
                    "tflops": factor * _tflops(1, heads, seqlen, headdim, causal, ms)})
        del q, k, v
        torch.cuda.empty_cache()

    if rank == 0:
        _summary(rows, world)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
    dist.destroy_process_group()
    return 0


def _step_profile(torch, dist, shards, causal, layout, world, rank):
    """Where one forward ring call's time goes, per rank: CUDA events around each ``flash_forward`` and merge of
    the call (offsets from the call's start, ms), then the same ``flash_forward`` calls again on each GPU while the
    others wait (no transfers beside them). Returns, on every rank, a list per rank of ``{"events": [(label,
    start, ms)], "call_ms", "solo_ms": [...]}``."""
    from numba_attn import api
    from numba_attn.distributed import merge as merge_module
    from numba_attn.distributed import ring as ring_module
    from numba_attn.distributed import ring_attention

    from numba_attn.distributed import agreement as agreement_module

    events, calls, host = [], [], {"start": 0.0}
    real_forward, real_merge, real_kernel_merge = api.flash_forward, ring_module._merge_into, merge_module.merge_into

    def timed(label, fn, keep=False):
        def wrapper(*args, **kwargs):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            host_begin = time.perf_counter()
            result = fn(*args, **kwargs)
            host_end = time.perf_counter()
            end.record()
            events.append((label, begin, end, (host_begin - host["start"]) * 1e3, (host_end - host_begin) * 1e3))
            if keep:
                calls.append((args, kwargs))
            return result
        return wrapper

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    api.flash_forward, ring_module._merge_into = timed("kernel", real_forward, True), timed("merge", real_merge)
    merge_module.merge_into = timed("merge", real_kernel_merge)
    real_check, real_read = ring_module.start_checked_on_every_rank, agreement_module.Agreement.result
    real_issue = ring_module._issue
    ring_module.start_checked_on_every_rank = timed("check", real_check)
    agreement_module.Agreement.result = timed("check_read", real_read)
    ring_module._issue = timed("transfer", real_issue)
    try:
        with torch.no_grad():
            ring_attention(*shards, causal=causal, layout=layout)  # warm (and the same kernels compiled)
            torch.cuda.synchronize()
            events.clear()
            calls.clear()
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            host["start"] = time.perf_counter()
            ring_attention(*shards, causal=causal, layout=layout)
            host["call"] = (time.perf_counter() - host["start"]) * 1e3
            stop.record()
            torch.cuda.synchronize()
    finally:
        api.flash_forward, ring_module._merge_into = real_forward, real_merge
        merge_module.merge_into = real_kernel_merge
        ring_module.start_checked_on_every_rank, agreement_module.Agreement.result = real_check, real_read
        ring_module._issue = real_issue
    # per event: label, GPU start and time (ms, from the call's start event), host start and time (ms, perf_counter)
    mine = {"call_ms": start.elapsed_time(stop), "host_call_ms": host["call"],
            "events": [(label, start.elapsed_time(b), b.elapsed_time(e), host_start, host_ms)
                       for label, b, e, host_start, host_ms in events]}
    solo = []
    with torch.no_grad():
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                for args, kwargs in calls:
                    real_forward(*args, **kwargs)  # warm
                for args, kwargs in calls:
                    times = []
                    for _ in range(5):
                        b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        b.record()
                        real_forward(*args, **kwargs)
                        e.record()
                        torch.cuda.synchronize()
                        times.append(b.elapsed_time(e))
                    solo.append(statistics.median(times))
            torch.cuda.synchronize()
    mine["solo_ms"] = solo
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for r, row in enumerate(everyone):
            kernels = [x for x in row["events"] if x[0] == "kernel"]
            merges = [x for x in row["events"] if x[0] == "merge"]
            print(f"steps rank {r}: call {row['call_ms']:.2f} ms; kernels "
                  + " ".join(f"{x[1]:.2f}+{x[2]:.2f}" for x in kernels)
                  + f" (sum {sum(x[2] for x in kernels):.2f}, alone {sum(row['solo_ms']):.2f}: "
                  + " ".join(f"{ms:.2f}" for ms in row["solo_ms"])
                  + f"); merges sum {sum(x[2] for x in merges):.2f}; host (start+ms) "
                  + " ".join(f"{x[0]} {x[3]:.2f}+{x[4]:.2f}" for x in row["events"] if x[0] != "merge")
                  + f"; host call {row['host_call_ms']:.2f}", flush=True)
    return everyone


def _torch_context_parallel(torch, dist, q, k, v, causal, world, backend, budget_s, backward=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    try:  # torch shards for causal load balance by default, which it refuses without is_causal
        from torch.distributed.tensor.experimental._attention import _cp_options
    except ImportError:  # (older layout)
        from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    _cp_options.enable_load_balance = causal
    mesh = init_device_mesh("cuda", (world,))
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    chosen = [backends[backend]] if backend else list(backends.values())
    q, k, v = (x.clone() for x in (q, k, v))  # context_parallel shards its buffers in place
    if backward:
        dout = torch.randn_like(q)
        with sdpa_kernel(chosen), context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                                                   no_restore_buffers={q, k, v, dout}):
            leaves = [x.requires_grad_() for x in (q, k, v)]
            def step():
                F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(dout)
            return _time(torch, dist, step, budget_s)
    with torch.no_grad(), sdpa_kernel(chosen), context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2],
                                                                 no_restore_buffers={q, k, v}):
        return _time(torch, dist, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), budget_s)


def _summary(rows, world):
    """One line per ring row, against the rows of the same round (those after it up to the next ring row: a length
    given twice in ``--seqlens`` is two rounds, each with its own one-GPU and torch timings)."""
    print(f"\nworld {world}: seqlen | ring TFLOP/s | torch_cp (best) | ring / torch_cp | strong eff. | weak eff.")
    rings = [i for i, row in enumerate(rows) if row["provider"] == "ring"]
    for at, end in zip(rings, rings[1:] + [len(rows)]):
        row, n = rows[at], rows[at]["seqlen"]
        by = {(r["provider"], r["seqlen"]): r for r in rows[at + 1:end] if "ms" in r}
        peers = [r for (p, s), r in by.items() if p.startswith("torch_cp") and s == n]
        best = max(peers, key=lambda r: r["tflops"]) if peers else None
        single, per_gpu = by.get(("single", n)), by.get(("single_per_gpu", n // world))
        strong = single["ms"] / (world * row["ms"]) if single else math.nan
        weak = row["tflops"] / world / per_gpu["tflops"] if per_gpu else math.nan
        vs = row["tflops"] / best["tflops"] if best else math.nan
        print(f"{n:>8} | {row['tflops']:12.1f} | {best['tflops'] if best else math.nan:8.1f} "
              f"({best['provider'] if best else '-'}) | {vs:5.2f} | {strong:5.2f} | {weak:5.2f}")


if __name__ == "__main__":
    sys.exit(main())
