"""Offline check (no GPU): the WS forward's default kernels with narrow tiles and without (the "wide_tails" probe,
the code before them) -- ptxas -v for sm_90a (registers, spills, warnings such as wgmma serialisation) and the SASS
instruction count. Run from the tree with CUDA_HOME / PATH at CUDA 13 and NUMBA_ENABLE_CUDASIM=0."""
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.getcwd())

CASES = [  # (name, fp8, config fields, d_pad, causal)
    ("fp8 224p", True, dict(block_n=224, persistent=True), 128, False),
    ("fp8 224p", True, dict(block_n=224, persistent=True), 128, True),
    ("bf16 D128 128", False, dict(), 128, False),
    ("bf16 D128 128p", False, dict(persistent=True), 128, True),
    ("bf16 D64 128p", False, dict(persistent=True), 64, True),
    ("bf16 D64 3x64", False, dict(block_n=64, stages=4, consumers=3, producer_registers=32, consumer_registers=160),
     64, True),
]


def build(spec):
    (name, fp8, fields, d_pad, causal), probe = spec
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    class Sm90:  # (device functions ask the current device's capability: none here; as scripts/forward_ptx.py)
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: Sm90()
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8, wgmma_ws_kernel
    from numba_attn.forward.common import Variant

    config = wgmma_ws.WsConfig(**fields)
    variant = Variant.of(causal, None, None)
    source = wgmma_ws_kernel._kernel_source(config, d_pad, True, False, variant, fp8=fp8, probe=probe, store="tma")
    sig = wgmma_ws_fp8.SIGNATURE if fp8 else wgmma_ws.SIGNATURE
    ptx, _ = cuda.compile_ptx(source, sig, cc=(9, 0), launch_bounds=(config.threads, 1))
    ptx = re.sub(r"^\.target sm_90$", ".target sm_90a", ptx, flags=re.M)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        open(path, "w").write(ptx)
        res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
        info = " ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                        if "Used" in line or "spill" in line or "arning" in line or "Loss" in line)
        sass = subprocess.run([os.environ.get("CUOBJDUMP", "cuobjdump"), "-sass", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True).stdout
        count = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line))
    return f"{name} {'causal' if causal else 'full'} [{probe or 'narrow'}]: {count} SASS | {info}"


if __name__ == "__main__":
    specs = [(case, probe) for case in CASES for probe in (None, "wide_tails")]
    with multiprocessing.get_context("spawn").Pool(min(len(specs), int(os.environ.get("JOBS", "6")))) as pool:
        for line in pool.map(build, specs):
            print(line, flush=True)
