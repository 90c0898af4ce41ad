"""Probe for the next session (issue #30's fp8 target, h/carry-tail): the fp8 (e4m3) WS forward with its default
configuration and with the persistent one forced, against our bf16 forward as users get it; B4 H32 D128, per-tensor
descales 1, bf16 output. At 4k keys a block walks 22 tiles of 192 keys, so a block's fixed cost weighs on fp8 more
than on 16-bit (the fp8 kernel reached 1.17-1.29x bf16 at 4k against 1.32-1.39x at 16k, 2026-11-27). Replay off
(forced configurations); each sample ten calls queued, median of 5 after 0.3 s of the call's own load; two rounds,
the better. Run from the tree to time (its ``numba_attn`` on the path; the helpers are this repository's
``scripts/_probe.py`` and ``_timing.py``). Arguments: key counts (default 4096 16384)."""
import dataclasses
import os
import sys

os.environ["NUMBA_ATTN_REPLAY"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))

if __name__ == "__main__":
    import torch

    import numba_attn
    from numba_attn.forward import wgmma_ws_fp8
    from _probe import forced_fp8_forward
    from _timing import queued_ms

    configs = {"fp8 default": wgmma_ws_fp8.DEFAULT_CONFIG,
               "fp8 persistent": dataclasses.replace(wgmma_ws_fp8.DEFAULT_CONFIG, persistent=True)}

    torch.manual_seed(0)
    for n in [int(x) for x in sys.argv[1:]] or (4096, 16384):
        for causal in (False, True):
            x = [torch.randn(4, 32, n, 128, device="cuda") for _ in range(3)]
            f8 = [t.to(torch.float8_e4m3fn) for t in x]
            b16 = [t.to(torch.bfloat16) for t in x]
            calls = {"bf16": lambda: numba_attn.flash_forward(*b16, causal=causal)}
            calls.update({name: forced_fp8_forward(*f8, causal, config) for name, config in configs.items()})
            times = {name: [] for name in calls}
            for _ in range(2):  # (two rounds over every call)
                for name, f in calls.items():
                    times[name].append(queued_ms(f))
            best = {name: min(ms) for name, ms in times.items()}
            flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
            rates = {name: flops / ms / 1e9 for name, ms in best.items()}
            print(f"fp8 D128 N{n} {'causal' if causal else 'full'}: " + " ".join(
                f"{name} {rate:.0f} ({rate / rates['bf16']:.3f})" for name, rate in rates.items()), flush=True)
            del x, f8, b16
