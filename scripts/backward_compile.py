"""Offline compile check of the tensor-core backwards (``scripts/check_backward.py --compile-only``; no GPU needed).

Every key-block / query-block specialisation of ``backward.mma`` (sm_90, ``ptxas -arch=sm_90``) and every key-block
specialisation of ``backward.wgmma`` (sm_90a: head dims 64 / 128 and the powers of two below, both dtypes, atomic
``dQ`` or not) is compiled with the argument types its launch passes and assembled by ``ptxas -v``: one line each
with the MMA count, registers, spills and ptxas's warnings (C7513: wgmma serialised).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile


def say(*args):
    print(*args, flush=True)


def _assembler(arch: str):
    ptxas = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")

    def assemble(ptx_src):
        if not os.path.exists(ptxas):
            return "ptxas not found"
        if arch == "sm_90a":  # (compiled for sm_90; wgmma needs the "a" target, as the launches compile it)
            ptx_src = re.sub(r"^\.target sm_90$", ".target sm_90a", ptx_src, flags=re.M)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx_src)
            res = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(res.stderr.strip()[:2000])
            return " | ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                              if "Used" in line or "spill" in line or "warning" in line)

    return assemble


def _mma_jobs(name, config):
    from numba_attn.backward import mma, mma_kernels

    for d_pad in (64, 128, 256):
        cfg = mma.default_config(d_pad) if config is None else config
        if cfg.shared_bytes(d_pad) > 227 * 1024:
            say(f"SKIP compile {name} d{d_pad}: {cfg.shared_bytes(d_pad)} bytes of shared memory (sm_90: 227 KB)")
            continue
        for dtype in ("float16", "bfloat16"):
            bf16 = dtype == "bfloat16"
            for want_dv, want_dk in mma.key_block_passes(cfg, d_pad):
                for atomic in ((True, False) if want_dk else (False,)):
                    for vred in ((True, False) if atomic else (False,)):
                        for vector in (True, False):
                            if not vector and (vred or not atomic):
                                continue  # the element loaders: once per dQ mode is enough to type-check
                            label = (f"key d{d_pad} {dtype} dv={int(want_dv)} dk={int(want_dk)} atomic={int(atomic)}"
                                     f" v2red={int(vred)} vector={int(vector)}")
                            yield (label, mma_kernels.key_block_source(cfg, d_pad, bf16, vector, want_dv, want_dk,
                                                                       atomic, vred),
                                   mma.KEY_SIGNATURE, cfg.key_launch_bounds(), "sm_90", "mma.sync")
            for vector in (True, False):
                yield (f"query d{d_pad} {dtype} vector={int(vector)}",
                       mma_kernels.query_block_source(cfg, d_pad, bf16, vector), mma.QUERY_SIGNATURE,
                       cfg.query_launch_bounds(), "sm_90", "mma.sync")


def _wgmma_jobs(name, config):
    from numba_attn.backward import wgmma, wgmma_kernels

    d_pads = (16, 32, 64, 128) if config is None else (64, 128)
    for d_pad in d_pads:
        cfg = wgmma.default_config(d_pad) if config is None else config
        if cfg.shared_bytes(d_pad) > 227 * 1024:
            say(f"SKIP compile wgmma {name} d{d_pad}: {cfg.shared_bytes(d_pad)} bytes of shared memory")
            continue
        for dtype in ("float16", "bfloat16"):
            for atomic in (True, False):
                yield (f"wgmma key d{d_pad} {dtype} atomic={int(atomic)}",
                       wgmma_kernels.key_block_source(cfg, d_pad, dtype == "bfloat16", atomic), wgmma.KEY_SIGNATURE,
                       cfg.launch_bounds(), "sm_90a", "wgmma.mma_async")


def _ws_jobs(name, config):
    from numba_attn.backward import wgmma_ws, wgmma_ws_kernels

    for d_pad in (64, 128):
        cfg = wgmma_ws.default_config(d_pad) if config is None else config
        if cfg.shared_bytes(d_pad) > 227 * 1024:
            say(f"SKIP compile wgmma_ws {name} d{d_pad}: {cfg.shared_bytes(d_pad)} bytes of shared memory")
            continue
        for dtype in ("float16", "bfloat16"):
            for atomic in (True, False):
                yield (f"wgmma_ws key d{d_pad} {dtype} atomic={int(atomic)}",
                       wgmma_ws_kernels.key_block_source(cfg, d_pad, dtype == "bfloat16", atomic),
                       wgmma_ws.KEY_SIGNATURE, (cfg.threads, 1), "sm_90a", "wgmma.mma_async")


def compile_only(mma_configs, wgmma_configs, ws_configs=()) -> int:
    """``*_configs``: (name, config or None for the defaults) to compile; returns the exit status."""
    import numba_attn  # noqa: F401  (decides simulator or not before numba.cuda is imported)
    from numba_attn.runtime.device import SIMULATOR, cuda

    if SIMULATOR:
        say("ERROR --compile-only needs NUMBA_ENABLE_CUDASIM=0 (Numba's compiler, no GPU needed)")
        return 1
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:  # device functions ask the current device for its compute capability; there is none
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()
    failed = 0
    jobs = [(name, job) for name, config in mma_configs for job in _mma_jobs(name, config)]
    jobs += [(name, job) for name, config in wgmma_configs for job in _wgmma_jobs(name, config)]
    jobs += [(name, job) for name, config in ws_configs for job in _ws_jobs(name, config)]
    for name, (label, source, signature, bounds, arch, mma_text) in jobs:
        try:
            ptx_src, _ = cuda.compile_ptx(source, signature.args, cc=(9, 0), launch_bounds=bounds)
            info = f"{ptx_src.count(mma_text)} {mma_text.split('.')[0]} | {_assembler(arch)(ptx_src)}"
            warned = "warning" in info
            failed += warned
            say(f"{'WARN' if warned else 'PASS'} compile {name} {label}: {info}")
        except Exception as exc:  # noqa: BLE001
            failed += 1
            say(f"ERROR compile {name} {label}: {type(exc).__name__}: {str(exc)[:1500]}")
    say(f"{'ALL COMPILED' if not failed else f'{failed} FAILED OR WARNED'}")
    return 1 if failed else 0
