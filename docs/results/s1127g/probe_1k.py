"""Probe (issue #30's 1k rows): the sweep read our D64 causal 1k forward at 0.115 ms (H100, 2026-11-27) where the
alternating-rounds probes read ~0.098 ms, while its non-causal 1k rows read no slower. For B4 bf16 at 1k (D64 H48,
D128 H32), causal and not, ours (``flash_forward``) and cuDNN: the host's microseconds per call (50 calls enqueued
without a synchronisation), the ms per call queued on one input set (``_timing.queued_ms``), and as the sweep times
it (event pairs around each call, chunks of 10 queued, three input sets rotated), with replay on and off. Call 4
(11:49) found the cause: D64 causal 1k runs on "wgmma" (``dispatch.WS_MIN_KEYS_AT``). ``ws=1`` adds the WS kernel
forced (``backend="wgmma_ws"``): calls 5-6 read it at 0.88-0.94x cuDNN queued but 0.60-0.88x in sweeps. Each line
also counts the tensor maps written while timed (a new output pointer per call would cost a map per call). Run from the
tree (its ``numba_attn`` on the path). Arguments: ``ws=1``."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

if __name__ == "__main__":
    import numpy as np
    import torch

    import numba_attn
    from numba_attn.runtime import replay, tensor_map
    from _probe import cudnn_forward
    from _timing import queued_ms

    def host_us(fn, calls=50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / calls * 1e6

    def sweep_ms(fns, count=30, chunk=10):
        times = []
        for first in range(0, count, chunk):
            pairs = []
            for i in range(first, first + chunk):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[i % len(fns)]()
                end.record()
                pairs.append((start, end))
            pairs[-1][1].synchronize()
            times.extend(s.elapsed_time(e) for s, e in pairs)
        return float(np.median(times)), float(np.percentile(times, 90))

    ws = sys.argv[1:] == ["ws=1"]
    torch.manual_seed(0)
    for d, h in ((64, 48), (128, 32)):
        for causal in (False, True):
            sets = [[torch.randn(4, h, 1024, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                    for _ in range(3)]
            flops = 4 * 4 * h * 1024 * 1024 * d / (2 if causal else 1)
            makers = [("ours", lambda s: lambda: numba_attn.flash_forward(*s, causal=causal)),
                      ("cuDNN", lambda s: cudnn_forward(*s, causal))]
            if ws:
                makers.insert(1, ("ours ws", lambda s: lambda: numba_attn.flash_forward(*s, causal=causal,
                                                                                      backend="wgmma_ws")))
            for name, make in makers:
                fns = [make(s) for s in sets]
                for modes in ((True, False) if name.startswith("ours") else (True,)):
                    replay.ENABLED = modes
                    replay.clear()
                    for f in fns:
                        f()
                    outcome = replay.last_outcome() if name.startswith("ours") else "-"  # ("planned", or why not)
                    us = host_us(fns[0])
                    queued = queued_ms(fns[0], 0.2, samples=5, calls=20)
                    uploads = tensor_map.maps_for().uploads
                    med, p90 = sweep_ms(fns)
                    uploads = tensor_map.maps_for().uploads - uploads  # (maps written while timed: new pointers)
                    tag = name + ("" if not name.startswith("ours") else (" replay" if modes else " no-replay"))
                    print(f"D{d} N1024 {'causal' if causal else 'full  '} {tag:15s}: host {us:6.1f} us/call, queued "
                          f"{queued:.4f} ms ({flops / queued / 1e9:.0f}), sweep-style {med:.4f} ms "
                          f"({flops / med / 1e9:.0f}), p90 {p90:.4f}, maps written {uploads}, plan: {outcome}",
                          flush=True)
                replay.ENABLED = True
            del sets
