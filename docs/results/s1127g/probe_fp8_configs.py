"""Probe for the next session (issue #30's fp8 target): the fp8 (e4m3) WS forward with each configuration named
against our bf16 forward as users get it, B4 H32 D128, per-tensor descales 1, bf16 output, causal and not, in
alternating rounds (replay off: forced configurations; each sample ten calls queued after 0.2 s of the call's own
load). The candidates added on 2026-11-27 (ptxas: no spills): 224-key tiles, and three consumer warpgroups of 96-
and 64-key tiles, whose two idle warpgroups' softmaxes run beside the third's MMAs. Run from the tree, after
``scripts/prewarm_ws.py 128:fp8`` (else each kernel compiles on first use, ~15 s). Arguments: ``n=4096,16384``,
``rounds=3``, then configurations as ``name:field=value,...`` (default: the shipped default and the three new
candidates, each with its persistent form)."""
import os
import sys

os.environ["NUMBA_ATTN_REPLAY"] = "0"
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

if __name__ == "__main__":
    import dataclasses

    import torch

    import numba_attn
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8
    from _fields import named_configs
    from _probe import alternating_rates, forced_fp8_forward, rates_line
    from _timing import queued_ms

    opts = dict(a.split("=", 1) for a in sys.argv[1:] if ":" not in a)
    named = named_configs(sys.argv[1:], wgmma_ws.WsConfig)
    if not named:
        three = dict(consumers=3, producer_registers=32, consumer_registers=160)
        base = {"192": wgmma_ws_fp8.DEFAULT_CONFIG, "224": wgmma_ws.WsConfig(block_n=224),
                "3x96": wgmma_ws.WsConfig(block_n=96, stages=3, **three),
                "3x64": wgmma_ws.WsConfig(block_n=64, stages=4, **three)}
        for name, config in base.items():
            named[name] = config
            named[name + "p"] = dataclasses.replace(config, persistent=True)
    rounds = int(opts.get("rounds", 3))
    torch.manual_seed(0)
    for n in [int(x) for x in opts.get("n", "4096,16384").split(",")]:
        for causal in (False, True):
            x = [torch.randn(4, 32, n, 128, device="cuda") for _ in range(3)]
            f8 = [t.to(torch.float8_e4m3fn) for t in x]
            b16 = [t.to(torch.bfloat16) for t in x]
            calls = {"bf16": lambda: numba_attn.flash_forward(*b16, causal=causal)}  # noqa: B023
            calls.update({name: forced_fp8_forward(*f8, causal, config) for name, config in named.items()})
            for f in calls.values():
                f()  # (compiles)
            flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
            rates = alternating_rates(calls, flops, rounds, lambda f: queued_ms(f, 0.2, samples=5, calls=10))
            print(rates_line(f"fp8 D128 N{n} {'causal' if causal else 'full'}", rates, reference="bf16"), flush=True)
            del x, f8, b16
