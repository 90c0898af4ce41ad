"""Probe: one ring rank's calls at 128k on 4 GPUs (zig-zag, B1 H8 D128 bf16) on one GPU: the own causal step and
the two non-causal block shapes, with the dispatch's choice and forced WS configurations, alternating rounds."""
import statistics, time
import torch, numba_attn
from numba_attn.forward import dispatch, wgmma_ws
orig = dispatch._tuned_config
def timed(f, reps=8, warm_s=0.3):
    t0 = time.time()
    while time.time() - t0 < warm_s:
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
total = 131072
L = total // 4; h = L // 2
q, k, v = (torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
cases = [("own causal LxL", lambda: numba_attn.flash_forward(q, k, v, causal=True), 2 * L * L),
         ("s<r L x L/2", lambda: numba_attn.flash_forward(q, k[:, :, :h], v[:, :, :h]), 4 * L * h),
         ("s>r L/2 x L", lambda: numba_attn.flash_forward(q[:, :, h:], k, v), 4 * h * L)]
configs = (("dispatch", None), ("default", wgmma_ws.DEFAULT_CONFIG), ("nopingpong", wgmma_ws.WsConfig(pingpong=False)),
           ("stages3", wgmma_ws.WsConfig(stages=3)))
for name, f, pairs in cases:
    res = {}
    for rnd in range(3):
        for cfgname, cfg in configs:
            dispatch._tuned_config = orig if cfg is None else (lambda *a, c=cfg, **kw: c)
            res.setdefault(cfgname, []).append(timed(f))
    dispatch._tuned_config = orig
    for cfgname, ts in res.items():
        ms = statistics.median(ts)
        print(f"R N{total // 1024}k {name:16s} {cfgname:10s} {ms:.3f} ms {pairs * 8 * 128 / ms / 1e9:.1f} TFLOP/s "
              f"rounds {' '.join(f'{t:.3f}' for t in ts)}", flush=True)
