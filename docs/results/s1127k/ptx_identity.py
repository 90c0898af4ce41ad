"""Offline check (no GPU): sha256 of the PTX of kernels the branch's changes could touch -- the 16-bit WS forward
(persistent and not, causal and not; its tile order moved to core.block_info) and the 16-bit wgmma forward (its
softmax takes p_exponent=0) -- to compare two trees: run from each with NUMBA_ENABLE_CUDASIM=0 and CUDA 13's NVVM.
Also compiles the fp8 wgmma_fp8 kernel (P times 2^8) and prints ptxas -v for it."""
import hashlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.getcwd())
import numba.cuda.dispatcher as dispatcher  # noqa: E402
from numba import cuda  # noqa: E402


class Sm90:  # (device functions ask the current device's capability: none here)
    compute_capability = (9, 0)


dispatcher.get_current_device = lambda: Sm90()
from numba_attn.forward import wgmma, wgmma_fp8, wgmma_ws, wgmma_ws_kernel  # noqa: E402
from numba_attn.forward.common import Variant  # noqa: E402


def ptx_of(source, signature, threads):
    ptx, _ = cuda.compile_ptx(source, signature, cc=(9, 0), launch_bounds=(threads, 1))
    return re.sub(r"^\.target sm_90$", ".target sm_90a", ptx, flags=re.M)


for persistent in (False, True):
    for causal in (False, True):
        config = wgmma_ws.WsConfig(persistent=persistent)
        source = wgmma_ws_kernel._kernel_source(config, 128, True, False, Variant.of(causal, None, None),
                                                store="tma", narrow=causal)
        ptx = ptx_of(source, wgmma_ws.SIGNATURE, config.threads)
        open(os.environ.get("PTX_OUT", "/tmp") + f"/ws16_{persistent}_{causal}.ptx", "w").write(ptx)
        print(f"ws16 persistent={persistent} causal={causal}: {hashlib.sha256(ptx.encode()).hexdigest()[:16]}",
              flush=True)
source = wgmma._kernel_source(wgmma.DEFAULT_CONFIG, 128, True, False, Variant.of(True, None, None))
ptx = ptx_of(source, wgmma.SIGNATURE, wgmma.THREADS)
open(os.environ.get("PTX_OUT", "/tmp") + "/wgmma16.ptx", "w").write(ptx)
print(f"wgmma16 causal: {hashlib.sha256(ptx.encode()).hexdigest()[:16]}", flush=True)
source = wgmma._kernel_source(wgmma_fp8.DEFAULT_CONFIG, 128, True, False, Variant.of(True, None, None), fp8=True)
ptx = ptx_of(source, wgmma_fp8.SIGNATURE, wgmma.THREADS)
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "k.ptx")
    open(path, "w").write(ptx)
    res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                         capture_output=True, text=True)
    print("wgmma_fp8 causal:", " ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                                         if "Used" in line or "spill" in line or "rror" in line), flush=True)
