"""Probe (issue #30's fp8 rows): the fp8 WS forward's output through staging tiles and the TMA store (this session's
change) against the register stores it had ("elements": 2-byte stores; "pairs": 4-byte), B4 H32 D128, per-tensor
descales 1, bf16 output, causal and not, in alternating rounds beside our bf16 forward (replay off: forced stores
and configurations; each sample ten calls queued after 0.2 s of the call's own load). Compiles its kernels in
parallel processes first. Run from the tree. Arguments: ``n=4096,16384``, ``rounds=3``, ``configs=192,224p,3x96``,
``stores=tma,elements``."""
import multiprocessing
import os
import sys
import time

os.environ["NUMBA_ATTN_REPLAY"] = "0"
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

THREE = dict(consumers=3, producer_registers=32, consumer_registers=160)
CONFIGS = {"192": dict(block_n=192), "224p": dict(block_n=224, persistent=True),
           "3x96": dict(block_n=96, stages=3, **THREE), "224": dict(block_n=224)}


def build(spec):
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8
    from numba_attn.forward.common import Variant

    fields, causal, store = spec
    wgmma_ws_fp8.flash_ws_fp8_kernel(wgmma_ws.WsConfig(**fields), 128, True, False, False, Variant.of(causal, None,
                                                                                                      None),
                                     None, store).dispatcher()


if __name__ == "__main__":
    opts = dict(a.split("=", 1) for a in sys.argv[1:])
    names = opts.get("configs", "192,224p,3x96").split(",")
    stores = opts.get("stores", "tma,elements").split(",")
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(14) as pool:
        pool.map(build, [(CONFIGS[n], c, s) for n in names for c in (False, True) for s in stores])
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)

    import torch

    import numba_attn
    from numba_attn.forward import wgmma_ws
    from _probe import alternating_rates, forced_fp8_forward, rates_line
    from _timing import queued_ms

    def with_store(store, fn):
        def call():
            real = wgmma_ws.output_store
            if store != "tma":
                wgmma_ws.output_store = lambda out, packed, stream: (store, 0)
            try:
                fn()
            finally:
                wgmma_ws.output_store = real
        return call

    rounds = int(opts.get("rounds", 3))
    torch.manual_seed(0)
    for n in [int(x) for x in opts.get("n", "4096,16384").split(",")]:
        for causal in (False, True):
            x = [torch.randn(4, 32, n, 128, device="cuda") for _ in range(3)]
            f8 = [t.to(torch.float8_e4m3fn) for t in x]
            b16 = [t.to(torch.bfloat16) for t in x]
            calls = {"bf16": lambda: numba_attn.flash_forward(*b16, causal=causal)}  # noqa: B023
            for name in names:
                for store in stores:
                    calls[f"{name}/{store}"] = with_store(store, forced_fp8_forward(
                        *f8, causal, wgmma_ws.WsConfig(**CONFIGS[name])))
            for f in calls.values():
                f()
            flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
            rates = alternating_rates(calls, flops, rounds, lambda f: queued_ms(f, 0.2, samples=5, calls=10))
            print(rates_line(f"fp8 D128 N{n} {'causal' if causal else 'full'}", rates, reference="bf16"), flush=True)
            del x, f8, b16
