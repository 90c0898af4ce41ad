"""Check (GPU): does a warp-specialised forward whose register budgets exceed what its launch holds finish? The
16-bit WS kernel, B1 H2 N1024 D128 bf16, with WsConfig's validation bypassed to give the producer 32 registers
beside two consumers of 240 (128 x (32 + 480) = 65536 registers; a block of 384 threads holds 168 x 384 = 64512).
Run under ``timeout``: a hang is the finding. Run from the tree."""
import sys
import time

import torch
from numba import cuda

from numba_attn.forward import wgmma_ws

producer = int(sys.argv[1]) if len(sys.argv) > 1 else 32
config = wgmma_ws.WsConfig()
object.__setattr__(config, "producer_registers", producer)  # (past the validation)
q, k, v = (torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = torch.empty_like(q)
lse = torch.empty(1, 2, 1024, device="cuda")


def bits(x):
    return cuda.as_cuda_array(x.view(torch.int16))


start = time.perf_counter()
wgmma_ws.launch(bits(q), bits(k), bits(v), bits(out), cuda.as_cuda_array(lse), False, 128 ** -0.5, False,
                cuda.default_stream(), config=config, dtype="bfloat16")
print(f"producer {producer} / consumers 240 launched ({time.perf_counter() - start:.0f} s, compile included)",
      flush=True)
torch.cuda.synchronize()
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
print(f"finished: error {((out.float() - ref.float()).norm() / ref.float().norm()).item():.2e}", flush=True)
