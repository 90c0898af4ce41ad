"""Probe (issues #29, #30): the warp-specialised forward with the warpgroup index made visibly uniform (a shuffle of
lane 0: the Q, K and V descriptors in uniform registers) -- run once per tree (this one, and the tree before it as
`.ab/base`) on one machine. B4 bf16, D128 H32 and D64 H48, 1k-16k, causal and not: cuDNN, today's dispatch, the
default WS configuration forced and the persistent one forced; then a 4k window on 64k keys (B1 H16 D128 causal)
with both configurations against the dense causal call, three rounds. Replay off; each sample five calls queued
(host time hidden), the median of 5 after 0.2 s of the call's own load. Kernels compiled beforehand in parallel
(scripts/prewarm_ws.py; PREWARM=0 skips it). Arguments: a tag for the output, then the parts (``d128[:n,...]``,
``d64[:n,...]``, ``window``; default all)."""
import os
import sys

ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ.setdefault("NUMBA_ATTN_REPLAY", "0")  # (REPLAY=1 in the environment: calls replayed, less host time)

if __name__ == "__main__":
    from prewarm_ws import prewarm

    pers = dict(persistent=True)
    extra = [(f, 128, "bfloat16", True, (4096, 0)) for f in ({}, pers)]
    if os.environ.get("PREWARM", "1") == "1":
        prewarm(["64:bfloat16", "128:bfloat16"], extra)

    import torch

    from numba_attn.forward import wgmma_ws
    from _probe import cudnn_forward, forced_forward as ours
    from _timing import queued_ms

    tag = sys.argv[1] if len(sys.argv) > 1 else "tree"
    # parts: "d128", "d64" (optionally ":n,n,..." key counts) and "window"; default all
    parts = dict((a.split(":") + [""])[:2] for a in sys.argv[2:]) or {"d128": "", "d64": "", "window": ""}

    def timed(f, warm_s=0.2):
        return queued_ms(f, warm_s, samples=5, calls=5)

    default, persistent = wgmma_ws.DEFAULT_CONFIG, wgmma_ws.WsConfig(persistent=True)
    torch.manual_seed(0)
    for d, h in ((128, 32), (64, 48)):
        if f"d{d}" not in parts:
            continue
        for n in [int(x) for x in parts[f"d{d}"].split(",") if x] or (1024, 2048, 4096, 16384):
            for causal in (False, True):
                q, k, v = (torch.randn(4, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * 4 * h * n * n * d / (2 if causal else 1)
                cudnn = cudnn_forward(q, k, v, causal)
                res = {"cuDNN": timed(cudnn), "dispatch": timed(ours(q, k, v, causal, backend=None)),
                       "default": timed(ours(q, k, v, causal, default)),
                       "persistent": timed(ours(q, k, v, causal, persistent))}
                res["cuDNN"] = min(res["cuDNN"], timed(cudnn))
                tf = {kk: flops / vv / 1e9 for kk, vv in res.items()}
                print(f"{tag} D{d} N{n} {'causal' if causal else 'full'}: " + " ".join(
                    f"{kk} {vv:.0f}" for kk, vv in tf.items()) + " | vs cuDNN: " + " ".join(
                    f"{kk} {vv / tf['cuDNN']:.3f}" for kk, vv in tf.items() if kk != "cuDNN"), flush=True)
                del q, k, v
    # the 4k window on 64k keys: computed 128 x 128 tiles per ms over the dense causal call's
    if "window" not in parts:
        sys.exit(0)
    L, W = 65536, 4096
    q, k, v = (torch.randn(1, 16, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    blocks = L // 128
    dense_tiles = blocks * (blocks + 1) // 2
    win_tiles = sum(min(i, W // 128) + 1 for i in range(blocks))
    for r in range(3):
        t_dense = timed(ours(q, k, v, True, backend=None), 0.4)
        row = {name: timed(ours(q, k, v, True, cfg, window=(W, 0)), 0.4) for name, cfg in (("default", default),
                                                                                           ("persistent", persistent))}
        print(f"{tag} window round {r}: dense {t_dense:.2f} ms, " + ", ".join(
            f"{kk} {vv:.2f} ms ratio {(win_tiles / vv) / (dense_tiles / t_dense):.3f}" for kk, vv in row.items()),
            flush=True)
