"""Probe (issue #30's D64 rows and short sequences, #29's window): every tuning candidate of the warp-specialised
forward at head dim 64 (three of them new: 192-key tiles in 2 or 3 stages, three consumers with 64-key tiles in
4 stages) against the `wgmma` kernel, today's dispatch and cuDNN, B4 H48 bf16 at 1k-16k, causal and not; then at
head dim 128 the three-consumer 64-key configuration against the default on a 4k window over 64k keys (H16) and
at B16 H32 1k / 2k. Replay off; each sample five calls queued (host time hidden), the median of 5 after 0.2 s of
the call's own load. Kernels compiled beforehand in parallel (scripts/prewarm_ws.py). Arguments: the parts to run (d64, d128;
default both)."""
import dataclasses
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "scripts"))
os.environ["NUMBA_ATTN_REPLAY"] = "0"

if __name__ == "__main__":
    from prewarm_ws import prewarm

    three64 = dict(block_n=64, stages=4, consumers=3, producer_registers=32, consumer_registers=160)
    default = {}
    extra = [(f, 128, "bfloat16", c, w) for f in (default, three64) for c, w in
             ((True, None), (True, (4096, 0)), (False, None))]
    parts = sys.argv[1:] or ["d64", "d128"]
    prewarm(["64:bfloat16"] if "d64" in parts else [], extra if "d128" in parts else [])

    import torch

    from numba_attn.forward import wgmma_ws
    from _probe import cudnn_forward, forced_forward as ours
    from _timing import queued_ms

    def timed(f, warm_s=0.2):
        return queued_ms(f, warm_s, samples=5, calls=5)

    def short(c):
        fields = {k: v for k, v in dataclasses.asdict(c).items() if v != getattr(wgmma_ws.DEFAULT_CONFIG, k)}
        return ",".join(f"{k[:4]}={v}" for k, v in fields.items() if k not in ("producer_registers",
                                                                               "consumer_registers")) or "default"

    torch.manual_seed(0)
    cands = [c for c in wgmma_ws.TUNING_CANDIDATES if wgmma_ws.usable(c, 64)]
    for n in (1024, 2048, 4096, 16384) if "d64" in parts else ():
        for causal in (False, True):
            q, k, v = (torch.randn(4, 48, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * 4 * 48 * n * n * 64 / (2 if causal else 1)
            cudnn = cudnn_forward(q, k, v, causal)
            res = {"cuDNN": timed(cudnn), "dispatch": timed(ours(q, k, v, causal, backend=None)),
                   "wgmma": timed(ours(q, k, v, causal, backend="wgmma"))}
            for c in cands:
                res[short(c)] = timed(ours(q, k, v, causal, c))
            res["cuDNN"] = min(res["cuDNN"], timed(cudnn))
            tf = {kk: flops / vv / 1e9 for kk, vv in res.items()}
            best = max((kk for kk in tf if kk not in ("cuDNN", "dispatch", "wgmma")), key=tf.get)
            print(f"D64 N{n} {'causal' if causal else 'full'}: cuDNN {tf['cuDNN']:.0f} dispatch {tf['dispatch']:.0f} "
                  f"wgmma {tf['wgmma']:.0f} best WS {best} {tf[best]:.0f} ({tf[best] / tf['cuDNN']:.3f}x cuDNN) | "
                  + " ".join(f"{kk}:{vv:.0f}" for kk, vv in tf.items() if kk not in ("cuDNN", "dispatch", "wgmma")),
                  flush=True)
            del q, k, v

    if "d128" not in parts:
        sys.exit(0)
    three = wgmma_ws.WsConfig(**three64)
    L, H = 65536, 16
    q, k, v = (torch.randn(1, H, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    wtiles = H * sum(min(mb, 32) + 1 for mb in range(L // 128))
    dtiles = H * sum(mb + 1 for mb in range(L // 128))
    res = {}
    for rnd in range(2):
        for name, cfg, window in (("dense", None, None), ("window", None, (4096, 0)), ("window 3c64", three, (4096, 0)),
                                  ("dense 3c64", three, None)):
            res.setdefault(name, []).append(timed(ours(q, k, v, True, cfg, window=window), warm_s=0.4))
        print(f"W round {rnd}: " + " ".join(f"{kk} {vv[-1]:.3f}" for kk, vv in res.items()), flush=True)
    med = {kk: statistics.median(vv) for kk, vv in res.items()}
    for w in ("window", "window 3c64"):
        print(f"W {w} {med[w]:.3f} ms: tile ratio {(wtiles / med[w]) / (dtiles / med['dense']):.3f} (dense "
              f"{med['dense']:.2f} ms; dense 3c64 {med['dense 3c64']:.2f})", flush=True)
    del q, k, v
    for n in (1024, 2048):
        for causal in (False, True):
            q, k, v = (torch.randn(16, 32, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * 16 * 32 * n * n * 128 / (2 if causal else 1)
            cudnn = cudnn_forward(q, k, v, causal)
            res = {"cuDNN": timed(cudnn), "dispatch": timed(ours(q, k, v, causal, backend=None)),
                   "3c64": timed(ours(q, k, v, causal, three))}
            tf = {kk: flops / vv / 1e9 for kk, vv in res.items()}
            print(f"S D128 B16 N{n} {'causal' if causal else 'full'}: " + " ".join(f"{kk} {vv:.0f}" for kk, vv in
                                                                                   tf.items()), flush=True)
