"""Probe: softmax_under_pv (the softmax held above the P V wait) on and off, for the fp8 (e4m3) WS forward and the
bf16 forward (flash_forward; replay off, so each call builds its launch -- ten calls queued per timed sample hide
that host time), B4 H32 D128, full and causal; two interleaved rounds, each variant after 0.3 s of its own calls."""
import functools
import os
import statistics
import time

os.environ["NUMBA_ATTN_REPLAY"] = "0"
import torch  # noqa: E402

import numba_attn  # noqa: E402
from numba_attn.forward import wgmma_ws, wgmma_ws_fp8, wgmma_ws_kernel  # noqa: E402
from numba_attn.runtime.device import kernel_jit  # noqa: E402

FLAG = {"on": False}


@functools.lru_cache(maxsize=None)
def _fp8(config, d_pad, bf16_out, scale_first, per_head, variant, probe, on):
    src = wgmma_ws_kernel._kernel_source(config, d_pad, bf16_out, scale_first, variant, fp8=True, per_head=per_head,
                                         probe=probe, softmax_under_pv=on)
    return kernel_jit((config.threads, 1), wgmma_ws_fp8.SIGNATURE)(src)


@functools.lru_cache(maxsize=None)
def _bf16(config, d_pad, bf16, scale_first, variant, store, on):
    src = wgmma_ws_kernel._kernel_source(config, d_pad, bf16, scale_first, variant, store=store, softmax_under_pv=on)
    return kernel_jit((config.threads, 1), wgmma_ws.SIGNATURE)(src)


wgmma_ws_fp8.flash_ws_fp8_kernel = lambda config, d, bf16_out, scale_first=False, per_head=False, \
    variant=wgmma_ws_fp8.PLAIN, probe=None: _fp8(config, d, bf16_out, scale_first, per_head, variant, probe,
                                                 FLAG["on"])
wgmma_ws.flash_ws_kernel = lambda config, d, bf16, scale_first=False, variant=wgmma_ws.PLAIN, store="elements": \
    _bf16(config, d, bf16, scale_first, variant, store, FLAG["on"])


def timed(f, warm_s=0.3, samples=5, calls=10):
    t0 = time.time()
    while time.time() - t0 < warm_s:
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    return statistics.median(ts)


torch.manual_seed(0)
for n in (4096, 16384):
    for causal in (False, True):
        x = [torch.randn(4, 32, n, 128, device="cuda") for _ in range(3)]
        f8 = [t.to(torch.float8_e4m3fn) for t in x]
        b16 = [t.to(torch.bfloat16) for t in x]
        outs = []
        for on in (False, True):
            FLAG["on"] = on
            outs.append(numba_attn.flash_forward(*f8, causal=causal, backend="wgmma_ws").float())
        same = float((outs[0] - outs[1]).abs().max())
        variants = {"fp8 off": (False, lambda: numba_attn.flash_forward(*f8, causal=causal, backend="wgmma_ws")),
                    "fp8 on": (True, lambda: numba_attn.flash_forward(*f8, causal=causal, backend="wgmma_ws")),
                    "bf16 off": (False, lambda: numba_attn.flash_forward(*b16, causal=causal)),
                    "bf16 on": (True, lambda: numba_attn.flash_forward(*b16, causal=causal))}
        res = {k: [] for k in variants}
        for _ in range(2):
            for name, (on, f) in variants.items():
                FLAG["on"] = on
                res[name].append(timed(f))
        flops = 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)
        tf = {k: flops / min(v) / 1e9 for k, v in res.items()}
        print(f"8 N{n} {'causal' if causal else 'full  '} TFLOP/s " + " ".join(f"{k} {v:.1f}" for k, v in tf.items())
              + f"  fp8 on/off {tf['fp8 on'] / tf['fp8 off']:.3f} bf16 on/off {tf['bf16 on'] / tf['bf16 off']:.3f}"
              f"  fp8 on / bf16 off {tf['fp8 on'] / tf['bf16 off']:.3f}  max|on-off| fp8 {same:.1e}  rounds "
              + str({k: [round(t, 3) for t in v] for k, v in res.items()}), flush=True)
        del x, f8, b16, outs
