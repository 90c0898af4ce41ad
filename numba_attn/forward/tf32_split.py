"""The 3xTF32 operand split of the float32 tensor-core forward (``forward.tf32``): its rules, its three MMAs, and the
tiles split once per block into shared memory (``Tf32Config.split``).

Rules (``split(x) -> (hi, lo)``, tf32 bit patterns with ``hi + lo = x`` to about 2^-22; ``lo`` goes to the MMA
unrounded, the tensor cores read its top 19 bits)

    ``"cvt"`` (the kernel before issue #26 item 6): ``hi = cvt.rna.tf32(x)``, four SASS instructions on sm_90 and a
    ``sub``. For ``x = +-inf``, ``hi = inf`` and ``lo = inf - inf = NaN``: every product with an infinite operand is
    NaN, where IEEE (``reference``, the SIMT kernel) gives +-inf.
    Every other mode: Q, K and V by ``ptx.round_tf32_keep_inf`` (the same rounding by integer arithmetic; ``+-inf ->
    hi = +-1, lo = +-inf``; as many instructions as ``cvt.rna`` + ``sub``), P by ``ptx.round_tf32`` (P is never
    infinite; two instructions less than ``cvt.rna``, a NaN stays in ``lo``). With ``a = +-inf`` the product
    ``a_lo b_hi + a_hi b_lo + a_hi b_hi`` is ``+-inf * b_hi`` plus finite terms: +-inf with the sign of ``a b``, NaN for
    ``b = 0``; ``inf * inf`` is +-inf (all three terms agree), and NaN stays NaN (through ``lo``). Finite values split
    exactly as ``"cvt"`` splits them (results bit for bit the same), except ``|x| >= ptx.TF32_HUGE`` (3.4e38, the
    values that round to inf), which become ``+-1 + (x -+ 1)``: finite, about 1e-3 accurate.

Where (the fragments each warp feeds its MMAs)

    ``"cvt"``, ``"warp"``: every warp splits the fragments it loads -- each K/V element once per warp of the block, Q
    once per key tile. ``"q"``: the Q tile is split once per block after it lands; ``"kv"``: each K/V tile is split
    once per block, by all threads, after its ``cp.async`` copy lands (one barrier more per tile); ``"qkv"``: both.
    A split tile holds 16-byte chunks ``(hi, hi, lo, lo)`` that ARE a lane's B fragment ``(b0_hi, b1_hi, b0_lo,
    b1_lo)`` (for Q: half of an A fragment), read by one 16-byte load:

    * Q and K, "row pairs": chunk ``(r, c)`` = columns ``2c, 2c + 1`` of row ``r``, rows of ``pair_row`` words
      (chunks = 4 mod 8, so the 8 lanes of a 16-byte load phase, rows ``g in {0, 1}`` and chunks ``4 kk + t``, hit
      8 different 4-bank groups);
    * V, "key pairs": chunk ``(p, c)`` = keys ``2p, 2p + 1`` of column ``c``, key pairs ``v_pair_row`` words apart
      (chunks = 2 mod 8: pairs ``4 kj + t`` and columns ``8 ob + g`` give groups ``2t + g``).

    The raw tiles are copied with ``cp.async`` into rows without padding (only the splitting threads read them, in
    order), the split tiles are twice the raw ones: ``forward.tf32._Tiles`` has the shared-memory layout.
"""
from __future__ import annotations

from ..core import ptx
from ..core.staging import device_function, inlined_function
from ..core.tf32 import mma1, mma3, split_finite

#: ``Tf32Config.split`` values: where the operands are split (module docstring)
SPLITS = ("cvt", "warp", "q", "kv", "qkv")


def split_rules(split: str, tf32_only: bool):
    """``(split_operand, split_p, mma_into)`` of one mode.

    ``split_operand(x) / split_p(x) -> (hi, lo)`` for Q, K, V and for P (``lo`` unused, 0, when ``tf32_only``).
    ``mma_into(c, mt, n, a_hi, a_lo, i, bh0, bh1, bl0, bl1)``: ``c[mt, n] += A B`` with A the fragment ``a_hi[mt, i]``
    / ``a_lo[mt, i]`` (register arrays), as three MMAs (lo * hi, hi * lo, hi * hi: the small terms first) or one
    (hi * hi, ``tf32_only``, which keeps ``cvt.rna`` and ignores ``split``): ``core.tf32.mma3`` / ``mma1``."""
    to_tf32 = ptx.to_tf32
    round_keep_inf = ptx.round_tf32_keep_inf
    bits_float = ptx.bits_float
    float_bits = ptx.float_bits

    def split_cvt(x):
        # lo = x - hi is exact in float32 and goes to the MMA unrounded: the tensor cores read only its tf32 bits
        # (at worst truncating the low 13), an error below 2^-21 |x| -- and one cvt per operand less
        hi = to_tf32(x)
        return hi, float_bits(x - bits_float(hi))

    def split_keep_inf(x):
        hi = round_keep_inf(x)
        return hi, float_bits(x - bits_float(hi))

    def split1(x):
        return to_tf32(x), 0

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if tf32_only:
        one = device_function(split1)
        return one, one, device_function(mma1)
    if split == "cvt":
        both = device_function(split_cvt)
        return both, both, device_function(mma3)
    # P is finite or NaN (a NaN stays in lo): core.tf32's split
    return device_function(split_keep_inf), device_function(split_finite), device_function(mma3)


def row_pairs_splitter(threads: int, rows: int, width: int, src_row: int, split):
    """``split_tile(smem, src, dst, tid)``: the float32 tile of ``rows`` (even) rows x ``width`` columns at
    ``smem[src + r * src_row + c]`` -> "row pairs" at ``dst``: chunk ``(r, c)`` = ``(hi, hi, lo, lo)`` of columns
    ``2c, 2c + 1`` of row ``r`` is 16-byte unit ``(r // 2) * width + 2c + r % 2`` (rows ``2i, 2i + 1`` interleaved
    chunk by chunk). Thread ``tid`` takes units ``tid + k * threads`` (one 8-byte load, one 16-byte store each);
    every one of the block's threads takes part, the caller puts barriers before and after."""
    PAIRS = width // 2
    ITEMS = rows * PAIRS
    STEPS = -(-ITEMS // threads)
    GUARD = ITEMS % threads != 0
    SRC_ROW, NT = src_row, threads
    load_f32x2 = ptx.load_f32x2
    store_f32x4 = ptx.store_f32x4
    bits_float = ptx.bits_float

    @device_function
    def split_tile(smem, src, dst, tid):
        for step in range(STEPS):
            unit = tid + step * NT
            if not GUARD or unit < ITEMS:
                pair = unit // 2  # (row pair, column pair)
                r2 = pair // PAIRS
                c = pair - r2 * PAIRS
                x0, x1 = load_f32x2(smem, src + (2 * r2 + unit % 2) * SRC_ROW + 2 * c)
                h0, l0 = split(x0)
                h1, l1 = split(x1)
                store_f32x4(smem, dst + 4 * unit, bits_float(h0), bits_float(h1), bits_float(l0), bits_float(l1))

    return split_tile


def key_pairs_splitter(threads: int, rows: int, width: int, src_row: int, split):
    """``split_tile(smem, src, dst, tid)``: the float32 tile of ``rows`` (even) keys x ``width`` (a multiple of 8)
    columns at ``smem[src + r * src_row + c]`` -> "key pairs" at ``dst``: chunk ``(p, c)`` = ``(hi, hi, lo, lo)`` of
    keys ``2p, 2p + 1`` in column ``c`` is 16-byte unit ``p * width + (c ^ 2 (p % 4))`` (the XOR spreads the 8 lanes
    of a load phase, key pairs ``4 kj + t`` and columns ``8 ob + g``, over 8 bank groups ``g ^ 2t``). Each item is
    two keys x two columns (two 8-byte loads, two 16-byte stores); every one of the block's threads takes part."""
    PAIRS = width // 2
    ITEMS = (rows // 2) * PAIRS
    STEPS = -(-ITEMS // threads)
    GUARD = ITEMS % threads != 0
    SRC_ROW, WIDTH, NT = src_row, width, threads
    load_f32x2 = ptx.load_f32x2
    store_f32x4 = ptx.store_f32x4
    bits_float = ptx.bits_float

    @device_function
    def split_tile(smem, src, dst, tid):
        for step in range(STEPS):
            idx = tid + step * NT
            if not GUARD or idx < ITEMS:
                p = idx // PAIRS
                c = 2 * (idx - p * PAIRS)
                a0, a1 = load_f32x2(smem, src + 2 * p * SRC_ROW + c)  # key 2p, columns c, c + 1
                b0, b1 = load_f32x2(smem, src + (2 * p + 1) * SRC_ROW + c)  # key 2p + 1
                ha0, la0 = split(a0)
                hb0, lb0 = split(b0)
                ha1, la1 = split(a1)
                hb1, lb1 = split(b1)
                at = dst + 4 * (p * WIDTH + (c ^ (2 * (p % 4))))  # c even: c + 1 lands in the next unit
                store_f32x4(smem, at, bits_float(ha0), bits_float(hb0), bits_float(la0), bits_float(lb0))
                store_f32x4(smem, at + 4, bits_float(ha1), bits_float(hb1), bits_float(la1), bits_float(lb1))

    return split_tile


def a_fragment_splitter(threads: int, rows: int, width: int, src_row: int, split):
    """``split_tile(smem, src, dst, tid)``: the float32 tile of ``rows`` rows (a multiple of 16) x ``width`` columns
    at ``smem[src + r * src_row + c]`` -> "A quads" at ``dst``: for the rows ``i, i + 8`` of a 16-row block (row
    pair ``rp = 8 (i // 16) + i % 8``) and column pair ``c``, the hi quad ``(hi(i, 2c), hi(i + 8, 2c), hi(i, 2c + 1),
    hi(i + 8, 2c + 1))`` -- an m16n8k8 A fragment's registers ``(a0, a1, a2, a3)`` with column ``t`` <-> k ``2t``
    -- and the lo quad in 16-byte units ``rp * width + 2c + {0, 1}``, hi second where ``rp`` is odd (so that the
    load phase's lanes ``g in {0, 1}``, column pairs ``4 kk + t``, hit units ``2t + g``: 8 bank groups). A warp
    reads its fragments in two 16-byte loads and no register moves. Every one of the block's threads takes part."""
    PAIRS = width // 2
    ITEMS = rows // 2 * PAIRS
    STEPS = -(-ITEMS // threads)
    GUARD = ITEMS % threads != 0
    SRC_ROW, WIDTH, NT = src_row, width, threads
    load_f32x2 = ptx.load_f32x2
    store_f32x4 = ptx.store_f32x4
    bits_float = ptx.bits_float

    @device_function
    def split_tile(smem, src, dst, tid):
        for step in range(STEPS):
            idx = tid + step * NT
            if not GUARD or idx < ITEMS:
                rp = idx // PAIRS
                c = idx - rp * PAIRS
                row = rp + (rp // 8) * 8  # 16 (rp // 8) + rp % 8
                x0, x2 = load_f32x2(smem, src + row * SRC_ROW + 2 * c)  # row i: a0, a2
                x1, x3 = load_f32x2(smem, src + (row + 8) * SRC_ROW + 2 * c)  # row i + 8: a1, a3
                h0, l0 = split(x0)
                h1, l1 = split(x1)
                h2, l2 = split(x2)
                h3, l3 = split(x3)
                hi = dst + 4 * (rp * WIDTH + 2 * c + rp % 2)
                lo = dst + 4 * (rp * WIDTH + 2 * c + 1 - rp % 2)
                store_f32x4(smem, hi, bits_float(h0), bits_float(h1), bits_float(h2), bits_float(h3))
                store_f32x4(smem, lo, bits_float(l0), bits_float(l1), bits_float(l2), bits_float(l3))

    return split_tile


def fragment_reads(tiles, split):
    """``(lane_words, read_q, read_k, read_v)``: where a lane's fragments lie in shared memory and how a warp reads
    them, split where they are used or already split (``tiles.q_split``, ``tiles.kv_split``), for ``forward.tf32``.

    ``lane_words(warp_row, g, t) -> (q_hi, q_lo, k_lane, v_lane)``: word offsets of lane ``(g, t)``'s fragments
    (Q rows ``g`` / ``g + 8`` of the warp's first m-tile, hi / lo parts when split; K row ``g``; V keys ``2t, 2t + 1``
    of column ``g``, past the K tile). ``read_q(smem, q_hi, q_lo, mt, kk, a_hi, a_lo)`` fills the A fragment
    ``a_hi[mt, 0]``, ``a_lo[mt, 0]`` of k-step ``kk``; ``read_k(smem, at, nb, kk)`` and ``read_v(smem, at, kj, ob)``
    give ``(bh0, bh1, bl0, bl1)`` (``at``: the stage plus ``k_lane`` / ``v_lane``)."""
    D_PAD, D_PASS = tiles.d_pad, tiles.d_pass
    K_STRIDE, V_STRIDE, K_TILE = tiles.k_stride, tiles.v_stride, tiles.k_tile
    Q_SPLIT, KV_SPLIT = tiles.q_split, tiles.kv_split
    load1 = ptx.load1
    load_f32x2 = ptx.load_f32x2
    load_f32x4 = ptx.load_f32x4_1d
    bits = ptx.float_bits

    @inlined_function
    def lane_words(warp_row, g, t):
        if Q_SPLIT:  # A quads of row pair (g, g + 8) of the warp's first m-tile, column pair t; hi second for odd g
            q_hi = (warp_row // 2 + g) * 4 * D_PAD + 8 * t + 4 * (g % 2)
            q_lo = q_hi + 4 - 8 * (g % 2)
        else:  # row g, columns 2t, 2t + 1 of a k-step (row g + 8: 8 rows on)
            q_hi = (warp_row + g) * K_STRIDE + 2 * t
            q_lo = q_hi
        if KV_SPLIT:  # K row g, column pair t: unit (g // 2) d_pad + 2t + g % 2; V key pair t, column g ^ 2t
            k_lane = (g // 2) * 4 * D_PAD + 8 * t + 4 * (g % 2)
            v_lane = K_TILE + t * 4 * D_PASS + 4 * (g ^ (2 * t))
        else:
            k_lane = g * K_STRIDE + 2 * t
            v_lane = K_TILE + 2 * t * V_STRIDE + g
        return q_hi, q_lo, k_lane, v_lane

    @inlined_function
    def read_q(smem, q_hi, q_lo, mt, kk, a_hi, a_lo):
        # (a0, a2): row g, columns 2t, 2t + 1; (a1, a3): row g + 8 (A column t <-> k 2t, t + 4 <-> 2t + 1)
        if Q_SPLIT:
            h0, h1, h2, h3 = load_f32x4(smem, q_hi + 32 * mt * D_PAD + 32 * kk)
            l0, l1, l2, l3 = load_f32x4(smem, q_lo + 32 * mt * D_PAD + 32 * kk)
            a_hi[mt, 0, 0], a_lo[mt, 0, 0] = bits(h0), bits(l0)
            a_hi[mt, 0, 1], a_lo[mt, 0, 1] = bits(h1), bits(l1)
            a_hi[mt, 0, 2], a_lo[mt, 0, 2] = bits(h2), bits(l2)
            a_hi[mt, 0, 3], a_lo[mt, 0, 3] = bits(h3), bits(l3)
        else:
            x0, x2 = load_f32x2(smem, q_hi + 16 * mt * K_STRIDE + 8 * kk)
            x1, x3 = load_f32x2(smem, q_lo + (16 * mt + 8) * K_STRIDE + 8 * kk)
            a_hi[mt, 0, 0], a_lo[mt, 0, 0] = split(x0)
            a_hi[mt, 0, 1], a_lo[mt, 0, 1] = split(x1)
            a_hi[mt, 0, 2], a_lo[mt, 0, 2] = split(x2)
            a_hi[mt, 0, 3], a_lo[mt, 0, 3] = split(x3)

    @inlined_function
    def read_k(smem, at, nb, kk):  # K row 8 nb + g, columns 8 kk + 2t, 8 kk + 2t + 1
        if KV_SPLIT:
            h0, h1, l0, l1 = load_f32x4(smem, at + 16 * nb * D_PAD + 32 * kk)
            return bits(h0), bits(h1), bits(l0), bits(l1)
        y0, y1 = load_f32x2(smem, at + 8 * nb * K_STRIDE + 8 * kk)
        bh0, bl0 = split(y0)
        bh1, bl1 = split(y1)
        return bh0, bh1, bl0, bl1

    @inlined_function
    def read_v(smem, at, kj, ob):  # V rows (keys) 8 kj + 2t and 8 kj + 2t + 1, column 8 ob + g
        if KV_SPLIT:
            h0, h1, l0, l1 = load_f32x4(smem, at + 16 * kj * D_PASS + 32 * ob)
            return bits(h0), bits(h1), bits(l0), bits(l1)
        y0 = load1(smem, at + 8 * kj * V_STRIDE + 8 * ob)
        y1 = load1(smem, at + (8 * kj + 1) * V_STRIDE + 8 * ob)
        bh0, bl0 = split(y0)
        bh1, bl1 = split(y1)
        return bh0, bh1, bl0, bl1

    return lane_words, read_q, read_k, read_v
