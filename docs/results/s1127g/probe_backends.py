"""Probe (issue #30, D64's short causal rows): ``flash_forward`` on the "wgmma" kernel and on the warp-specialised one
(each with its tuned configuration) against cuDNN, B4 H48 D64, fp16 and bf16, at the rows where the dispatch's
threshold (``dispatch.WS_MIN_KEYS_AT``) decides between them: 512 keys non-causal and causal, 1k causal (512 keys per
row on average), 2k causal. Alternating rounds, replayed calls, each sample 20 calls queued after 0.2 s of the call's
own load. Run from the tree. Arguments: ``rounds=3``."""
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

if __name__ == "__main__":
    import torch

    import numba_attn
    from _probe import alternating_rates, cudnn_forward, rates_line
    from _timing import queued_ms

    opts = dict(a.split("=", 1) for a in sys.argv[1:])
    rounds = int(opts.get("rounds", 3))
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for n, causal in ((512, False), (512, True), (1024, True), (2048, True)):
            q, k, v = (torch.randn(4, 48, n, 64, device="cuda", dtype=dtype) for _ in range(3))
            calls = {"cuDNN": cudnn_forward(q, k, v, causal)}
            for backend in ("wgmma", "wgmma_ws"):
                calls[backend] = (lambda b: lambda: numba_attn.flash_forward(q, k, v, causal=causal, backend=b))(
                    backend)
            for f in calls.values():
                f()
            flops = 4 * 4 * 48 * n * n * 64 / (2 if causal else 1)
            rates = alternating_rates(calls, flops, rounds, lambda f: queued_ms(f, 0.2, samples=5, calls=20))
            label = f"{str(dtype)[6:]} D64 N{n} {'causal' if causal else 'full'}"
            print(rates_line(label, rates), flush=True)
            del q, k, v
