"""Probe: window 4k on L64k H16 D128 causal, bf16: the dispatch's choice and forced WS configurations against the
dense causal call (dispatch), alternating rounds, each call timed (median of 10) after 0.4 s of its own calls.
Tile ratio = computed 128x128 tiles per ms over the dense causal call's. Usage: probe_window.py [config names]"""
import statistics
import sys
import time

import torch

import numba_attn
from numba_attn.forward import dispatch, wgmma_ws

orig = dispatch._tuned_config
W = wgmma_ws.WsConfig
CONFIGS = {"dispatch": None, "default": wgmma_ws.DEFAULT_CONFIG, "persistent": W(persistent=True),
           "persistent_nopp": W(persistent=True, pingpong=False), "persistent_st3": W(persistent=True, stages=3),
           "default_st3": W(stages=3), "default_nopp": W(pingpong=False)}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CONFIGS)
n, heads, d = 65536, 16, 128


def timed(f, reps=10, warm_s=0.4):
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


for dt in (torch.bfloat16,):
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=dt) for _ in range(3))
    blocks = n // 128
    wt = sum(min(mb, 32) + 1 for mb in range(blocks))
    dense_tiles = sum(mb + 1 for mb in range(blocks))
    res = {}
    for rnd in range(3):
        for name in names:
            cfg = CONFIGS[name]
            dispatch._tuned_config = orig if cfg is None else (lambda *a, c=cfg, **kw: c)
            res.setdefault(name, []).append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=True,
                                                                                  window=(4096, 0))))
        dispatch._tuned_config = orig
        res.setdefault("dense", []).append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=True), 5))
    dense_ms = statistics.median(res.pop("dense"))
    for name, t in res.items():
        ms = statistics.median(t)
        ratio = (wt / ms) / (dense_tiles / dense_ms)
        print(f"P {str(dt)[6:]} W4096 {name:16s} {ms:.3f} ms  dense {dense_ms:.2f} ms  tile ratio {ratio:.3f}  "
              f"rounds {' '.join(f'{x:.3f}' for x in t)}", flush=True)
