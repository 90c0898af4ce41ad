"""Probe for the next session (issue #30: what bounds the 16-bit WS forward at head dim 64 and at short rows): the
shipped table's configuration for B4 bf16 (D64 H48, D128 H32), causal and not, launched directly
(``wgmma_ws.launch``) whole, without its softmax (``_probe="no_softmax"``: no max, exp or sums) and without P's
conversion (``"no_pack"``) -- timing probes with wrong results -- beside cuDNN, in alternating rounds. If the kernel
without its softmax runs near the tensor cores' time, the softmax (MUFU, its latency chain) is the bound; if not,
the pipeline is. (fp8: ``scripts/check_fp8.py --part probe``.) Run from the tree to time. Arguments: ``n=1024,4096``,
``rounds=3``."""
import json
import math
import os
import sys

ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "scripts"))

if __name__ == "__main__":
    import numpy as np
    import torch

    from numba_attn.forward import wgmma_ws
    from numba_attn.runtime.autotune import size_class
    from numba_attn.runtime.device import DeviceView
    from _probe import alternating_rates, cudnn_forward, rates_line
    from _timing import queued_ms

    opts = dict(a.split("=", 1) for a in sys.argv[1:])
    rounds = int(opts.get("rounds", 3))
    entries = json.load(open(os.path.join(ROOT, "numba_attn", "forward", "tuned", "sm90.json")))
    entries = entries["tuners"]["flash_wgmma_ws"]["entries"]
    stream = torch.cuda.current_stream().cuda_stream

    def view(t, dtype=np.uint16):
        size = t.element_size()
        return DeviceView(t.data_ptr(), tuple(t.shape), tuple(s * size for s in t.stride()), np.dtype(dtype), t)

    torch.manual_seed(0)
    for d, h in ((64, 48), (128, 32)):
        for n in [int(x) for x in opts.get("n", "1024,4096").split(",")]:
            for causal in (False, True):
                q, k, v = (torch.randn(4, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                out = torch.empty_like(q)
                lse = torch.empty(4, h, n, dtype=torch.float32, device="cuda")
                entry = entries.get(f"bfloat16|{d}|{causal}|{size_class(4 * h * n)}|{size_class(n)}")
                config = wgmma_ws.WsConfig(**entry["config"]) if entry else wgmma_ws.DEFAULT_CONFIG
                views = [view(x.view(torch.int16)) for x in (q, k, v, out)] + [view(lse, np.float32)]

                def direct(probe):
                    return lambda: wgmma_ws.launch(*views, False, 1 / math.sqrt(d), causal, stream,
                                                   config=config, dtype="bfloat16", _probe=probe)

                calls = {"cuDNN": cudnn_forward(q, k, v, causal), "kernel": direct(None),
                         "no_softmax": direct("no_softmax"), "no_pack": direct("no_pack")}
                for f in calls.values():
                    f()  # (compiles)
                flops = 4 * 4 * h * n * n * d / (2 if causal else 1)
                rates = alternating_rates(calls, flops, rounds, lambda f: queued_ms(f, 0.2, samples=5, calls=20))
                label = f"D{d} N{n} {'causal' if causal else 'full'}"
                print(rates_line(label, rates) + f" | {config}", flush=True)
                del q, k, v, out
