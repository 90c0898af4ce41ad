"""Times ``flash_decode``'s key-range plans against each other and against torch SDPA, in one process.

A plan is ``decode.plan.plan_splits`` with its knobs set: ``POOL_FRACTION`` (``pF``: share of every row tile's keys
in the pool its blocks take tile by tile; used where a row tile has several lead ranges), ``TAIL_FRACTION`` (share
of every row tile's keys cut into short tail ranges that the block scheduler hands to the SMs that finish their lead
range first; for the plans without a pool) and ``TAIL_RANGES_PER_SLOT`` (how many tail ranges per resident block,
i.e. their length). ``0`` is the plan without tail ranges (equal ranges filling one wave, or the pool); a variant
ends in ``+field=value`` changes of the kernel's config, e.g. ``0.2:4+key_pool=0`` (no pool: tail ranges).

Each (case, variant) is timed two ways, in rounds that alternate the variants:

- ``graph``: ``--steps`` calls captured in one torch CUDA graph, replayed ``--replays`` times between CUDA events;
  the median replay over ``--steps`` (GPU time of a step, no host time);
- ``queued``: calls queued back to back, 10 between host synchronisations, with an event pair around each call
  (``scripts/sweep.py``'s timer; host time shows where it exceeds the GPU work).

Every variant's output is compared with the float64 reference on the first kv head's query heads of the first batch
entry. ``--kernels`` adds the kernels' own times (torch profiler); ``--host N`` first times and profiles the host
side of N planned calls.

    python scripts/decode_tail.py [--lengths 16k,32k,64k] [--kv-heads 4,32] [--variants 0,0.2:4] [--json FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import numpy as np

import numba_attn
import reference
from numba_attn.decode import cached as _decode_plan
from numba_attn.decode import mma as decode_mma
from numba_attn.decode import plan as split_plan


_DEFAULT_CONFIG = decode_mma.DEFAULT_CONFIG


def parse_variant(text: str) -> tuple:
    """``F:R`` (tail fraction F, R ranges per slot), ``0`` (equal ranges, one wave) or ``nS`` (the caller's
    ``num_splits=S``), then ``+field=value`` changes of ``decode_mma.DEFAULT_CONFIG`` (``0+stages=3+l2_prefetch=0``)."""
    text, *changes = text.split("+")
    config = {}
    for change in changes:
        field, _, value = change.partition("=")
        kind = type(getattr(_DEFAULT_CONFIG, field))
        config[field] = bool(int(value)) if kind is bool else kind(value)
    pool = split_plan.POOL_FRACTION
    if text.startswith("p"):  # pF: pooled plans with a pool of share F (the kernel's key_pool on)
        config["key_pool"], pool, text = True, float(text[1:]), "0"
    config = tuple(sorted(config.items()))
    if text.startswith("n"):
        return (0.0, split_plan.TAIL_RANGES_PER_SLOT, int(text[1:]), config, pool)
    fraction, _, per_slot = text.partition(":")
    return float(fraction), int(per_slot or split_plan.TAIL_RANGES_PER_SLOT), None, config, pool


def set_variant(variant) -> None:
    knobs = (split_plan.TAIL_FRACTION, split_plan.TAIL_RANGES_PER_SLOT, split_plan.POOL_FRACTION)
    split_plan.TAIL_FRACTION, split_plan.TAIL_RANGES_PER_SLOT = variant[:2]
    split_plan.POOL_FRACTION = variant[4]
    if knobs != variant[:2] + (variant[4],):
        _decode_plan.clear()  # (each launch keeps its plans per cache length)
    config = dataclasses.replace(_DEFAULT_CONFIG, **dict(variant[3]))
    if config != decode_mma.DEFAULT_CONFIG:
        decode_mma.DEFAULT_CONFIG = config
        _decode_plan.clear()


def label(variant) -> str:
    fraction, per_slot, num_splits, config, pool = variant
    if num_splits:
        text = f"num_splits={num_splits}"
    elif dict(config).get("key_pool", _DEFAULT_CONFIG.key_pool) and pool > 0:
        text = f"pool {pool:g} (else tail {fraction:g}, {per_slot}/slot)" if fraction > 0 else f"pool {pool:g}"
    else:
        text = "equal ranges" if fraction <= 0 else f"tail {fraction:g}, {per_slot}/slot"
    return text + "".join(f" {field}={value}" for field, value in config)


def graph_step_us(torch, fn, steps: int, replays: int) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    del graph
    return statistics.median(times)


def queued_call_us(torch, fn, calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for first in range(0, calls, 10):
        pairs = []
        for _ in range(min(10, calls - first)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        pairs[-1][1].synchronize()
        times.extend(s.elapsed_time(e) * 1e3 for s, e in pairs)
    return statistics.median(times)


def copy_gbps(torch) -> float:
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e-3)
    return 2 * src.numel() * 2 / statistics.median(times) / 1e9


def kernel_times(torch, fn, steps: int) -> list:
    """(kernel name, calls, mean us) of ``steps`` calls from the torch profiler (CUPTI: our kernels too), and the
    span of the last step (first kernel start to last kernel end)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" and evt.count:
            total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            rows.append((evt.key[:60], evt.count, total / evt.count))
    return sorted(rows, key=lambda r: -r[1] * r[2])


def host_profile(calls: int) -> None:
    """Host time of planned ``flash_decode`` calls (B1 H32 Hkv4 D128, 4k keys: GPU work of a few us) and where it
    goes (cProfile)."""
    import cProfile
    import io
    import pstats
    import time

    import torch

    q = torch.randn(1, 32, 1, 128, device="cuda").half()
    k, v = (torch.randn(1, 4, 4096, 128, device="cuda").half() for _ in range(2))
    for _ in range(10):
        numba_attn.flash_decode(q, k, v)
    torch.cuda.synchronize()
    for name, fn in (("flash_decode (planned)", lambda: numba_attn.flash_decode(q, k, v)),
                     ("torch.empty x2", lambda: (torch.empty((1, 32, 1, 128), dtype=torch.float16, device="cuda"),
                                                 torch.empty((8 * 32 * 129,), dtype=torch.float32, device="cuda"))),
                     ("3 x (shape, stride, data_ptr)", lambda: [(x.shape, x.stride(), x.data_ptr())
                                                                for x in (q, k, v)])):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        print(f"host: {name:32s} {best:7.1f} us per call", flush=True)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        numba_attn.flash_decode(q, k, v)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16k,32k,64k")
    parser.add_argument("--kv-heads", default="4,32")
    parser.add_argument("--variants", default="0,0.1:4,0.2:2,0.2:4,0.2:8,0.3:4")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--no-queued", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="also per-kernel GPU times (torch profiler)")
    parser.add_argument("--host", type=int, default=0, help="first profile the host time of this many calls")
    parser.add_argument("--min-lead-tiles", type=int, default=None,
                        help="split_plan.MIN_LEAD_TILES for the tail variants (default: the module's)")
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if args.min_lead_tiles is not None:
        split_plan.MIN_LEAD_TILES = args.min_lead_tiles
    if args.host:
        host_profile(args.host)
    lengths = [int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in args.lengths.split(",")]
    variants = [parse_variant(x) for x in args.variants.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_gbps(torch)
    print(f"device {torch.cuda.get_device_name()} ({sms} SMs); copy {copy:.0f} GB/s", flush=True)
    rows = []
    for kv_heads in (int(x) for x in args.kv_heads.split(",")):
        for seqlen_k in lengths:
            gen = torch.Generator(device="cuda").manual_seed(seqlen_k + kv_heads)
            b, h, d = args.batch, args.heads, args.head_dim
            q = torch.randn(b, h, 1, d, device="cuda", generator=gen).half()
            k = torch.randn(b, kv_heads, seqlen_k, d, device="cuda", generator=gen).half()
            v = torch.randn(b, kv_heads, seqlen_k, d, device="cuda", generator=gen).half()
            nbytes = 2 * (2 * b * kv_heads * seqlen_k * d + 2 * b * h * d)
            group = h // kv_heads
            ref = reference.attention(*(x[:1, :heads].double().cpu().numpy()
                                        for x, heads in ((q, group), (k, 1), (v, 1))))
            case = f"B{b} H{h} Hkv{kv_heads} D{d} {seqlen_k // 1024}k"
            fns = {label(var): (var, lambda n=var[2]: numba_attn.flash_decode(q, k, v, num_splits=n))
                   for var in variants}

            def sdpa():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != h)

            fns["SDPA flash"] = (None, sdpa)
            results = {name: {"graph": [], "queued": []} for name in fns}
            for name, (var, fn) in fns.items():
                if var is not None:
                    set_variant(var)
                    config = decode_mma.DEFAULT_CONFIG
                    plan = (split_plan.uniform_plan(seqlen_k, var[2], config.block_n) if var[2]
                            else split_plan.plan_splits(b, kv_heads, h // kv_heads, seqlen_k, sms, config))
                    results[name]["plan"] = plan.__dict__
                out = fn()
                torch.cuda.synchronize()
                got = out[:1, :group].double().cpu().numpy()
                results[name]["error"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            if args.kernels:
                for name, (var, fn) in fns.items():
                    if var is not None:
                        set_variant(var)
                    for kernel, count, us in kernel_times(torch, fn, args.steps):
                        print(f"  kernels {name:40s} {kernel:60s} x{count:3d} {us:8.1f} us", flush=True)
            for _ in range(args.rounds):
                for name, (var, fn) in fns.items():
                    if var is not None:
                        set_variant(var)
                    results[name]["graph"].append(graph_step_us(torch, fn, args.steps, args.replays))
                    if not args.no_queued:
                        results[name]["queued"].append(queued_call_us(torch, fn, args.calls))
            print(f"\n{case} ({nbytes / 1e6:.0f} MB per step)", flush=True)
            for name, r in results.items():
                g = statistics.median(r["graph"])
                qd = statistics.median(r["queued"]) if r["queued"] else float("nan")
                plan = r.get("plan")
                plan_text = (f"{plan['lead_splits']}x{plan['lead_keys']} + {plan['num_splits'] - plan['lead_splits']}"
                             f"x{plan['tail_keys']}" if plan else "")
                if plan and plan["pool_first"] != split_plan.NO_POOL:
                    plan_text += f", pool from key {plan['pool_first']}"
                print(f"  {name:40s} graph {g:7.1f} us ({nbytes / g / 1e3 / copy:5.1%} of copy)  queued {qd:7.1f} us "
                      f"({nbytes / qd / 1e3 / copy:5.1%})  err {r['error']:.1e}  {plan_text}  "
                      f"rounds {' '.join(f'{x:.1f}' for x in r['graph'])} / {' '.join(f'{x:.1f}' for x in r['queued'])}",
                      flush=True)
                rows.append(dict(case=case, variant=name, nbytes=nbytes, copy_gbps=copy, **r))
            del q, k, v
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
