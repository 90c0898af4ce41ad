"""FlashAttention-2 backward on tensor cores (``mma.sync.m16n8k16``, float32 accumulation), float16 and bfloat16.

Same interface as ``simt`` (views ``(batch, heads, seqlen, headdim)``, any strides, grouped-query heads, the
bottom-right causal mask, rows with ``lse = -inf`` contribute nothing), but the per-row statistics come from
``preprocess`` as ``stats`` (``(lse log2(e), D)`` pairs, padded rows) and 16-bit arrays travel as uint16 bit views.

Key-block kernel (``key_block_kernel``), grid ``(key blocks, kv_heads, batch)``
    ``warps`` warps, warp ``w`` owning keys ``16 key_tiles w ..`` of the block's ``block_n``; K and V of the block
    stay in shared memory, ``dK`` and ``dV`` in registers. The block streams the query tiles that see its keys (causal:
    from ``block_info.query_tiles_start``), for every query head of the kv head's group in one flat walk, so the
    group's sum needs no second pass and the ``cp.async`` double buffer of (Q, dO, stats) tiles runs across heads.
    Per tile, each warp for its keys: ``S^T = K Q^T`` and ``dP^T = V dO^T`` (A: K / V by ``ldmatrix``; B: Q / dO by
    ``ldmatrix``, as the forward's K), then ``P^T``, ``dS^T`` on the fragments (``core.gradients``), then ``dV += P^T
    dO`` and ``dK += dS^T Q`` with ``P^T`` / ``dS^T`` packed to 16 bits once, IN REGISTERS, as the A operand (C
    fragments of n8 blocks ``2j, 2j + 1`` = A fragment of k-step ``j``) and dO / Q as B by ``ldmatrix.trans``. Unless
    deterministic, ``dS^T`` also goes to shared memory (16-bit, 32-bit stores), and after a barrier the warps split
    ``dQ_tile = dS K`` (A: ``ldmatrix.trans`` of ``dS^T``; B: ``ldmatrix.trans`` of K; ``dq_row_tiles`` m-tiles x a
    share of the columns per warp) and add it to a float32 accumulator with ``red.global.add`` (``.v2`` on sm_90).
    Padded head dims above ``max_single_pass_dim`` take two launches, one for ``dV`` (no ``dP``) and one for ``dK``
    and ``dQ``, so that one ``16 x d_pad`` accumulator per warp is live.
Query-block kernel (``query_block_kernel``, ``deterministic=True``), grid ``(query blocks, heads, batch)``
    The forward's walk: Q, dO and stats resident, K / V tiles double-buffered up to the diagonal; ``S = Q K^T``,
    ``dP = dO V^T``, ``dS`` on the fragments, ``dQ += dS K`` with ``dS`` from registers and K by ``ldmatrix.trans``;
    ``dQ`` written once (the same sums in the same order on every call).

Variants (``forward.common.Variant``, compile-time, the forward's): a sliding window (key blocks walk only the query
tiles that see them, ``block_info.query_tile_range``; query blocks only the key tiles, ``block_info.key_tile_walk``;
masks on the tiles the window's edges cut), soft-capping (``core.gradients``: ``tanh.approx``, as the 16-bit forward
kernels) and packed sequences (``flash_backward_varlen``: key blocks over a key schedule, query blocks over the
forward's; the stats of tiles that start on any row copied element by element, ``preprocess.stats_loader``).

Shared-memory rows are ``d_pad + 8`` (``dS^T``: ``block_m + 8``) 16-bit elements, an odd number of 16-byte pieces,
so the 8 rows an ``ldmatrix`` matrix reads (and the 8 rows of a fragment's 32-bit stores) fall in distinct banks.
Rows past a sequence and columns past headdim are zeros. Runs under the CUDA simulator with the ``ptx`` twins.

This module: the configuration (``MmaBackwardConfig``), which calls it takes (``supports``), the compiled kernels of
each specialisation (``lru_cache``d builders over the sources in ``mma_kernels``) and the launches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import types

from ..core.block_info import QUERY_MAJOR
from ..forward import common
from ..forward.common import PLAIN, Variant
from ..runtime.device import SIMULATOR, kernel_jit, max_shared_per_block
from ..runtime.launch import launch as device_launch
from . import mma_kernels as _kernels

#: float16 and bfloat16 (float32 stays on the SIMT kernels)
DTYPES = ("float16", "bfloat16")
#: mma.sync.m16n8k16 with bf16 operands, ldmatrix and cp.async need sm_80; red.add.v2.f32 needs sm_90
MIN_COMPUTE_CAPABILITY = (8, 0)
VECTOR_RED_CAPABILITY = (9, 0)


class KeyQueryTiles:
    """What the tensor-core backwards' configurations (``MmaBackwardConfig``, ``tf32.Tf32BackwardConfig``) derive
    alike from their fields ``warps``, ``key_tiles``, ``block_m``, ``dq_row_tiles``, ``min_warps``, ``dq_warps`` and
    ``dq_m_tiles``: a mixin of those frozen dataclasses."""

    def check_dq_row_tiles(self) -> None:
        m_tiles = self.block_m // 16
        if m_tiles % self.dq_row_tiles or self.warps % (m_tiles // self.dq_row_tiles):
            raise ValueError(f"{type(self).__name__}: dq_row_tiles ({self.dq_row_tiles}) must divide block_m / 16 "
                             f"({m_tiles}) into groups whose count divides warps ({self.warps})")

    @property
    def block_n(self) -> int:
        """Keys per block of the key-block kernel."""
        return 16 * self.key_tiles * self.warps

    @property
    def dq_block_m(self) -> int:
        """Query rows per block of the query-block kernel."""
        return 16 * self.dq_m_tiles * self.dq_warps

    def key_launch_bounds(self) -> tuple:
        return 32 * self.warps, max(1, self.min_warps // self.warps)

    def query_launch_bounds(self) -> tuple:
        return 32 * self.dq_warps, max(1, self.min_warps // self.dq_warps)


@dataclass(frozen=True)
class MmaBackwardConfig(KeyQueryTiles):
    """Tiles of both kernels, validated where made (whether they fit a device's shared memory at a head dim is the
    launch's question: ``shared_bytes``, ``common.check_shared_memory``)."""

    warps: int = 8  # key-block kernel: warps per block
    key_tiles: int = 1  # 16-key MMA tiles per warp: block_n = 16 key_tiles warps keys per block
    block_m: int = 64  # query rows per streamed tile
    dq_row_tiles: int = 2  # 16-row m-tiles of a tile's dQ = dS K per warp (the warps of one group split the columns)
    stages: int = 2  # cp.async stages of (Q, dO, stats) tiles
    min_warps: int = 8  # launch bound, as warps per SM to keep resident (as the forward's MmaConfig)
    max_single_pass_dim: int = 128  # padded head dims above this take two key-block launches (dV, then dK and dQ)
    dq_warps: int = 4  # query-block kernel: warps per block
    dq_m_tiles: int = 1  # 16-row m-tiles per warp there: dq_block_m = 16 dq_m_tiles dq_warps
    dq_block_n: int = 64  # keys per K / V tile there
    dq_stages: int = 2
    kv_in_registers: bool = False  # key-block kernel, padded head dims up to 64 / key_tiles: K, V fragments held

    def __post_init__(self):
        if type(self.kv_in_registers) is not bool:
            raise ValueError(f"MmaBackwardConfig.kv_in_registers: expected a bool, got {self.kv_in_registers!r}")
        common.check_fields(self, warps=(1, 32, 1), key_tiles=(1, 8, 1), block_m=(16, 256, 16),
                            dq_row_tiles=(1, 16, 1), stages=(2, 4, 1), min_warps=(1, None, 1),
                            max_single_pass_dim=(16, common.MAX_HEAD_DIM, 16), dq_warps=(1, 32, 1),
                            dq_m_tiles=(1, 8, 1), dq_block_n=(16, 256, 16), dq_stages=(2, 4, 1))
        self.check_dq_row_tiles()

    def key_shared_bytes(self, d_pad: int, atomic_dq: bool) -> int:
        """K, V; ``stages`` x (Q, dO, stats); ``dS^T`` when ``dQ`` is added by atomics."""
        row = d_pad + 8
        stage = 2 * self.block_m * row + 4 * self.block_m
        ds = self.block_n * (self.block_m + 8) if atomic_dq else 0
        return 2 * (2 * self.block_n * row + self.stages * stage + ds)

    def query_shared_bytes(self, d_pad: int) -> int:
        """Q, dO, stats; ``dq_stages`` x (K, V)."""
        row = d_pad + 8
        return 2 * (2 * self.dq_block_m * row + 4 * self.dq_block_m + self.dq_stages * 2 * self.dq_block_n * row)

    def shared_bytes(self, d_pad: int) -> int:
        """The most either kernel needs at this padded head dim."""
        return max(self.key_shared_bytes(d_pad, True), self.query_shared_bytes(d_pad))


#: GPU tiles by padded head dim (not yet timed on a GPU: ``scripts/check_backward.py --configs`` compares them).
#: <= 64 and <= 128: 8 warps of 16 keys (128-key blocks, one block per SM at 128) and 64-row query tiles, as FA2's
#: sm80 backward; above 128: 64-key blocks, 32-row tiles, two key-block launches (158 KB at 128, 141 KB at 256).
GPU_CONFIG_64 = MmaBackwardConfig()
GPU_CONFIG_128 = MmaBackwardConfig()
GPU_CONFIG_256 = MmaBackwardConfig(warps=4, block_m=32, dq_row_tiles=1, dq_block_n=32)
#: alternatives for ``scripts/check_backward.py --configs`` (ptxas for sm_90, fp16: registers / spill stores)
GPU_CANDIDATES = {
    "w8m64": GPU_CONFIG_128,  # the default: 255 regs, spills 0 B at 64, 60 B at 128
    "w8m64q1": MmaBackwardConfig(dq_row_tiles=1),  # dQ: one m-tile x half the columns per warp
    "w8m128": MmaBackwardConfig(block_m=128),  # 128-row query tiles (head dim 64 only: 147 KB; spills 132 B)
    "w4m64": MmaBackwardConfig(warps=4),  # 64-key blocks, two blocks per SM (115 KB at 128)
    "w8m32": MmaBackwardConfig(block_m=32, dq_row_tiles=1),  # 32-row tiles: no spills at 128
    "w4k2m32": MmaBackwardConfig(warps=4, key_tiles=2, block_m=32, dq_row_tiles=1),  # 32 keys per warp
    "w8k2m32": MmaBackwardConfig(key_tiles=2, block_m=32, dq_row_tiles=1),  # 256-key blocks: half the dQ atomics
    "w8m64dq8": MmaBackwardConfig(dq_warps=8),  # deterministic dQ: 128-row query blocks
    "w8m64kv": MmaBackwardConfig(kv_in_registers=True),  # head dim <= 64: K / V fragments held in registers
    "w4m32": GPU_CONFIG_256,  # the default above 128
}
#: one warp, 16-key blocks and 16-row tiles; two passes above 32 (every thread is a Python thread there)
SIMULATOR_CONFIG = MmaBackwardConfig(warps=1, block_m=16, dq_row_tiles=1, dq_warps=1, dq_block_n=16,
                                    max_single_pass_dim=32)


#: packed sequences up to padded head dim 128: the key-block kernel's bounds are run-time values and the stats of its
#: tiles are copied element by element (tiles start on any row), and with the default tiles ptxas spilled 80 bytes at
#: 64 and 200 at 128 (sm_90, float16); 32-row query tiles spill none at 64 and 16 bytes at 128
PACKED_GPU_CONFIG = GPU_CANDIDATES["w8m32"]


def default_config(head_dim: int = 128, packed: bool = False) -> MmaBackwardConfig:
    """The simulator's tiles, or the GPU tiles for this head dim (``packed``: for packed sequences)."""
    if SIMULATOR:
        return SIMULATOR_CONFIG
    d_pad = padded_head_dim(head_dim)
    if packed and d_pad <= 128:
        return PACKED_GPU_CONFIG
    return GPU_CONFIG_64 if d_pad <= 64 else GPU_CONFIG_128 if d_pad <= 128 else GPU_CONFIG_256


def padded_head_dim(head_dim: int) -> int:
    """A multiple of 16 (one MMA k-step; dK / dV / dQ columns in pairs of n8 blocks)."""
    return common.padded_head_dim(head_dim, 16)


def supports(dtype: str, head_dim: int) -> bool:
    """True when these kernels take the call on this device: float16 / bfloat16, head dims up to 256 whose default
    tiles fit a block's shared memory (every one on sm_80 / sm_90), any strides, sm_80 or newer."""
    if dtype not in DTYPES or not 1 <= head_dim <= common.MAX_HEAD_DIM:
        return False
    if not common.runs_here(MIN_COMPUTE_CAPABILITY):
        return False
    return SIMULATOR or default_config(head_dim).shared_bytes(padded_head_dim(head_dim)) <= max_shared_per_block()


def stats_rows(seqlen_q: int, config: MmaBackwardConfig) -> int:
    """Rows of the ``stats`` scratch (``preprocess``): ``seqlen_q`` rounded up to whole tiles of both kernels."""
    multiple = math.lcm(config.block_m, config.dq_block_m)
    return -(-seqlen_q // multiple) * multiple


_OPERAND = types.Array(types.uint16, 4, "A")
_FLOATS = types.Array(types.float32, 4, "A")
#: ``kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale)``
KEY_SIGNATURE = types.void(_OPERAND, _OPERAND, _OPERAND, _OPERAND, _FLOATS, _FLOATS, _OPERAND, _OPERAND,
                           types.boolean, types.float32, types.float32)
#: ``kernel(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale)``
QUERY_SIGNATURE = types.void(_OPERAND, _OPERAND, _OPERAND, _OPERAND, _FLOATS, _OPERAND, types.boolean,
                             types.float32, types.float32)


def signature(base: types.Signature, variant: Variant) -> types.Signature:
    """``KEY_SIGNATURE`` or ``QUERY_SIGNATURE``, with the int32 schedule after it for packed sequences."""
    return types.void(*base.args, types.Array(types.int32, 1, "A")) if variant.packed else base


@lru_cache(maxsize=None)
def key_block_kernel(config: MmaBackwardConfig, d_pad: int, bf16: bool, vector_loads: bool, want_dv: bool,
                     want_dk: bool, atomic_dq: bool, vector_red: bool, variant: Variant = PLAIN):
    """The compiled key-block kernel of one specialisation (``mma_kernels.key_block_source``)."""
    source = _kernels.key_block_source(config, d_pad, bf16, vector_loads, want_dv, want_dk, atomic_dq, vector_red,
                                       variant)
    return kernel_jit(config.key_launch_bounds(), signature(KEY_SIGNATURE, variant))(source)


@lru_cache(maxsize=None)
def query_block_kernel(config: MmaBackwardConfig, d_pad: int, bf16: bool, vector_loads: bool,
                       variant: Variant = PLAIN):
    """The compiled query-block kernel of one specialisation (``mma_kernels.query_block_source``)."""
    return kernel_jit(config.query_launch_bounds(), signature(QUERY_SIGNATURE, variant))(
        _kernels.query_block_source(config, d_pad, bf16, vector_loads, variant))


def key_block_passes(config: MmaBackwardConfig, d_pad: int) -> tuple:
    """``(want_dv, want_dk)`` of each key-block launch: one, or two above ``max_single_pass_dim``."""
    if d_pad <= config.max_single_pass_dim:
        return ((True, True),)
    return ((True, False), (False, True))


def _operands(dtype, *arrays):
    if dtype not in DTYPES:
        raise TypeError(f"dtype: the tensor-core backward takes float16 or bfloat16, got {dtype}")
    return [common.bits(x, name) for x, name in zip(arrays, ("q", "k", "v", "dout", "dq / dk", "dv"))]


def launch_dkdv(q, k, v, dout, stats, dq_acc, dk, dv, sm_scale: float, causal: bool, stream,
                config: MmaBackwardConfig | None = None, dtype: str | None = None, window=None,
                softcap: float | None = None, schedule=None) -> None:
    """``dk``, ``dv`` (and, unless ``dq_acc`` is None, ``sm_scale dS K`` added to ``dq_acc``: float32 ``(batch,
    heads, seqlen_q, padded head dim)``, zeroed before) from views ``(batch, heads, seqlen, headdim)`` of float16 or
    bfloat16 (bit views); ``stats`` from ``preprocess`` (``stats_rows`` rows). ``window``, ``softcap``: checked, as
    the forward's; ``schedule``: None, or the key schedule of packed sequences (``backward.varlen``; the views are
    then ``(1, heads, total, headdim)``)."""
    batch, kv_heads, seqlen_k, head_dim = k.shape
    config = config or default_config(head_dim)
    dtype = common.sixteen_bit_dtype(q, dtype)
    q, k, v, dout, dk, dv = _operands(dtype, q, k, v, dout, dk, dv)
    d_pad = padded_head_dim(head_dim)
    atomic = dq_acc is not None
    vector_red = atomic and not SIMULATOR and common.runs_here(VECTOR_RED_CAPABILITY)
    vector = common.vector_loads_ok(q, k, v, dout)
    shape = common.launch_grid(QUERY_MAJOR, batch, kv_heads, seqlen_k, config.block_n, schedule)
    variant = Variant.of(bool(causal), window, softcap, schedule is not None)
    scale, _ = common.scale_args(sm_scale, softcap)  # (applied inside the exponent: either sign)
    extra = () if schedule is None else (schedule,)
    for want_dv, want_dk in key_block_passes(config, d_pad):
        shared_bytes = config.key_shared_bytes(d_pad, atomic and want_dk)
        common.check_shared_memory(shared_bytes)
        kernel = key_block_kernel(config, d_pad, dtype == "bfloat16", vector, want_dv, want_dk, atomic and want_dk,
                                  vector_red, variant)
        # without atomics the kernel never touches dq_acc: the float32 stats stand in (one compiled type)
        device_launch(kernel, shape, config.warps * 32, stream, shared_bytes, q, k, v, dout, stats,
                      dq_acc if atomic else stats, dk, dv, bool(causal), scale, np.float32(sm_scale), *extra)


def launch_dq(q, k, v, dout, stats, dq, sm_scale: float, causal: bool, stream,
              config: MmaBackwardConfig | None = None, dtype: str | None = None, window=None,
              softcap: float | None = None, schedule=None) -> None:
    """``dq`` (q's dtype, any strides) from the query-block kernel; arguments as ``launch_dkdv`` (``schedule``: the
    forward's schedule of packed sequences, ``forward.varlen``, over ``dq_block_m``-row blocks)."""
    batch, heads, seqlen_q, head_dim = q.shape
    config = config or default_config(head_dim)
    dtype = common.sixteen_bit_dtype(q, dtype)
    q, k, v, dout, dq = _operands(dtype, q, k, v, dout, dq)
    d_pad = padded_head_dim(head_dim)
    shared_bytes = config.query_shared_bytes(d_pad)
    common.check_shared_memory(shared_bytes)
    variant = Variant.of(bool(causal), window, softcap, schedule is not None)
    kernel = query_block_kernel(config, d_pad, dtype == "bfloat16", common.vector_loads_ok(q, k, v, dout), variant)
    scale, _ = common.scale_args(sm_scale, softcap)
    extra = () if schedule is None else (schedule,)
    device_launch(kernel, common.launch_grid(QUERY_MAJOR, batch, heads, seqlen_q, config.dq_block_m, schedule),
                  config.dq_warps * 32, stream, shared_bytes, q, k, v, dout, stats, dq, bool(causal), scale,
                  np.float32(sm_scale), *extra)
