"""Probe (issue #30's fp8 rows): the fp8 WS forward with P's row sums from the P V MMA (``WsConfig.fp8_sums``: a row
of ones under each V^T box, no sum in the softmax) against the default, B4 H32 D128, per-tensor descales 1, bf16
output, causal and not, in alternating rounds beside our bf16 forward (replay off; each sample ten calls queued
after 0.2 s of the call's own load). First each form's error against float32 attention of the dequantised inputs
on odd shapes. Needs branch ``h/fp8-mma-sums``. Arguments: ``n=4096,16384``, ``rounds=3``, ``configs=224p,224ps``,
``check=0`` (no error check) or ``short`` (three shapes)."""
import multiprocessing
import os
import sys
import time

os.environ["NUMBA_ATTN_REPLAY"] = "0"
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

CONFIGS = {"224p": dict(block_n=224, persistent=True), "224ps": dict(block_n=224, persistent=True, fp8_sums=True),
           "192p": dict(block_n=192, persistent=True), "192ps": dict(block_n=192, persistent=True, fp8_sums=True)}


def build(spec):
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8
    from numba_attn.forward.common import Variant

    fields, d, causal, narrow = spec
    wgmma_ws_fp8.flash_ws_fp8_kernel(wgmma_ws.WsConfig(**fields), d, True, False, False,
                                     Variant.of(causal, None, None), None, "tma", narrow).dispatcher()


if __name__ == "__main__":
    opts = dict(a.split("=", 1) for a in sys.argv[1:])
    names = opts.get("configs", "224p,224ps").split(",")
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(14) as pool:
        # (the timed calls' kernels and the checked shapes': (head dim, causal, narrow))
        kinds = [(128, c, w) for c in (False, True) for w in (False, True)] + [(96, False, True)]
        if opts.get("check") != "short":
            kinds.append((64, True, True))
        pool.map(build, [(CONFIGS[n], *kind) for n in names for kind in kinds])
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)

    import torch

    import numba_attn
    from numba_attn.forward import wgmma_ws
    from _probe import _forced, alternating_rates, forced_fp8_forward, rates_line
    from _timing import queued_ms

    torch.manual_seed(0)
    checks = {"0": [], "short": [(2, 3, 3, 333, 4113, 128, False), (1, 2, 2, 77, 4099, 96, False),
                                 (4, 32, 32, 4096, 4096, 128, True)]}.get(opts.get("check"), [
        (1, 4, 2, 1000, 1000, 128, True), (2, 3, 3, 333, 4113, 128, False), (1, 2, 1, 4096, 4096, 64, True),
        (1, 2, 2, 77, 4099, 96, False), (4, 32, 32, 4096, 4096, 128, True)])
    for b, h, hk, nq, nk, d, causal in checks:
        x = [torch.randn(b, hh, n, d, device="cuda").to(torch.float8_e4m3fn) for hh, n in ((h, nq), (hk, nk), (hk, nk))]
        outs = {}
        for name in names:
            holder = {}

            def run(name=name):
                holder["o"] = numba_attn.flash_forward(*x, causal=causal, backend="wgmma_ws")
            forced_fp8_forward(*x, causal, wgmma_ws.WsConfig(**CONFIGS[name]))  # (patches the fp8 default)
            _forced(wgmma_ws.WsConfig(**CONFIGS[name]), run)()
            outs[name] = holder["o"].float()
        deq = [t.float() for t in x]
        group = h // hk
        deq[1], deq[2] = (t.repeat_interleave(group, dim=1) for t in deq[1:])
        ref = torch.nn.functional.scaled_dot_product_attention(*deq, is_causal=causal) if nq == nk or not causal \
            else None
        if ref is None:
            continue
        errs = {n: f"{((o - ref).norm() / ref.norm()).item():.3e}" for n, o in outs.items()}
        print(f"B{b} H{h}/{hk} {nq}x{nk} D{d} {'causal' if causal else 'full'}: error against float32 {errs}",
              flush=True)

    rounds = int(opts.get("rounds", 3))
    for n in [int(x) for x in opts.get("n", "4096,16384").split(",")]:
        for causal in (False, True):
            x = [torch.randn(4, 32, n, 128, device="cuda") for _ in range(3)]
            f8 = [t.to(torch.float8_e4m3fn) for t in x]
            b16 = [t.to(torch.bfloat16) for t in x]
            calls = {"bf16": lambda: numba_attn.flash_forward(*b16, causal=causal)}  # noqa: B023
            for name in names:
                calls[name] = forced_fp8_forward(*f8, causal, wgmma_ws.WsConfig(**CONFIGS[name]))
            for f in calls.values():
                f()
            flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
            rates = alternating_rates(calls, flops, rounds, lambda f: queued_ms(f, 0.2, samples=5, calls=10))
            print(rates_line(f"fp8 D128 N{n} {'causal' if causal else 'full'}", rates, reference="bf16"), flush=True)
            del x, f8, b16
