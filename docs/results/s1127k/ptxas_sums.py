"""Offline check (no GPU): ptxas -v for sm_90a (registers, spills) of the fp8 WS forward's default kernel (224-key
tiles, persistent, P times 2 ** core.fp8.P_EXPONENT) with P's row sums from the P V MMA (``fp8_sums``, the default)
and from the softmax (what calls asking for the lse run). Run from the tree with CUDA_HOME / PATH at CUDA 13 and
NUMBA_ENABLE_CUDASIM=0."""
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.getcwd())

CASES = [  # (config fields, causal)
    (dict(block_n=224, persistent=True, fp8_sums=True), False),
    (dict(block_n=224, persistent=True, fp8_sums=True), True),
    (dict(block_n=224, persistent=True), False),
    (dict(block_n=224, persistent=True), True),
]


def build(spec):
    fields, causal = spec
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    class Sm90:  # (device functions ask the current device's capability: none here)
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: Sm90()
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8, wgmma_ws_kernel
    from numba_attn.forward.common import Variant

    config = wgmma_ws.WsConfig(**fields)
    source = wgmma_ws_kernel._kernel_source(config, 128, True, False, Variant.of(causal, None, None), fp8=True,
                                            store="tma", narrow=causal)
    ptx, _ = cuda.compile_ptx(source, wgmma_ws_fp8.SIGNATURE, cc=(9, 0), launch_bounds=(config.threads, 1))
    ptx = re.sub(r"^\.target sm_90$", ".target sm_90a", ptx, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        open(path, "w").write(ptx)
        res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
        info = " ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                        if "Used" in line or "spill" in line or "arning" in line or "Loss" in line or "rror" in line)
    return f"{fields} {'causal' if causal else 'full'}: {info}"


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        for line in pool.map(build, CASES):
            print(line, flush=True)
