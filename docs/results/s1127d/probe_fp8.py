"""Probe (issue #30's fp8 target): the fp8 (e4m3) WS forward against our bf16 forward as users get it, B4 H32 D128,
4k and 16k, full and causal (per-tensor descales 1, bf16 output). Replay off; each sample ten calls queued (host
time hidden), median of 5 after 0.3 s of the call's own load; two interleaved rounds, the better one.
Arguments: key counts (default 4096 16384); MASK=full or causal: one mask only."""
import os
import sys

os.environ["NUMBA_ATTN_REPLAY"] = "0"
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch  # noqa: E402

import numba_attn  # noqa: E402
from _timing import queued_ms  # noqa: E402


timed = queued_ms


torch.manual_seed(0)
for n in [int(x) for x in sys.argv[1:]] or (4096, 16384):
    for causal in {"full": (False,), "causal": (True,)}.get(os.environ.get("MASK"), (False, True)):
        x = [torch.randn(4, 32, n, 128, device="cuda") for _ in range(3)]
        f8 = [t.to(torch.float8_e4m3fn) for t in x]
        b16 = [t.to(torch.bfloat16) for t in x]
        variants = {"fp8": lambda: numba_attn.flash_forward(*f8, causal=causal, backend="wgmma_ws"),
                    "bf16": lambda: numba_attn.flash_forward(*b16, causal=causal)}
        res = {k: [] for k in variants}
        for _ in range(2):
            for name, f in variants.items():
                res[name].append(timed(f))
        flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
        tf = {k: flops / min(v) / 1e9 for k, v in res.items()}
        print(f"fp8 N{n} {'causal' if causal else 'full  '} TFLOP/s fp8 {tf['fp8']:.1f} bf16 {tf['bf16']:.1f} "
              f"fp8 / bf16 {tf['fp8'] / tf['bf16']:.3f} rounds "
              + str({k: [round(t, 3) for t in v] for k, v in res.items()}), flush=True)
        del x, f8, b16
