"""GPU check of the Triton FlashAttention-2 backward peer (``flash_backward`` in scripts/bench/peers/triton_flash_backward.py).

    python3 scripts/check_triton_backward.py                 # correctness, then timing
    python3 scripts/check_triton_backward.py --skip-timing
    python3 scripts/check_triton_backward.py --skip-correctness --dtype bfloat16 --reps 50

correctness  float16 / bfloat16 inputs; our forward (``return_lse=True``) then ``flash_backward``; dq, dk, dv against
             torch's math SDPA backward in float64 on the same inputs (causal: an explicit bottom-right mask), as
             ``||x - ref|| / ||ref||``, next to the same errors of torch's own 16-bit SDPA backward (flash backend,
             or efficient where a mask or GQA is needed). A case fails when one of ours exceeds twice torch's error
             plus 1e-3 (torch's missing: fp16 2e-3, bf16 1e-2). Non-zero exit if any fails.
timing       B=4 H=32 D=128 N=--seqlen, non-causal and causal: median of --reps CUDA-event timed calls (after warm-up,
             which includes the autotuning) of ours and of torch SDPA's flash backward (``torch.autograd.grad`` of one
             recorded forward). TFLOP/s count 2.5 x 4 B H N^2 D, halved when causal.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _timing import median_ms  # noqa: E402
from bench.peers import triton_flash_backward as tf  # noqa: E402  (flash_forward with lse, flash_backward)

DEVICE = "cuda"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
FALLBACK = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
#: (dtype, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal, layout)
CASES = [
    ("float16", 2, 4, 4, 1024, 1024, 64, False, "contig"),
    ("float16", 2, 4, 4, 1024, 1024, 128, True, "contig"),
    ("float16", 2, 4, 4, 2048, 2048, 64, True, "contig"),
    ("bfloat16", 2, 4, 4, 1000, 1000, 64, True, "contig"),
    ("bfloat16", 2, 4, 4, 2048, 2048, 128, False, "contig"),
    ("bfloat16", 2, 4, 4, 1000, 1000, 128, True, "blhd"),  # strided: memory (batch, seqlen, heads, headdim)
    ("float16", 2, 4, 4, 1000, 1500, 128, True, "contig"),
    ("bfloat16", 2, 4, 4, 1500, 1000, 64, True, "contig"),  # rows 0..499 see no key: dq 0
    ("float16", 2, 4, 4, 777, 1024, 64, False, "contig"),
    ("float16", 2, 8, 2, 1024, 1024, 128, True, "contig"),  # GQA
    ("bfloat16", 2, 8, 2, 1000, 1000, 64, False, "contig"),  # GQA (the forward packs the group's rows)
    ("float16", 1, 4, 4, 1000, 1000, 32, True, "contig"),
    ("bfloat16", 1, 4, 4, 1000, 1000, 256, True, "contig"),
]


def mask_for(lq, lk, device):
    """Bottom-right causal mask: query i sees key j <= i + lk - lq."""
    return torch.arange(lk, device=device)[None, :] <= torch.arange(lq, device=device)[:, None] + (lk - lq)


def sdpa_grads(q, k, v, dout, causal, backend):
    """(dq, dk, dv) of SDPA with ``backend`` forced; GQA by repeating K/V (autograd sums their gradients back)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(group, 1) for x in (k, v)) if group > 1 else (k, v)
    lq, lk = q.shape[2], k.shape[2]
    mask = mask_for(lq, lk, q.device) if causal and lq != lk else None
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=causal and mask is None)
    return torch.autograd.grad(out, (q, k, v), dout)


def rel(x, ref):
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def correctness() -> int:
    failed = 0
    for dtype, b, h, hk, lq, lk, d, causal, layout in CASES:
        dt = DTYPES[dtype]
        g = torch.Generator(device=DEVICE).manual_seed(lq * 7 + lk + d)
        q, dout = (torch.randn(b, h, lq, d, device=DEVICE, generator=g).to(dt) for _ in range(2))
        k, v = (torch.randn(b, hk, lk, d, device=DEVICE, generator=g).to(dt) for _ in range(2))
        if layout == "blhd":
            q, k, v, dout = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, dout))
        refs = sdpa_grads(*(x.double() for x in (q, k, v, dout)), causal, SDPBackend.MATH)
        out, lse = tf.flash_forward(q, k, v, causal=causal, return_lse=True)
        ours = [rel(x, r) for x, r in zip(tf.flash_backward(dout, q, k, v, out, lse, causal=causal), refs)]
        theirs = None
        use_flash = not causal or lq == lk  # (torch's flash aligns is_causal top-left and takes no mask)
        for backend in ([SDPBackend.FLASH_ATTENTION] if use_flash else []) + [SDPBackend.EFFICIENT_ATTENTION]:
            try:
                theirs = [rel(x, r) for x, r in zip(sdpa_grads(q, k, v, dout, causal, backend), refs)]
            except RuntimeError:
                continue
            if all(math.isfinite(e) for e in theirs):
                break
            theirs = None
        bounds = [2 * t + 1e-3 for t in theirs] if theirs else [FALLBACK[dt]] * 3
        ok = all(e <= bound for e, bound in zip(ours, bounds))
        failed += not ok
        torch_text = " ".join(f"{e:.2e}" for e in theirs) if theirs else "n/a"
        print(f"{'PASS' if ok else 'FAIL'} {dtype:8s} B{b} H{h}/{hk} Lq{lq} Lk{lk} D{d} causal={int(causal)} {layout:6s}"
              f" ours dq/dk/dv {' '.join(f'{e:.2e}' for e in ours)}  torch {torch_text}", flush=True)
        del refs
        torch.cuda.empty_cache()
    print(f"{len(CASES) - failed} passed, {failed} failed", flush=True)
    return failed


def timing(dtype, seqlen, reps):
    b, h, d, n = 4, 32, 128, seqlen
    dt = DTYPES[dtype]
    q, k, v, dout = (torch.randn(b, h, n, d, device=DEVICE, dtype=dt) for _ in range(4))
    for causal in (False, True):
        flops = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        out, lse = tf.flash_forward(q, k, v, causal=causal, return_lse=True)
        ours = median_ms(lambda: tf.flash_backward(dout, q, k, v, out, lse, causal=causal), reps)
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref_out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        theirs = median_ms(lambda: torch.autograd.grad(ref_out, (qq, kk, vv), dout, retain_graph=True), reps)
        tiles = [getattr(kern, "best_config", None) for kern in (tf._bwd_dkdv_kernel, tf._bwd_dq_kernel)]
        print(f"{dtype} B{b} H{h} D{d} N{n} causal={int(causal)}: triton-fa2 {ours:.3f} ms {flops / ours * 1e-9:.1f} "
              f"TFLOP/s | torch-sdpa-flash {theirs:.3f} ms {flops / theirs * 1e-9:.1f} TFLOP/s | ours/torch speed "
              f"{theirs / ours:.2f}x | tiles dkdv {tiles[0]} dq {tiles[1]}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16", help="timing dtype")
    parser.add_argument("--seqlen", type=int, default=4096, help="timing sequence length")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("check_triton_backward: needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {tf.triton.__version__}", flush=True)
    failed = 0 if args.skip_correctness else correctness()
    if not args.skip_timing:
        timing(args.dtype, args.seqlen, args.reps)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
