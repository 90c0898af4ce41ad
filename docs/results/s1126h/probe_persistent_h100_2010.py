"""Probe: WS default vs persistent (own output staging, early Q release); windows, dense causal, #30 shapes, cuDNN."""
import sys, time, statistics
sys.path.insert(0, "scripts")
import torch, numba_attn
from numba_attn.forward import dispatch, wgmma_ws
from _timing import median_ms
from torch.nn.attention import SDPBackend, sdpa_kernel
orig = dispatch._tuned_config
CFG = {"default": wgmma_ws.DEFAULT_CONFIG, "persistent": wgmma_ws.WsConfig(persistent=True)}
def timed(f, reps=10):
    until = time.perf_counter() + 0.3
    while time.perf_counter() < until:
        f(); torch.cuda.synchronize()
    return median_ms(f, reps)
def case(label, q, k, v, flops, kw, cudnn=False):
    res = {}
    ref = numba_attn.flash_forward(q, k, v, **kw)
    for rnd in range(3):
        for name, cfg in CFG.items():
            dispatch._tuned_config = lambda *a, c=cfg, **k2: c
            if rnd == 0:
                out = numba_attn.flash_forward(q, k, v, **kw)
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                assert err < 1e-2, (label, name, err)
            res.setdefault(name, []).append(timed(lambda: numba_attn.flash_forward(q, k, v, **kw)))
        dispatch._tuned_config = orig
        if cudnn:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=kw.get("causal", False))
                res.setdefault("cudnn", []).append(timed(f))
    out = {}
    for name, t in res.items():
        ms = statistics.median(t)
        out[name] = flops / ms / 1e9
        print(f"P {label:34s} {name:10s} {ms:8.3f} ms {out[name]:6.1f} TFLOP/s", flush=True)
    return out
n, heads, d = 65536, 16, 128
for dt in (torch.bfloat16, torch.float16):
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=dt) for _ in range(3))
    vis = sum(min(i, 4096) + 1 for i in range(n))
    w = case(f"{str(dt)[6:]} L64k W4096", q, k, v, 4.0 * heads * d * vis, dict(causal=True, window=(4096, 0)))
    c = case(f"{str(dt)[6:]} L64k causal", q, k, v, 4.0 * heads * d * n * (n + 1) / 2, dict(causal=True))
    print(f"R {str(dt)[6:]} window/dense: default {w['default'] / c['default']:.3f}, persistent {w['persistent'] / c['persistent']:.3f}, best/best {max(w.values()) / max(c.values()):.3f}", flush=True)
    del q, k, v
for n in (1024, 4096, 16384):
    for causal in (True, False):
        q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        case(f"bf16 B4 H32 D128 N{n} {'causal' if causal else 'full'}", q, k, v,
             4.0 * 4 * 32 * n * n * 128 * (0.5 if causal else 1.0), dict(causal=causal), cudnn=True)
