"""Check and time the warp-specialised Hopper forward (``backend="wgmma_ws"``) against ``backend="wgmma"``, torch
SDPA's FlashAttention-2 and cuDNN backends, in one process, one call at a time (H100; a few minutes at most).

    python scripts/check_ws.py                       # B4, (D64 H48) and (D128 H32), N 1k..16k, causal and not, fp16/bf16
    python scripts/check_ws.py --seqlens 1k,4k,16k --dtypes fp16 --ws-configs all   # every wgmma_ws candidate

First every kernel specialisation the run needs is compiled in parallel child processes (they fill the kernel
cache on disk, which the main process then loads). Per case: the outputs of ``wgmma_ws`` and ``wgmma`` against a
float64 reference on the GPU for batch entry 0 and two heads (N <= ``--check-max``; above it ``wgmma_ws`` against
``wgmma``), then TFLOP/s of each provider (``4 B H N^2 D``, halved under the causal mask): CUDA events around
``--reps`` back-to-back calls, warm-up first, the median of ``--rounds`` rounds. One line per case and a summary;
a FAIL line for an error above the tolerance (fp16 2e-3, bf16 1e-2 relative Frobenius).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("NUMBA_ATTN_AUTOTUNE", "0")  # the shipped table or the default config: no tuning runs

TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def _sizes(text: str) -> list:
    return [int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in text.split(",")]


def _configs(which: str, head_dim: int):
    """The wgmma_ws configurations to time at ``head_dim``: the default, or every tuning candidate whose registers
    fit (``wgmma_ws.fits_registers``)."""
    from numba_attn.forward import wgmma_ws

    if which != "all":
        return [wgmma_ws.DEFAULT_CONFIG]
    return [c for c in wgmma_ws.TUNING_CANDIDATES if wgmma_ws.usable(c, wgmma_ws.padded_head_dim(head_dim))]


def _warm(job):
    """Child process: compile (or load) one kernel (``config`` None: the wgmma one) by calling it on each case's
    shape, both masks."""
    dtype, head_dim, heads, batch, seqlens, config = job
    import torch

    import numba_attn

    t0 = time.time()
    q = torch.randn(batch, heads, max(seqlens), head_dim, device="cuda", dtype=getattr(torch, dtype))
    for n in seqlens:
        x = q[:, :, :n]
        for causal in (False, True):
            if config is None:
                numba_attn.flash_forward(x, x, x, causal=causal, backend="wgmma")
            else:
                _run_ws(x, x, x, causal, config)
    torch.cuda.synchronize()
    return time.time() - t0


def _run_ws(q, k, v, causal, config):
    """``flash_forward(backend="wgmma_ws")``, or ``wgmma_ws.launch`` with ``config`` (not the default)."""
    import numba_attn
    from numba_attn.forward import wgmma_ws

    if config == wgmma_ws.DEFAULT_CONFIG:
        return numba_attn.flash_forward(q, k, v, causal=causal, backend="wgmma_ws")
    import torch

    from numba_attn.runtime.device import DeviceView

    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    dtype = "bfloat16" if q.dtype == torch.bfloat16 else "float16"
    views = [DeviceView.of(x.view(torch.int16) if x.dtype == torch.bfloat16 else x) for x in (q, k, v, out)]
    wgmma_ws.launch(*views, DeviceView.of(lse), False, q.shape[-1] ** -0.5, causal,
                    torch.cuda.current_stream().cuda_stream, config=config, dtype=dtype)
    return out


def _tag(config) -> str:
    """A config in a few letters: c<consumers>n<block_n>s<stages>, then 'np' without ping-pong, 'P' persistent."""
    return (f"c{config.consumers}n{config.block_n}s{config.stages}{'' if config.pingpong else 'np'}"
            f"{'P' if config.persistent else ''}")


def _time(fn, reps: int, rounds: int) -> float:
    """Median ms per call over ``rounds`` rounds of ``reps`` back-to-back calls between CUDA events."""
    import torch

    fn()
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples)


def _reference(q, k, v, causal):
    """float64 attention of batch entry 0, heads 0 and 1 (bottom-right causal mask; Lq == Lk here)."""
    import torch

    qd, kd, vd = (x[:1, :2].double() for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[2]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ vd


def _error(x, ref) -> float:
    return ((x[:1, :2].double() - ref).norm() / ref.norm()).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=_sizes, default=_sizes("1k,2k,4k,8k,16k"))
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--configs", default="64x48,128x32", help="head dim x heads, comma-separated")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    parser.add_argument("--ws-configs", default="default", choices=("default", "all"))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check-max", type=int, default=4096, help="largest N checked against float64")
    parser.add_argument("--no-warm", action="store_true", help="compile in this process only")
    args = parser.parse_args()

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import numba_attn

    dtypes = [{"fp16": "float16", "bf16": "bfloat16"}[x] for x in args.dtypes.split(",")]
    shapes = [tuple(int(p) for p in c.split("x")) for c in args.configs.split(",")]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    t_start = time.time()
    print(f"check_ws: {torch.cuda.get_device_name()}, torch {torch.__version__}, B{args.batch}, "
          f"ws configs {args.ws_configs}", flush=True)
    if not args.no_warm:
        import concurrent.futures as futures
        import multiprocessing

        jobs = [(dtype, d, h, args.batch, args.seqlens, config) for dtype in dtypes for d, h in shapes
                for config in [None] + _configs(args.ws_configs, d)]
        workers = min(len(jobs), max(1, (os.cpu_count() or 2) - 1))
        with futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            spent = list(pool.map(_warm, jobs))
        print(f"compiled {len(jobs)} kernels in {workers} processes: {time.time() - t_start:.0f}s "
              f"(longest {max(spent):.0f}s)", flush=True)
    print("dtype D   H  causal     N |   ws  wgmma  fa2  cudnn TF/s | ws/cudnn ws/wgmma | err ws / wgmma"
          + (" | each ws config (c consumers, n block_n, s stages, np no ping-pong, P persistent)"
             if args.ws_configs == "all" else ""), flush=True)
    failed, ratios = 0, []
    for d, h in shapes:
        for dtype in dtypes:
            tdtype = getattr(torch, dtype)
            for causal in causals:
                for n in args.seqlens:
                    gen = torch.Generator(device="cuda").manual_seed(n + d)
                    q, k, v = (torch.randn(args.batch, h, n, d, device="cuda", dtype=tdtype, generator=gen)
                               for _ in range(3))
                    outs = {"wgmma": numba_attn.flash_forward(q, k, v, causal=causal, backend="wgmma")}
                    configs = _configs(args.ws_configs, d)
                    for config in configs:
                        outs[config] = _run_ws(q, k, v, causal, config)
                    if n <= args.check_max:
                        ref = _reference(q, k, v, causal)
                        errors = {name: _error(x, ref) for name, x in outs.items()}
                    else:  # against the wgmma kernel
                        ref = outs["wgmma"][:1, :2].double()
                        errors = {name: _error(x, ref) for name, x in outs.items()}
                        errors["wgmma"] = float("nan")
                    flops = 4 * args.batch * h * n * n * d / (2 if causal else 1)
                    times = {"wgmma": _time(lambda: numba_attn.flash_forward(q, k, v, causal=causal,
                                                                               backend="wgmma"),
                                            args.reps, args.rounds)}
                    for config in configs:
                        times[config] = _time(lambda: _run_ws(q, k, v, causal, config), args.reps, args.rounds)
                    for name, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                        try:
                            with sdpa_kernel(backend):
                                times[name] = _time(lambda: sdpa(q, k, v, is_causal=causal), args.reps, args.rounds)
                        except RuntimeError:
                            times[name] = float("nan")
                    rate = {name: flops / t / 1e9 for name, t in times.items()}
                    best = max(configs, key=lambda c: rate[c])
                    bad = [name for name, e in errors.items() if e > TOLERANCE[dtype]]
                    failed += bool(bad)
                    ratios.append((dtype, d, causal, n, rate[best] / rate["cudnn"]))
                    extra = ""
                    if len(configs) > 1:
                        extra = " | " + " ".join(f"{_tag(c)}:{rate[c]:.0f}" for c in configs)
                    print(f"{SHORT[dtype]}  {d:3d} {h:3d} {'yes' if causal else 'no ':3s} {n:6d} | "
                          f"{rate[best]:5.0f} {rate['wgmma']:5.0f} {rate['fa2']:5.0f} {rate['cudnn']:5.0f}      | "
                          f"{rate[best] / rate['cudnn']:7.2f} {rate[best] / rate['wgmma']:8.2f} | "
                          f"{errors[best]:.1e} / {errors['wgmma']:.1e} {'FAIL ' + str(bad) if bad else 'ok'}"
                          f"{extra}", flush=True)
    long = [r for (_, _, _, n, r) in ratios if n >= 4096]
    short = [r for (_, _, _, n, r) in ratios if n < 4096]
    summary = f"ws/cudnn min {min(long):.2f} at N>=4k" if long else ""
    if short:
        summary += f", min {min(short):.2f} at N<4k"
    print(f"check_ws: {'FAIL' if failed else 'PASS'} ({failed} cases above tolerance); {summary}; "
          f"{time.time() - t_start:.0f}s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
