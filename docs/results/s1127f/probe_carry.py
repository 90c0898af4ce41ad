"""Probe (issue #30, h/carry-tail): the persistent WS forward forced, against cuDNN, B4 bf16, D128 H32 / D64 H48,
causal and not -- run once per tree (main, the branch, the branch's first commit) and the trees taken in turn, so
that a tree's ratio to cuDNN is read beside the run's spread. Calls replayed (NUMBA_ATTN_REPLAY=1); per row ROUNDS
rounds of cuDNN then the persistent call, each sample 20 calls queued after 0.2 s of the call's own load; prints the
median ratio and its range. Kernels compiled first (scripts/prewarm_ws.py; PREWARM=0 skips it). Arguments: a tag,
then ``d128:n,...`` / ``d64:n,...``, optionally ``rounds=N`` (default 3)."""
import os
import statistics
import sys

ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "scripts"))
os.environ.setdefault("NUMBA_ATTN_REPLAY", "1")

if __name__ == "__main__":
    args = dict((a.split(":", 1) if ":" in a else a.split("=", 1)) for a in sys.argv[2:])
    rounds = int(args.pop("rounds", 3))
    if os.environ.get("PREWARM", "1") == "1":
        from prewarm_ws import prewarm
        prewarm([f"{k[1:]}:bfloat16" for k in args])

    import torch

    from numba_attn.forward import wgmma_ws
    from _probe import cudnn_forward, forced_forward
    from _timing import queued_ms

    persistent = wgmma_ws.WsConfig(persistent=True)
    torch.manual_seed(0)
    for part, ns in args.items():
        d = int(part[1:])
        h = 32 if d == 128 else 48
        for n in [int(x) for x in ns.split(",")]:
            for causal in (False, True):
                q, k, v = (torch.randn(4, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * 4 * h * n * n * d / (2 if causal else 1)
                cudnn, ours = cudnn_forward(q, k, v, causal), forced_forward(q, k, v, causal, persistent)
                ours()
                ratios, rates = [], []
                for _ in range(rounds):
                    t_cudnn = queued_ms(cudnn, 0.2, samples=5, calls=20)
                    t_ours = queued_ms(ours, 0.2, samples=5, calls=20)
                    ratios.append(t_cudnn / t_ours)
                    rates.append(flops / t_ours / 1e9)
                print(f"{sys.argv[1]} D{d} N{n} {'causal' if causal else 'full'}: persistent "
                      f"{statistics.median(rates):.0f} TFLOP/s, vs cuDNN {statistics.median(ratios):.3f} "
                      f"[{min(ratios):.3f}-{max(ratios):.3f}]", flush=True)
                del q, k, v
