"""Write the normalised sm_90 PTX of the decode split kernels' specialisations, offline (no GPU needed).

    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/decode_ptx.py DIR [--kv] [--ptxas]
    diff -r DIR_BEFORE DIR_AFTER        # two trees' kernels: identical files, identical code

Without ``--kv``: the kernels ``flash_decode`` compiled before KV-cache options existed -- the tensor-core split
kernel (``decode.mma``: head dims 64, 128 and 256, float16 and bfloat16, vector and element loads) and the SIMT split
kernel (``decode.simt``: head dims 64 and 128, one and eight rows per pass, causal or not, float32 / float16 /
bfloat16, parts or the output written directly). With ``--kv``: six of them specialised for each of
``decode.kvcache.KV_SPECS`` (ragged lengths, paged caches, a window, softcap, all four), which must compile. With
``--ptxas`` each is assembled by ``ptxas -v`` (registers, spills). The kernels are typed as the launch passes their
arguments (arrays of layout "A"). Mangled names are normalised as ``scripts/ptx_dump.py`` does, and static shared
arrays by first appearance; ``index.txt`` lists each specialisation's hash and instruction count.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


_SHARED = re.compile(r"_cudapy_smem_[0-9]+")


def _normalised(ptx: str) -> str:
    """``ptx_dump.normalise``, and static shared arrays numbered by first appearance (Numba numbers them across
    every kernel the process compiled)."""
    from ptx_dump import normalise

    names: dict = {}
    return _SHARED.sub(lambda m: names.setdefault(m.group(0), f"SMEM{len(names)}"), normalise(ptx))


def _ptxas(ptx: str) -> str:
    ptxas = shutil.which("ptxas") or "/usr/local/bin/ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    if done.returncode:
        return "ptxas FAILED: " + done.stderr[-500:]
    return " | ".join(line.split("info    :")[-1].strip() for line in done.stderr.splitlines()
                      if "Used" in line or "spill" in line)


def _specs(kv: bool):
    """(name, python function, argument types, launch bounds) of every specialisation: the default ones, or with
    ``kv`` a few of them (``_KV_SUBSET``: each takes seconds to compile) with each ``KV_SPECS`` entry."""
    from numba_attn.decode.kvcache import KV_SPECS

    for kv_options in (KV_SPECS if kv else (None,)):
        suffix = "" if kv_options is None else "_" + kv_options.name
        for name, fn, argtypes, bounds in _specs_of(kv_options):
            if kv_options is None or name in _KV_SUBSET:
                yield name + suffix, fn, argtypes, bounds


#: the default specialisations also compiled with each ``KV_SPECS`` entry under ``--kv``
_KV_SUBSET = ("mma_d128_f16_vec", "mma_d64_bf16_elem", "mma_d256_f16_vec", "simt_d128_r1_full_float16_out",
              "simt_d128_r8_causal_bfloat16_parts", "simt_d64_r8_full_float32_parts")


def _specs_of(kv_options):
    from numba import types

    from numba_attn.decode import mma, simt

    for d in (64, 128, 256):
        config = mma.config_for(d)
        layout = mma.layout_for(config, mma.padded_head_dim(d))
        for bf16 in (False, True):
            for vector_loads in ((True, False) if d != 256 else (True,)):
                source = mma._kernel_source(layout, bf16, vector_loads, False, kv_options)
                name = f"mma_d{d}_{'bf16' if bf16 else 'f16'}_{'vec' if vector_loads else 'elem'}"
                yield name, source, mma.signature_for(kv_options).args, (config.threads, config.blocks_per_sm)
    config = simt.GPU_CONFIG
    f32 = types.float32
    for d in (64, 128):
        lanes, cols = simt.key_group_layout(config, d)
        for rows in (1, 8):
            for causal in (False, True):
                for dtype, bf16_out, parts in (("float32", False, True), ("float16", False, False),
                                               ("bfloat16", False, True), ("bfloat16", True, False)):
                    bf16 = dtype == "bfloat16"
                    kernel = simt.split_kernel(config, lanes, cols, rows, causal, bf16, bf16_out, kv_options)
                    elem = types.uint16 if bf16 else getattr(types, dtype)
                    out = types.float32 if parts else (types.uint16 if bf16_out else elem)
                    array = types.Array(elem, 4, "A")
                    argtypes = (array, array, array, types.Array(out, 5, "A"), types.Array(f32, 4, "A"),
                                types.boolean, f32) + simt.kv_argument_types(kv_options)
                    name = f"simt_d{d}_r{rows}_{'causal' if causal else 'full'}_{dtype}_{'parts' if parts else 'out'}"
                    yield name, kernel.py_func, argtypes, (config.threads, simt.min_blocks_per_sm(config.threads, rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for the PTX files and index.txt")
    parser.add_argument("--kv", action="store_true", help="the KV-cache specialisations instead of the default ones")
    parser.add_argument("--ptxas", action="store_true", help="assemble each with ptxas -v (registers, spills)")
    parser.add_argument("--only", default="", help="names containing this")
    args = parser.parse_args()
    import numba_attn  # noqa: F401  (decides simulator or not before numba.cuda is imported)
    from numba_attn.runtime.device import SIMULATOR, cuda

    if SIMULATOR:
        print("needs NUMBA_ENABLE_CUDASIM=0 (Numba's compiler, no GPU needed)")
        return 1
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:  # device functions ask the current device for its compute capability; there is none
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    os.makedirs(args.out, exist_ok=True)
    lines = []
    failed = 0
    for name, fn, argtypes, bounds in _specs(args.kv):
        if args.only not in name:
            continue
        try:
            ptx, _ = cuda.compile_ptx(fn, argtypes, cc=(9, 0), launch_bounds=bounds)
        except Exception as exc:  # noqa: BLE001
            failed += 1
            lines.append(f"{name} ERROR {type(exc).__name__}: {str(exc)[:2000]}")
            print(lines[-1], flush=True)
            continue
        ptx = _normalised(ptx)
        with open(os.path.join(args.out, name + ".ptx"), "w") as f:
            f.write(ptx)
        count = sum(1 for line in ptx.splitlines() if line.strip().endswith(";"))
        line = f"{name} {hashlib.sha256(ptx.encode()).hexdigest()[:16]} {count} instructions"
        if args.ptxas:
            info = _ptxas(ptx)
            failed += info.startswith("ptxas FAILED")
            line += " | " + info
        lines.append(line)
        print(line, flush=True)
    with open(os.path.join(args.out, "index.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
