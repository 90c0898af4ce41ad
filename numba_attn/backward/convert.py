"""The backward's last kernel where ``dq`` was accumulated with atomics into a float32 buffer: that buffer cast to
``dq``'s dtype (float16, or bfloat16 bit patterns) and stored with ``dq``'s strides. (float32 ``dq`` is accumulated
in place: no cast.) The buffer is row-major, or (``tile_d_pad``) in ``core.dq_tile``'s tiled layout, read through
its column permutation."""
from __future__ import annotations

from functools import lru_cache

from ..core.block_info import HEAD_MAJOR, block_position, grid
from ..core.dq_tile import tile_swizzle
from ..core.epilogue import as_16bit
from ..runtime.device import SIMULATOR, cuda, kernel_jit
from ..runtime.launch import launch as device_launch

#: threads along head-dim columns and rows of a block
GPU_BLOCK = (32, 8)
SIMULATOR_BLOCK = (4, 4)


@lru_cache(maxsize=None)
def convert_kernel(threads_x: int, threads_y: int, bf16: bool = False, tile_d_pad: int = 0):
    """``kernel(src, dst)``: ``dst[b, h, i, d] = src[b, h, i, d]`` in ``dst``'s dtype; ``bf16``: ``dst`` holds
    bfloat16 bit patterns (uint16), rounded to nearest even; ``tile_d_pad`` (0: row-major): ``src`` is in the tiled
    layout of that many columns, ``src[b, h, i, d ^ swizzle(i)]``."""
    TX, TY = threads_x, threads_y
    BF16 = bf16
    TILED = tile_d_pad > 0
    swizzle = tile_swizzle(tile_d_pad if TILED else 16)
    position = block_position(HEAD_MAJOR, TY)
    to_bf16 = as_16bit(True)

    @kernel_jit(launch_bounds=(TX * TY, 1))
    def kernel(src, dst):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        b, h, m0, src_head, _, _, dst_head = position(src, src, src, dst, False)
        row = m0 + ty
        if row < src.shape[2]:
            sw = swizzle(row) if TILED else 0
            for d in range(tx, dst.shape[3], TX):
                x = src_head[row, d ^ sw]
                if BF16:
                    bits, _ = to_bf16(x, x)
                    dst_head[row, d] = bits
                else:
                    dst_head[row, d] = x

    return kernel


def launch(src, dst, stream, bf16: bool = False, tiled: bool = False) -> None:
    """Cast ``src`` (float32) into ``dst``: views ``(batch, heads, seqlen, headdim)``, ``src`` as wide as ``dst`` or
    wider along headdim (its first ``headdim`` columns are read); ``bf16``: ``dst`` holds bfloat16 bits; ``tiled``:
    ``src`` is in ``core.dq_tile``'s layout, its width the padded head dim (16, 32, 64 or 128)."""
    batch, heads, seqlen, _ = dst.shape
    tx, ty = SIMULATOR_BLOCK if SIMULATOR else GPU_BLOCK
    kernel = convert_kernel(tx, ty, bool(bf16), src.shape[3] if tiled else 0)
    device_launch(kernel, grid(HEAD_MAJOR, batch, heads, seqlen, ty), (tx, ty), stream, 0, src, dst)
