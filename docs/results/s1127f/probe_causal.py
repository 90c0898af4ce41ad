"""Probe (issue #30, after the snake rounds): the causal rows' configurations -- the shipped table's choice, the
persistent form, and a retuned table's choice (path given) -- against cuDNN, B4 bf16, D128 H32 / D64 H48, in
ROUNDS rounds that alternate them, so that a choice's rate and the run's spread are seen side by side. Calls replayed
(NUMBA_ATTN_REPLAY=1), each sample 20 calls queued after 0.2 s of the call's own load; prints per row the median of
the rounds, their range, and the ratio to cuDNN's median. Run from the tree to time. Arguments: the retuned table,
then ``rounds=N`` (default 3) and ``n=1024,2048,...``."""
import json
import os
import sys

ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ.setdefault("NUMBA_ATTN_REPLAY", "1")


def table_config(path, dtype, d, causal, batch, heads, n):
    """The table's configuration for this call's key (exact key only), or None."""
    from numba_attn.forward import wgmma_ws
    from numba_attn.runtime.autotune import size_class

    entries = json.load(open(path))["tuners"]["flash_wgmma_ws"]["entries"]
    entry = entries.get(f"{dtype}|{d}|{causal}|{size_class(batch * heads * n)}|{size_class(n)}")
    return wgmma_ws.WsConfig(**entry["config"]) if entry else None


if __name__ == "__main__":
    from prewarm_ws import prewarm

    prewarm(["64:bfloat16", "128:bfloat16"])

    import numpy as np
    import torch

    from numba_attn.forward import wgmma_ws
    from _probe import cudnn_forward, forced_forward
    from _timing import queued_ms

    retuned_path = sys.argv[1]
    opts = dict(a.split("=") for a in sys.argv[2:])
    rounds = int(opts.get("rounds", 3))
    shipped_path = os.path.join(ROOT, "numba_attn", "forward", "tuned", "sm90.json")
    persistent = wgmma_ws.WsConfig(persistent=True)
    torch.manual_seed(0)
    for d, h in ((128, 32), (64, 48)):
        for n in [int(x) for x in opts.get("n", "1024,2048,4096,16384").split(",")]:
            q, k, v = (torch.randn(4, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            shipped = table_config(shipped_path, "bfloat16", d, True, 4, h, n)
            retuned = table_config(retuned_path, "bfloat16", d, True, 4, h, n)
            calls = {"cuDNN": cudnn_forward(q, k, v, True), "shipped": forced_forward(q, k, v, True, shipped)}
            if persistent != shipped:
                calls["persistent"] = forced_forward(q, k, v, True, persistent)
            if retuned not in (None, shipped, persistent):
                calls["retuned"] = forced_forward(q, k, v, True, retuned)
            flops = 4 * 4 * h * n * n * d / 2
            rates = {name: [] for name in calls}
            for _ in range(rounds):
                for name, f in calls.items():
                    rates[name].append(flops / queued_ms(f, 0.2, samples=5, calls=20) / 1e9)
            ref = float(np.median(rates["cuDNN"]))
            print(f"D{d} N{n} causal: " + "; ".join(
                f"{name} {np.median(r):.0f} [{min(r):.0f}-{max(r):.0f}] ({np.median(r) / ref:.3f})"
                for name, r in rates.items()) + f" | shipped {shipped} | retuned {retuned}", flush=True)
            del q, k, v
