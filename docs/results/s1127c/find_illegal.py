"""Which tuning candidate raised 'illegal instruction' at D64 B4 H48 N1024 causal bf16 (probe_configs.py, H100
2026-11-27 ~03:50 UTC)? Each candidate in a process of its own, checked against torch's float32 attention."""
import dataclasses
import os
import subprocess
import sys

if len(sys.argv) == 1:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
    from numba_attn.forward import wgmma_ws
    for i, c in enumerate(wgmma_ws.TUNING_CANDIDATES):
        for shape in ("4,48,1024,64,1", "1,2,1024,64,1", "1,2,300,64,1", "4,48,1024,128,1", "1,2,1100,128,1"):
            if not wgmma_ws.usable(c, int(shape.split(",")[3])):
                continue
            r = subprocess.run([sys.executable, __file__, str(i), shape], capture_output=True, text=True, timeout=120)
            tail = (r.stdout + r.stderr).strip().splitlines()
            print(i, shape, c, "->", tail[-1][:160] if tail else r.returncode, flush=True)
else:
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
    import numba_attn
    from numba_attn.forward import dispatch, wgmma_ws
    cfg = wgmma_ws.TUNING_CANDIDATES[int(sys.argv[1])]
    dispatch._tuned_config = lambda *a, **k: cfg
    b, h, n, d, causal = map(int, sys.argv[2].split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = numba_attn.flash_forward(q, k, v, causal=bool(causal), backend="wgmma_ws")
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=bool(causal))
    print(f"ok error {float((out.float() - ref).norm() / ref.norm()):.2e}")
