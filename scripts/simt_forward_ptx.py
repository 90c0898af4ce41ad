"""Write the normalised sm_90 PTX of the SIMT forward kernel's specialisations, offline (no GPU needed).

    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/simt_forward_ptx.py DIR [--window L R]
    diff -r DIR_BEFORE DIR_AFTER        # two trees' kernels: identical files, identical code

Head dims 16, 64 and 128 (each with its default GPU tiles), float32 and float16 inputs, causal and not; without
``--window`` the window-free kernels (``NO_WINDOW``: what kernels compiled before windows existed), with it the
kernels of ``window=(L, R)`` (``none`` for an unbounded side). The kernel is typed lazily, so the argument types are
built here as the launch passes them: four 4-d arrays of the dtype (layout "A"), the 3-d float32 lse, a bool and the
float32 score scale. Mangled names are normalised as ``scripts/ptx_dump.py`` does; ``index.txt`` lists each
specialisation's hash and instruction count.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for the PTX files and index.txt")
    parser.add_argument("--window", nargs=2, metavar=("LEFT", "RIGHT"))
    args = parser.parse_args()
    import numba_attn  # noqa: F401  (decides simulator or not before numba.cuda is imported)
    from numba_attn.runtime.device import SIMULATOR, cuda

    if SIMULATOR:
        print("needs NUMBA_ENABLE_CUDASIM=0 (Numba's compiler, no GPU needed)")
        return 1
    import numba.cuda.dispatcher as dispatcher
    from numba import types

    from numba_attn.forward import simt
    from ptx_dump import normalise

    class _Sm90:  # device functions ask the current device for its compute capability; there is none
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    window = None if args.window is None else tuple(None if s == "none" else int(s) for s in args.window)
    os.makedirs(args.out, exist_ok=True)
    lines = []
    for d in (16, 64, 128):
        config = simt.default_config(d)
        d_pad = simt.padded_head_dim(d, config)
        for dtype in (types.float32, types.float16):
            for causal in (False, True):
                if window is None:
                    kernel = simt.flash_forward_kernel(config, d_pad, causal)  # the builder's pre-window call
                else:
                    from numba_attn.core.mask import window_sides

                    kernel = simt.flash_forward_kernel(config, d_pad, causal, window_sides(window, causal))
                array = types.Array(dtype, 4, "A")
                argtypes = (array, array, array, array, types.Array(types.float32, 3, "A"), types.boolean,
                            types.float32)
                ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0),
                                          launch_bounds=(config.threads, config.blocks_per_sm))
                ptx = normalise(ptx)
                name = f"d{d}_{dtype}_{'causal' if causal else 'full'}"
                with open(os.path.join(args.out, name + ".ptx"), "w") as f:
                    f.write(ptx)
                count = sum(1 for line in ptx.splitlines() if line.strip().endswith(";"))
                lines.append(f"{name} {hashlib.sha256(ptx.encode()).hexdigest()[:16]} {count} instructions")
                print(lines[-1], flush=True)
    with open(os.path.join(args.out, "index.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
