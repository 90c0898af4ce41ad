"""The backward's first kernel: ``D_i = rowsum(dout_i * out_i)`` in float32 for every query row (FlashAttention-2's
preprocessing), and, where ``dq`` is accumulated with atomics, the float32 accumulator zeroed in the same pass.

Grid ``(batch * heads, ceil(rows / threads_y))``; thread ``(ty, tx)`` sums columns ``tx + threads_x j`` of row
``ty`` of its block, the partial sums meet in shared memory and are added in a fixed order (the result does not
depend on timing). 16-bit rows in aligned 16-byte pieces (``vector_rows``) take 16-byte loads instead, thread ``tx``
the 8 columns from ``8 (tx + threads_x j)``: element by element the kernel was bound by its instructions (an H100 ran
it at 2.4x the time of cuDNN's). A contiguous accumulator is zeroed by a memset on the stream.

Two outputs: ``delta`` ``(batch, heads, seqlen_q)`` (the SIMT kernels), or, for the tensor-core kernels, ``stats``:
per row the pair ``(lse log2(e), D)``, float32, rows padded to a whole number of tiles, stored as ``(batch, heads,
rows / 2, 4)`` (two rows per 16-byte piece, what ``cp.async`` copies). There a row that sees no key (``lse = -inf``)
and every padding row get ``(+inf, 0)``: ``P = exp2(s - inf) = 0`` needs no test in the kernels. The kernels copy
a tile's pairs to shared memory with ``stats_loader`` (the same layout there: row ``r`` at float ``2r``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32
from numba import uint32 as index

from ..core import ptx
from ..core.block_info import HEAD_MAJOR, block_position, grid
from ..core.constants import LOG2E
from ..core.staging import device_function, tile_loader
from ..forward import common
from ..runtime.device import SIMULATOR, DeviceView, cuda, kernel_jit
from ..runtime.launch import launch as device_launch
from ..runtime.launch import stream_handle, zero_words_async


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
#: 16-byte loads: 8 threads cover 64 columns of a row, 32 rows per block
GPU_VECTOR_CONFIG = PreprocessConfig(threads_x=8, threads_y=32)
SIMULATOR_VECTOR_CONFIG = PreprocessConfig(threads_x=2, threads_y=4)


def default_config(vector: bool = False) -> PreprocessConfig:
    if vector:
        return SIMULATOR_VECTOR_CONFIG if SIMULATOR else GPU_VECTOR_CONFIG
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


_INF = np.float32(np.inf)
_LOG2E = np.float32(LOG2E)


@lru_cache(maxsize=None)
def preprocess_kernel(config: PreprocessConfig, zero_dq: bool, bf16: bool = False, stats: bool = False,
                      vector: bool = False):
    """``kernel(out, dout, lse, delta, dq_acc)``; ``zero_dq``: also set ``dq_acc`` (float32, q's shape, or wider or
    longer: padded columns and rows, ``core.dq_tile``) to 0, whole; ``bf16``: ``out`` and ``dout`` are bfloat16 bit
    patterns (uint16); ``stats``: ``delta`` is the ``stats`` array of the module docstring (``lse`` is read only
    then); ``vector``: ``out`` and ``dout`` are uint16 (float16 or bfloat16 bits, as ``bf16`` says) whose rows load
    in 16-byte pieces (``vector_rows``)."""
    TX, TY = config.threads_x, config.threads_y
    VECTOR = vector
    load8 = ptx.load_u16x8
    half_to_float = ptx.half_to_float
    PARTS = TX * TY  # a shared array's size must be a constant of the closure, not an expression of two
    ZERO_DQ = zero_dq
    STATS = stats
    BF16 = bf16
    INF = _INF
    LOG2E_F32 = _LOG2E
    position = block_position(HEAD_MAJOR, TY)
    bf16_to_float = ptx.bf16_to_float

    @kernel_jit(launch_bounds=(TX * TY, 1))
    def kernel(out, dout, lse, delta, dq_acc):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        # (out twice: one head per block, no grouped heads here)
        b, h, m0, out_head, _, do_head, dq_head = position(out, out, dout, dq_acc, False)
        seqlen_q = out.shape[2]
        head_dim = out.shape[3]
        rows = delta.shape[2] * 2 if STATS else seqlen_q
        row = m0 + ty
        part = float32(0.0)
        if VECTOR and row < seqlen_q:
            for c in range(8 * tx, head_dim, 8 * TX):
                a = load8(do_head, row, c)
                o = load8(out_head, row, c)
                for n in range(4):
                    if BF16:
                        part += bf16_to_float(a[n]) * bf16_to_float(o[n])
                        part += bf16_to_float(a[n] >> 16) * bf16_to_float(o[n] >> 16)
                    else:
                        part += half_to_float(a[n]) * half_to_float(o[n])
                        part += half_to_float(a[n] >> 16) * half_to_float(o[n] >> 16)
        elif row < seqlen_q:
            for d in range(tx, head_dim, TX):
                if BF16:
                    part += bf16_to_float(do_head[row, d]) * bf16_to_float(out_head[row, d])
                else:
                    part += float32(do_head[row, d]) * float32(out_head[row, d])
        if ZERO_DQ and row < dq_acc.shape[2]:
            for d in range(tx, dq_acc.shape[3], TX):
                dq_head[row, d] = float32(0.0)
        parts = cuda.shared.array(PARTS, float32)
        parts[index(ty * TX + tx)] = part
        cuda.syncthreads()
        if tx == 0 and row < rows:
            total = float32(0.0)
            for t in range(TX):
                total += parts[index(ty * TX + t)]
            if STATS:
                lse2 = INF
                if row < seqlen_q:
                    x = lse[b, h, row]
                    if x != -INF:
                        lse2 = x * LOG2E_F32
                delta[b, h, row // 2, 2 * (row % 2)] = lse2
                delta[b, h, row // 2, 2 * (row % 2) + 1] = total
            else:
                delta[b, h, row] = total

    return kernel


def launch(out, dout, delta, dq_acc, stream, config: PreprocessConfig | None = None, bf16: bool = False,
           lse=None) -> None:
    """``delta[b, h, i] = sum_d dout * out`` (float32 ``(batch, heads, seqlen_q)``); ``dq_acc`` (float32, q's shape
    or wider along headdim, or with more rows) zeroed whole unless None. Views of shape ``(batch, heads, seqlen_q,
    headdim)``, any strides; ``bf16``: they hold bfloat16 bits. With ``lse`` (the forward's, ``(batch, heads,
    seqlen_q)``) ``delta`` is the ``stats`` array ``(batch, heads, padded_rows / 2, 4)`` of the module docstring
    instead."""
    batch, heads, seqlen_q, _ = out.shape
    vector = config is None and vector_rows(out, dout)
    config = config or default_config(vector)
    if vector:  # (float16 read as its bits, as bfloat16 already is)
        out, dout = common.bits(out, "out"), common.bits(dout, "dout")
    zero_dq = dq_acc is not None
    if zero_dq and not SIMULATOR:
        view = DeviceView.of(dq_acc)
        if _contiguous(view):  # one memset on the stream, no stores in the kernel
            zero_words_async(view.ptr, view.size, stream_handle(stream))
            zero_dq = False
    stats = lse is not None
    kernel = preprocess_kernel(config, zero_dq, bool(bf16), stats, vector)
    rows = 2 * delta.shape[2] if stats else seqlen_q
    if zero_dq:
        rows = max(rows, dq_acc.shape[2])
    shape = grid(HEAD_MAJOR, batch, heads, rows, config.threads_y)
    device_launch(kernel, shape, (config.threads_x, config.threads_y), stream, 0, out, dout,
                  lse if stats else delta, delta, dq_acc if zero_dq else out)


def vector_rows(*arrays) -> bool:
    """Whether the 16-byte loads can read these arrays: 16-bit elements, rows in aligned 16-byte pieces."""
    return all(np.dtype(x.dtype).itemsize == 2 for x in arrays) and common.vector_loads_ok(*arrays)


def _contiguous(view) -> bool:
    step = view.dtype.itemsize
    for n, stride in zip(reversed(view.shape), reversed(view.strides)):
        if n > 1 and stride != step:
            return False
        step *= n
    return True


def stats_loader(threads: int, block_m: int, packed: bool):
    """``load(stats_head, floats, at, tid, m0, row_end)``: the ``(lse log2(e), D)`` pairs of rows ``m0 .. m0 +
    block_m - 1`` from ``stats_head`` (``(rows / 2, 4)``, one head of ``stats``) to ``floats[at + 2r ..]``, every one
    of the block's ``threads`` threads taking part. Dense batches: ``m0`` even (a tile of the query grid), 16-byte
    ``cp.async`` copies of row pairs, the padding rows' ``(+inf, 0)`` included (``row_end`` unused). Packed
    sequences, whose tiles start on any row: element by element and synchronous, rows from ``row_end`` on (another
    sequence's) as ``(+inf, 0)``."""
    if not packed:
        copy = tile_loader(threads, 4, 4, block_m // 2, np.float32, True)

        @device_function
        def load_pairs(stats_head, floats, at, tid, m0, row_end):
            copy(stats_head, floats, at, tid, m0 // 2, stats_head.shape[0], 0, 4)

        return load_pairs
    NT = threads
    WORDS = 2 * block_m
    INF = _INF
    ZERO = np.float32(0.0)

    @device_function
    def load_elements(stats_head, floats, at, tid, m0, row_end):
        for idx in range(tid, WORDS, NT):
            row = m0 + idx // 2
            x = INF if idx % 2 == 0 else ZERO
            if row < row_end:
                x = stats_head[row // 2, 2 * (row % 2) + idx % 2]
            floats[at + idx] = x

    return load_elements
