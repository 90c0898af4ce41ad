"""Time the flash kernels' tile configurations on this GPU (a tuning aid, not the benchmark).

    python scripts/tune_flash.py --seqlen 4096 --headdim 64 128 --dtype float32
    python scripts/tune_flash.py --kernel mma --dtype float16 --mma 4:64:8 8:64:8 --causal

Prints, for each configuration tried, the median time and TFLOP/s next to torch SDPA on the same inputs (if torch
is installed; its flash backend for 16-bit inputs), and for ``mma`` the output's relative difference to SDPA's.
``--mma warps:m_tiles:block_n:min_warps`` is MmaConfig(warps, m_tiles, block_n, min_warps=min_warps). The
benchmark of record is scripts/sweep.py.
"""
from __future__ import annotations

import argparse
import itertools

import numpy as np

import numba_attn
from numba_attn.forward import mma as flash_mma
from numba_attn.forward import simt as flash_simt


def _time(fn, reps=20):
    from _timing import median_ms  # (this script's folder is on sys.path when it runs)

    return median_ms(fn, reps, warmup=3)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--kernel", choices=("simt", "mma"), default="simt")
    parser.add_argument("--mma", nargs="+", default=["4:2:64:8", "8:1:64:8"], help="warps:m_tiles:block_n:min_warps")
    args = parser.parse_args()
    if numba_attn.SIMULATOR:
        raise SystemExit("tune_flash.py needs a GPU")
    import cupy
    from numba import cuda

    simt_configs = [
        flash_simt.SimtConfig(threads_x=tx, threads_y=ty, rows_per_thread=rm, keys_per_thread=rn, blocks_per_sm=bps)
        for (tx, ty, rm, rn, bps) in [
            (8, 16, 8, 8, 1), (16, 16, 8, 4, 1), (16, 8, 8, 4, 1), (16, 8, 8, 8, 1),
            (16, 16, 8, 8, 1), (8, 32, 4, 8, 1), (16, 16, 4, 8, 2), (8, 16, 8, 4, 2),
        ]
    ]
    rng = np.random.default_rng(0)
    for head_dim in args.headdim:
        if args.kernel == "mma":
            configs = []
            for spec in args.mma:
                warps, m_tiles, block_n, min_warps = (int(x) for x in spec.split(":"))
                configs.append(flash_mma.MmaConfig(warps=warps, m_tiles=m_tiles, block_n=block_n, min_warps=min_warps))
            launch = flash_mma.launch
        else:
            configs, launch = simt_configs, flash_simt.launch
        shape = (args.batch, args.heads, args.seqlen, head_dim)
        q, k, v = (cupy.asarray(rng.standard_normal(shape).astype(args.dtype)) for _ in range(3))
        out = cupy.empty_like(q)
        flops = 4 * args.batch * args.heads * args.seqlen**2 * head_dim * (0.5 if args.causal else 1.0)
        lse = cupy.empty((1, 1, 1), np.float32)
        rows = []
        outputs = {}
        for config in configs:
            stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)

            def run(config=config, stream=stream):
                launch(q, k, v, out, lse, False, head_dim**-0.5, args.causal, stream, config)

            try:
                out.fill(np.nan)
                ms = _time(run)
                rows.append((str(config), ms, flops / ms / 1e9))
                outputs[str(config)] = out.copy()
            except Exception as exc:  # a config can fail to compile or launch (too many registers, shared memory)
                rows.append((str(config), float("nan"), f"{type(exc).__name__}: {exc}"[:80]))
        try:
            import torch
            tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backends = [SDPBackend.FLASH_ATTENTION] if args.dtype in ("float16", "bfloat16") else list(SDPBackend)
            with sdpa_kernel(backends):
                sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
                ms = _time(sdpa)
                peer = cupy.asarray(sdpa()).astype(np.float32)
            rows.append((f"torch SDPA ({'flash' if len(backends) == 1 else 'default'} backend)", ms, flops / ms / 1e9))
            for name, o in outputs.items():
                diff = float(cupy.linalg.norm(o.astype(np.float32) - peer) / cupy.linalg.norm(peer))
                rows.append((f"  {name}: |out - SDPA| / |SDPA| = {diff:.2e}", float("nan"), ""))
        except Exception as exc:
            rows.append(("torch SDPA", float("nan"), str(exc)[:80]))
        print(f"\nB={args.batch} H={args.heads} N={args.seqlen} D={head_dim} {args.dtype} causal={args.causal}")
        for name, ms, tflops in rows:
            print(f"  {ms:9.3f} ms  {tflops if isinstance(tflops, str) else f'{tflops:7.1f} TFLOP/s'}  {name}")


if __name__ == "__main__":
    main()
