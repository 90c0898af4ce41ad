"""Probe (issue #30): the WS forward with narrow tiles (the kernel now: where the keys a consumer's rows see end
inside a tile it computes the tile's first 64 or 128 keys, or none) against the same kernel computing every tile
whole (``narrow=False``, the code before; calls 2-3 ran this on 6c3118d, where it was ``probe="wide_tails"``), in
alternating rounds beside cuDNN (16-bit) or our bf16 forward (fp8). Shapes of the sweep, B4: bf16 D128 H32 and D64
H48 at the tuned tables' configurations, fp8 D128 H32 at its default. Each sample ten calls queued; replay off, or
with ``replay=1`` on (as the sweep calls: the short rows' host time hidden), each form from a plan of its own (the
flag is part of the plan's key). Compiles its kernels in parallel processes first. Run from the tree. Arguments:
``rounds=3``, ``cases=...`` (names below), ``replay=0``."""
import json
import multiprocessing
import os
import sys
import time

OPTS = dict(a.split("=", 1) for a in sys.argv[1:])
os.environ["NUMBA_ATTN_REPLAY"] = OPTS.get("replay", "0")
ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "scripts"))

#: name -> (dtype, head dim, heads, seqlen, causal)
CASES = {"d128c1k": ("bf16", 128, 32, 1024, True), "d128c4k": ("bf16", 128, 32, 4096, True),
         "d128f4k": ("bf16", 128, 32, 4096, False), "d64c1k": ("bf16", 64, 48, 1024, True),
         "d64c2k": ("bf16", 64, 48, 2048, True), "d64f1k": ("bf16", 64, 48, 1024, False),
         "fp8f4k": ("fp8", 128, 32, 4096, False), "fp8c4k": ("fp8", 128, 32, 4096, True),
         "fp8c16k": ("fp8", 128, 32, 16384, True)}


def tuned(d, heads, n, causal):
    from numba_attn.forward import wgmma_ws
    from numba_attn.runtime.autotune import size_class

    entries = json.load(open(os.path.join(ROOT, "numba_attn", "forward", "tuned", "sm90.json")))
    entry = entries["tuners"]["flash_wgmma_ws"]["entries"].get(
        f"bfloat16|{d}|{causal}|{size_class(4 * heads * n)}|{size_class(n)}")
    return wgmma_ws.WsConfig(**entry["config"]) if entry else wgmma_ws.DEFAULT_CONFIG


def build(spec):
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8
    from numba_attn.forward.common import Variant

    name, narrow = spec
    dtype, d, heads, n, causal = CASES[name]
    variant = Variant.of(causal, None, None)
    if dtype == "fp8":
        wgmma_ws_fp8.flash_ws_fp8_kernel(wgmma_ws_fp8.DEFAULT_CONFIG, d, True, False, False, variant, None, "tma",
                                         narrow).dispatcher()
    else:
        wgmma_ws.flash_ws_kernel(tuned(d, heads, n, causal), d, True, False, variant, "tma", None,
                                 narrow).dispatcher()


if __name__ == "__main__":
    opts = OPTS
    names = opts.get("cases", ",".join(CASES)).split(",")
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(14) as pool:
        pool.map(build, [(name, narrow) for name in names for narrow in (True, False)])
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)

    import torch

    import numba_attn
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8
    from _probe import alternating_rates, cudnn_forward, rates_line
    from _timing import queued_ms

    real = {"16": wgmma_ws.flash_ws_kernel, "8": wgmma_ws_fp8.flash_ws_fp8_kernel}
    wide = {"on": False}

    def kernel16(config, d_pad, bf16, scale_first=False, variant=wgmma_ws.PLAIN, store="elements", probe=None,
                 narrow=True):
        return real["16"](config, d_pad, bf16, scale_first, variant, store, probe, narrow and not wide["on"])

    def kernel8(config, d_pad, bf16_out, scale_first=False, per_head=False, variant=wgmma_ws.PLAIN, probe=None,
                store="tma", narrow=True):
        return real["8"](config, d_pad, bf16_out, scale_first, per_head, variant, probe, store,
                         narrow and not wide["on"])

    wgmma_ws.flash_ws_kernel = kernel16
    wgmma_ws_fp8.flash_ws_fp8_kernel = kernel8
    from numba_attn.runtime import replay

    find = replay.find
    replay.find = lambda name, arrays, options: find(name, arrays, tuple(options) + (("wide", wide["on"]),))

    def wide_tails(fn):
        def call():
            wide["on"] = True
            try:
                fn()
            finally:
                wide["on"] = False
        return call

    rounds = int(opts.get("rounds", 3))
    torch.manual_seed(0)
    for name in names:
        dtype, d, heads, n, causal = CASES[name]
        x = [torch.randn(4, heads, n, d, device="cuda") for _ in range(3)]
        b16 = [t.to(torch.bfloat16) for t in x]
        if dtype == "fp8":
            f8 = [t.to(torch.float8_e4m3fn) for t in x]
            fp8 = lambda: numba_attn.flash_forward(*f8, causal=causal)  # noqa: E731
            calls = {"bf16": lambda: numba_attn.flash_forward(*b16, causal=causal), "fp8": fp8,
                     "fp8 wide": wide_tails(fp8)}
            reference = "bf16"
        else:
            ours = lambda: numba_attn.flash_forward(*b16, causal=causal, backend="wgmma_ws")  # noqa: E731
            calls = {"cuDNN": cudnn_forward(*b16, causal), "narrow": ours, "wide": wide_tails(ours)}
            reference = "cuDNN"
        for f in calls.values():
            f()
        torch.cuda.synchronize()
        flops = 4 * 4 * heads * n * n * d / (2 if causal else 1)
        rates = alternating_rates(calls, flops, rounds, lambda f: queued_ms(f, 0.2, samples=5, calls=10))
        label = f"{name} ({dtype} D{d} H{heads} N{n} {'causal' if causal else 'full'})"
        print(rates_line(label, rates, reference=reference), flush=True)
        del x, b16
