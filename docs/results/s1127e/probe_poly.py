"""Probe (h/poly-exp2; issue #30's D64 rows and fp8 target), run from that branch's tree: part of the exponentials
on the FMA pipe (``WsConfig.poly_every``) and the lazy running max (``max_slack``). B4 bf16 D64 H48 against cuDNN and
poly_every = 0; fp8 D128 H32 against our bf16 (also the persistent form); 4k and 16k, causal and not. Each sample ten
calls queued, median of 5 after 0.3 s of the call's own load, two rounds, the better. The candidates are compiled
first in parallel processes (16-bit through ``scripts/prewarm_ws.py``'s ``build``, fp8 here). Arguments: parts
``d64``, ``fp8`` (default both)."""
import dataclasses
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

THREE = dict(consumers=3, producer_registers=32, consumer_registers=160)


def d64_candidates():
    from numba_attn.forward import wgmma_ws

    cands = {"dispatch": None}
    for pe in (0, 6, 8, 12):
        cands[f"bn192 pe{pe}"] = wgmma_ws.WsConfig(block_n=192, stages=2, poly_every=pe)
    for pe in (0, 8):  # (with the lazy running max: the output's rescale skipped in most tiles)
        cands[f"bn192 pe{pe} slack8"] = wgmma_ws.WsConfig(block_n=192, stages=2, poly_every=pe, max_slack=8)
    for pe in (0, 4, 6):
        cands[f"3x bn96 pe{pe}"] = wgmma_ws.WsConfig(block_n=96, stages=3, poly_every=pe, **THREE)
    return cands


def fp8_candidates():
    from numba_attn.forward import wgmma_ws_fp8

    base = wgmma_ws_fp8.DEFAULT_CONFIG  # (the GPU's default, also when this runs on the simulator)
    cands = {f"fp8 pe{pe}": dataclasses.replace(base, poly_every=pe) for pe in (0, 6, 8, 12)}
    cands["fp8 pe8 slack8"] = dataclasses.replace(base, poly_every=8, max_slack=8)
    for pe in (0, 8):  # (the persistent form: one block's fixed costs under the next, as for 16-bit)
        cands[f"fp8 persistent pe{pe}"] = dataclasses.replace(base, poly_every=pe, persistent=True)
    return cands


def build_fp8(spec):
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8
    from numba_attn.forward.common import Variant

    fields, causal = spec
    start = time.perf_counter()
    wgmma_ws_fp8.flash_ws_fp8_kernel(wgmma_ws.WsConfig(**fields), 128, True, False, False,
                                     Variant.of(causal, None, None)).dispatcher()
    return time.perf_counter() - start


def prewarm(parts):
    from prewarm_ws import build

    todo = []
    if "d64" in parts:
        todo += [(build, (dataclasses.asdict(c), 64, "bfloat16", causal, None))
                 for c in d64_candidates().values() if c for causal in (False, True)]
    if "fp8" in parts:
        todo += [(build_fp8, (dataclasses.asdict(c), causal)) for c in fp8_candidates().values()
                 for causal in (False, True)]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(14) as pool:
        results = [pool.apply_async(f, (s,)) for f, s in todo]
        for r in results:
            try:
                r.get()
            except Exception as exc:  # (a candidate that does not build: the timing run reports it)
                print(f"prewarm: {type(exc).__name__}: {exc}", flush=True)
    print(f"prewarm: {len(todo)} kernels in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["d64", "fp8"]
    prewarm(parts)

    import torch

    import numba_attn
    from numba_attn.forward import wgmma_ws_fp8
    from _probe import cudnn_forward, forced_forward
    from _timing import queued_ms

    FP8 = {"cfg": None}
    real_fp8_default = wgmma_ws_fp8.default_config
    wgmma_ws_fp8.default_config = lambda: FP8["cfg"] or real_fp8_default()

    def fp8_forced(cfg, f8, causal):
        def g():
            FP8["cfg"] = cfg
            try:
                numba_attn.flash_forward(*f8, causal=causal, backend="wgmma_ws")
            finally:
                FP8["cfg"] = None
        return g

    def best_of_two(calls):
        res = {name: [] for name in calls}
        for _ in range(2):
            for name, f in calls.items():
                try:
                    res[name].append(queued_ms(f))
                except Exception as exc:
                    print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
                    res[name].append(float("inf"))
        return {name: min(v) for name, v in res.items()}

    torch.manual_seed(0)
    for n in (4096, 16384):
        for causal in (False, True):
            label = f"N{n} {'causal' if causal else 'full'}"
            if "d64" in parts:
                q, k, v = (torch.randn(4, 48, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                calls = {"cuDNN": cudnn_forward(q, k, v, causal)}
                calls.update({name: forced_forward(q, k, v, causal, cfg, backend=None if cfg is None else "wgmma_ws")
                              for name, cfg in d64_candidates().items()})
                flops = 4 * 4 * 48 * n * n * 64 / (2 if causal else 1)
                tf = {kk: flops / vv / 1e9 for kk, vv in best_of_two(calls).items()}
                print(f"D64 {label}: " + " ".join(f"{kk} {vv:.0f} ({vv / tf['cuDNN']:.3f})" for kk, vv in tf.items()),
                      flush=True)
                del q, k, v
            if "fp8" in parts:
                x = [torch.randn(4, 32, n, 128, device="cuda") for _ in range(3)]
                f8 = [t.to(torch.float8_e4m3fn) for t in x]
                b16 = [t.to(torch.bfloat16) for t in x]
                calls = {"bf16": lambda: numba_attn.flash_forward(*b16, causal=causal)}
                calls.update({name: fp8_forced(cfg, f8, causal) for name, cfg in fp8_candidates().items()})
                flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
                tf = {kk: flops / vv / 1e9 for kk, vv in best_of_two(calls).items()}
                print(f"fp8 D128 {label}: " + " ".join(f"{kk} {vv:.0f} ({vv / tf['bf16']:.3f})"
                                                       for kk, vv in tf.items()), flush=True)
                del x, f8, b16
