"""Probe for the next session (issue #30's 1k-2k rows): the WS forward's candidate configurations at B4 bf16, D128 H32
and D64 H48, 1k and 2k keys, causal and not, in ROUNDS rounds that alternate every candidate and cuDNN, so that a
configuration's rate and the run's spread are seen side by side (two sweeps minutes apart read one unchanged
configuration 577 and 490 TFLOP/s at D128 1k, 2026-11-27 07:45 UTC). Calls replayed (NUMBA_ATTN_REPLAY=1, less host
time), each sample 20 calls queued back to back after 0.2 s of the call's own load. Prints per row the median of the
rounds and, in brackets, their range; candidates: the shipped table's choice ("dispatch"), the default, the
persistent default, and the retune's choice (``sm90_retuned_not_adopted.json`` beside this file). Kernels compiled
first by ``scripts/prewarm_ws.py``. Arguments: ``rounds=N`` (default 5)."""
import json
import os
import sys

ROOT = os.getcwd()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ.setdefault("NUMBA_ATTN_REPLAY", "1")


def retuned(dtype, d, causal, batch, heads, n):
    """The retuned table's configuration for this call's key (exact key only), or None."""
    from numba_attn.forward import wgmma_ws
    from numba_attn.runtime.autotune import size_class

    entries = json.load(open(os.path.join(HERE, "sm90_retuned_not_adopted.json")))["tuners"]["flash_wgmma_ws"]
    entry = entries["entries"].get(f"{dtype}|{d}|{causal}|{size_class(batch * heads * n)}|{size_class(n)}")
    return wgmma_ws.WsConfig(**entry["config"]) if entry else None


if __name__ == "__main__":
    from prewarm_ws import prewarm

    prewarm(["64:bfloat16", "128:bfloat16"])

    import numpy as np
    import torch

    from numba_attn.forward import wgmma_ws
    from _probe import cudnn_forward, forced_forward
    from _timing import queued_ms

    rounds = int(dict(a.split("=") for a in sys.argv[1:]).get("rounds", 5))
    torch.manual_seed(0)
    for d, h in ((128, 32), (64, 48)):
        for n in (1024, 2048):
            for causal in (False, True):
                q, k, v = (torch.randn(4, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                calls = {"cuDNN": cudnn_forward(q, k, v, causal),
                         "dispatch": forced_forward(q, k, v, causal, backend=None),
                         "default": forced_forward(q, k, v, causal, wgmma_ws.DEFAULT_CONFIG),
                         "persistent": forced_forward(q, k, v, causal, wgmma_ws.WsConfig(persistent=True))}
                config = retuned("bfloat16", d, causal, 4, h, n)
                if config not in (None, wgmma_ws.DEFAULT_CONFIG, wgmma_ws.WsConfig(persistent=True)):
                    calls[f"retuned {config}"] = forced_forward(q, k, v, causal, config)
                flops = 4 * 4 * h * n * n * d / (2 if causal else 1)
                rates = {name: [] for name in calls}
                for _ in range(rounds):
                    for name, f in calls.items():
                        rates[name].append(flops / queued_ms(f, 0.2, samples=5, calls=20) / 1e9)
                ref = float(np.median(rates["cuDNN"]))
                print(f"D{d} N{n} {'causal' if causal else 'full'}: " + "; ".join(
                    f"{name} {np.median(r):.0f} [{min(r):.0f}-{max(r):.0f}] ({np.median(r) / ref:.3f})"
                    for name, r in rates.items()), flush=True)
                del q, k, v
