"""The illegal instruction of probe_configs.py (D64 B4 H48 N1024 causal bf16) came in a candidate's warm-up: many
calls queued back to back. Each candidate in a process of its own: 300 calls queued, then a check against torch."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
if len(sys.argv) == 1:
    from numba_attn.forward import wgmma_ws
    for i, c in enumerate(wgmma_ws.TUNING_CANDIDATES):
        if wgmma_ws.usable(c, 64):
            r = subprocess.run([sys.executable, __file__, str(i)], capture_output=True, text=True, timeout=100)
            tail = [x for x in (r.stdout + r.stderr).strip().splitlines() if "Error" in x or "ok" in x]
            print(i, c, "->", tail[-1][:160] if tail else r.returncode, flush=True)
else:
    import torch
    import numba_attn
    from numba_attn.forward import dispatch, wgmma_ws
    cfg = wgmma_ws.TUNING_CANDIDATES[int(sys.argv[1])]
    dispatch._tuned_config = lambda *a, **k: cfg
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 48, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(300):
        out = numba_attn.flash_forward(q, k, v, causal=True, backend="wgmma_ws")
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    print(f"ok error {float((out.float() - ref).norm() / ref.norm()):.2e}")
