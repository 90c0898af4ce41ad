"""Probe (issue #30's short rows): where the host's time per ``flash_forward`` call goes, B4 bf16 D64 H48 N1024
causal, the WS kernel forced (``backend="wgmma_ws"``) and the default ("wgmma" there): microseconds per call of 300
calls queued (one synchronisation at the end), as the sweep makes them (three input sets rotated, a new output
each call), then cProfile's top functions by own time. Run from the tree."""
import cProfile
import io
import os
import pstats
import sys
import time

if __name__ == "__main__":
    import torch

    import numba_attn

    torch.manual_seed(0)
    sets = [[torch.randn(4, 48, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)] for _ in range(3)]
    for backend in ("wgmma_ws", None):
        fns = [(lambda s: lambda: numba_attn.flash_forward(*s, causal=True, backend=backend))(s) for s in sets]
        for _ in range(30):
            for f in fns:
                f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(300):
            fns[i % 3]()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"backend={backend}: host {(t1 - t0) / 300 * 1e6:.1f} us/call", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(300):
            fns[i % 3]()
        prof.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
        print("\n".join(l for l in out.getvalue().splitlines() if l.strip())[:6000], flush=True)
