"""Probe (issue #30 / #29; usage: probe_forward.py LABEL [LENGTHS [d128]]): flash_forward (the dispatch's choice)
against torch SDPA's cuDNN backend, B4, bf16, D128 H32 and D64 H48, causal and not; and the window 4k on L64k H16
D128 against the dense causal call. Each call timed (median of 10 CUDA-event samples, one call each) after 0.3 s of
its own calls; two rounds. Run once per tree (A/B)."""
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import numba_attn

label = sys.argv[1] if len(sys.argv) > 1 else "tree"
torch.manual_seed(0)


def timed(f, reps=10, warm_s=0.3):
    t0 = time.time()
    while time.time() - t0 < warm_s:
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


lengths = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 4096, 16384]
shapes = [(128, 32, n, c) for n in lengths for c in (False, True)]
if len(sys.argv) <= 3 or sys.argv[3] != "d128":
    shapes += [(64, 48, n, c) for n in lengths if n >= 4096 for c in (False, True)]
for d, h, n, causal in shapes:
    q, k, v = (torch.randn(4, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal) \
        if n <= 4096 else None
    out = numba_attn.flash_forward(q, k, v, causal=causal)
    err = float((out.float() - ref).norm() / ref.norm()) if ref is not None else float("nan")
    flops = 4 * 4 * h * n * n * d / (2 if causal else 1)
    ours, cudnn = [], []
    for _ in range(2):
        ours.append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=causal)))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cudnn.append(timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)))
    o, c = min(ours), min(cudnn)
    print(f"F {label} D{d} H{h} N{n} {'causal' if causal else 'full  '} ours {flops / o / 1e9:6.1f} cuDNN "
          f"{flops / c / 1e9:6.1f} TFLOP/s  ours/cuDNN {c / o:.3f}  err {err:.1e}  rounds {ours} {cudnn}", flush=True)
    del q, k, v, out

n, heads = 65536, 16
q, k, v = (torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
blocks = n // 128
wt = sum(min(mb, 32) + 1 for mb in range(blocks))
dense_tiles = sum(mb + 1 for mb in range(blocks))
win, dense = [], []
for _ in range(3):
    win.append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=True, window=(4096, 0))))
    dense.append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=True), 5))
w, dn = statistics.median(win), statistics.median(dense)
print(f"W {label} window 4k L64k H16 D128 bf16: {w:.3f} ms, dense causal {dn:.2f} ms, tile ratio "
      f"{(wt / w) / (dense_tiles / dn):.3f}, dense {4 * heads * n * n * 128 / 2 / dn / 1e9:.1f} TFLOP/s  rounds {win} "
      f"{dense}", flush=True)
