"""float8 e4m3 building blocks of the warpgroup kernels: P as an 8-bit A operand, V transposed into a K-major B,
the descale factors.

What a kernel takes from here (``forward.wgmma_fp8`` uses all of it; a warp-specialised kernel would too):
``probabilities`` (S accumulators -> e4m3 A registers of P V), ``v_transposer_swizzled`` (a V tile as the TMA or
``swizzled_tile_loader`` writes it -> ``V^T``) or ``staging_loader`` + ``v_transposer`` (the cp.async path with a
conflict-free layout of its own), ``descaled`` (per-tensor or per-head factors), and from elsewhere
``warpgroup.wgmma_ss_e4m3`` / ``wgmma_rs_e4m3`` with ``warpgroup.k_major`` layouts, ``epilogue.store_rows(scaled=True)``.

``wgmma`` on 8-bit types takes both shared-memory operands K-major (``core.warpgroup``). For ``O += P V`` the k
dimension is the keys, so B must be ``V^T``: head-dim rows, keys contiguous. V arrives ``[key][d]``; the kernel
copies each V tile to a *staging* tile (``staging_loader``) and ``v_transposer`` turns it into a ``V^T`` tile in
the 128-byte swizzled K-major layout, through registers and byte permutes (``prmt``), while the tensor cores run.

The key order inside each 16-key group. The 8-bit A fragment of a k-step holds, in lane ``(g, t)``, k-columns ``4t ..
4t + 3`` and ``16 + 4t .. 16 + 4t + 3``; the float32 C fragments of S hold keys ``2t, 2t + 1`` of each n8 block. The
sum over keys does not care about their order, so column ``c = 4t + i`` of each 16-column group of the MMA's k
dimension stands for key ``KEY_OF_COLUMN[c] = 2t + i % 2 + 8 (i // 2)`` of the matching 16-key group: then the four
scores a lane owns for keys ``2t, 2t + 1, 8 + 2t, 9 + 2t`` of a group are exactly the four bytes it must supply for
columns ``4t .. 4t + 3``. P packs in registers (``probabilities``, no shuffles, no byte permutes), and the
transposer writes ``V^T`` with its keys in the same order. ``KEY_OF_COLUMN`` lets tests check both sides.

Staging tile: ``block_n`` rows (keys) of 128 bytes (``d_pad <= 128`` bytes used), the 16-byte piece ``p`` of key
``n`` at piece ``p ^ phase``, ``phase = (n // 16) * (128 // block_n) % 8``: the transposer's 32-bit loads (a warp
reads one 4-byte column of 16-key groups side by side) and its 16-byte stores (8 lanes write one ``V^T`` row's
pieces) then meet no bank conflict.
"""
from __future__ import annotations

import numpy as np
from numba import uint32

from ..runtime.device import SIMULATOR, cuda
from . import ptx
from .staging import device_function, inlined_function
from .swizzled_tiles import swizzled_tile_loader

#: key (within its 16-key group) that column ``c`` (within its 16-column group) of the P V MMA's k dimension holds
KEY_OF_COLUMN = tuple(2 * (c // 4) + c % 2 + 8 * (c % 4 // 2) for c in range(16))


def staging_phase(block_n: int) -> tuple:
    """``(phase_rows, phase_step)`` of the staging tile of ``block_n`` keys (``swizzled_tile_loader``'s arguments)."""
    if block_n % 16 or not 16 <= block_n <= 128:
        raise ValueError(f"block_n must be a multiple of 16 in [16, 128], got {block_n}")
    return 16, 128 // block_n


def staging_loader(block_n: int, d_pad: int, threads: int):
    """``load(head, smem, base, tid, n0, seqlen, head_dim)``: the ``cp.async`` copy of V rows ``n0 .. n0 + block_n``
    (float8: 1-byte elements) into the staging tile at element ``base`` of the uint16 ``smem``."""
    return swizzled_tile_loader(block_n, d_pad, threads, 1, *staging_phase(block_n))


def probabilities(pv_steps: int):
    """``pack(s, p)``: the probabilities ``s[0, nb, e]`` (float32 C fragments of one m-tile, ``4 pv_steps`` n8
    blocks) rounded to e4m3 into ``p``, the A registers of ``pv_steps`` k-steps of 32 keys: k-step ``kk``'s words
    are (row ``g``: blocks ``4kk``, ``4kk + 1``), (row ``g + 8``: the same), (row ``g``: blocks ``4kk + 2``, ``4kk +
    3``), (row ``g + 8``: the same), each block's two keys low to high (the module docstring's key order)."""
    PV_STEPS = pv_steps
    pack4 = ptx.pack_e4m3x4

    @device_function
    def pack(s, p):
        for kk in range(PV_STEPS):
            for half in range(2):  # keys 0..15 and 16..31 of the k-step
                nb = 4 * kk + 2 * half
                p[4 * kk + 2 * half] = pack4(s[0, nb, 0], s[0, nb, 1], s[0, nb + 1, 0], s[0, nb + 1, 1])
                p[4 * kk + 2 * half + 1] = pack4(s[0, nb, 2], s[0, nb, 3], s[0, nb + 1, 2], s[0, nb + 1, 3])

    return pack


def v_transposer(block_n: int, d_pad: int, threads: int):
    """``transpose(smem, src, dst, tid)``: the staging tile of ``block_n`` keys at element ``src`` of the uint16
    ``smem`` to the ``V^T`` tile at ``dst``: ``d_pad`` rows (head-dim columns) of 128 bytes (one atom column of
    keys, the 128-byte swizzle), keys in the module docstring's order; the block's ``threads`` threads take part.

    A unit of work is 16 keys (group ``q``) x 4 head-dim columns (``4b .. 4b + 3``): 16 loads of 32 bits, four 4 x 4
    byte transposes (8 ``prmt`` each) of keys ``(2t, 2t + 1, 8 + 2t, 9 + 2t)``, whose byte columns are word ``t``
    of the ``V^T`` pieces, and 4 stores of 16 bytes (one piece of each of the 4 rows). Consecutive threads take
    consecutive ``q`` first. Ordinary stores: the writers must ``fence_proxy_async`` before the barrier that precedes
    the MMAs reading the tile."""
    staging_phase(block_n)
    if d_pad % 16 or not 16 <= d_pad <= 128:
        raise ValueError(f"d_pad must be a multiple of 16 in [16, 128], got {d_pad}")
    GROUPS = block_n // 16
    UNITS = GROUPS * (d_pad // 4)
    STEPS = -(-UNITS // threads)
    GUARD = UNITS % threads != 0
    THREADS = threads
    PHASE_STEP = 128 // block_n
    load_word = ptx.load_u16x2
    store_piece = ptx.store_u32x4_1d
    perm = ptx.byte_perm

    # (under the simulator a simulated device function: only those see the running thread's ``cuda.local``)
    @(cuda.jit(device=True) if SIMULATOR else device_function)
    def transpose(smem, src, dst, tid):
        w = cuda.local.array(16, uint32)
        o = cuda.local.array(16, uint32)
        for step in range(STEPS):
            u = tid + THREADS * step
            if not GUARD or u < UNITS:
                q = u % GROUPS
                b = u // GROUPS
                # key 16 q + r of the staging tile: its 32-bit word b sits in piece (b // 4) ^ phase
                at = src + 1024 * q + 8 * ((b // 4) ^ (q * PHASE_STEP % 8)) + 2 * (b % 4)
                for r in range(16):
                    w[r] = load_word(smem, at + 64 * r)
                for t in range(4):  # keys 2t, 2t + 1, 8 + 2t, 9 + 2t -> byte columns 0..3 = words t of rows 4b + i
                    x = perm(w[2 * t], w[2 * t + 1], 0x5140)  # bytes 0 and 1 of both, interleaved
                    y = perm(w[2 * t], w[2 * t + 1], 0x7362)  # bytes 2 and 3
                    z = perm(w[2 * t + 8], w[2 * t + 9], 0x5140)
                    v = perm(w[2 * t + 8], w[2 * t + 9], 0x7362)
                    o[t] = perm(x, z, 0x5410)
                    o[4 + t] = perm(x, z, 0x7632)
                    o[8 + t] = perm(y, v, 0x5410)
                    o[12 + t] = perm(y, v, 0x7632)
                for i in range(4):  # V^T row d = 4 b + i: piece q of its 128-byte row, swizzled
                    d = 4 * b + i
                    store_piece(smem, dst + 64 * d + 8 * (q ^ (d % 8)), o[4 * i], o[4 * i + 1], o[4 * i + 2],
                                o[4 * i + 3])

    return transpose


def descaled(per_head: bool):
    """``scales(scale_log2, out_scale, descale_q, descale_k, descale_v, b, h, heads) -> (scale, v_scale)``: a block's
    score scale (the softmax's ``scale_log2``) and output scale (``epilogue.store_rows(scaled=True)``'s
    ``out_scale``). Per tensor (``per_head=False``) the launch folded the factors in: both pass through. Per head:
    times ``descale_q[b, x] * descale_k[b, x]`` and ``descale_v[b, x]``, float32 ``(batch, H)`` arrays read with ``x
    = h // (heads // H)`` -- ``H`` the query heads or the kv heads (FlashAttention-3's), or 1 for a value broadcast
    with zero strides."""
    PER_HEAD = per_head

    @device_function
    def scales(scale_log2, out_scale, descale_q, descale_k, descale_v, b, h, heads):
        if PER_HEAD:
            return (scale_log2 * (descale_q[b, h // (heads // descale_q.shape[1])]
                                  * descale_k[b, h // (heads // descale_k.shape[1])]),
                    out_scale * descale_v[b, h // (heads // descale_v.shape[1])])
        return scale_log2, out_scale

    return scales


@inlined_function
def no_descale(scale_log2, out_scale, descale_q, descale_k, descale_v, b, h, heads):
    """``descaled``'s call for 16-bit inputs: both scales as they came. Inlined in Numba's IR, so the 16-bit forms
    of kernels whose body also serves 8-bit inputs compile as if the call were not there."""
    return scale_log2, out_scale


def v_transposer_swizzled(block_n: int, d_pad: int, threads: int):
    """``transpose(smem, src, dst, tid)``: as ``v_transposer``, from a V tile in the hardware's 128-byte swizzle
    (``swizzled_tile_loader``'s default phase, what the TMA writes with ``CU_TENSOR_MAP_SWIZZLE_128B``) instead of the
    staging layout: ``block_n`` rows (keys) of 128 bytes at element ``src``. Every warp of the block's ``threads``
    takes part (``ldmatrix`` is warp-wide).

    A warp's unit is 32 keys (groups ``2u``, ``2u + 1``) x 16 head-dim columns (piece ``c``): one ``ldmatrix.x4``
    whose lane ``8 m + i`` points at key ``16 (i // 4) + KEYS[m]`` of word ``i % 4`` (``KEYS``: ``2w, 2w + 1, 8 +
    2w, 9 + 2w``, the pairs swapped for the second group so that the 8 rows of each matrix fall in 8 bank groups);
    lane ``(g, t)`` then holds bytes ``4t .. 4t + 3`` of the four keys of word ``g % 4`` of group ``2u + g // 4``,
    one 4 x 4 byte transpose (8 ``prmt``, the second group's selectors swapped) makes the four words of rows ``16c +
    4t + j``, and 4 stores of 32 bits put them in place (rows ``d`` and ``d + 8`` meet in a bank: 2 wavefronts per
    store)."""
    staging_phase(block_n)
    if d_pad % 16 or not 16 <= d_pad <= 128 or block_n % 32:
        raise ValueError(f"v_transposer_swizzled: block_n a multiple of 32 and d_pad of 16 up to 128, got "
                         f"{block_n}, {d_pad}")
    WARPS = threads // 32
    PIECES = d_pad // 16
    UNITS = (block_n // 32) * PIECES
    STEPS = -(-UNITS // WARPS)
    GUARD = UNITS % WARPS != 0
    ldmatrix = ptx.ldmatrix_x4
    perm = ptx.byte_perm
    store_word = ptx.store_u16x2

    @device_function
    def transpose(smem, src, dst, tid):
        warp = tid // 32
        lane = tid % 32
        # the row this lane points ldmatrix at: matrix m = lane // 8, row i = lane % 8 (group i // 4, word i % 4)
        m = lane // 8
        i = lane % 8
        entry = m ^ (i // 4)  # the second group's pairs swapped
        key_in = 16 * (i // 4) + 2 * (i % 4) + entry % 2 + 8 * (entry // 2)
        # what this lane receives: row g of each matrix, bytes 4t .. 4t + 3
        g = lane // 4
        t = lane % 4
        swap = g // 4  # 1: the words arrive as (2w + 1, 2w, 9 + 2w, 8 + 2w)
        low_pair = 0x1504 if swap else 0x5140
        high_pair = 0x3726 if swap else 0x7362
        for step in range(STEPS):
            unit = warp + WARPS * step
            if GUARD and unit >= UNITS:  # (an idle warp loads a unit anyway: ldmatrix is collective, and the
                unit = UNITS - 1  # simulator's twin meets the whole block)
            u = unit // PIECES
            c = unit - u * PIECES
            key = 32 * u + key_in
            w0, w1, w2, w3 = ldmatrix(smem, src + 64 * key + 8 * (c ^ (key % 8)))
            x = perm(w0, w1, low_pair)  # bytes 0 and 1 of keys 2w, 2w + 1
            y = perm(w0, w1, high_pair)  # bytes 2 and 3
            z = perm(w2, w3, low_pair)  # the same of keys 8 + 2w, 9 + 2w
            v = perm(w2, w3, high_pair)
            if not GUARD or warp + WARPS * step < UNITS:
                q = 2 * u + g // 4
                d = 16 * c + 4 * t
                at = dst + 64 * d + 2 * (g % 4)
                store_word(smem, at + 8 * (q ^ (d % 8)), perm(x, z, 0x5410))
                store_word(smem, at + 64 + 8 * (q ^ ((d + 1) % 8)), perm(x, z, 0x7632))
                store_word(smem, at + 128 + 8 * (q ^ ((d + 2) % 8)), perm(y, v, 0x5410))
                store_word(smem, at + 192 + 8 * (q ^ ((d + 3) % 8)), perm(y, v, 0x7632))

    return transpose


#: rows under each ``V^T`` box for ``mma_row_sums``: one row of ones (P V's column ``d_pad`` is then P's row sums),
#: seven of zeros to fill the MMA's n8 block
SUM_ROWS = 8
_ONES, _ZEROS = np.uint16(0x3838), np.uint16(0)  # two e4m3 1.0s (0x38): the uint16 element of shared memory


def mma_row_sums(d_pad: int, boxes: int, box_elements: int):
    """``(write_rows(smem, v_base, tid, threads), fold(acc, l_run), scale(l_run, alpha))``: P's row sums taken from
    the P V MMA instead of the softmax's additions (``softmax_update(row_sums=False)``), for a ring of ``boxes``
    ``V^T`` boxes of ``box_elements`` uint16 elements each, whose first ``d_pad`` rows (128 bytes each) the TMA
    writes. ``write_rows``: once, before the ring's first use, ``SUM_ROWS`` rows under each box's ``d_pad`` -- the
    copies never overwrite them (the caller's ``fence_proxy_async`` makes them visible to the MMAs). ``fold``: after
    each tile's P V, its sums (column ``d_pad``: lane ``t = 0``'s accumulators; the other lanes' columns hold 0)
    into float32 ``l_run``, and the column cleared -- the 8-bit MMA adds into its accumulator keeping ~14 bits, and
    sums carried there across tiles lost about twice the accuracy. ``scale``: ``l_run`` to a new running maximum.
    The sums are those of P rounded to e4m3, the very values P V weights (``reference.flash_fp8_model(rounded_sums=
    True)``)."""
    SUM_COLUMN = d_pad // 8  # (the accumulator's n8 block of columns d_pad ..)
    ROW0 = d_pad * 64  # (the first sum row's element in a box)
    PER_BOX = SUM_ROWS * 64
    BOX = box_elements
    ALL = boxes * PER_BOX
    zero = np.float32(0.0)

    @device_function
    def write_rows(smem, v_base, tid, threads):
        for i in range(tid, ALL, threads):
            box, j = i // PER_BOX, i % PER_BOX
            smem[v_base + box * BOX + ROW0 + j] = _ONES if j < 64 else _ZEROS

    @inlined_function
    def fold(acc, l_run):
        l_run[0] += acc[0, SUM_COLUMN, 0]
        l_run[1] += acc[0, SUM_COLUMN, 2]
        acc[0, SUM_COLUMN, 0] = zero
        acc[0, SUM_COLUMN, 2] = zero

    @inlined_function
    def scale(l_run, alpha):
        l_run[0] *= alpha[0]
        l_run[1] *= alpha[1]

    return write_rows, fold, scale


#: the 8-bit kernels' P goes into the P V MMA times 2 ** P_EXPONENT (``softmax_step(p_exponent=)``): P <= 1 then
#: rounds to e4m3 (largest 448, normal down to 2 ** -6) with its values down to 2 ** -14 normal instead of flushed to
#: subnormals or zero. FlashAttention-3 takes the same offset. Against float64 (model, B1 H2 512 x 2048 D128, scores'
#: sd ~2.3): 1.68e-2 -> 1.35e-2 with the softmax's sums, 3.66e-2 -> 1.33e-2 with ``mma_row_sums``, whose sums lose
#: what rounds to 0 (docs/results/s1127k/model_p_exponent.py)
P_EXPONENT = 8
_P_UNSCALE = np.float32(2.0 ** -P_EXPONENT)


@inlined_function
def p_unscaled(l_run, out_scale):
    """``out_scale`` and a thread's two row sums ``l_run`` with P's factor ``2 ** P_EXPONENT`` taken back (the
    output ``O = acc out_scale / l`` is the same; the lse is P's own): before the epilogue."""
    l_run[0] *= _P_UNSCALE
    l_run[1] *= _P_UNSCALE
    return out_scale * _P_UNSCALE
