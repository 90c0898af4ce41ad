"""CUDA-event timing shared by the GPU check and tuning scripts (``from _timing import median_ms``; the scripts'
folder on ``sys.path``, as it is for a script run directly)."""
from __future__ import annotations

import time


def median_ms(fn, reps: int, warmup: int = 2) -> float:
    """The median milliseconds of ``reps`` calls of ``fn``, each between two CUDA events recorded on torch's current
    stream (Numba's and CuPy's default stream too), after ``warmup`` untimed calls and a synchronisation."""
    import numpy as np
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def queued_ms(fn, warm_s: float = 0.3, samples: int = 5, calls: int = 10) -> float:
    """The median milliseconds per call of ``fn`` when ``calls`` calls are queued back to back (host time hidden
    behind the GPU's), over ``samples`` samples, after ``warm_s`` seconds of the call's own load (so that the clocks
    have settled on it, not on the call timed before)."""
    until = time.time() + warm_s
    while time.time() < until:
        fn()
    return median_ms(lambda: [fn() for _ in range(calls)], samples, warmup=0) / calls
