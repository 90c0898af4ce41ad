"""Probe (issue #30, head dim 64 rows): the WS forward's shipped choice and the configurations named against cuDNN,
B4 bf16 at one head dim (H48 at 64, H32 at 128), causal and not, in ROUNDS rounds that alternate them. Calls replayed
(NUMBA_ATTN_REPLAY=1), each sample 20 calls queued after 0.2 s of the call's own load; prints per row the median of
the rounds, their range and the ratio to cuDNN's median. Run from the tree to time (kernels: scripts/prewarm_ws.py
first). Arguments: ``d=64``, ``n=1024,...``, ``rounds=3``, then configurations as ``name:field=value,...``
(``name:block_n=128,stages=2,consumers=3,producer_registers=32,consumer_registers=160``)."""
import json
import os
import sys

ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ.setdefault("NUMBA_ATTN_REPLAY", "1")

if __name__ == "__main__":
    import torch

    from numba_attn.forward import wgmma_ws
    from numba_attn.runtime.autotune import size_class
    from _fields import named_configs
    from _probe import alternating_rates, cudnn_forward, forced_forward, rates_line
    from _timing import queued_ms

    opts = dict(a.split("=", 1) for a in sys.argv[1:] if ":" not in a)
    named = named_configs(sys.argv[1:], wgmma_ws.WsConfig)
    d, rounds = int(opts.get("d", 64)), int(opts.get("rounds", 3))
    h = 48 if d == 64 else 32
    entries = json.load(open(os.path.join(ROOT, "numba_attn", "forward", "tuned", "sm90.json")))
    entries = entries["tuners"]["flash_wgmma_ws"]["entries"]
    torch.manual_seed(0)
    for n in [int(x) for x in opts.get("n", "1024,2048,4096,16384").split(",")]:
        for causal in (False, True):
            q, k, v = (torch.randn(4, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            entry = entries.get(f"bfloat16|{d}|{causal}|{size_class(4 * h * n)}|{size_class(n)}")
            shipped = wgmma_ws.WsConfig(**entry["config"]) if entry else wgmma_ws.DEFAULT_CONFIG
            calls = {"cuDNN": cudnn_forward(q, k, v, causal), "shipped": forced_forward(q, k, v, causal, shipped)}
            calls.update({name: forced_forward(q, k, v, causal, c) for name, c in named.items() if c != shipped})
            flops = 4 * 4 * h * n * n * d / (2 if causal else 1)
            rates = alternating_rates(calls, flops, rounds, lambda f: queued_ms(f, 0.2, samples=5, calls=20))
            label = f"D{d} N{n} {'causal' if causal else 'full'}"
            print(rates_line(label, rates) + f" | shipped {shipped}", flush=True)
            del q, k, v
