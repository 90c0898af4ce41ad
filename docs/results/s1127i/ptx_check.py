"""Offline check (no GPU): the PTX of nine WS kernels (fp8 and 16-bit, narrow and whole, three consumers, window +
soft-cap, packed) in two trees, hashed without comments and exception-flag globals. Run as
``python3 ptx_check.py TREE`` with CUDA_HOME at CUDA 13 and NUMBA_ENABLE_CUDASIM=0; same hashes, same code."""
import sys, re, hashlib
sys.path.insert(0, sys.argv[1])
import numba.cuda.dispatcher as dispatcher
from numba import cuda
class Sm90:
    compute_capability = (9, 0)
dispatcher.get_current_device = lambda: Sm90()
from numba_attn.forward import wgmma_ws, wgmma_ws_fp8, wgmma_ws_kernel
from numba_attn.forward.common import Variant
THREE = dict(consumers=3, producer_registers=32, consumer_registers=160)
cases = [
    ("fp8 224p causal", True, dict(block_n=224, persistent=True), 128, Variant.of(True, None, None), "tma", True),
    ("fp8 224p whole", True, dict(block_n=224, persistent=True), 128, Variant.of(False, None, None), "tma", False),
    ("d128 128 narrow", False, dict(), 128, Variant.of(True, None, None), "tma", True),
    ("d128 128 whole", False, dict(), 128, Variant.of(False, None, None), "tma", False),
    ("d64 3x128p narrow", False, dict(block_n=128, persistent=True, **THREE), 64, Variant.of(True, None, None), "tma", True),
    ("d64 3x64 narrow", False, dict(block_n=64, stages=4, **THREE), 64, Variant.of(True, None, None), "tma", True),
    ("d128 window softcap", False, dict(persistent=True), 128, Variant.of(True, (256, 0), 30.0), "tma", True),
    ("d128 packed", False, dict(), 128, Variant.of(True, None, None, True), "pairs", True),
    ("d128 192 narrow", False, dict(block_n=192), 128, Variant.of(False, None, None), "tma", True),
]
for name, fp8, fields, d, variant, store, narrow in cases:
    config = wgmma_ws.WsConfig(**fields)
    src = wgmma_ws_kernel._kernel_source(config, d, True, False, variant, fp8=fp8, store=store, narrow=narrow)
    sig = wgmma_ws_fp8.SIGNATURE if fp8 else (wgmma_ws.PACKED_SIGNATURE if variant.packed else wgmma_ws.SIGNATURE)
    ptx, _ = cuda.compile_ptx(src, sig, cc=(9, 0), launch_bounds=(config.threads, 1))
    ptx = re.sub(r"_ZN[0-9A-Za-z_$]+", "F", ptx)
    body = [l for l in ptx.splitlines() if not l.startswith("//") and ".common .global" not in l]
    print(f"{name}: {hashlib.sha1(chr(10).join(body).encode()).hexdigest()[:12]} {len(body)}", flush=True)
