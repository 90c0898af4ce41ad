"""Paged against dense KV caches on a GPU: ``flash_decode`` of one token per row, in GB/s of K and V read.

For each shape: a dense cache ``(batch, kv_heads, capacity, headdim)`` without lengths (the default kernel), the
same with device ``cache_seqlens`` (ragged lengths), and paged caches of several page sizes (pages in a shuffled
order) with the same lengths. Each call is timed inside a CUDA graph of ``--calls`` calls (no host time: the
kernels' own) and queued back to back without a graph (host time included where it dominates). Bytes: the keys and
values the rows' lengths cover (what a kernel must read). torch float16.

    python scripts/decode_kvcache_bench.py [--calls 20] [--pages 16 64 256] [--quick]
"""
from __future__ import annotations

import argparse

import numpy as np

#: (batch, heads, kv_heads, capacity, headdim): GQA 4 and 8, a short and a long cache
SHAPES = ((8, 32, 8, 16384, 128), (1, 32, 4, 65536, 128), (32, 32, 8, 4096, 128))


def _time(fn, calls: int, graph: bool) -> float:
    """Microseconds per call: replays of a graph of ``calls`` calls, or ``calls`` queued calls."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(calls):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(calls):
                fn()
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--pages", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    args = parser.parse_args()
    import torch

    import numba_attn

    if numba_attn.SIMULATOR:
        raise SystemExit("decode_kvcache_bench.py needs a GPU")
    rng = np.random.default_rng(0)
    print(f"{'case':44s} {'graph us':>9s} {'GB/s':>7s} {'queued us':>10s}  check against the dense cache")
    for batch, heads, kv_heads, capacity, head_dim in SHAPES[:1] if args.quick else SHAPES:
        q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(batch, kv_heads, capacity, head_dim, device="cuda", dtype=torch.float16)
                for _ in range(2))
        full = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
        ragged = torch.from_numpy(rng.integers(capacity // 2, capacity + 1, batch).astype(np.int32)).cuda()
        calls = {"dense": (lambda: numba_attn.flash_decode(q, k, v), full),
                 "dense, cache_seqlens": (lambda: numba_attn.flash_decode(q, k, v, cache_seqlens=ragged), ragged)}
        for page in args.pages:
            max_pages = capacity // page
            order = torch.from_numpy(rng.permutation(batch * max_pages).astype(np.int64)).cuda()
            table = order.reshape(batch, max_pages).to(torch.int32)
            # page p of row b holds that row's keys p * page ..: the pool in the table's (shuffled) order
            k_pages, v_pages = (torch.empty(batch * max_pages, page, kv_heads, head_dim, device="cuda",
                                            dtype=torch.float16) for _ in range(2))
            for dense, pages in ((k, k_pages), (v, v_pages)):
                pages[order] = dense.transpose(1, 2).reshape(batch * max_pages, page, kv_heads, head_dim)

            def paged(k_pages=k_pages, v_pages=v_pages, table=table):
                return numba_attn.flash_decode(q, k_pages, v_pages, cache_seqlens=ragged, block_table=table)

            calls[f"paged {page}, cache_seqlens"] = (paged, ragged)
        reference = numba_attn.flash_decode(q, k, v, cache_seqlens=ragged).float()
        for name, (fn, lengths) in calls.items():
            check = ""
            if lengths is ragged:
                error = float((fn().float() - reference).norm() / reference.norm())
                check = f"{'PASS' if error < 2e-3 else 'FAIL'} {error:.1e}"
            keys = int(lengths.sum())
            gigabytes = 2 * keys * kv_heads * head_dim * 2 / 1e9
            graph_us = _time(fn, args.calls, True)
            queued_us = _time(fn, args.calls, False)
            label = f"B{batch} H{heads}/{kv_heads} D{head_dim} L{capacity} {name}"
            print(f"{label:44s} {graph_us:9.1f} {gigabytes / graph_us * 1e6:7.0f} {queued_us:10.1f}  {check}",
                  flush=True)
        del k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
