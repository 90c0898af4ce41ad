"""The fp8 warp-specialised forward's pre-pass: V ``(batch, kv_heads, seqlen_k, headdim)`` e4m3 -> ``V^T``
``(batch, kv_heads, headdim, keys)``, once per call.

8-bit MMAs take their B operand K-major only, so P V needs V with the keys contiguous. Transposing each V tile
inside the attention kernel put a shared-memory round trip and an mbarrier hand-off on the consumers' path (the
first port ran at 0.55-0.67x our bf16 kernel); one pass over V costs a read and a write of V (1-3 % of the
attention's time at 4k-16k keys) and lets the kernel's TMA copy ``V^T`` tiles like K tiles.

Layout of ``V^T``: ``keys`` = seqlen_k rounded up to 16 (so that rows are 16-byte multiples, as the TMA needs);
inside each 16-key group the keys are permuted as ``core.fp8.KEY_OF_COLUMN`` says (column ``c`` holds key
``KEY_OF_COLUMN[c]``: the order in which ``core.fp8.probabilities`` packs P), and the keys past seqlen_k are zeros.

Kernel: one block per 128 keys of one (batch, kv head), ``8 x 8 ceil(headdim / 32)`` threads. Each thread first
issues all its 16-byte loads of V rows (four at headdim 128; a warp reads whole rows), keeping them in registers
(so that they are in flight together: a load and a shared store per step ran at ~1 TB/s on the H100), then stores
them to a shared tile of 32-bit words; then it takes 4 head-dim rows x one 16-key group: 16 words from shared
memory (the group's keys in ``KEY_OF_COLUMN`` order), four 4 x 4 byte transposes (8 ``prmt`` each) and four
16-byte stores, one per ``V^T`` row (a warp writes 64 contiguous bytes of each of 8 rows).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import types, uint32

from ..core import ptx
from ..runtime.device import SIMULATOR, DeviceView, cuda, kernel_jit
from ..runtime.launch import launch as device_launch

KEYS = 128  # keys per block
GROUPS = KEYS // 16
MAX_HEAD_DIM = 128


def padded_keys(seqlen_k: int) -> int:
    return -(-seqlen_k // 16) * 16


def threads_for(head_dim: int) -> int:
    """Threads of a block: one per (4 head-dim rows, 16-key group), in whole groups of 8 x 8."""
    return 64 * -(-head_dim // 32)


@lru_cache(maxsize=None)
def _kernel(head_dim: int):
    """The pre-pass for rows of ``head_dim`` bytes (a multiple of 16 up to 128)."""
    W = head_dim // 4  # 32-bit words per V row
    PIECES = head_dim // 16  # 16-byte pieces per V row
    STRIDE = W + 1  # (a padded shared row: the key rows a warp reads fall in different banks)
    THREADS = threads_for(head_dim)
    LOADS = -(-KEYS * PIECES // THREADS)
    GUARD = (KEYS * PIECES) % THREADS != 0
    HELD = 4 * LOADS  # words a thread holds between its loads and its shared stores
    load16 = ptx.load_u16x8
    store16 = ptx.store_u32x4
    perm = ptx.byte_perm
    zero = uint32(0)

    def transpose_v(v, vt, seqlen_k, keys_out):
        tile = cuda.shared.array((KEYS, STRIDE), uint32)
        words = cuda.local.array(HELD, uint32)
        tid = cuda.threadIdx.x
        n0 = cuda.blockIdx.x * KEYS
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        rows = v[b, h]  # (seqlen_k, head_dim / 2) uint16
        for r in range(LOADS):  # every load first: all of them in flight at once
            i = tid + THREADS * r
            key = i // PIECES
            if (not GUARD or i < KEYS * PIECES) and n0 + key < seqlen_k:
                words[4 * r], words[4 * r + 1], words[4 * r + 2], words[4 * r + 3] = load16(
                    rows, n0 + key, 8 * (i - key * PIECES))
            else:
                words[4 * r] = zero
                words[4 * r + 1] = zero
                words[4 * r + 2] = zero
                words[4 * r + 3] = zero
        for r in range(LOADS):
            i = tid + THREADS * r
            if not GUARD or i < KEYS * PIECES:
                key = i // PIECES
                c = i - key * PIECES
                for x in range(4):
                    tile[key, 4 * c + x] = words[4 * r + x]
        cuda.syncthreads()
        # this thread: head-dim rows 4w .. 4w + 3 and key group g (a warp: 4 groups x 8 row quads)
        warp = tid // 32
        lane = tid % 32
        g = lane % 4 + 4 * (warp % 2)
        w = lane // 4 + 8 * (warp // 2)
        if w < W and n0 + 16 * g < keys_out:
            out_rows = vt[b, h]  # (head_dim, keys_out / 4) uint32
            col = n0 // 4 + 4 * g
            o = cuda.local.array(16, uint32)
            for t in range(4):
                # columns 4t .. 4t + 3 of the group hold keys 2t, 2t + 1, 8 + 2t, 9 + 2t (KEY_OF_COLUMN)
                k0 = tile[16 * g + 2 * t, w]
                k1 = tile[16 * g + 2 * t + 1, w]
                k2 = tile[16 * g + 2 * t + 8, w]
                k3 = tile[16 * g + 2 * t + 9, w]
                x = perm(k0, k1, 0x5140)  # bytes 0 and 1 of k0, k1 interleaved: rows 4w, 4w + 1
                y = perm(k0, k1, 0x7362)  # bytes 2 and 3: rows 4w + 2, 4w + 3
                z = perm(k2, k3, 0x5140)
                u = perm(k2, k3, 0x7362)
                o[t] = perm(x, z, 0x5410)  # row 4w, word t
                o[4 + t] = perm(x, z, 0x7632)
                o[8 + t] = perm(y, u, 0x5410)
                o[12 + t] = perm(y, u, 0x7632)
            for r in range(4):
                store16(out_rows, 4 * w + r, col, o[4 * r], o[4 * r + 1], o[4 * r + 2], o[4 * r + 3])

    if SIMULATOR:
        return cuda.jit(transpose_v)
    v_type = types.Array(types.uint16, 4, "A")
    vt_type = types.Array(types.uint32, 4, "A")
    return kernel_jit((THREADS, 1), types.void(v_type, vt_type, types.int32, types.int32))(transpose_v)


def _as(x, dtype):
    """The ``dtype`` (uint16 or uint32) view of a uint8 ``(..., d)`` device (or simulator) array with a contiguous
    last axis and aligned rows; no copy."""
    size = np.dtype(dtype).itemsize
    if SIMULATOR:
        host = getattr(x, "_ary", None)
        return (host if host is not None else np.asarray(x)).view(dtype)
    view = x if isinstance(x, DeviceView) else DeviceView.of(x)
    return DeviceView(view.ptr, view.shape[:-1] + (view.shape[-1] // size,), view.strides[:-1] + (size,), dtype, view)


def transpose(v, vt, stream) -> None:
    """Write ``V^T`` (module docstring) of the uint8 ``v`` ``(batch, kv_heads, seqlen_k, headdim)`` (headdim % 16 ==
    0 up to 128, 16-byte aligned rows: what the TMA reads too) into the uint8 ``vt`` ``(batch, kv_heads, headdim,
    padded_keys(seqlen_k))`` (16-byte aligned rows), on ``stream``."""
    batch, heads, seqlen_k, head_dim = v.shape
    keys = padded_keys(seqlen_k)
    if tuple(vt.shape) != (batch, heads, head_dim, keys) or head_dim % 16 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"vt: expected shape {(batch, heads, head_dim, keys)} for v of shape {tuple(v.shape)} "
                         f"(headdim % 16 == 0 up to {MAX_HEAD_DIM})")
    if batch * heads * keys == 0:
        return
    grid = (-(-keys // KEYS), heads, batch)
    device_launch(_kernel(head_dim), grid, threads_for(head_dim), stream, 0, _as(v, np.uint16), _as(vt, np.uint32),
                  seqlen_k, keys)
