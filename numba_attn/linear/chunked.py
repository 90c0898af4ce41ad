"""Chunked causal linear attention on tensor cores (``mma.sync.m16n8k8`` with tf32 operands, float32 accumulation).

``out_i = sum_{j <= i} (q_i . k_j) v_j`` cut into chunks of ``C`` rows (``reference.causal_dot_product_chunked``)::

    out_c = (Q_c K_c^T * tril) V_c  +  Q_c H_c        H_c = S_0 + sum_{c' < c} K_c'^T V_c'

The intra-chunk part is two small matrix products per chunk (like one attention tile without a softmax); the state
``H`` (``E x M``, float32) carries everything before the chunk. A sequential walk over the chunks of one head would
leave most of the GPU idle for a few heads, so the sequence of each head is cut into ``segments`` of whole chunks:

1. ``STATES`` pass (only when there is more than one segment): block ``(head, M tile, segment)`` writes
   ``K_s^T V_s`` of its segment to a float32 scratch array.
2. ``prefix`` kernel: turns those increments into the state BEFORE each segment (exclusive prefix over segments,
   starting from ``initial_state``), in place, one thread per state entry.
3. ``CAUSAL`` pass: block ``(head, M tile, segment)`` loads its segment's starting state into shared memory and walks
   its chunks: ``out_c`` from ``Q_c, K_c, V_c`` and ``H``, then ``H += K_c^T V_c``. The block of the last segment
   ends with the final state (``return_state``).

Non-causal linear attention is passes 1 and 2 (a total instead of a prefix) and an ``APPLY`` pass, ``out_c = Q_c H``.
The normalised layer appends a column of ones to V (an extra n8 block per M tile): the same products then carry the
cumulative key sum ``z`` as one more state column and give the denominator ``phi(q_i) . z_i`` beside the numerator.

Tensor cores. Every tile is staged in shared memory as float32 (inputs converted on load, ``phi = elu + 1`` applied
there for the layer). The MMA is the tf32 one, whose operands are float32 bit patterns (``ptx`` module docstring has
the fragment layouts); the inputs are split so that the result keeps float32 accuracy where it matters:

* float16 / bfloat16 inputs are exact in tf32; the scores ``P`` are rounded to tf32 once (as fla rounds them to the
  input dtype); the state ``H`` is split ``hi = tf32(H)``, ``lo = tf32(H - hi)`` and multiplied twice, so the
  inter-chunk term keeps float32 accuracy and range (an fp16 state would overflow for long positive sequences).
* float32 inputs ("3xTF32", the CUTLASS fast-fp32 scheme): every operand split in two, ``a b ~ a_lo b_hi + a_hi b_lo
  + a_hi b_hi``, relative error about 1e-6. ``tf32=True`` opts into one term (rounded inputs, ~1e-3, faster).

Work split in a block: ``warps`` warps, chunk ``C = 16 * warps`` rows; warp ``w`` owns rows ``16 w .. 16 w + 15`` of
``S = Q_c K_c^T`` and of ``out_c`` (the M = 16 of an MMA), and the E rows ``16 e`` for ``e = w, w + warps, ...`` of
the state update. With the k-permutation of the ``ptx`` docstring the C fragments of ``S`` are the A fragments of
``P V_c`` (no shuffles), and ``K_c^T`` is read straight from the ``[key][e]`` tile as an A operand.

Shared memory (float32 words): ``Q [C][E + 4]``, ``K [C][E + 4]``, ``V [C][cols + 4]``, ``H [E][cols + pad]``,
strides chosen so that every fragment load of a warp hits 32 different banks (``K[g][t]``: stride = 4 mod 8;
``K[2t][g]`` and ``V[2t][g]``: stride = 4 mod 8 too; ``H[t][g]``: stride = 8 mod 32). Where it fits (E <= 128)
``H``'s tf32 hi and lo parts sit beside it (``presplit``), so the ``Q H`` operand needs no conversion per use. That
is 107 KB at E = M = 64 (dynamic shared memory, attribute raised by ``_launch.launch``).

Staging. Rows arrive in pieces of 4 elements (8-byte loads of 16-bit data, 16-byte loads of float32; ``vector``,
when every row is aligned and contiguous, else element by element), a batch of loads in flight before the first is
converted, and land as one 16-byte shared store per piece (consecutive lanes, consecutive pieces: no bank
conflicts). Shared memory is indexed with 64-bit integers without wraparound (``ptx.load1`` / ``store1``), so that
``base + constant`` folds into an immediate offset. ``docs/design.md`` has the profiles behind these choices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32, types
from numba import uint32

from ..runtime.device import SIMULATOR, cuda, kernel_jit, multiprocessor_count
from ..runtime.launch import resident_blocks
from ..runtime.views import rows_in_pieces, with_unit_axes
from ..runtime.launch import launch as device_launch
from ..core import ptx

#: Kernel modes (one body): the causal walk, the per-segment state increments, the non-causal output.
CAUSAL, STATES, APPLY = 0, 1, 2
#: Input kinds: 16-bit float patterns (uint16 views) or float32.
FLOAT16, BFLOAT16, FLOAT32 = "float16", "bfloat16", "float32"
DTYPES = (FLOAT16, BFLOAT16, FLOAT32)
#: mma.sync m16n8k8 tf32 and cvt.rna.tf32 need sm_80.
MIN_COMPUTE_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class ChunkConfig:
    """Tuning knobs."""

    warps: int = 4  # chunk length C = 16 * warps rows; each warp owns 16 rows of S and of the output
    block_cols: int = 64  # value columns per block (the M tile) for E <= 128
    block_cols_wide: int = 32  # ... for E > 128, to keep Q, K and H of a block in shared memory
    blocks_per_sm: int = 3  # without an occupancy figure: segments are added until the grid has this many per SM
    wave_plan: bool = True  # size segments by the occupancy calculator's resident blocks (see plan)
    states_cost: float = 0.35  # time of the STATES pass per chunk, in walk steps (measured: 0.20 vs 0.60 ms)
    segment_cost: float = 0.0  # walk steps per segment (a walking block first sums its predecessors' increments)
    min_segment_chunks: int = 2  # segments shorter than this cost more in the extra passes than they gain
    prefix_threads: int = 256
    min_blocks_per_sm: int = 1  # launch bound: 2 caps registers at 255 -> 255 (4 warps), 3 at 168
    max_shared_bytes: int = 227 * 1024
    presplit: bool = True  # keep H's tf32 (hi, lo) parts in shared memory too (more memory, fewer conversions)

    @property
    def chunk(self) -> int:
        return 16 * self.warps


GPU_CONFIG = ChunkConfig()
#: the simulator runs every thread as a Python thread and every MMA as a block-wide barrier: one warp, narrow tiles
SIMULATOR_CONFIG = ChunkConfig(warps=1, block_cols=8, block_cols_wide=8, blocks_per_sm=1, min_segment_chunks=1)


def default_config() -> ChunkConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Tiles:
    """Compile-time shape of one specialisation."""

    warps: int
    e_pad: int  # E rounded up to 16 (the M of the state-update MMA)
    value_cols: int  # value columns of V / out a block owns
    normalise: bool  # one more n8 block: a ones column of V, giving the normaliser
    min_blocks: int = 1  # launch bound (blocks per SM the registers must allow)

    @property
    def chunk(self) -> int:
        return 16 * self.warps

    @property
    def cols(self) -> int:  # state / V-tile columns
        return self.value_cols + (8 if self.normalise else 0)

    @property
    def q_stride(self) -> int:
        return self.e_pad + 4

    @property
    def v_stride(self) -> int:
        return self.cols + 4

    @property
    def h_stride(self) -> int:
        return self.cols + (8 - self.cols % 32) % 32

    @property
    def k_offset(self) -> int:
        return self.chunk * self.q_stride

    @property
    def v_offset(self) -> int:
        return 2 * self.chunk * self.q_stride

    @property
    def h_offset(self) -> int:
        return self.v_offset + self.chunk * self.v_stride

    presplit: bool = False  # H also kept as its tf32 (hi, lo) parts, ready for the Q H product

    @property
    def h_size(self) -> int:
        return self.e_pad * self.h_stride

    @property
    def shared_bytes(self) -> int:
        return 4 * (self.h_offset + self.h_size * (3 if self.presplit else 1))


@lru_cache(maxsize=512)  # asked twice per call (the launcher's occupancy query, then plan): made once per shape
def tiles_for(config: ChunkConfig, e: int, m: int, normalise: bool) -> Tiles:
    e_pad = _cdiv(e, 16) * 16
    width = config.block_cols if e_pad <= 128 else config.block_cols_wide
    value_cols = min(width, _cdiv(m, 8) * 8)
    tiles = Tiles(config.warps, e_pad, value_cols, normalise, config.min_blocks_per_sm, presplit=config.presplit)
    if tiles.shared_bytes > config.max_shared_bytes:  # no room for the split copies: split H where it is read
        tiles = Tiles(config.warps, e_pad, value_cols, normalise, config.min_blocks_per_sm, presplit=False)
    if tiles.shared_bytes > config.max_shared_bytes:
        raise ValueError(f"E={e}, M={m}: tiles need {tiles.shared_bytes} bytes of shared memory")
    return tiles


@dataclass(frozen=True)
class Plan:
    tiles: Tiles
    m_tiles: int  # blocks across M per head
    segments: int  # blocks along the sequence per (head, M tile)
    segment_chunks: int


def plan(batch_heads: int, seqlen: int, e: int, m: int, normalise: bool, sm_count: int,
         config: ChunkConfig | None = None, segments: int | None = None, resident: int | None = None) -> Plan:
    """Tiles and the sequence split into segments (blocks along the sequence per head and M tile).

    ``resident``: blocks of the walk kernel one SM holds at once (the occupancy calculator's answer). Given, the
    segment count minimises the walk's critical path, ``waves * chunks per segment``, where a wave is one block
    on every resident slot of the GPU: every block walks the same number of chunks, so a last wave that fills a
    few slots costs as long as a full one. Segments beyond one cost the STATES pass (``config.states_cost`` of
    a walk step per chunk), a prefix launch and ``config.segment_cost`` steps per segment, so ties go to fewer.
    Without ``resident``: segments are added until the grid has ``config.blocks_per_sm`` blocks per SM. ``segments`` given: used as is (clamped).
    """
    config = config or default_config()
    tiles = tiles_for(config, e, m, normalise)
    m_tiles = _cdiv(m, tiles.value_cols)
    chunks = max(1, _cdiv(seqlen, tiles.chunk))
    if segments is None:
        most = max(1, chunks // config.min_segment_chunks)
        groups = max(1, batch_heads * m_tiles)
        if resident:
            segments = _fewest_steps(groups, chunks, most, max(1, resident * sm_count), config.states_cost,
                                     config.segment_cost)
        else:
            segments = min(_cdiv(config.blocks_per_sm * sm_count, groups), most)
    segments = max(1, min(int(segments), chunks, 65535))
    segment_chunks = _cdiv(chunks, segments)
    segments = _cdiv(chunks, segment_chunks)  # no empty segment
    return Plan(tiles, m_tiles, segments, segment_chunks)


@lru_cache(maxsize=4096)
def _fewest_steps(groups: int, chunks: int, most: int, slots: int, states_cost: float, segment_cost: float) -> int:
    best, best_cost = 1, float("inf")
    segments = 1
    while segments <= most:
        # only the distinct segment lengths matter, each with the fewest segments that give it: O(sqrt(chunks))
        length = _cdiv(chunks, segments)
        fewest = _cdiv(chunks, length)
        steps = _cdiv(groups * fewest, slots) * length
        cost = steps * (1.0 + states_cost) + segment_cost * fewest if fewest > 1 else float(steps)
        if cost < best_cost:
            best, best_cost = fewest, cost
        if length == 1:
            break
        segments = max(segments + 1, _cdiv(chunks, length - 1))
    return best


def _device_function(fn):
    if SIMULATOR:
        return fn
    return cuda.jit(device=True, forceinline=True)(fn)


def _mma_terms(a_split: bool, b_split: bool):
    """``C += A B`` with tf32 operands given as (hi, lo) pairs: the lo terms only where the operand is split, small
    terms first (they are rounded away least when the big term is added last)."""
    mma = ptx.mma_m16n8k8_tf32

    def terms(a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, c0, c1, c2, c3):
        if a_split:
            c0, c1, c2, c3 = mma(l0, l1, l2, l3, b0, b1, c0, c1, c2, c3)
        if b_split:
            c0, c1, c2, c3 = mma(a0, a1, a2, a3, m0, m1, c0, c1, c2, c3)
        return mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    return _device_function(terms)


def _operand(split: bool):
    """float32 -> (hi, lo) tf32 bit patterns; without ``split`` the value is already tf32 (staged rounded): (bits, 0)."""
    to_tf32 = ptx.to_tf32
    float_bits = ptx.float_bits
    bits_float = ptx.bits_float

    def operand(x):
        if split:
            hi = to_tf32(x)
            return hi, to_tf32(x - bits_float(hi))
        return float_bits(x), uint32(0)

    return _device_function(operand)


def _kernel_source(tiles: Tiles, mode: int, dtype: str, split: bool, feature_map: bool, vector: bool):
    WARPS = tiles.warps
    NT = 32 * WARPS
    C = tiles.chunk
    E_PAD = tiles.e_pad
    COLS = tiles.cols
    VALUE_COLS = tiles.value_cols
    NORM = tiles.normalise
    PRESPLIT = tiles.presplit
    DEN_BLOCK = VALUE_COLS // 8  # the n8 block whose first column is the ones column (normalise)
    QS, VS, HS = tiles.q_stride, tiles.v_stride, tiles.h_stride
    K_OFF, V_OFF, H_OFF = tiles.k_offset, tiles.v_offset, tiles.h_offset
    HI_OFF = H_OFF + tiles.h_size  # presplit: tf32 hi parts of H (as float32 bit patterns), then the lo parts
    LO_OFF = HI_OFF + tiles.h_size
    E_STEPS = E_PAD // 8  # k8 steps over E
    E_BLOCKS = E_PAD // 16  # m16 blocks of the state
    S_BLOCKS = C // 8  # n8 blocks of S = k8 steps of P V and of K^T V
    O_BLOCKS = COLS // 8
    ZERO = np.float32(0.0)
    ONE = np.float32(1.0)
    F32 = dtype == FLOAT32
    RAW = float32 if F32 else types.uint16  # a loaded element before conversion
    RAW_ZERO = np.float32(0.0) if F32 else np.uint16(0)
    QK_PER_THREAD = C * E_PAD // NT  # elements of one Q or K tile per thread (E_PAD / 2)
    V_PER_THREAD = C * COLS // NT
    BATCH = 16  # element loads in flight per thread while staging
    PIECE = 4  # elements per vector load (16 bytes of float32, 8 of 16-bit) and per 16-byte shared store
    QK_PIECES = C * E_PAD // PIECE
    V_PIECES = C * COLS // PIECE
    PIECE_BATCH = 8  # vector loads in flight per thread and tile
    STAGE_ROUNDED = not split  # single-term operands are rounded to tf32 once, when staged
    load1 = ptx.load1
    store1 = ptx.store1
    load2 = ptx.load2
    store2 = ptx.store2
    load_u16x4 = ptx.load_u16x4
    load_f32x2 = ptx.load_f32x2
    store_f32x2 = ptx.store_f32x2
    store_f32x4 = ptx.store_f32x4
    store_pair = ptx.store_pair
    load_f32x4 = ptx.load_f32x4
    to_tf32 = ptx.to_tf32
    float_bits = ptx.float_bits
    bits_float = ptx.bits_float
    shfl_xor = ptx.shfl_xor_f32
    low_u16 = ptx.low_u16
    half_to_float = ptx.half_to_float
    bf16_to_float = ptx.bf16_to_float
    pack = ptx.pack_bf16x2 if dtype == BFLOAT16 else ptx.pack_half2
    qk_mma = _mma_terms(split, split)  # S = Q K^T and K^T V: both inputs
    pv_mma = _mma_terms(split, split)  # P V: P is split exactly when the inputs are
    qh_mma = _mma_terms(split, True)  # Q H: the float32 state is always split
    input_operand = _operand(split)
    state_operand = _operand(True)
    p_operand = _operand(split)
    p_round = not split  # single-term P: round to tf32 (a plain bit read would truncate)
    exp = math.exp

    def finish(val, phi):
        """A converted element as the tiles hold it: feature-mapped, rounded for one-term MMAs."""
        if phi:
            val = val + ONE if val > ZERO else float32(exp(val))
        if STAGE_ROUNDED:
            val = bits_float(to_tf32(val))
        return val

    finish = _device_function(finish)

    def to_value(raw, phi):
        if F32:
            val = float32(raw)
        elif dtype == BFLOAT16:
            val = bf16_to_float(raw)
        else:
            val = half_to_float(raw)
        return finish(val, phi)

    to_value = _device_function(to_value)

    def low_value(word):
        return bf16_to_float(word) if dtype == BFLOAT16 else half_to_float(word)

    def high_value(word):
        return bits_float(word & 0xFFFF0000) if dtype == BFLOAT16 else half_to_float(word >> 16)

    low_value = _device_function(low_value)
    high_value = _device_function(high_value)

    def store_piece(smem, at, inside, w0, w1, w2, w3, phi):
        """One staged piece of 4 elements at smem[at ...] in one 16-byte store (float32: w0..w3 are the values;
        16-bit inputs: w0, w1 are two words of two elements each). A warp's stores then cover consecutive 16-byte
        slots, free of bank conflicts (element-wise stores 8 words apart would conflict 4 ways)."""
        if not inside:
            store_f32x4(smem, at, ZERO, ZERO, ZERO, ZERO)
        elif F32:
            store_f32x4(smem, at, finish(w0, phi), finish(w1, phi), finish(w2, phi), finish(w3, phi))
        else:
            store_f32x4(smem, at, finish(low_value(w0), phi), finish(high_value(w0), phi),
                        finish(low_value(w1), phi), finish(high_value(w1), phi))

    store_piece = _device_function(store_piece)

    def load_piece(arr, row, col):
        if F32:
            return load_f32x4(arr, row, col)
        w0, w1 = load_u16x4(arr, row, col)
        return w0, w1, w0, w1  # (only the first two words are used)

    load_piece = _device_function(load_piece)

    def store_out(arr, row, col, x0, x1, pairs):
        """Two neighbouring output elements (col even): one 4- or 8-byte store when ``pairs``."""
        if F32:
            if pairs:
                store_pair(arr, row, col, x0, x1)
            else:
                store2(arr, row, col, x0)
                if col + 1 < arr.shape[1]:
                    store2(arr, row, col + 1, x1)
        else:
            word = pack(x0, x1)
            if pairs:
                store_pair(arr, row, col, low_u16(word), ptx.high_u16(word))
            else:
                store2(arr, row, col, low_u16(word))
                if col + 1 < arr.shape[1]:
                    store2(arr, row, col + 1, ptx.high_u16(word))

    store_out = _device_function(store_out)

    def store_state(smem, at, value):
        """H[at] = value, and its tf32 parts when the kernel keeps them."""
        store1(smem, H_OFF + at, value)
        if PRESPLIT:
            hi = to_tf32(value)
            store1(smem, HI_OFF + at, bits_float(hi))
            store1(smem, LO_OFF + at, bits_float(to_tf32(value - bits_float(hi))))

    store_state = _device_function(store_state)

    def add_state_pair(smem, at, x0, x1):
        """H[at : at + 2] += (x0, x1) with 8-byte accesses (a warp's C-fragment pairs then hit no bank twice), and
        the tf32 parts when kept."""
        h0, h1 = load_f32x2(smem, H_OFF + at)
        h0 += x0
        h1 += x1
        store_f32x2(smem, H_OFF + at, h0, h1)
        if PRESPLIT:
            hi0 = to_tf32(h0)
            hi1 = to_tf32(h1)
            store_f32x2(smem, HI_OFF + at, bits_float(hi0), bits_float(hi1))
            store_f32x2(smem, LO_OFF + at, bits_float(to_tf32(h0 - bits_float(hi0))),
                        bits_float(to_tf32(h1 - bits_float(hi1))))

    add_state_pair = _device_function(add_state_pair)

    def state_b(smem, at):
        """(hi, lo) tf32 parts of H[at] as the B operand of Q H."""
        if PRESPLIT:
            return float_bits(load1(smem, HI_OFF + at)), float_bits(load1(smem, LO_OFF + at))
        return state_operand(load1(smem, H_OFF + at))

    state_b = _device_function(state_b)

    def kernel(q, k, v, out, state, final, has_state, write_final, eps, segment_chunks, state_segments, m_tiles):
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        bhm = cuda.blockIdx.x
        seg = cuda.blockIdx.y
        mt = bhm % m_tiles
        bh = bhm // m_tiles
        heads = q.shape[1]
        b = bh // heads
        h = bh % heads
        e_dim = q.shape[3]
        m_dim = v.shape[3]
        seqlen = k.shape[2] if mode == STATES else q.shape[2]
        col0 = mt * VALUE_COLS
        row_begin = seg * segment_chunks * C
        row_end = min(seqlen, row_begin + segment_chunks * C)
        state_row = bhm * state_segments + (0 if mode == APPLY else seg)
        q_head = q[b, h]
        k_head = k[b, h]
        v_head = v[b, h]
        out_head = out[b, h]
        smem = cuda.shared.array(0, float32)
        q_raw = cuda.local.array(BATCH, RAW)
        k_raw = cuda.local.array(BATCH, RAW)
        v_raw = cuda.local.array(BATCH, RAW)
        q_words = cuda.local.array((PIECE_BATCH, 4), RAW if F32 else types.uint32)
        k_words = cuda.local.array((PIECE_BATCH, 4), RAW if F32 else types.uint32)
        s = cuda.local.array((S_BLOCKS, 4), float32)
        o = cuda.local.array((O_BLOCKS, 4), float32)

        # ---- the state this block starts from (zero for STATES: it sums its own segment) ---------------------------
        for idx in range(tid, E_PAD * COLS, NT):
            e = idx // COLS
            c = idx - e * COLS
            val = ZERO
            if has_state and mode != STATES:
                val = state[state_row, e, c]
            store_state(smem, e * HS + c, val)

        for c0 in range(row_begin, row_end, C):
            cuda.syncthreads()  # the previous chunk's tiles and state are no longer read
            # ---- stage the chunk: rows past the end and padded columns are zeros (they add exactly 0) ------------
            # Loads are issued in batches before any is converted and stored, so that their latencies overlap (a
            # shared store between two global loads would serialise them: LLVM cannot tell the global pointer
            # from the shared one).
            if vector:
                for base in range(0, QK_PIECES, PIECE_BATCH * NT):
                    for i in range(PIECE_BATCH):
                        piece = base + i * NT + tid
                        r = piece // (E_PAD // PIECE)
                        col = (piece - r * (E_PAD // PIECE)) * PIECE
                        if piece < QK_PIECES and c0 + r < seqlen and col < e_dim:
                            if mode != STATES:
                                q_words[i, 0], q_words[i, 1], q_words[i, 2], q_words[i, 3] = load_piece(
                                    q_head, c0 + r, col)
                            if mode != APPLY:
                                k_words[i, 0], k_words[i, 1], k_words[i, 2], k_words[i, 3] = load_piece(
                                    k_head, c0 + r, col)
                    for i in range(PIECE_BATCH):
                        piece = base + i * NT + tid
                        r = piece // (E_PAD // PIECE)
                        col = (piece - r * (E_PAD // PIECE)) * PIECE
                        inside = c0 + r < seqlen and col < e_dim
                        if piece < QK_PIECES:
                            if mode != STATES:
                                store_piece(smem, r * QS + col, inside, q_words[i, 0], q_words[i, 1],
                                            q_words[i, 2], q_words[i, 3], feature_map)
                            if mode != APPLY:
                                store_piece(smem, K_OFF + r * QS + col, inside, k_words[i, 0], k_words[i, 1],
                                            k_words[i, 2], k_words[i, 3], feature_map)
                if mode != APPLY:
                    for base in range(0, V_PIECES, PIECE_BATCH * NT):
                        for i in range(PIECE_BATCH):
                            piece = base + i * NT + tid
                            r = piece // (COLS // PIECE)
                            col = (piece - r * (COLS // PIECE)) * PIECE
                            if piece < V_PIECES and c0 + r < seqlen and col < VALUE_COLS and col0 + col < m_dim:
                                q_words[i, 0], q_words[i, 1], q_words[i, 2], q_words[i, 3] = load_piece(
                                    v_head, c0 + r, col0 + col)
                        for i in range(PIECE_BATCH):
                            piece = base + i * NT + tid
                            r = piece // (COLS // PIECE)
                            col = (piece - r * (COLS // PIECE)) * PIECE
                            if piece < V_PIECES:
                                if col < VALUE_COLS:
                                    inside = c0 + r < seqlen and col0 + col < m_dim
                                    store_piece(smem, V_OFF + r * VS + col, inside, q_words[i, 0], q_words[i, 1],
                                                q_words[i, 2], q_words[i, 3], False)
                                else:  # the normaliser's block: a ones column, then zeros
                                    one = ONE if c0 + r < seqlen and col == VALUE_COLS else ZERO
                                    store_f32x4(smem, V_OFF + r * VS + col, one, ZERO, ZERO, ZERO)
            else:
                for base in range(0, QK_PER_THREAD, BATCH):
                    for i in range(BATCH):
                        if base + i < QK_PER_THREAD:
                            idx = tid + (base + i) * NT
                            r = idx // E_PAD
                            e = idx - r * E_PAD
                            inside = c0 + r < seqlen and e < e_dim
                            if mode != STATES:
                                q_raw[i] = load2(q_head, c0 + r, e) if inside else RAW_ZERO
                            if mode != APPLY:
                                k_raw[i] = load2(k_head, c0 + r, e) if inside else RAW_ZERO
                    for i in range(BATCH):
                        if base + i < QK_PER_THREAD:
                            idx = tid + (base + i) * NT
                            r = idx // E_PAD
                            e = idx - r * E_PAD
                            inside = c0 + r < seqlen and e < e_dim
                            if mode != STATES:
                                store1(smem, r * QS + e, to_value(q_raw[i], feature_map) if inside else ZERO)
                            if mode != APPLY:
                                store1(smem, K_OFF + r * QS + e, to_value(k_raw[i], feature_map) if inside else ZERO)
                if mode != APPLY:
                    for base in range(0, V_PER_THREAD, BATCH):
                        for i in range(BATCH):
                            if base + i < V_PER_THREAD:
                                idx = tid + (base + i) * NT
                                r = idx // COLS
                                c = idx - r * COLS
                                inside = c0 + r < seqlen and c < VALUE_COLS and col0 + c < m_dim
                                v_raw[i] = load2(v_head, c0 + r, col0 + c) if inside else RAW_ZERO
                        for i in range(BATCH):
                            if base + i < V_PER_THREAD:
                                idx = tid + (base + i) * NT
                                r = idx // COLS
                                c = idx - r * COLS
                                val = to_value(v_raw[i], False)
                                if c == VALUE_COLS and c0 + r < seqlen:
                                    val = ONE  # the normaliser's column (normalise only: COLS > VALUE_COLS)
                                store1(smem, V_OFF + r * VS + c, val)
            cuda.syncthreads()

            if mode != STATES:
                # ---- S = Q K^T (causal) and O = Q H, sharing the Q fragments ---------------------------------------
                r0 = 16 * warp + g  # this thread's rows r0 and r0 + 8 of the chunk
                for ob in range(O_BLOCKS):
                    for x in range(4):
                        o[ob, x] = ZERO
                for nb in range(S_BLOCKS):
                    for x in range(4):
                        s[nb, x] = ZERO
                for kk in range(E_STEPS):
                    a0, l0 = input_operand(load1(smem, r0 * QS + 8 * kk + t))
                    a1, l1 = input_operand(load1(smem, (r0 + 8) * QS + 8 * kk + t))
                    a2, l2 = input_operand(load1(smem, r0 * QS + 8 * kk + t + 4))
                    a3, l3 = input_operand(load1(smem, (r0 + 8) * QS + 8 * kk + t + 4))
                    if mode == CAUSAL:
                        for nb in range(S_BLOCKS):
                            if 8 * nb <= 16 * warp + 15:  # blocks wholly above the diagonal stay 0
                                b0, m0 = input_operand(load1(smem, K_OFF + (8 * nb + g) * QS + 8 * kk + t))
                                b1, m1 = input_operand(load1(smem, K_OFF + (8 * nb + g) * QS + 8 * kk + t + 4))
                                s[nb, 0], s[nb, 1], s[nb, 2], s[nb, 3] = qk_mma(
                                    a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, s[nb, 0], s[nb, 1], s[nb, 2],
                                    s[nb, 3])
                    for ob in range(O_BLOCKS):
                        b0, m0 = state_b(smem, (8 * kk + t) * HS + 8 * ob + g)
                        b1, m1 = state_b(smem, (8 * kk + t + 4) * HS + 8 * ob + g)
                        o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3] = qh_mma(
                            a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3])

                if mode == CAUSAL:
                    # ---- keep keys j <= i, then O += P V with S's C fragments as A (c0, c2, c1, c3) ------------------
                    for nb in range(S_BLOCKS):
                        for x in range(4):
                            key = 8 * nb + 2 * t + x % 2
                            if key > r0 + 8 * (x // 2):
                                s[nb, x] = ZERO
                            elif p_round:
                                s[nb, x] = bits_float(to_tf32(s[nb, x]))
                    for kk in range(S_BLOCKS):
                        if 8 * kk <= 16 * warp + 15:
                            a0, l0 = p_operand(s[kk, 0])
                            a1, l1 = p_operand(s[kk, 2])
                            a2, l2 = p_operand(s[kk, 1])
                            a3, l3 = p_operand(s[kk, 3])
                            for ob in range(O_BLOCKS):
                                b0, m0 = input_operand(load1(smem, V_OFF + (8 * kk + 2 * t) * VS + 8 * ob + g))
                                b1, m1 = input_operand(load1(smem, V_OFF + (8 * kk + 2 * t + 1) * VS + 8 * ob + g))
                                o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3] = pv_mma(
                                    a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, o[ob, 0], o[ob, 1], o[ob, 2],
                                    o[ob, 3])

                # ---- output rows (normalise: numerator / (denominator + eps), 0 where that is 0) -----------------
                row_a = c0 + r0
                row_b = row_a + 8
                scale_a = ONE
                scale_b = ONE
                if NORM:
                    # the ones column is column 0 of DEN_BLOCK, held by t == 0; the other lanes hold zero columns
                    den_a = o[DEN_BLOCK, 0]
                    den_b = o[DEN_BLOCK, 2]
                    den_a += shfl_xor(den_a, 1)
                    den_a += shfl_xor(den_a, 2)
                    den_b += shfl_xor(den_b, 1)
                    den_b += shfl_xor(den_b, 2)
                    den_a += eps
                    den_b += eps
                    scale_a = ONE / den_a if den_a != ZERO else ZERO
                    scale_b = ONE / den_b if den_b != ZERO else ZERO
                for ob in range(VALUE_COLS // 8):
                    col = col0 + 8 * ob + 2 * t
                    if col < m_dim:
                        if row_a < seqlen:
                            store_out(out_head, row_a, col, o[ob, 0] * scale_a, o[ob, 1] * scale_a, vector)
                        if row_b < seqlen:
                            store_out(out_head, row_b, col, o[ob, 2] * scale_b, o[ob, 3] * scale_b, vector)

            if mode != APPLY:
                if mode == CAUSAL:
                    cuda.syncthreads()  # every warp has read H for this chunk's output
                # ---- H += K_c^T V_c: A = K^T read from the [key][e] tile with the permuted k (keys 2t, 2t + 1) ----
                # The chunk's increment starts from zero and is added to H with ordinary float32 adds: the tensor
                # cores' accumulation does not round to nearest, and feeding H itself as C would let that error
                # grow with the number of chunks (measured: 8e-5 after 256 chunks vs 1e-6 this way).
                for eb in range(warp, E_BLOCKS, WARPS):
                    e0 = 16 * eb + g
                    for ob in range(O_BLOCKS):
                        for x in range(4):
                            o[ob, x] = ZERO
                    for kk in range(S_BLOCKS):
                        a0, l0 = input_operand(load1(smem, K_OFF + (8 * kk + 2 * t) * QS + e0))
                        a1, l1 = input_operand(load1(smem, K_OFF + (8 * kk + 2 * t) * QS + e0 + 8))
                        a2, l2 = input_operand(load1(smem, K_OFF + (8 * kk + 2 * t + 1) * QS + e0))
                        a3, l3 = input_operand(load1(smem, K_OFF + (8 * kk + 2 * t + 1) * QS + e0 + 8))
                        for ob in range(O_BLOCKS):
                            b0, m0 = input_operand(load1(smem, V_OFF + (8 * kk + 2 * t) * VS + 8 * ob + g))
                            b1, m1 = input_operand(load1(smem, V_OFF + (8 * kk + 2 * t + 1) * VS + 8 * ob + g))
                            o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3] = qk_mma(
                                a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, o[ob, 0], o[ob, 1], o[ob, 2], o[ob, 3])
                    for ob in range(O_BLOCKS):
                        add_state_pair(smem, e0 * HS + 8 * ob + 2 * t, o[ob, 0], o[ob, 1])
                        add_state_pair(smem, (e0 + 8) * HS + 8 * ob + 2 * t, o[ob, 2], o[ob, 3])

        # ---- the segment's increment (STATES), or the final state (last CAUSAL segment) --------------------------
        if mode == STATES or (mode == CAUSAL and write_final and seg == cuda.gridDim.y - 1):
            cuda.syncthreads()
            for idx in range(tid, E_PAD * COLS, NT):
                e = idx // COLS
                c = idx - e * COLS
                val = load1(smem, H_OFF + e * HS + c)
                if mode == STATES:
                    state[state_row, e, c] = val
                elif e < e_dim and c < VALUE_COLS and col0 + c < m_dim:
                    final[b, h, e, col0 + c] = val

    return kernel


_U16_4D = types.Array(types.uint16, 4, "A")
_F32_4D = types.Array(types.float32, 4, "A")
_F32_3D = types.Array(types.float32, 3, "A")


def _signature(dtype: str):
    data = _F32_4D if dtype == FLOAT32 else _U16_4D
    return types.void(data, data, data, data, _F32_3D, _F32_4D, types.boolean, types.boolean, types.float32,
                      types.int64, types.int64, types.int64)


@lru_cache(maxsize=None)
def chunk_kernel(tiles: Tiles, mode: int, dtype: str, split: bool, feature_map: bool, vector: bool = False):
    """The compiled kernel of one specialisation (tiles, mode, dtype, operand split, feature map and load width are
    constants)."""
    source = _kernel_source(tiles, mode, dtype, split, feature_map, vector)
    if SIMULATOR:
        return cuda.jit(source)
    return cuda.jit(_signature(dtype), launch_bounds=(32 * tiles.warps, tiles.min_blocks), cache=True)(source)


@lru_cache(maxsize=None)
def _prefix_kernel(threads: int):
    @kernel_jit(launch_bounds=(threads, 1))
    def prefix(state, segments, init, has_init, m_tiles, value_cols, read_state, exclusive):
        """Per state entry: the state BEFORE each segment (``exclusive``: in place, starting from ``init``) or the
        total over segments (written to segment 0). ``read_state`` False: no increments yet, only ``init``."""
        e_pad = state.shape[1]
        cols = state.shape[2]
        groups = state.shape[0] // segments
        total = groups * e_pad * cols
        start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        for idx in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
            c = idx % cols
            e = (idx // cols) % e_pad
            bhm = idx // (cols * e_pad)
            running = float32(0.0)
            if has_init:
                bh = bhm // m_tiles
                m = (bhm % m_tiles) * value_cols + c
                if c < value_cols and e < init.shape[2] and m < init.shape[3]:
                    running = init[bh // init.shape[1], bh % init.shape[1], e, m]
            for seg in range(segments):
                r = bhm * segments + seg
                x = float32(0.0)
                if read_state:
                    x = state[r, e, c]
                if exclusive:
                    state[r, e, c] = running
                running += x
            if not exclusive:
                state[bhm * segments, e, c] = running

    return prefix


def _kind(x, dtype):
    """(array for the kernel, dtype name): 16-bit inputs travel as uint16 bit views."""
    np_dtype = np.dtype(x.dtype)
    if np_dtype == np.float32:
        return x, FLOAT32
    if np_dtype.itemsize != 2:
        raise TypeError(f"expected float16, bfloat16 (16-bit bits) or float32, got {np_dtype}")
    name = dtype or (FLOAT16 if np_dtype == np.float16 else BFLOAT16)
    return (x if np_dtype == np.uint16 else x.view(np.uint16)), name


def vector_loads_ok(*arrays) -> bool:
    """True when every row can be read and written in aligned pieces of 4 elements (8 bytes of 16-bit data, 16 of
    float32). Under the simulator only the row length matters: its twins read element by element, any strides."""
    if SIMULATOR:
        return all(x.shape[-1] % 4 == 0 for x in arrays)
    return all(rows_in_pieces(x, 4) for x in arrays)


def unused4(state):
    """A 4-D float32 stand-in for an argument the kernel does not touch. On a GPU a view of ``state``; under the
    simulator a separate array, because the simulator copies array arguments back after a launch and a stale alias
    would overwrite ``state``."""
    if SIMULATOR:
        return np.zeros((1, 1, 1, 1), np.float32)
    return with_unit_axes(state, 0, 1)


def scratch_state(scratch, shape, stream):
    if scratch:
        return scratch(shape)
    if SIMULATOR:
        return np.empty(shape, dtype=np.float32)
    return cuda.device_array(shape, dtype=np.float32, stream=stream)


def run_prefix(state, segments, init, has_init, p: Plan, read_state, exclusive, stream, config):
    threads = config.prefix_threads
    total = (state.shape[0] // segments) * state.shape[1] * state.shape[2]
    blocks = max(1, min(_cdiv(total, threads), 8 * multiprocessor_count()))
    args = (state, segments, init, bool(has_init), p.m_tiles, p.tiles.value_cols, bool(read_state), bool(exclusive))
    device_launch(_prefix_kernel(threads), blocks, threads, stream, 0, *args)


def _launch(kernel, p: Plan, grid_y, stream, *args):
    grid = (args[0].shape[0] * args[0].shape[1] * p.m_tiles, grid_y)
    device_launch(kernel, grid, 32 * p.tiles.warps, stream, p.tiles.shared_bytes, *args)


#: kernels of the causal dot product: "registers" (``linear_mma``: the state in registers, cp.async staging,
#: float16 / bfloat16 MMAs for 16-bit inputs and tf32 for float32; the plain product, E <= 128) or "shared" (this
#: module's kernel: the state in shared memory; the layer, E up to 256); None takes "registers" where it applies
KERNELS = ("registers", "shared")


def launch_causal(q, k, v, out, stream, *, initial_state=None, final_state=None, normalise=False, eps=0.0,
                  tf32=False, dtype=None, segments=None, config: ChunkConfig | None = None, scratch=None,
                  kernel: str | None = None):
    """Causal dot product (``normalise=False``) or the causal layer with ``phi = elu + 1`` (``normalise=True``) on
    device views ``(batch, heads, seqlen, E | M)``, any strides.

    ``initial_state`` / ``final_state``: float32 ``(batch, heads, E, M)`` views (plain product only), read before /
    written after the sequence. ``tf32``: float32 inputs in one tf32 term instead of three. ``segments``: sequence
    blocks per (head, M tile), None for :func:`plan`'s choice. ``kernel``: see ``KERNELS``; ``config`` tunes this
    module's kernel only (``linear_mma`` has its own).
    """
    from . import mma as linear_mma

    batch, heads, seqlen, e = q.shape
    m = v.shape[3]
    bh = batch * heads
    if bh == 0:
        return
    q, dtype = _kind(q, dtype)
    k, _ = _kind(k, dtype)
    v, _ = _kind(v, dtype)
    out, _ = _kind(out, dtype)
    if kernel not in (None,) + KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS} or None, got {kernel!r}")
    registers_ok = not normalise and linear_mma.supports(e, m)
    if kernel == "registers" and not registers_ok:
        raise ValueError(f"kernel: 'registers' takes the plain causal product with E <= {linear_mma.MAX_E}")
    if registers_ok and kernel != "shared":
        linear_mma.launch_causal(q, k, v, out, stream, dtype=dtype, terms=1 if tf32 else 3,
                                 initial_state=initial_state, final_state=final_state, segments=segments,
                                 scratch=scratch)
        return
    config = config or default_config()
    split = dtype == FLOAT32 and not tf32
    vector = vector_loads_ok(q, k, v, out)
    tiles = tiles_for(config, e, m, normalise)
    walk = chunk_kernel(tiles, CAUSAL, dtype, split, normalise, vector)
    resident = resident_blocks(walk, 32 * tiles.warps, tiles.shared_bytes) if config.wave_plan else None
    p = plan(bh, seqlen, e, m, normalise, multiprocessor_count(), config, segments, resident)
    has_init = initial_state is not None
    shape = (bh * p.m_tiles * p.segments, p.tiles.e_pad, p.tiles.cols)
    if p.segments > 1 or has_init:
        state = scratch_state(scratch, shape, stream)
        if p.segments > 1:
            states = chunk_kernel(p.tiles, STATES, dtype, split, normalise, vector)
            _launch(states, p, p.segments, stream, q, k, v, out, state, unused4(state), False, False,
                    np.float32(0.0),
                    p.segment_chunks, p.segments, p.m_tiles)
        init = initial_state if has_init else unused4(state)
        run_prefix(state, p.segments, init, has_init, p, p.segments > 1, True, stream, config)
        has_state = True
    else:
        state = scratch_state(scratch, (1, 1, 1), stream)
        has_state = False
    # seqlen == 0 still launches one block per (head, M tile): it writes the final state (= the initial one)
    final = final_state if final_state is not None else unused4(state)  # a placeholder, not written
    _launch(walk, p, p.segments, stream, q, k, v, out, state, final, has_state, final_state is not None,
            np.float32(eps), p.segment_chunks, p.segments, p.m_tiles)


def launch_noncausal(q, k, v, out, eps, stream, *, tf32=False, dtype=None, segments=None,
                     config: ChunkConfig | None = None, scratch=None):
    """Non-causal linear attention with ``phi = elu + 1`` and the normaliser: ``out = phi(Q) H / (phi(Q) z + eps)``
    with ``H = phi(K)^T V`` and ``z = sum phi(k_j)`` over all keys. k, v may have a seqlen different from q's."""
    config = config or default_config()
    batch, heads, seqlen_q, e = q.shape
    seqlen_k, m = v.shape[2], v.shape[3]
    bh = batch * heads
    if bh == 0 or seqlen_q == 0:
        return
    q, dtype = _kind(q, dtype)
    k, _ = _kind(k, dtype)
    v, _ = _kind(v, dtype)
    out, _ = _kind(out, dtype)
    split = dtype == FLOAT32 and not tf32
    vector = vector_loads_ok(q, k, v, out)
    sm_count = multiprocessor_count()
    tiles = tiles_for(config, e, m, True)
    apply = chunk_kernel(tiles, APPLY, dtype, split, True, vector)
    resident = resident_blocks(apply, 32 * tiles.warps, tiles.shared_bytes) if config.wave_plan else None
    p_keys = plan(bh, seqlen_k, e, m, True, sm_count, config, segments, resident)
    p_rows = plan(bh, seqlen_q, e, m, True, sm_count, config, None, resident)
    state = scratch_state(scratch, (bh * p_keys.m_tiles * p_keys.segments, p_keys.tiles.e_pad, p_keys.tiles.cols), stream)
    zero = np.float32(0.0)
    if seqlen_k > 0:
        states = chunk_kernel(p_keys.tiles, STATES, dtype, split, True, vector)
        _launch(states, p_keys, p_keys.segments, stream, q, k, v, out, state, unused4(state), False,
                False, zero,
                p_keys.segment_chunks, p_keys.segments, p_keys.m_tiles)
    run_prefix(state, p_keys.segments, unused4(state), False, p_keys, seqlen_k > 0, False, stream,
                config)
    _launch(apply, p_rows, p_rows.segments, stream, q, k, v, out, state, unused4(state), True, False,
            np.float32(eps),
            p_rows.segment_chunks, p_keys.segments, p_rows.m_tiles)
