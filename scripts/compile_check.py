"""Compile GPU kernels for sm_90 offline (no GPU needed): Numba's typing and lowering errors show here, which the
simulator never meets.

    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/compile_check.py [FAMILY ...] [--out DIR]

Families: ``backward`` (preprocess, the SIMT dK/dV and dQ kernels, convert: each specialisation its launch can
build, with the argument types it passes -- 4-d arrays of the input dtype, layout "A"; float32 lse / delta /
accumulators), ``tma`` (the TMA smoke kernel of ``check_tma.py`` and the tensor-map writer) and ``ws`` (the
warp-specialised Hopper forward, ``forward.wgmma_ws``); ``backward_variants``: the SIMT backward kernels'
specialisations of a sliding window, soft-capping and packed sequences (the tensor-core ones compile in the GPU
tests, ``tests/backward/test_flash_backward_variants.py``); ``linear_backward``: the linear-attention layer
backward's small kernels (every dtype, causal and non-causal flavours); ``linear_backward_call``: exactly the
kernels one non-causal float16 ``linear_attention_backward`` call (B4 H8 N4096 E = M = 64) compiles -- its count
and total seconds measure that call's cold start offline. Prints one line per kernel (``OK`` with its instruction
count and compile seconds, or ``FAIL`` and the error's first lines), then the total time; exit status 1 if any
failed. ``--out`` also writes the PTX;
``--ptxas`` assembles each for sm_90a and adds registers, spills and warnings (C7508: setmaxnreg ignored; C7510,
C7513, C7514 ...: "Potential Performance Loss", wgmma serialised -- an info line of ptxas, not a warning -- both
count as failures).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _ptxas(ptx: str) -> str:
    """``ptxas -v`` of PTX text for sm_90a: registers, spills and warnings on one line."""
    import re
    import shutil
    import subprocess
    import tempfile

    ptxas = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")
    ptx = re.sub(r"^\.target sm_90$", ".target sm_90a", ptx, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "k.ptx"), "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    if res.returncode:
        return "ptxas FAILED: " + " ".join(res.stderr.strip().splitlines()[-3:])
    return " ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                    if "Used" in line or "spill" in line or "warning" in line or "Performance Loss" in line)


def _fake_sm90():
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:  # device functions ask the current device for its compute capability; there is none
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()


def backward_cases():
    """(name, kernel, argument types, launch bounds) of every backward kernel the launches build."""
    from numba import types

    from numba_attn.backward import convert, preprocess, simt

    f32 = types.float32
    arr4 = lambda dtype: types.Array(dtype, 4, "A")  # noqa: E731
    arr3 = types.Array(f32, 3, "A")
    cases = []
    for zero in (False, True):
        config = preprocess.GPU_CONFIG
        for dtype in (types.float16, f32):
            # (out, dout, delta as the unread lse, delta, dq_acc or out)
            cases.append((f"preprocess_{dtype}_zero{int(zero)}", preprocess.preprocess_kernel(config, zero),
                          (arr4(dtype), arr4(dtype), arr3, arr3, arr4(f32) if zero else arr4(dtype)),
                          (config.threads_x * config.threads_y, 1)))
    config = preprocess.GPU_VECTOR_CONFIG  # 16-byte rows, stats for the tensor-core kernels: (out, dout, lse, stats, dq)
    for bf16 in (False, True):
        for zero in (False, True):
            u16 = arr4(types.uint16)
            cases.append((f"preprocess_vector_{'bf16' if bf16 else 'f16'}_zero{int(zero)}",
                          preprocess.preprocess_kernel(config, zero, bf16, True, True),
                          (u16, u16, arr3, arr4(f32), arr4(f32) if zero else u16),
                          (config.threads_x * config.threads_y, 1)))
    tx, ty = convert.GPU_BLOCK
    cases.append(("convert_f16", convert.convert_kernel(tx, ty), (arr4(f32), arr4(types.float16)), (tx * ty, 1)))
    for config in simt.GPU_CONFIGS:
        for d in (64, 128, 256):
            pad = simt.padded_head_dim(d, config)
            for dtype in (types.float16, f32):
                a = arr4(dtype)
                for causal in (False, True):
                    bounds = (config.threads, config.blocks_per_sm)
                    tag = f"t{config.threads_x}x{config.threads_y}_r{config.rows_per_thread}_d{d}_{dtype}_c{int(causal)}"
                    for atomic in (False, True):
                        cases.append((f"dkdv_{tag}_atomic{int(atomic)}", simt.dkdv_kernel(config, pad, causal, atomic),
                                      (a, a, a, a, arr3, arr3, arr4(f32), a, a, f32, f32), bounds))
                    cases.append((f"dq_{tag}", simt.dq_kernel(config, pad, causal),
                                  (a, a, a, a, arr3, arr3, a, f32, f32), bounds))
    return cases


def backward_variant_cases():
    """The SIMT backward kernels' window / softcap / packed specialisations, float16 and float32, head dims 64 / 256."""
    from numba import types

    from numba_attn.backward import simt
    from numba_attn.forward.common import Variant

    f32 = types.float32
    arr3 = types.Array(f32, 3, "A")
    schedule = types.Array(types.int32, 1, "A")
    variants = {"window": Variant(window=(256, 0)), "window2": Variant(window=(100, 37)),
                "softcap": Variant(softcap=30.0), "packed": Variant(packed=True),
                "all": Variant(window=(256, 0), softcap=30.0, packed=True)}
    cases = []
    config = simt.GPU_CONFIG
    bounds = (config.threads, config.blocks_per_sm)
    for name, variant in variants.items():
        extra = (schedule,) if variant.packed else ()
        for d in (64, 256):
            pad = simt.padded_head_dim(d, config)
            for dtype in (types.float16, f32):
                a = types.Array(dtype, 4, "A")
                tag = f"{name}_d{d}_{dtype}"
                cases.append((f"dkdv_{tag}", simt.dkdv_kernel(config, pad, True, True, variant),
                              (a, a, a, a, arr3, arr3, types.Array(f32, 4, "A"), a, a, f32, f32) + extra, bounds))
                cases.append((f"dq_{tag}", simt.dq_kernel(config, pad, False, variant),
                              (a, a, a, a, arr3, arr3, a, f32, f32) + extra, bounds))
    return cases




def tma_cases():
    """The TMA smoke kernel of ``scripts/check_tma.py`` (two shapes) and the tensor-map writer."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import check_tma

    from numba_attn.runtime import tensor_map

    cases = []
    for rows, atoms in ((64, 1), (128, 2)):
        kernel, _ = check_tma.tile_kernel(rows, atoms, 3)
        cases.append((f"check_tile_r{rows}_a{atoms}", kernel, kernel.signature.args, (check_tma.THREADS, 1)))
    writer = tensor_map._map_writer()
    cases.append(("tensor_map_writer", writer, writer.signature.args, (32, 1)))
    return cases


def ws_cases():
    """Every specialisation of the warp-specialised Hopper forward (``forward.wgmma_ws``) that ``scripts/forward_ptx.py
    --kernels wgmma_ws`` builds."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from forward_ptx import _specs

    return [(name, py_func, argtypes, bounds) for name, py_func, argtypes, bounds in _specs("wgmma_ws", None, None,
                                                                                           False)]


def _layer_backward_kernels(dtype: str, key_sums: bool, layout: str):
    """(name, kernel, argument types, launch bounds) of the layer backward's small kernels for ``dtype`` inputs, the
    non-causal flavour (``key_sums``: the normaliser from column sums) or the causal one; arrays of ``layout``."""
    from numba import types

    from numba_attn.linear import column_sums
    from numba_attn.linear import layer_backward as lb

    f32 = types.Array(types.float32, 4, layout)
    raw = f32 if dtype == "float32" else types.Array(types.uint16, 4, layout)
    cfg = lb.GPU_CONFIG
    bounds = (cfg.threads, lb.ROW_KERNEL_BLOCKS)
    tag = f"{dtype}_{'keysums' if key_sums else 'products'}"
    cases = [(f"prepare_{tag}", lb.prepare_kernel(dtype, cfg.threads, cfg.row_threads, not key_sums),
              (raw, raw, raw, f32, f32, f32, f32), bounds),
             (f"rows_{tag}", lb.rows_kernel(dtype, cfg.row_threads, cfg.rows_per_block, key_sums),
              (f32, f32, raw, types.float32, f32, f32), (cfg.row_threads * cfg.rows_per_block,)),
             (f"finish_{tag}", lb.finish_kernel(dtype, cfg.threads, cfg.row_threads, key_sums),
              (f32, f32, raw, raw, f32, f32, raw, raw, f32, raw, f32), bounds)]
    if key_sums and dtype == "float16":  # (the same kernel for every dtype: float32 intermediates)
        warps = column_sums.GPU_CONFIG.warps
        cases.append(("column_sums", column_sums.column_sums_kernel(warps),
                      (f32, f32, types.boolean, f32, types.int64), (32 * warps, column_sums.BLOCKS_PER_SM)))
    return cases


def linear_backward_cases():
    """The layer backward's small kernels (``linear.layer_backward``, ``linear.column_sums``): every dtype, both
    flavours (non-causal with column sums, causal with the normaliser's products), strided arrays (layout "A")."""
    return [case for dtype in ("float16", "bfloat16", "float32") for key_sums in (True, False)
            for case in _layer_backward_kernels(dtype, key_sums, "A")]


def linear_backward_call_cases():
    """The kernels one ``linear_attention_backward`` call of float16 B4 H8 N4096 E = M = 64 compiles with its defaults
    (non-causal, chunked, 3xTF32 products): the layer's small kernels and the shared-state passes of its product,
    with the argument types the launches pass (contiguous scratch and inputs: layout "C"). The count and the seconds
    of this family are the offline measure of that call's cold start (issue #27)."""
    from numba import types

    from numba_attn.linear import shared_state
    from numba_attn.linear.chunk_plan import APPLY, STATES

    cases = _layer_backward_kernels("float16", True, "C")
    config = shared_state.GPU_CONFIG
    prefix = shared_state.prefix_kernel(config.prefix_threads)
    cases.append(("prefix", prefix, (types.Array(types.float32, 3, "C"), types.int64, types.Array(types.float32, 4, "A"),
                                     types.boolean, types.int64, types.int64, types.boolean, types.boolean),
                  (config.prefix_threads, 1)))
    tiles = shared_state.tiles_for(config, 64, 64, False, 227 * 1024)  # (the numerator's operands, all E = M = 64)
    for mode, label in ((STATES, "states"), (APPLY, "apply")):
        kernel = shared_state.chunk_kernel(tiles, mode, "float32", True, False, True)
        cases.append((f"shared_state_{label}_e64_m64", kernel, shared_state.signature("float32").args,
                      (32 * tiles.warps, tiles.min_blocks)))
    return cases


FAMILIES = {"backward": backward_cases, "backward_variants": backward_variant_cases, "tma": tma_cases,
            "ws": ws_cases, "linear_backward": linear_backward_cases, "linear_backward_call": linear_backward_call_cases}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", default=["backward"], choices=list(FAMILIES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--first", type=int, default=0, help="only the first N kernels of each family (0: all)")
    parser.add_argument("--ptxas", action="store_true", help="also assemble each for sm_90a (registers, spills, "
                        "warnings; a setmaxnreg or wgmma-serialisation warning counts as a failure)")
    args = parser.parse_args()
    import numba_attn  # noqa: F401  (decides simulator or not before numba.cuda is imported)
    from numba_attn.runtime.device import SIMULATOR, cuda

    if SIMULATOR:
        print("needs NUMBA_ENABLE_CUDASIM=0 (Numba's compiler, no GPU needed)")
        return 1
    _fake_sm90()
    failed = 0
    started, cpu, compiled = time.perf_counter(), time.process_time(), 0
    for family in args.families:
        cases = FAMILIES[family]()
        for name, kernel, argtypes, bounds in cases[:args.first or None]:
            try:
                t0 = time.perf_counter()
                ptx, _ = cuda.compile_ptx(getattr(kernel, "py_func", kernel), argtypes, cc=(9, 0),
                                          launch_bounds=bounds)
            except Exception as error:  # noqa: BLE001 - reported per kernel
                failed += 1
                first = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
                print(f"FAIL {family}/{name}: " + " | ".join(line.strip() for line in first[:6]), flush=True)
                continue
            seconds = time.perf_counter() - t0
            compiled += 1
            count = sum(1 for line in ptx.splitlines() if line.strip().endswith(";"))
            extra = ""
            if args.ptxas:
                extra = " | " + _ptxas(ptx)
                failed += "FAILED" in extra or "C7508" in extra or "Performance Loss" in extra
            print(f"OK   {family}/{name}: {count} instructions, {seconds:.2f} s{extra}", flush=True)
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, f"{family}_{name}.ptx"), "w") as handle:
                    handle.write(ptx)
    print(f"{failed} failed; {compiled} kernels compiled to PTX in {time.perf_counter() - started:.1f} s "
          f"({time.process_time() - cpu:.1f} s of CPU; compile_ptx only, ptxas excluded)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
