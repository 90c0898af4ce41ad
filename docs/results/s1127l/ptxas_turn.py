"""Offline check (no GPU): ptxas -v for sm_90a (registers, spills) of the WS forward's kernels that the persistent
turn changes (branch h/block-turn: a block's last P V under the next block's tile 0) and one it must not (one block per
query block). Run from a tree with CUDA_HOME / PATH at CUDA 13 and NUMBA_ENABLE_CUDASIM=0; prints one line a case
(``scripts/compile_check.py``'s ptxas summary; ptxas_turn.log came from a copy of it written here before)."""
import multiprocessing
import os
import sys

sys.path.insert(0, os.getcwd())

CASES = [  # (config fields, head dim, causal, fp8)
    (dict(block_n=224, persistent=True, fp8_sums=True), 128, False, True),
    (dict(block_n=224, persistent=True, fp8_sums=True), 128, True, True),
    (dict(block_n=128, persistent=True), 64, False, False),
    (dict(block_n=128, persistent=True), 64, True, False),
    (dict(block_n=128, persistent=True), 128, False, False),
    (dict(block_n=128, persistent=True), 128, True, False),
    (dict(block_n=128, persistent=True, consumers=3, producer_registers=32, consumer_registers=160), 64, False, False),
    (dict(block_n=128), 128, False, False),
]


def build(spec):
    fields, d, causal, fp8 = spec
    sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
    from compile_check import _fake_sm90, _ptxas

    _fake_sm90()
    from numba import cuda

    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8, wgmma_ws_kernel
    from numba_attn.forward.common import Variant

    config = wgmma_ws.WsConfig(**fields)
    source = wgmma_ws_kernel._kernel_source(config, d, True, False, Variant.of(causal, None, None), fp8=fp8,
                                            store="tma", narrow=True)
    signature = wgmma_ws_fp8.SIGNATURE if fp8 else wgmma_ws.SIGNATURE
    ptx, _ = cuda.compile_ptx(source, signature, cc=(9, 0), launch_bounds=(config.threads, 1))
    return f"{fields} D{d} {'causal' if causal else 'full'}{' fp8' if fp8 else ''}: {_ptxas(ptx)}"


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        for line in pool.map(build, CASES):
            print(line, flush=True)
