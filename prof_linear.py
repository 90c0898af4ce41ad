import torch, numba_attn
torch.manual_seed(0)
q, k, v = (torch.randn(4, 8, 16384, 64, device="cuda", dtype=torch.float16) for _ in range(3))
for _ in range(3):
    numba_attn.causal_dot_product(q, k, v, backend="chunked")
torch.cuda.synchronize()
