"""Probe: window 4k on L64k H16 D128: the dispatch's choice vs forced default / persistent configs, against the
dense causal call, alternating rounds after a warm period of each call's own load."""
import sys, statistics, time
sys.path.insert(0, "scripts")
import torch, numba_attn
from numba_attn.forward import dispatch, wgmma_ws

orig = dispatch._tuned_config
n, heads, d = 65536, 16, 128
def timed(f, reps=10, warm_s=0.4):
    t0 = time.time()
    while time.time() - t0 < warm_s:
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
for dt in (torch.bfloat16, torch.float16):
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=dt) for _ in range(3))
    # computed 128x128 tiles: window call and dense causal call
    blocks = n // 128
    wt = sum(min(mb, 32) + 1 for mb in range(blocks))
    dt_tiles = sum(mb + 1 for mb in range(blocks))
    cfgs = {"dispatch": None, "default": wgmma_ws.DEFAULT_CONFIG, "persistent": wgmma_ws.WsConfig(persistent=True)}
    res = {}
    for rnd in range(3):
        for name, cfg in cfgs.items():
            dispatch._tuned_config = orig if cfg is None else (lambda *a, c=cfg, **kw: c)
            res.setdefault(name, []).append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=True, window=(4096, 0))))
        dispatch._tuned_config = orig
        res.setdefault("dense", []).append(timed(lambda: numba_attn.flash_forward(q, k, v, causal=True), 5))
    dense_ms = statistics.median(res.pop("dense"))
    for name, t in res.items():
        ms = statistics.median(t)
        ratio = (wt / ms) / (dt_tiles / dense_ms)
        print(f"P {str(dt)[6:]} W4096 {name:10s} {ms:.3f} ms  dense {dense_ms:.2f} ms  tile ratio {ratio:.3f}", flush=True)
