"""Probe: the WS kernel with the softmax held above the P V wait (softmax_under_pv) against without, timed in
interleaved rounds (every variant once per round: the median of 5 calls after 0.3 s of its own calls; the 01:48 run
timed 3 calls after one, no warm-up). Window 4k on L64k H16 D128 bf16 causal (default and persistent
configurations) against the dense causal launch of the same flag (launched directly: each call's host time is in its
sample); then B4 H32 D128 bf16 dense shapes with torch SDPA cuDNN."""
import functools
import statistics
import sys
import time

import torch
from numba import cuda
from torch.nn.attention import SDPBackend, sdpa_kernel

from numba_attn.forward import wgmma_ws, wgmma_ws_kernel
from numba_attn.runtime.device import kernel_jit

FLAG = {"on": False}


@functools.lru_cache(maxsize=None)
def _kernel(config, d_pad, bf16, scale_first, variant, store, on):
    source = wgmma_ws_kernel._kernel_source(config, d_pad, bf16, scale_first, variant, store=store,
                                            softmax_under_pv=on)
    return kernel_jit((config.threads, 1), wgmma_ws.SIGNATURE)(source)


wgmma_ws.flash_ws_kernel = lambda config, d, bf16, scale_first=False, variant=wgmma_ws.PLAIN, store="elements": \
    _kernel(config, d, bf16, scale_first, variant, store, FLAG["on"])


def bits(x):
    return cuda.as_cuda_array(x.view(torch.int16))


def call(q, k, v, out, lse, causal, config, window=None):
    wgmma_ws.launch(bits(q), bits(k), bits(v), bits(out), cuda.as_cuda_array(lse), False, q.shape[-1] ** -0.5,
                    causal, cuda.default_stream(), config=config, dtype="bfloat16", window=window)


def timed(f, reps=5, warm_s=0.3):
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


def rounds(variants, n):
    """{name: [ms per round]} over ``n`` interleaved rounds of ``variants`` {name: (flag, fn)}."""
    res = {name: [] for name in variants}
    for r in range(n + 1):
        for name, (on, f) in variants.items():
            FLAG["on"] = on
            t = timed(f)
            if r:  # (round 0: compiles and warms)
                res[name].append(t)
    return res


torch.manual_seed(0)
D = wgmma_ws.DEFAULT_CONFIG
P = wgmma_ws.WsConfig(persistent=True)
part = sys.argv[1] if len(sys.argv) > 1 else "window,dense"
for causal, window, config in ((False, None, D), (True, None, D), (True, (1000, 0), D), (True, (1000, 0), P)):
    q, k, v = (torch.randn(2, 8, 3000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    outs = []
    for on in (False, True):
        FLAG["on"] = on
        out = torch.full_like(q, float("nan"))
        lse = torch.empty(2, 8, 3000, device="cuda", dtype=torch.float32)
        call(q, k, v, out, lse, causal, config, window)
        outs.append(out.float())
    i = torch.arange(3000, device="cuda")
    mask = (i[None, :] <= i[:, None]) if causal else torch.ones(3000, 3000, dtype=torch.bool, device="cuda")
    if window:
        mask &= i[None, :] >= i[:, None] - window[0]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    errs = [float((o - ref).norm() / ref.norm()) for o in outs]
    print(f"C causal {causal} window {window} persistent {config.persistent}: error off {errs[0]:.1e} on {errs[1]:.1e}"
          f", max |on - off| {float((outs[0] - outs[1]).abs().max()):.1e}", flush=True)
if "window" in part:
    n, heads = 65536, 16
    q, k, v = (torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, heads, n, device="cuda", dtype=torch.float32)
    blocks = n // 128
    ratio = sum(mb + 1 for mb in range(blocks)) / sum(min(mb, 32) + 1 for mb in range(blocks))  # dense / window tiles
    variants = {}
    for on in (False, True):
        tag = "on" if on else "off"
        variants[f"dense {tag}"] = (on, lambda: call(q, k, v, out, lse, True, D))
        variants[f"window default {tag}"] = (on, lambda: call(q, k, v, out, lse, True, D, (4096, 0)))
        variants[f"window persistent {tag}"] = (on, lambda: call(q, k, v, out, lse, True, P, (4096, 0)))
    res = rounds(variants, 3)
    for name, ts in res.items():
        if name.startswith("window"):
            tag = name.split()[-1]
            per_round = [ratio * w / dn for w, dn in zip(ts, res[f"dense {tag}"])]  # window tile rate / dense's
            per_round = [1 / x for x in per_round]
            print(f"W {name:22s} {statistics.median(ts):.3f} ms (rounds {min(ts):.3f}-{max(ts):.3f}); tile ratio "
                  f"to dense {tag}: median {statistics.median(per_round):.3f}, min {min(per_round):.3f}, max "
                  f"{max(per_round):.3f}", flush=True)
        else:
            print(f"W {name:22s} {statistics.median(ts):.2f} ms (rounds {min(ts):.2f}-{max(ts):.2f})", flush=True)
    del q, k, v, out, lse
if "dense" in part:
    for n, causal in ((1024, True), (1024, False), (4096, True), (4096, False), (16384, True), (16384, False)):
        q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(4, 32, n, device="cuda", dtype=torch.float32)
        flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        res = rounds({"off": (False, lambda: call(q, k, v, out, lse, causal, D)),
                      "on": (True, lambda: call(q, k, v, out, lse, causal, D)), "cudnn": (False, cudnn)},
                     3)
        tf = {name: flops / statistics.median(ts) / 1e9 for name, ts in res.items()}
        print(f"D N{n} {'causal' if causal else 'full  '} TFLOP/s off {tf['off']:.1f} on {tf['on']:.1f} cuDNN "
              f"{tf['cudnn']:.1f}  on/off {tf['on'] / tf['off']:.3f}  on/cuDNN {tf['on'] / tf['cudnn']:.3f}  off/cuDNN "
              f"{tf['off'] / tf['cudnn']:.3f}", flush=True)
        del q, k, v, out, lse
