"""The backward's first kernel: ``D_i = rowsum(dout_i * out_i)`` in float32 for every query row (FlashAttention-2's
preprocessing), and, where ``dq`` is accumulated with atomics, the float32 accumulator zeroed in the same pass.

Grid ``(batch * heads, ceil(seqlen_q / threads_y))``; thread ``(ty, tx)`` sums columns ``tx + threads_x j`` of row
``ty`` of its block, the partial sums meet in shared memory and are added in a fixed order (the result does not
depend on timing).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from numba import float32
from numba import uint32 as index

from ..core.block_info import HEAD_MAJOR, block_position, grid
from ..forward import common
from ..runtime.device import SIMULATOR, cuda, kernel_jit
from ..runtime.launch import launch as device_launch


@dataclass(frozen=True)
class PreprocessConfig:
    """``threads_x`` threads share a row, ``threads_y`` rows per block."""

    threads_x: int = 32
    threads_y: int = 8

    def __post_init__(self):
        common.check_fields(self, threads_x=(1, 1024, 1), threads_y=(1, 1024, 1))
        if self.threads_x * self.threads_y > 1024:
            raise ValueError("PreprocessConfig: threads_x * threads_y must be at most 1024, got "
                             f"{self.threads_x * self.threads_y}")


GPU_CONFIG = PreprocessConfig()
SIMULATOR_CONFIG = PreprocessConfig(threads_x=4, threads_y=4)


def default_config() -> PreprocessConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


@lru_cache(maxsize=None)
def preprocess_kernel(config: PreprocessConfig, zero_dq: bool):
    """``kernel(out, dout, delta, dq_acc)``; ``zero_dq``: also set ``dq_acc`` (float32, q's shape) to 0."""
    TX, TY = config.threads_x, config.threads_y
    PARTS = TX * TY  # a shared array's size must be a constant of the closure, not an expression of two
    ZERO_DQ = zero_dq
    position = block_position(HEAD_MAJOR, TY)

    @kernel_jit(launch_bounds=(TX * TY, 1))
    def kernel(out, dout, delta, dq_acc):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        # (out twice: one head per block, no grouped heads here)
        b, h, m0, out_head, _, do_head, dq_head = position(out, out, dout, dq_acc, False)
        seqlen_q = out.shape[2]
        head_dim = out.shape[3]
        row = m0 + ty
        part = float32(0.0)
        if row < seqlen_q:
            for d in range(tx, head_dim, TX):
                part += float32(do_head[row, d]) * float32(out_head[row, d])
                if ZERO_DQ:
                    dq_head[row, d] = float32(0.0)
        parts = cuda.shared.array(PARTS, float32)
        parts[index(ty * TX + tx)] = part
        cuda.syncthreads()
        if tx == 0 and row < seqlen_q:
            total = float32(0.0)
            for t in range(TX):
                total += parts[index(ty * TX + t)]
            delta[b, h, row] = total

    return kernel


def launch(out, dout, delta, dq_acc, stream, config: PreprocessConfig | None = None) -> None:
    """``delta[b, h, i] = sum_d dout * out`` (float32 ``(batch, heads, seqlen_q)``); ``dq_acc`` (float32, q's shape)
    zeroed unless None. Views of shape ``(batch, heads, seqlen_q, headdim)``, any strides."""
    batch, heads, seqlen_q, _ = out.shape
    config = config or default_config()
    zero_dq = dq_acc is not None
    kernel = preprocess_kernel(config, zero_dq)
    shape = grid(HEAD_MAJOR, batch, heads, seqlen_q, config.threads_y)
    device_launch(kernel, shape, (config.threads_x, config.threads_y), stream, 0, out, dout, delta,
                  dq_acc if zero_dq else out)
