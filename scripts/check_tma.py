"""GPU smoke test of the TMA building blocks (``core.ptx.tma``, ``runtime.tensor_map``), well under a minute.

    python scripts/check_tma.py          # on an sm_90 GPU; under the simulator it checks the Python twins

A kernel of 128 threads loads the tiles ``rows x headdim`` of one (batch, head) of a ``(batch, heads, seqlen,
headdim)`` float16 tensor one after another into the same shared buffer: thread 0 waits until everyone has read
the previous tile (an "empty" mbarrier of 128 arrivals), arms a "full" mbarrier with the tile's bytes and issues one
``cp.async.bulk.tensor.4d`` per 64-column atom column; everyone waits on the full barrier's phase ``j & 1``, copies
the shared words out as they lie and arrives on the empty one. The host compares them with the tile laid out as
``core.warpgroup`` documents (128-byte swizzle; zeros past the sequence and past headdim). Cases: head dims 64, 128,
80 (the second atom column half outside) and 32 (a box wider than the tensor), a sequence no box divides, a strided
``(batch, seqlen, heads, headdim)`` view, and the map cache (a second request for the same tensor writes nothing).
Prints one PASS / FAIL / SKIP line per case and a summary.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import numba_attn  # noqa: E402,F401  (decides simulator or not before numba.cuda is imported)
from numba_attn.core import warpgroup  # noqa: E402
from numba_attn.core.ptx import tma  # noqa: E402
from numba_attn.runtime import tensor_map  # noqa: E402
from numba_attn.runtime.device import SIMULATOR, DeviceView, compute_capability, cuda  # noqa: E402
from numba_attn.runtime.launch import launch as device_launch  # noqa: E402

THREADS = 128


def tile_kernel(rows: int, atoms: int, tiles: int):
    from numba import types, uint16

    from numba_attn.runtime.device import kernel_jit

    TILE = 64 * rows * atoms  # elements
    ROWS, ATOMS, TILES = rows, atoms, tiles
    shared_address = warpgroup.shared_address

    def kernel(tmap, out, h, b):
        smem = cuda.shared.array(0, uint16)
        base = ((1024 - shared_address(smem) % 1024) % 1024) // 2
        full = base + TILE  # the tile has landed (one arrival: thread 0's, plus the bytes)
        empty = full + 4  # everyone has read it (128 arrivals)
        tid = cuda.threadIdx.x
        if tid == 0:
            tma.mbarrier_init(smem, full, 1)
            tma.mbarrier_init(smem, empty, THREADS)
            tma.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            tma.tensormap_acquire(tmap)
        for j in range(TILES):
            if tid == 0:
                tma.mbarrier_wait(smem, empty, (j & 1) ^ 1)  # (passes at once for the first tile)
                tma.mbarrier_arrive_expect_tx(smem, full, 2 * TILE)
                for a in range(ATOMS):
                    tma.tma_load_4d(smem, base + a * 64 * ROWS, tmap, 64 * a, j * ROWS, h, b, full)
            tma.mbarrier_wait(smem, full, j & 1)
            for i in range(tid, TILE, THREADS):
                out[j * TILE + i] = smem[base + i]
            tma.mbarrier_arrive(smem, empty)  # (release: the reads above come first)

    sig = types.void(types.uint64, types.Array(types.uint16, 1, "A"), types.int32, types.int32)
    return kernel_jit((THREADS, 1), sig)(kernel), 2 * TILE + 1024 + 16


def expected_tiles(x: np.ndarray, b: int, h: int, rows: int, atoms: int, tiles: int) -> np.ndarray:
    """The shared words the kernel should see, tile after tile (``core.warpgroup`` layout)."""
    head = x[b, h]
    seqlen, head_dim = head.shape
    out = np.zeros((tiles, 64 * rows * atoms), np.uint16)
    r = np.arange(rows)[:, None]
    c = np.arange(64)[None, :]
    for j in range(tiles):
        padded = np.zeros((rows, 64 * atoms), np.uint16)
        part = head[j * rows:(j + 1) * rows, :]
        padded[:part.shape[0], :min(head_dim, 64 * atoms)] = part[:, :64 * atoms]
        for a in range(atoms):
            at = (a * 128 * rows + warpgroup.swizzle(128 * r + 2 * c)) // 2
            out[j, at] = padded[:, 64 * a:64 * a + 64]
    return out


def run_case(name, batch, heads, seqlen, head_dim, rows, layout="contig"):
    rng = np.random.default_rng(seqlen + head_dim)
    host = rng.integers(1, 60000, size=(batch, heads, seqlen, head_dim), dtype=np.uint16)
    if layout == "blhd":  # the same values in a (batch, seqlen, heads, headdim) buffer, viewed as bhld
        buf = cuda.to_device(np.ascontiguousarray(host.transpose(0, 2, 1, 3)))
        if SIMULATOR:
            dev = buf._ary.transpose(0, 2, 1, 3)
        else:
            view = DeviceView.of(buf)
            (n0, n1, n2, n3), (s0, s1, s2, s3) = view.shape, view.strides
            dev = view.with_axes((n0, n2, n1, n3), (s0, s2, s1, s3))
    else:
        dev = cuda.to_device(host)
    if not tensor_map.tma_layout_ok(dev):
        return "SKIP", "layout not readable by the TMA"
    d_pad = -(-head_dim // 16) * 16
    atoms = warpgroup.atom_columns(d_pad)
    tiles = -(-seqlen // rows)
    maps = tensor_map.maps_for()
    before = maps.uploads
    address = maps.address(dev, rows, 0)
    if address is None:
        return "SKIP", "the driver refused the map (the kernel falls back to cp.async here)"
    again = maps.address(dev, rows, 0)
    if again != address or maps.uploads != before + 1:
        return "FAIL", f"map cache: address {address:#x} then {again:#x}, {maps.uploads - before} uploads"
    kernel, nbytes = tile_kernel(rows, atoms, tiles)
    b, h = batch - 1, heads - 1
    out = cuda.to_device(np.full(tiles * 64 * rows * atoms, 0xDEAD, np.uint16))
    device_launch(kernel, 1, THREADS, 0, nbytes, np.uint64(address), out, np.int32(h), np.int32(b))
    cuda.synchronize()
    got = out.copy_to_host().reshape(tiles, -1)
    want = expected_tiles(host, b, h, rows, atoms, tiles)
    bad = np.count_nonzero(got != want)
    if bad:
        j, i = np.argwhere(got != want)[0]
        return "FAIL", f"{bad} of {got.size} words differ (first: tile {j} word {i}: {got[j, i]:#x} != {want[j, i]:#x})"
    return "PASS", f"{tiles} tiles of {rows} x {64 * atoms}, {len(set(range(tiles)))} phases"


CASES = [
    ("d64_rows64_tail", 2, 3, 200, 64, 64),
    ("d128_rows128_tail", 1, 2, 300, 128, 128),
    ("d128_rows64", 1, 1, 128, 128, 64),
    ("d80_half_atom", 1, 2, 100, 80, 64),
    ("d32_box_wider_than_tensor", 1, 1, 70, 32, 64),
    ("d64_blhd_view", 2, 4, 90, 64, 64, "blhd"),
    ("d64_rows176", 1, 1, 400, 64, 176),
]
SIM_CASES = [("sim_d64_tail", 1, 2, 20, 64, 8), ("sim_d80_half_atom", 1, 1, 9, 80, 8),
             ("sim_blhd_view", 2, 2, 12, 64, 8, "blhd")]


def main() -> int:
    if not SIMULATOR and compute_capability() < (9, 0):
        print(f"SKIP all: needs sm_90, got {compute_capability()}")
        return 0
    failed = 0
    t_start = time.time()
    for case in SIM_CASES if SIMULATOR else CASES:
        name, *args = case
        t0 = time.time()
        try:
            status, detail = run_case(name, *args)
        except Exception as error:  # noqa: BLE001 - reported per case
            status, detail = "FAIL", "".join(traceback.format_exception_only(type(error), error)).strip()
        failed += status == "FAIL"
        print(f"{status} {name}: {detail} ({time.time() - t0:.1f}s)", flush=True)
    print(f"check_tma: {'FAIL' if failed else 'PASS'} ({failed} failed, {time.time() - t_start:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
