"""Probe (issue #30's D64 1k rows, below 0.9x cuDNN): the WS forward's candidate tiles for the shipped table's key of
B4 H48 D64 at 512 and 1024 keys (``bfloat16|64|*|262144|1024`` and float16's), each beside cuDNN in alternating
rounds: the tuned entry as users get it, and four forced configurations -- two consumers or three (192 rows),
persistent or one block per query block. Each sample ten calls queued after 0.2 s of the call's own load. Needs the
kernels prewarmed (``scripts/prewarm_ws.py 64:bfloat16,float16``). Arguments: ``rounds=5``, ``n=512,1024``."""
import os
import sys

os.environ["NUMBA_ATTN_REPLAY"] = "0"
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

if __name__ == "__main__":
    opts = dict(a.split("=", 1) for a in sys.argv[1:])
    import torch

    from numba_attn.forward import wgmma_ws
    from _probe import alternating_rates, cudnn_forward, forced_forward, rates_line
    from _timing import queued_ms

    three = dict(consumers=3, producer_registers=32, consumer_registers=160)
    configs = {"2p": wgmma_ws.WsConfig(persistent=True), "3p": wgmma_ws.WsConfig(persistent=True, **three),
               "2": wgmma_ws.WsConfig(), "3": wgmma_ws.WsConfig(**three)}
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for n in [int(x) for x in opts.get("n", "512,1024").split(",")]:
            for causal in (False, True):
                x = [torch.randn(4, 48, n, 64, device="cuda", dtype=dtype) for _ in range(3)]
                calls = {"cuDNN": cudnn_forward(*x, causal), "tuned": forced_forward(*x, causal)}
                calls.update({name: forced_forward(*x, causal, config) for name, config in configs.items()})
                for f in calls.values():
                    f()
                flops = 4 * 4 * 48 * n * n * 64 / (2 if causal else 1)
                rates = alternating_rates(calls, flops, int(opts.get("rounds", 5)),
                                          lambda f: queued_ms(f, 0.2, samples=5, calls=10))
                print(rates_line(f"{str(dtype)[6:]} D64 H48 N{n} {'causal' if causal else 'full'}", rates),
                      flush=True)
