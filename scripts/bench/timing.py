"""How calls are timed: wall clock, CUDA-event pairs, CUDA-graph replays, and the per-case reps budget.

The functions take the environment (``environment.Env``) whose stream, events and arrays they use; the
environments' ``time_calls`` / ``copy_bandwidth`` / ``graph_call_ms`` methods call them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .cli import Options
    from .environment import Env


def host_calls(env: Env, fns: list, count: int) -> list:
    """Per-call ms by ``time.perf_counter``, synchronising after each call (the simulator runs synchronously)."""
    times = []
    for i in range(count):
        t0 = time.perf_counter()
        fns[i % len(fns)]()
        env.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def event_calls(env: Env, fns: list, count: int, chunk: int = 10) -> list:
    """Per-call ms from event pairs; ``chunk`` calls are queued back to back between host synchronisations."""
    times = []
    for first in range(0, count, chunk):
        pairs = []
        for i in range(first, min(count, first + chunk)):
            start, end = env._event(), env._event()
            start.record()
            fns[i % len(fns)]()
            end.record()
            pairs.append((start, end))
        pairs[-1][1].synchronize()
        times.extend(env._elapsed(s, e) for s, e in pairs)
    return times


def copy_bandwidth(env: Env, nbytes: int) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (read + written bytes), median of 20."""
    fn = env._copy_fn(nbytes)
    for _ in range(3):
        fn()
    ms = float(np.median(env.time_calls([fn], 20)))
    del fn
    env.free()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def torch_graph_call_ms(env: Env, fns: list, steps: int, replays: int) -> float:
    """ms per call from CUDA graph replays of ``steps`` calls rotating over ``fns`` (torch streams and graphs)."""
    torch = env.torch
    side = torch.cuda.Stream(env.device)
    side.wait_stream(env.stream)
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch asks before a capture
        for fn in fns:
            fn()
    env.stream.wait_stream(side)
    env.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps):
            fns[i % len(fns)]()
    times = []
    for _ in range(1 + replays):  # the first replay uploads the graph
        start, end = env._event(), env._event()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(env._elapsed(start, end) / steps)
    del graph
    return float(np.median(times[1:]))


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    reps: int


def measure(env: Env, fns: list, opts: Options) -> Timing:
    """Warm up, estimate one call, then time up to ``opts.reps`` calls within ``opts.budget`` seconds."""
    for i in range(opts.warmup):
        fns[i % len(fns)]()
    times = env.time_calls(fns[:1], 1)  # the first timed call also sizes the run
    count = int(opts.budget * 1e3 / max(times[0], 1e-3))
    count = max(opts.min_reps, min(opts.reps, count))
    if count > 1:
        times += env.time_calls(fns[1:] + fns[:1], count - 1)
    return Timing(float(np.median(times)), float(np.min(times)), len(times))
