"""Compile warp-specialised forward kernels (``forward.wgmma_ws``) in parallel processes into the kernel cache
(``runtime.kernel_cache``), so that the process that times them (a probe, ``scripts/tune_defaults.py``) loads them
from disk instead of compiling one after another (10-15 s each on the device's CPUs).

    python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16   # every usable candidate, causal and not
    python3 scripts/prewarm_ws.py 128:fp8     # the fp8 kernel's candidates and their persistent forms (bf16 out)

On the H100 machine (16 CPUs) 52 kernels took 44 s in 14 processes, the longest 13 s. The
kernels are those ``flash_forward`` builds for dense calls whose output the TMA can store (``store="tma"``), no
window or soft-cap (causal: with narrow tiles; not: without, as for keys the tiles divide); the cache is the one of ``$NUMBA_ATTN_CACHE_DIR`` (``scripts/tune_defaults.py`` shares it).
"""
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def build(spec):
    from numba_attn.core.mask import may_narrow
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8
    from numba_attn.forward.common import Variant

    fields, d, dtype, causal, window = spec
    start = time.perf_counter()
    config = wgmma_ws.WsConfig(**fields)
    variant = Variant.of(causal, window, None)
    # (the launchers' rule, for keys the tiles divide)
    narrow = may_narrow(causal, variant.window, False, config.block_n, config.block_n)
    if dtype == "fp8":  # (per-tensor descales, no soft-cap: what a call without descale factors builds)
        kernel = wgmma_ws_fp8.flash_ws_fp8_kernel(config, d, True, False, False, variant, None, "tma", narrow)
    else:
        kernel = wgmma_ws.flash_ws_kernel(config, d, dtype == "bfloat16", False, variant, "tma", None, narrow)
    kernel.dispatcher()
    return spec, time.perf_counter() - start


def specs(args, extra=()):
    """(config fields, head dim, dtype, causal, window) of every usable candidate per ``d:dtype,...`` argument,
    then ``extra``."""
    import dataclasses

    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8

    found = []
    for arg in args:
        d, dtypes = arg.split(":")
        for dtype in dtypes.split(","):
            if dtype == "fp8":
                configs = [c for base in wgmma_ws_fp8.TUNING_CANDIDATES
                           for c in (base, dataclasses.replace(base, persistent=True))
                           if wgmma_ws_fp8.usable(c, int(d))]
            else:
                configs = [c for c in wgmma_ws.TUNING_CANDIDATES if wgmma_ws.usable(c, int(d))]
            for causal in (False, True):
                for config in dict.fromkeys(configs):
                    found.append((dataclasses.asdict(config), int(d), dtype, causal, None))
    return found + list(extra)


def prewarm(args, extra=(), processes=14):
    """Compile ``specs(args, extra)`` in ``processes`` spawned processes; prints the count and the time."""
    todo = specs(args, extra)
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        times = [t for _, t in pool.imap_unordered(build, todo)]
    print(f"prewarm: {len(todo)} kernels in {time.perf_counter() - start:.0f} s (longest {max(times):.0f} s)",
          flush=True)


if __name__ == "__main__":
    prewarm(sys.argv[1:])
