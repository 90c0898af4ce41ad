"""Probe (issue #30's fp8 rows): what the fp8 WS forward's V^T pre-pass (``forward.fp8_vt.transpose``) costs of a
whole call, B4 H32 D128, causal and not, at 4k and 16k keys: the pre-pass alone (ten queued, median of five
samples after 0.2 s of its own load) against the default fp8 call (replay off) and our bf16 forward. Run from the
tree on a GPU."""
import os
import sys

os.environ["NUMBA_ATTN_REPLAY"] = "0"
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

import torch  # noqa: E402
from numba import cuda  # noqa: E402

import numba_attn  # noqa: E402
from numba_attn.forward import fp8_vt  # noqa: E402
from _timing import queued_ms  # noqa: E402

torch.manual_seed(0)
for n in (4096, 16384):
    x = [torch.randn(4, 32, n, 128, device="cuda") for _ in range(3)]
    f8 = [t.to(torch.float8_e4m3fn) for t in x]
    b16 = [t.to(torch.bfloat16) for t in x]
    v8 = f8[2].view(torch.uint8)
    vt = torch.empty(4, 32, 128, fp8_vt.padded_keys(n), device="cuda", dtype=torch.uint8)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    pre = queued_ms(lambda: fp8_vt.transpose(v8, vt, stream), 0.2)
    gbs = 2 * v8.numel() / pre / 1e6
    for causal in (False, True):
        fp8 = queued_ms(lambda: numba_attn.flash_forward(*f8, causal=causal), 0.2)
        bf = queued_ms(lambda: numba_attn.flash_forward(*b16, causal=causal), 0.2)
        flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
        print(f"N{n} {'causal' if causal else 'full'}: pre-pass {pre * 1e3:.1f} us ({gbs:.0f} GB/s), "
              f"{100 * pre / fp8:.1f} % of the fp8 call {fp8 * 1e3:.0f} us ({flops / fp8 / 1e9:.0f} TFLOP/s; "
              f"without the pre-pass {flops / (fp8 - pre) / 1e9:.0f}); bf16 {flops / bf / 1e9:.0f} TFLOP/s; "
              f"ratio {bf / fp8:.3f}, without the pre-pass {bf / (fp8 - pre):.3f}", flush=True)
    del x, f8, b16, v8, vt
