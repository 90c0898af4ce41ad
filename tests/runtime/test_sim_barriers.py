"""The simulator's ``cuda.syncthreads()`` under the collectives' twins (CPU only): a warp at a kernel barrier must
not leave it while another warp spends the block's barrier rounds inside shuffles (``core.ptx._sim``)."""
from __future__ import annotations

import numpy as np
import pytest
from numba import float32

from numba_attn.core.ptx.warp import shfl_xor_f32
from numba_attn.runtime.device import SIMULATOR, cuda

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="the simulator's barrier (a GPU has its own)")


@cuda.jit
def _shuffles_then_barrier(out, shuffles):
    sm = cuda.shared.array(32, float32)
    tid = cuda.threadIdx.x
    if tid < 32:  # warp 0: shuffles (block barrier rounds under the simulator), then its shared store
        v = float32(tid)
        for _ in range(shuffles):
            v = shfl_xor_f32(v, 1)
        sm[tid] = v + float32(1.0)
    cuda.syncthreads()
    if tid >= 32 and tid < 64:  # warp 1 reads what warp 0 stored before the barrier
        out[tid - 32] = sm[tid - 32]
    cuda.syncthreads()
    if tid >= 64:  # (a warp that leaves before the second barrier: exited threads count as arrived)
        return
    cuda.syncthreads()


@pytest.mark.parametrize("shuffles", [1, 3])
def test_a_kernel_barrier_waits_for_warps_inside_shuffles(shuffles):
    # (before the counted barrier warp 1 read uninitialised shared memory here, every run)
    out = np.full(32, np.nan, np.float32)
    _shuffles_then_barrier[1, 96](out, shuffles)
    lanes = np.arange(32)
    expect = (lanes ^ 1 if shuffles % 2 else lanes) + 1.0
    np.testing.assert_array_equal(out, expect.astype(np.float32))
