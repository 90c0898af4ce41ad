"""Write the normalised sm_90 PTX of the forward kernels' specialisations, offline (no GPU needed).

    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/forward_ptx.py DIR [--kernels simt,mma]
        [--window L R] [--softcap C] [--varlen] [--store elements|pairs|tma]
    diff -r DIR_BEFORE DIR_AFTER        # two trees' kernels: identical files, identical code

Kernels ``simt``, ``mma`` (float16 / bfloat16 ``mma.sync``), ``tf32`` (float32 3xTF32 and plain tf32), ``wgmma``
(Hopper), ``wgmma_ws`` (Hopper, warp-specialised: every tuning candidate, the default in both dtypes) and ``fp8``
(Hopper, float8 e4m3 inputs: bfloat16 / float16 output, per-tensor and per-head descales, every tuning candidate;
``fp8_ws``: the same on ``wgmma_ws``'s fp8 variant), each at head dims 64 and 128 (and 16 / 256 where the kernel has other tiles there) with its default GPU
tiles, both input dtypes, and the variants that change its code: causal and not for ``simt`` (a compile-time flag
there), a scale <= 0 for the others. Without options the plain kernels (no window, no soft-capping, dense batches:
what kernels compiled before these existed); ``--window`` (``none`` for an unbounded side), ``--softcap`` and
``--varlen`` (packed sequences) build those specialisations instead; ``--store`` picks how ``wgmma_ws`` and
``fp8_ws`` write their output (``wgmma_ws_kernel.STORES``; default "elements", the kernel as it was before the others). The kernels are compiled as the launches type them (the SIMT
kernel's argument types are built here; the others have fixed signatures). Mangled names are normalised as
``scripts/ptx_dump.py`` does, and so are the numbers Numba gives dynamic shared arrays; ``index.txt`` lists each specialisation's hash and instruction count.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KERNELS = ("simt", "mma", "tf32", "wgmma", "wgmma_ws", "fp8", "fp8_ws")


def _variant_kwargs(window, softcap, varlen, causal):
    """The builders' ``variant=`` keyword for the options, or none for the plain kernel (the pre-variant call)."""
    if window is None and softcap is None and not varlen:
        return {}
    from numba_attn.core.mask import window_sides
    from numba_attn.forward.common import Variant

    options = {"window": window_sides(window, causal)}
    if softcap is not None:
        options["softcap"] = softcap
    if varlen:
        options["packed"] = True
    return {"variant": Variant(**options)}


def _specs(kernel, window, softcap, varlen, store="elements"):
    """``(name, py_func, argtypes, launch_bounds)`` of each specialisation of ``kernel``."""
    from numba import types

    from numba_attn.forward import mma, simt, tf32, wgmma

    def signature(module, kwargs):
        variant = kwargs.get("variant")
        if variant is None or not getattr(variant, "packed", False):
            return module.SIGNATURE.args
        return module.SIGNATURE.args + (types.Array(types.int32, 1, "A"),)  # the schedule

    if kernel == "simt":
        for d in (16, 64, 128):
            config = simt.default_config(d)
            d_pad = simt.padded_head_dim(d, config)
            for dtype in (types.float32, types.float16):
                for causal in (False, True):
                    kwargs = _variant_kwargs(window, softcap, varlen, causal)
                    built = simt.flash_forward_kernel(config, d_pad, causal, **kwargs)
                    array = types.Array(dtype, 4, "A")
                    argtypes = (array, array, array, array, types.Array(types.float32, 3, "A"), types.boolean,
                                types.float32)
                    if varlen:  # the schedule
                        argtypes += (types.Array(types.int32, 1, "A"),)
                    yield (f"simt_d{d}_{dtype}_{'causal' if causal else 'full'}", built.py_func, argtypes,
                           (config.threads, config.blocks_per_sm))
    elif kernel == "mma":
        kwargs = _variant_kwargs(window, softcap, varlen, False)
        for d in (64, 128, 256):
            config = mma.DEFAULT_CONFIG
            tiles = mma.tiles_for(config, mma.padded_head_dim(d, config))
            for bf16 in (False, True):
                for vector_loads, scale_first in ((True, False), (False, False), (True, True)):
                    if (not vector_loads or scale_first) and (d != 128 or bf16):
                        continue  # the rarer variants once
                    if scale_first and softcap is not None:
                        continue  # (capped kernels never scale first)
                    name = (f"mma_d{d}_{'bf16' if bf16 else 'f16'}_{'vec' if vector_loads else 'elem'}"
                            f"{'_scalefirst' if scale_first else ''}")
                    yield (name, mma._kernel_source(tiles, bf16, vector_loads, scale_first, **kwargs),
                           signature(mma, kwargs), config.launch_bounds())
    elif kernel == "tf32":
        kwargs = _variant_kwargs(window, softcap, varlen, False)
        for d in (64, 128, 256):
            for tf32_only in (False, True):
                config = tf32.gpu_config(d, tf32_only)
                tiles = tf32.tiles_for(config, tf32.padded_head_dim(d, config), tf32_only)
                yield (f"tf32_d{d}_{'tf32' if tf32_only else '3xtf32'}",
                       tf32._kernel_source(tiles, tf32_only, True, False, **kwargs), signature(tf32, kwargs),
                       config.launch_bounds())
    elif kernel == "wgmma":
        kwargs = _variant_kwargs(window, softcap, varlen, False)
        config = wgmma.DEFAULT_CONFIG
        for d in (64, 128):
            for bf16 in (False, True):
                for scale_first in (False, True):
                    if scale_first and (bf16 or softcap is not None):
                        continue
                    yield (f"wgmma_d{d}_{'bf16' if bf16 else 'f16'}{'_scalefirst' if scale_first else ''}",
                           wgmma._kernel_source(config, d, bf16, scale_first, **kwargs), signature(wgmma, kwargs),
                           (wgmma.THREADS, config.blocks_per_sm))
    elif kernel == "wgmma_ws":
        from numba_attn.forward import wgmma_ws

        kwargs = _variant_kwargs(window, softcap, varlen, False)
        for config in wgmma_ws.TUNING_CANDIDATES:
            if varlen and config.persistent:
                continue  # (packed sequences: one block per schedule entry)
            tag = (f"c{config.consumers}_n{config.block_n}_s{config.stages}{'' if config.pingpong else '_nopp'}"
                   f"{'_persistent' if config.persistent else ''}")
            for d in (64, 128):
                if not wgmma_ws.usable(config, d):
                    continue
                for bf16 in (False, True):
                    for scale_first in (False, True):
                        if (scale_first or bf16) and (config != wgmma_ws.DEFAULT_CONFIG or
                                                      (scale_first and (bf16 or softcap is not None))):
                            continue
                        yield (f"wgmma_ws_{tag}_d{d}_{'bf16' if bf16 else 'f16'}{'_scalefirst' if scale_first else ''}",
                               wgmma_ws._kernel_source(config, d, bf16, scale_first, store=store, **kwargs),
                               (wgmma_ws.PACKED_SIGNATURE if varlen else wgmma_ws.SIGNATURE).args,
                               (config.threads, 1))
    elif kernel == "fp8":
        from numba_attn.forward import wgmma_fp8

        if varlen:
            return
        kwargs = _variant_kwargs(window, softcap, False, False)
        for config in wgmma_fp8.TUNING_CANDIDATES:
            for d in (64, 128):
                for bf16, scale_first, per_head in ((True, False, False), (False, False, True), (True, True, False)):
                    if (scale_first and softcap is not None) or (config != wgmma_fp8.DEFAULT_CONFIG and not bf16):
                        continue
                    name = (f"fp8_n{config.block_n}{'_ldm' if config.v_transpose == 'ldmatrix' else ''}_d{d}_"
                            f"{'bf16' if bf16 else 'f16'}{'_perhead' if per_head else ''}"
                            f"{'_scalefirst' if scale_first else ''}")
                    yield (name, wgmma._kernel_source(config, d, bf16, scale_first, fp8=True, per_head=per_head,
                                                      **kwargs),
                           wgmma_fp8.SIGNATURE.args, (wgmma_fp8.THREADS, config.blocks_per_sm))
    elif kernel == "fp8_ws":
        from numba_attn.forward import wgmma_ws, wgmma_ws_fp8

        if varlen:
            return
        kwargs = _variant_kwargs(window, softcap, False, False)
        for config in wgmma_ws_fp8.TUNING_CANDIDATES:
            tag = (f"c{config.consumers}_n{config.block_n}_s{config.stages}{'' if config.pingpong else '_nopp'}"
                   f"{'_persistent' if config.persistent else ''}")
            for d in (64, 128):
                for bf16, scale_first, per_head in ((True, False, False), (False, False, True), (True, True, False)):
                    if (scale_first and softcap is not None) or (config != wgmma_ws_fp8.DEFAULT_CONFIG and not bf16):
                        continue
                    name = (f"fp8_ws_{tag}_d{d}_{'bf16' if bf16 else 'f16'}{'_perhead' if per_head else ''}"
                            f"{'_scalefirst' if scale_first else ''}")
                    yield (name, wgmma_ws._kernel_source(config, d, bf16, scale_first, fp8=True, per_head=per_head,
                                                         store=store, **kwargs),
                           wgmma_ws_fp8.SIGNATURE.args, (config.threads, 1))
    else:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")


def _ptxas(path: str) -> str:
    """``ptxas -v`` of one PTX file for sm_90a: registers, stack frame and spills."""
    import shutil
    import subprocess
    import tempfile

    ptxas = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")
    with open(path) as f:  # (compiled for sm_90; wgmma needs the "a" target, as the launches compile it)
        ptx = re.sub(r"^\.target sm_90$", ".target sm_90a", f.read(), flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    if res.returncode:
        return "ptxas FAILED: " + res.stderr.strip().splitlines()[-1]
    return " ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                    if "Used" in line or "spill" in line or "warning" in line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for the PTX files and index.txt")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--window", nargs=2, metavar=("LEFT", "RIGHT"))
    parser.add_argument("--softcap", type=float)
    parser.add_argument("--varlen", action="store_true")
    parser.add_argument("--store", default="elements", help="wgmma_ws, fp8_ws: how the output is written")
    parser.add_argument("--ptxas", action="store_true", help="also assemble each for sm_90a: registers and spills")
    args = parser.parse_args()
    import numba_attn  # noqa: F401  (decides simulator or not before numba.cuda is imported)
    from numba_attn.runtime.device import SIMULATOR, cuda

    if SIMULATOR:
        print("needs NUMBA_ENABLE_CUDASIM=0 (Numba's compiler, no GPU needed)")
        return 1
    import numba.cuda.dispatcher as dispatcher

    from ptx_dump import normalise

    class _Sm90:  # device functions ask the current device for its compute capability; there is none
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    window = None if args.window is None else tuple(None if s == "none" else int(s) for s in args.window)
    os.makedirs(args.out, exist_ok=True)
    lines = []
    for kernel in args.kernels.split(","):
        for name, py_func, argtypes, launch_bounds in _specs(kernel, window, args.softcap, args.varlen, args.store):
            t0 = time.time()
            ptx, _ = cuda.compile_ptx(py_func, argtypes, cc=(9, 0), launch_bounds=launch_bounds)
            # (dynamic shared arrays are numbered in the order the process built them)
            ptx = re.sub(r"_cudapy_smem_[0-9]+", "_cudapy_smem_N", normalise(ptx))
            with open(os.path.join(args.out, name + ".ptx"), "w") as f:
                f.write(ptx)
            count = sum(1 for line in ptx.splitlines() if line.strip().endswith(";"))
            lines.append(f"{name} {hashlib.sha256(ptx.encode()).hexdigest()[:16]} {count} instructions")
            if "wgmma.mma_async" in ptx and "wgmma.fence" in ptx:
                lines[-1] += f", {ptx.count('wgmma.mma_async')} wgmma"
            if args.ptxas:
                lines[-1] += " | " + _ptxas(os.path.join(args.out, name + ".ptx"))
            print(f"{lines[-1]} ({time.time() - t0:.0f}s)", flush=True)
    with open(os.path.join(args.out, "index.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
