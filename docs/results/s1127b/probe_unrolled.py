"""Probe: the persistent WS kernel with two query blocks per block of threads written out (blocks_per_cta=2: no
block loop, so ptxas keeps the descriptors in uniform registers) against the default (one block per query block).
Window 4k on L64k H16 D128 bf16 causal, and the dense causal call; then B16 H32 D128 bf16 at 1k and 2k keys
with cuDNN beside them; replay off, each sample five calls queued (host time hidden), the median of 5 after 0.4 s of
the call's own load; three alternating rounds. First a correctness check
of the same specialisations against torch's float32 attention. Written 2026-11-27 ~02:35 UTC and not yet run (the
stop's device time was spent): the next session's first measurement."""
import functools
import math
import os
import statistics
import sys
import time

os.environ["NUMBA_ATTN_REPLAY"] = "0"
import torch  # noqa: E402

import numba_attn  # noqa: E402
from numba_attn.forward import dispatch, wgmma_ws, wgmma_ws_kernel  # noqa: E402
from numba_attn.runtime.device import kernel_jit  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "scripts"))
from _timing import median_ms  # noqa: E402

FLAG = {"u": 0, "grid": None, "cfg": None}
real_sms = wgmma_ws.multiprocessor_count
real_tuned = dispatch._tuned_config


@functools.lru_cache(maxsize=None)
def _kernel(config, d, bf16, scale_first, variant, store, u):
    src = wgmma_ws_kernel._kernel_source(config, d, bf16, scale_first, variant, store=store, blocks_per_cta=u)
    return kernel_jit((config.threads, 1), wgmma_ws.SIGNATURE)(src)


wgmma_ws.flash_ws_kernel = lambda config, d, bf16, scale_first=False, variant=wgmma_ws.PLAIN, store="elements": \
    _kernel(config, d, bf16, scale_first, variant, store, FLAG["u"] if config.persistent else 0)
wgmma_ws.multiprocessor_count = lambda: FLAG["grid"] or real_sms()
dispatch._tuned_config = lambda *a, **k: FLAG["cfg"] or real_tuned(*a, **k)
PERS = wgmma_ws.WsConfig(persistent=True)


def use(kind, blocks):
    FLAG["u"], FLAG["cfg"], FLAG["grid"] = (2, PERS, math.ceil(blocks / 2)) if kind == "u2" else \
        (0, wgmma_ws.DEFAULT_CONFIG, None)


def timed(f, warm_s=0.4, calls=5):
    """Milliseconds per call: the median of 5 samples of ``calls`` queued calls after ``warm_s`` of the call's load."""
    until = time.time() + warm_s
    while time.time() < until:
        f()
    return median_ms(lambda: [f() for _ in range(calls)], 5, warmup=0) / calls


torch.manual_seed(0)
n = 3000
q, k, v = (torch.randn(2, 4, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
i = torch.arange(n, device="cuda")
for window in (None, (1000, 0)):
    mask = i[None, :] <= i[:, None]
    if window:
        mask &= i[None, :] >= i[:, None] - window[0]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    outs = {}
    for kind in ("default", "u2"):
        use(kind, 2 * 4 * math.ceil(n / 128))
        outs[kind] = numba_attn.flash_forward(q, k, v, causal=True, window=window, backend="wgmma_ws").float()
    errs = {kd: float((o - ref).norm() / ref.norm()) for kd, o in outs.items()}
    diff = float((outs["u2"] - outs["default"]).abs().max())
    print(f"C window {window}: error {errs}, max |u2 - default| {diff:.1e}", flush=True)

L, H = 65536, 16
q, k, v = (torch.randn(1, H, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
blocks = H * L // 128
wtiles = H * sum(min(mb, 32) + 1 for mb in range(L // 128))
dtiles = H * sum(mb + 1 for mb in range(L // 128))
res = {}
for rnd in range(3):
    for name, kind, window in (("dense default", "default", None), ("window default", "default", (4096, 0)),
                               ("window u2", "u2", (4096, 0)), ("dense u2", "u2", None)):
        use(kind, blocks)
        res.setdefault(name, []).append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=True, window=window,
                                                                               backend="wgmma_ws")))
    print(f"R round {rnd}: " + " ".join(f"{kk} {vv[-1]:.3f}" for kk, vv in res.items()), flush=True)
med = {kk: statistics.median(vv) for kk, vv in res.items()}
for w in ("window default", "window u2"):
    for dn in ("dense default", "dense u2"):
        ratio = (wtiles / med[w]) / (dtiles / med[dn])
        print(f"W {w} {med[w]:.3f} ms vs {dn} {med[dn]:.2f} ms: tile ratio {ratio:.3f}", flush=True)

# short sequences (issue #30's 1k-2k rows, where a block's fixed cost is most of its time), with cuDNN beside them;
# batch 16, not the sweep's 4, so that a call's GPU time stays above its host time (replay is off here)
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

for n in (1024, 2048):
    for causal in (False, True):
        q, k, v = (torch.randn(16, 32, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        blocks = 16 * 32 * math.ceil(n / 128)
        flops = 4 * 16 * 32 * n * n * 128 / (2 if causal else 1)

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        res = {}
        for _ in range(3):
            for kind in ("default", "u2"):
                use(kind, blocks)
                res.setdefault(kind, []).append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=causal,
                                                                                       backend="wgmma_ws")))
            res.setdefault("cudnn", []).append(timed(cudnn))
        tf = {kk: flops / statistics.median(vv) / 1e9 for kk, vv in res.items()}
        print(f"S B16 N{n} {'causal' if causal else 'full  '} TFLOP/s default {tf['default']:.1f} u2 {tf['u2']:.1f} "
              f"cuDNN {tf['cudnn']:.1f}  u2/default {tf['u2'] / tf['default']:.3f}  u2/cuDNN "
              f"{tf['u2'] / tf['cudnn']:.3f}", flush=True)
