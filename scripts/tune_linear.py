"""Time the chunked linear-attention kernel's configurations on this GPU (a tuning aid, not the benchmark).

    python scripts/tune_linear.py --seqlen 1024 4096 16384 --dtype float16 float32

It also times both kernels of the chunked causal product (``kernel="registers"``: ``mma`` / ``mma_f32``;
``"shared"``: ``shared_state``), float32 also with ``allow_tf32``.

For each ``ChunkConfig`` tried, prints the median time of ``causal_dot_product`` next to the sequential kernel and
to fla's ``chunk_linear_attn`` / ``fused_recurrent_linear_attn`` on the same inputs (fla when installed), with each
result's relative error against a float64 reference computed on a slice of the heads. The benchmark of record is
scripts/sweep.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numba_attn  # noqa: E402
import reference  # noqa: E402
from _timing import median_ms  # noqa: E402
from numba_attn.linear import launch as linear_chunked  # noqa: E402
from numba_attn.linear import shared_state  # noqa: E402

VARIANTS = {
    "default": {},
    "plan by blocks/SM 3": {"wave_plan": False},
    "blocks/SM 2": {"blocks_per_sm": 2},
    "blocks/SM 6": {"blocks_per_sm": 6},
    "one segment": {"blocks_per_sm": 0},
    "launch bound 2": {"min_blocks_per_sm": 2},
    "launch bound 3": {"min_blocks_per_sm": 3},
    "no presplit, launch bound 3": {"presplit": False, "min_blocks_per_sm": 3},
    "no presplit": {"presplit": False},
    "2 warps": {"warps": 2},
    "8 warps": {"warps": 8},
    "cols 32": {"block_cols": 32},
}


def _time(fn, reps):
    return median_ms(fn, reps, warmup=3)


def _error(out, ref, heads):
    got = out[:, :heads].float().cpu().numpy().astype(np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _launcher(q, k, v):
    """The chunked kernels on prepared Numba views, without the public API's array handling: the difference to the
    public call's time is host overhead."""
    import torch
    from numba import cuda

    out = torch.empty_like(v)
    views = [cuda.as_cuda_array(x.view(torch.int16) if x.dtype == torch.bfloat16 else x) for x in (q, k, v, out)]
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    scratch = {}

    def make(shape):
        if shape not in scratch:
            scratch[shape] = cuda.device_array(shape, dtype=np.float32)
        return scratch[shape]

    return lambda: linear_chunked.launch_causal(*views, stream, scratch=make)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64, help="E = M")
    parser.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--dtype", nargs="+", default=["float16", "float32"])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    if numba_attn.SIMULATOR:
        raise SystemExit("tune_linear.py needs a GPU")
    import torch

    try:
        from bench.peers import fla_linear
    except Exception as exc:  # noqa: BLE001
        print(f"fla not available: {exc}")
        fla_linear = None
    original = shared_state.GPU_CONFIG
    for dtype in args.dtype:
        for n in args.seqlen:
            torch.manual_seed(n)
            shape = (args.batch, args.heads, n, args.dim)
            q, k, v = (torch.randn(shape, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
            ref = reference.causal_dot_product(*(x[:, :1].double().cpu().numpy() for x in (q, k, v)),
                                               method="chunked", chunk_size=256)
            rows = []
            for name in args.variants:
                config = dataclasses.replace(original, **VARIANTS[name])
                if config.blocks_per_sm == 0:
                    config = dataclasses.replace(config, blocks_per_sm=1, min_segment_chunks=1 << 30)
                shared_state.GPU_CONFIG = config
                try:
                    out = numba_attn.causal_dot_product(q, k, v, backend="chunked")
                    rows.append((f"chunked {name}", _time(lambda: numba_attn.causal_dot_product(
                        q, k, v, backend="chunked"), args.reps), _error(out, ref, 1)))
                except Exception as exc:  # noqa: BLE001  (a variant may not fit: report and go on)
                    rows.append((f"chunked {name}", float("nan"), f"{type(exc).__name__}: {exc}"[:90]))
                finally:
                    shared_state.GPU_CONFIG = original
            for kernel in linear_chunked.KERNELS:  # both kernels of the causal product (default: "registers")
                for tf32 in ((False, True) if dtype == "float32" else (False,)):
                    launch = linear_chunked.launch_causal
                    linear_chunked.launch_causal = functools.partial(launch, kernel=kernel)
                    label = f"chunked kernel={kernel}" + (" tf32" if tf32 else "")
                    try:
                        out = numba_attn.causal_dot_product(q, k, v, backend="chunked", allow_tf32=tf32)
                        rows.append((label, _time(lambda: numba_attn.causal_dot_product(
                            q, k, v, backend="chunked", allow_tf32=tf32), args.reps), _error(out, ref, 1)))
                    finally:
                        linear_chunked.launch_causal = launch
            rows.append(("chunked launches only", _time(_launcher(q, k, v), args.reps), "no array handling"))
            if dtype != "bfloat16":  # the sequential kernel takes float16 and float32
                out = numba_attn.causal_dot_product(q, k, v, backend="recurrent")
                rows.append(("recurrent", _time(lambda: numba_attn.causal_dot_product(q, k, v, backend="recurrent"),
                                                max(3, args.reps // 5)), _error(out, ref, 1)))
            if fla_linear is not None:
                tq, tk, tv = (fla_linear.to_fla_layout(x) for x in (q, k, v))
                for name, fn in fla_linear.KERNELS.items():
                    out = fla_linear.from_fla_layout(fn(tq, tk, tv))
                    reps = args.reps if name == "chunk" else max(3, args.reps // 5)
                    rows.append((f"fla {name}", _time(lambda fn=fn: fn(tq, tk, tv), reps), _error(out, ref, 1)))
            print(f"\nB={args.batch} H={args.heads} N={n} E=M={args.dim} {dtype}", flush=True)
            best_fla = min((ms for name, ms, _ in rows if name == "fla chunk"), default=float("nan"))
            for name, ms, err in rows:
                ratio = ms / best_fla if best_fla == best_fla else float("nan")
                err_text = err if isinstance(err, str) else f"rel err {err:.2e}"
                print(f"  {ms:9.3f} ms  {ratio:6.2f}x fla-chunk  {err_text}  {name}", flush=True)


if __name__ == "__main__":
    main()
