"""The fp8 warp-specialised forward's pre-pass: V ``(batch, kv_heads, seqlen_k, headdim)`` e4m3 -> ``V^T``
``(batch, kv_heads, headdim, keys)``, once per call.

8-bit MMAs take their B operand K-major only, so P V needs V with the keys contiguous. Transposing each V tile
inside the attention kernel put a shared-memory round trip and an mbarrier hand-off on the consumers' path (the
first port ran at 0.55-0.67x our bf16 kernel); one pass over V costs a read and a write of V (1-3 % of the
attention's time at 4k-16k keys) and lets the kernel's TMA copy ``V^T`` tiles like K tiles.

Layout of ``V^T``: ``keys`` = seqlen_k rounded up to 16 (so that rows are 16-byte multiples, as the TMA needs);
inside each 16-key group the keys are permuted as ``core.fp8.KEY_OF_COLUMN`` says (column ``c`` holds key
``KEY_OF_COLUMN[c]``: the order in which ``core.fp8.probabilities`` packs P), and the keys past seqlen_k are zeros.

Kernel: one block of 256 threads per 64 keys of one (batch, kv head); 32-bit words throughout. The block copies
the 64 rows to shared memory (a warp reads whole rows), then each thread takes 4 head-dim rows x 4 key columns:
four words from shared memory (the keys of those columns), a 4 x 4 byte transpose (8 ``prmt``) and four words out
(consecutive threads write consecutive words of a ``V^T`` row).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import types, uint32

from ..core import ptx
from ..runtime.device import SIMULATOR, DeviceView, cuda, kernel_jit
from ..runtime.launch import launch as device_launch

THREADS = 256
KEYS = 64  # keys per block
MAX_HEAD_DIM = 128


def padded_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // 16) * 16


@lru_cache(maxsize=None)
def _kernel(words_per_row: int):
    """The pre-pass for rows of ``words_per_row`` 32-bit words (headdim / 4)."""
    W = words_per_row
    STRIDE = W + 1  # (a padded shared row: the 4 key rows a thread reads fall in different banks)
    KEY_WORDS = KEYS // 4  # output words per V^T row in a block
    ITEMS = W * KEY_WORDS
    perm = ptx.byte_perm
    zero = uint32(0)

    def transpose_v(v, vt, seqlen_k, keys_out):
        tile = cuda.shared.array((KEYS, STRIDE), uint32)
        tid = cuda.threadIdx.x
        n0 = cuda.blockIdx.x * KEYS
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        for i in range(tid, KEYS * W, THREADS):
            key = i // W
            w = i - key * W
            tile[key, w] = v[b, h, n0 + key, w] if n0 + key < seqlen_k else zero
        cuda.syncthreads()
        for i in range(tid, ITEMS, THREADS):
            w = i // KEY_WORDS  # head-dim rows 4w .. 4w + 3
            j = i - w * KEY_WORDS  # key columns 4j .. 4j + 3 of the block
            if n0 + 4 * j < keys_out:
                base = 16 * (j // 4)
                t = j % 4
                # the keys of columns 4t .. 4t + 3 of the group: 2t, 2t + 1, 8 + 2t, 9 + 2t (KEY_OF_COLUMN)
                k0 = tile[base + 2 * t, w]
                k1 = tile[base + 2 * t + 1, w]
                k2 = tile[base + 2 * t + 8, w]
                k3 = tile[base + 2 * t + 9, w]
                x = perm(k0, k1, 0x5140)  # bytes 0 and 1 of k0, k1 interleaved: d = 4w, 4w + 1
                y = perm(k0, k1, 0x7362)  # bytes 2 and 3: d = 4w + 2, 4w + 3
                z = perm(k2, k3, 0x5140)
                u = perm(k2, k3, 0x7362)
                col = n0 // 4 + j
                vt[b, h, 4 * w, col] = perm(x, z, 0x5410)
                vt[b, h, 4 * w + 1, col] = perm(x, z, 0x7632)
                vt[b, h, 4 * w + 2, col] = perm(y, u, 0x5410)
                vt[b, h, 4 * w + 3, col] = perm(y, u, 0x7632)

    if SIMULATOR:
        return cuda.jit(transpose_v)
    words = types.Array(types.uint32, 4, "A")
    return kernel_jit((THREADS, 1), types.void(words, words, types.int32, types.int32))(transpose_v)


def _words(x):
    """The uint32 view of a uint8 ``(..., d)`` device (or simulator) array with ``d % 4 == 0`` and 4-byte aligned
    rows; no copy."""
    if SIMULATOR:
        host = getattr(x, "_ary", None)
        return (host if host is not None else np.asarray(x)).view(np.uint32)
    view = x if isinstance(x, DeviceView) else DeviceView.of(x)
    return DeviceView(view.ptr, view.shape[:-1] + (view.shape[-1] // 4,), view.strides[:-1] + (4,), np.uint32, view)


def transpose(v, vt, stream) -> None:
    """Write ``V^T`` (module docstring) of the uint8 ``v`` ``(batch, kv_heads, seqlen_k, headdim)`` (headdim % 4 ==
    0 up to 128, 4-byte aligned rows) into the uint8 ``vt`` ``(batch, kv_heads, headdim, padded_keys(seqlen_k))``,
    on ``stream``."""
    batch, heads, seqlen_k, head_dim = v.shape
    keys = padded_keys(seqlen_k)
    if tuple(vt.shape) != (batch, heads, head_dim, keys) or head_dim % 4 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"vt: expected shape {(batch, heads, head_dim, keys)} for v of shape {tuple(v.shape)} "
                         f"(headdim % 4 == 0 up to {MAX_HEAD_DIM})")
    if batch * heads * keys == 0:
        return
    grid = (-(-keys // KEYS), heads, batch)
    device_launch(_kernel(head_dim // 4), grid, THREADS, stream, 0, _words(v), _words(vt), seqlen_k, keys)
