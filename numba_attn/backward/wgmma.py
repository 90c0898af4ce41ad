"""FlashAttention backward on Hopper's warpgroup MMAs (``wgmma.mma_async``, sm_90a), float16 and bfloat16: the
key-block kernel of ``backward.mma`` (``dK``, ``dV`` in registers, ``dQ`` by float32 reductions) rebuilt on
``core.warpgroup``, in the way of FlashAttention-3's backward.

Same interface as ``mma.launch_dkdv`` (views ``(batch, heads, seqlen, headdim)``, grouped-query heads, the
bottom-right causal mask, rows with ``lse = -inf`` contribute nothing, ``stats`` from ``preprocess``); it takes
inputs whose rows copy in aligned 16-byte pieces and padded head dims up to ``MAX_HEAD_DIM`` (``supports``), and the
dispatch gives the rest, and the deterministic ``dq`` (``mma.launch_dq``), to ``backward.mma``.

Work split, grid ``(key blocks, kv_heads, batch)``
    A block is ``warpgroups`` warpgroups (128 threads each) and ``block_n = 64 warpgroups`` keys; warpgroup ``w``
    owns keys ``64 w .. 64 w + 63``, the M dimension of its products. K and V of the block stay in shared memory,
    ``dK`` and ``dV`` (64 x d_pad float32 per warpgroup) in registers. The block streams the query tiles of
    ``block_m`` rows that see its keys (causal: from ``block_info.query_tiles_start``), for every query head of the
    kv head's group in one flat walk (as ``backward.mma``), Q, dO and their ``(lse log2 e, D)`` stats through a
    ``cp.async`` ring of ``stages`` stages.
Per query tile, per warpgroup (``wgmma_kernels``)
    1. ``S^T = K Q^T`` and ``dP^T = V dO^T`` (``wgmma_ss``, both operands K-major swizzled tiles, N = block_m),
       issued together without waiting.
    2. wait for ``S^T``; ``P^T = exp2(S^T scale log2 e - lse log2 e)`` on the fragments (``core.gradients``,
       masks only on tiles crossing the diagonal or the last key) while ``dP^T`` runs; ``P^T`` packed to 16 bits
       as the register A operand (``warpgroup.a_fragments``) of ``dV += P^T dO`` (``wgmma_rs``, dO the MN-major B,
       ``trans-b``), issued.
    3. wait for ``dP^T``; ``dS^T = P^T (dP^T - D)``, packed the same way; stored to a swizzled ``[key][query]``
       tile; fence, barrier.
    4. ``dQ_tile = dS K``: ``wgmma_ss`` with ``dS^T`` read as a transposed (MN-major) A operand (``trans-a``) and
       K as MN-major B; the warpgroups split the tile's 64-row m-blocks, then the head-dim columns. ``dK += dS^T Q``
       (``wgmma_rs``) is issued behind it and runs while the finished ``dQ`` slice goes to the float32 accumulator
       with ``red.global.add.v2.f32`` (``dq_quads``: ``.v4``; ``dq_bulk``: into a shared staging tile, which thread
       0 adds after the next barrier by one bulk reduction, ``core.dq_tile``).
    5. wait for everything: the barrier of the next tile then frees this tile's stage and ``dS^T``.
    Finally ``dV`` and ``sm_scale dK`` are rounded and stored. Each group of MMAs is one inline-asm block; the waits
    pass the awaited accumulator through as operands (``warpgroup.wgmma_wait``).

Head dims pad to a power of two (16, 32, 64, 128): a ``dQ`` column slice must lie within one 64-column atom or be
whole atoms. Runs under the CUDA simulator with the ``core.warpgroup`` twins (one warpgroup, 64-key blocks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import types

from ..core import dq_tile
from ..core.block_info import QUERY_MAJOR, grid
from ..core.constants import LOG2E
from ..forward import common
from ..runtime.device import SIMULATOR, kernel_jit, max_shared_per_block
from ..runtime.launch import launch as device_launch
from . import wgmma_kernels as _kernels

DTYPES = ("float16", "bfloat16")
#: wgmma needs sm_90a
MIN_COMPUTE_CAPABILITY = (9, 0)
#: padded head dims above this stay on ``backward.mma`` (dK and dV of 64 keys beside S^T and dP^T fill the registers)
MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class WgmmaBackwardConfig:
    """Tiles of the key-block kernel, validated where made (whether they fit a device's shared memory at a head dim is
    the launch's question: ``shared_bytes``, ``common.check_shared_memory``)."""

    warpgroups: int = 2  # warpgroups per block: block_n = 64 warpgroups keys
    block_m: int = 64  # query rows per streamed tile (whole 64-row m-blocks of dQ)
    stages: int = 2  # cp.async stages of (Q, dO, stats) tiles
    blocks_per_sm: int = 1  # launch bound: resident blocks per SM ptxas must allow (caps the registers)
    # one block barrier per tile instead of two: before dQ, it also publishes tile j + 1 (copies two tiles ahead,
    # so stages >= 3) and frees tile j - 1's stage; dS^T double-buffered (a warpgroup may write tile j + 1's
    # while another still reads tile j's)
    one_barrier: bool = False
    probe: str = ""  # timing only, WRONG dq: "no_red" (dQ MMAs, no reductions), "no_dq" (no dQ at all)
    # dQ through shared staging tiles in the tiled layout of core.dq_tile, each added to the accumulator by ONE
    # bulk reduction (cp.reduce.async.bulk, thread 0, after the next barrier) instead of every thread's
    # red.global.add; the accumulator then has that layout (``dq_tiled``)
    dq_bulk: bool = False
    dq_buffers: int = 2  # dq_bulk's staging tiles (1: thread 0 waits for the copy's read before the tile's barrier)
    # dq_bulk with two staging tiles: thread 0 waits for the older copy's read just before the barrier after which
    # the tile is staged, not right after issuing the newer copy (measured slower at head dim 128, faster at 64)
    dq_late_wait: bool = False
    # per-thread dQ reductions as red.global.add.v4.f32 (lanes t, t ^ 1 swap a pair first): half the reductions
    dq_quads: bool = False
    dq_evict_last: bool = False  # dq_bulk: the bulk reductions with the L2 policy "evict last" (FlashAttention-3's)

    # dK += dS^T Q reads dS^T from its shared tile (where dQ reads it) instead of registers: 16 fewer live
    # registers while dQ runs (with atomic dQ only; the deterministic path keeps the registers)
    dk_smem: bool = False

    def __post_init__(self):
        if type(self.dk_smem) is not bool:
            raise ValueError(f"WgmmaBackwardConfig.dk_smem: expected a bool, got {self.dk_smem!r}")
        common.check_fields(self, warpgroups=(1, 4, 1), block_m=(64, 256, 64), stages=(2, 4, 1),
                            blocks_per_sm=(1, None, 1), dq_buffers=(1, 2, 1))
        if type(self.one_barrier) is not bool:
            raise ValueError(f"WgmmaBackwardConfig.one_barrier: expected a bool, got {self.one_barrier!r}")
        if self.one_barrier and self.stages < 3:
            raise ValueError("WgmmaBackwardConfig: one_barrier needs stages >= 3 (copies two tiles ahead)")
        if type(self.dq_late_wait) is not bool:
            raise ValueError(f"WgmmaBackwardConfig.dq_late_wait: expected a bool, got {self.dq_late_wait!r}")
        if type(self.dq_evict_last) is not bool:
            raise ValueError(f"WgmmaBackwardConfig.dq_evict_last: expected a bool, got {self.dq_evict_last!r}")
        if type(self.dq_quads) is not bool:
            raise ValueError(f"WgmmaBackwardConfig.dq_quads: expected a bool, got {self.dq_quads!r}")
        if type(self.dq_bulk) is not bool:
            raise ValueError(f"WgmmaBackwardConfig.dq_bulk: expected a bool, got {self.dq_bulk!r}")
        if self.dq_bulk and self.one_barrier:
            raise ValueError("WgmmaBackwardConfig: dq_bulk needs the two-barrier pipeline (one_barrier=False)")
        if self.probe not in ("", "no_red", "no_dq"):
            raise ValueError(f"WgmmaBackwardConfig.probe: expected '', 'no_red' or 'no_dq', got {self.probe!r}")
        m_blocks = self.block_m // 64
        if self.warpgroups % m_blocks and m_blocks % self.warpgroups:
            raise ValueError(f"WgmmaBackwardConfig: block_m / 64 ({m_blocks}) and warpgroups ({self.warpgroups}) "
                             "must divide one another (how the warpgroups share a tile's dQ)")

    @property
    def block_n(self) -> int:
        return 64 * self.warpgroups

    @property
    def dq_tiled(self) -> bool:
        """Whether ``dQ`` goes to the accumulator in whole tiles (``core.dq_tile``'s layout and row padding)."""
        return self.dq_bulk

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    def launch_bounds(self) -> tuple:
        return self.threads, self.blocks_per_sm

    def shared_bytes(self, d_pad: int) -> int:
        """K, V, dS^T, ``stages`` x (Q, dO, stats), plus 1 KB to align the first tile to 1024 bytes."""
        return 2 * _kernels.layout(self, d_pad)["END"] + 1024


#: GPU tiles by padded head dim (``scripts/check_backward.py --wgmma-configs`` compares them): 128 keys (two
#: warpgroups) per block, 64-row query tiles, as FlashAttention-3 at head dim 128, dQ by one bulk reduction per tile
#: (210 KB of shared memory at 128): 0.99-1.14x the per-thread reductions on an H100 (bf16, 2026-11-26 03:28). Up to
#: head dim 128 the dispatch takes ``wgmma_ws`` instead (``dispatch.WS_MAX_HEAD_DIM``); this is its fallback for
#: arrays no tensor map describes.
GPU_CONFIG_64 = WgmmaBackwardConfig(dq_bulk=True)
GPU_CONFIG_128 = GPU_CONFIG_64
GPU_CANDIDATES = {
    "g2m64": WgmmaBackwardConfig(),  # dQ by every thread's red.global.add.v2 (the default until 2026-11-26)
    "g2m64s3": WgmmaBackwardConfig(stages=3),  # three stages of Q / dO
    "g2m128": WgmmaBackwardConfig(block_m=128),  # 128-row tiles, each warpgroup one m-block of dQ (head dim 64)
    "g1m64": WgmmaBackwardConfig(warpgroups=1, blocks_per_sm=2),  # 64-key blocks, two per SM
    "g1m128": WgmmaBackwardConfig(warpgroups=1, block_m=128, blocks_per_sm=2),  # head dim 64: N = 128 for S^T
    "g2m64b1": WgmmaBackwardConfig(stages=3, one_barrier=True),  # one barrier per tile
    "g2m64k": WgmmaBackwardConfig(dk_smem=True),  # dK's A (dS^T) from shared memory
    "g2m64tile": GPU_CONFIG_128,  # the default: dQ by one bulk reduction per tile from shared staging
    "g2m64tilek": WgmmaBackwardConfig(dq_bulk=True, dk_smem=True),
    "g2m64tile1": WgmmaBackwardConfig(dq_bulk=True, dq_buffers=1),  # one staging tile (178 KB at head dim 128)
    "g2m64tilelate": WgmmaBackwardConfig(dq_bulk=True, dq_late_wait=True),  # the copy's read waited for late
    "g2m64tileL2": WgmmaBackwardConfig(dq_bulk=True, dq_evict_last=True),  # ... with the L2 hint "evict last"
    "g2m64q4": WgmmaBackwardConfig(dq_quads=True),  # per-thread dQ reductions as v4 (a lane exchange first)
    "g2m64b1k": WgmmaBackwardConfig(stages=3, one_barrier=True, dk_smem=True),
    "g2m128b1": WgmmaBackwardConfig(block_m=128, stages=3, one_barrier=True),  # (head dim 64)
    # timing probes (wrong dq): what dQ's reductions, and dQ as a whole, cost
    "probe_nored": WgmmaBackwardConfig(probe="no_red"),
    "probe_nodq": WgmmaBackwardConfig(probe="no_dq"),
}
#: one warpgroup (64 keys) and 64-row tiles: the smallest the warpgroup MMAs allow; dQ as on the GPU
SIMULATOR_CONFIG = WgmmaBackwardConfig(warpgroups=1, dq_bulk=True)


def default_config(head_dim: int = 128) -> WgmmaBackwardConfig:
    if SIMULATOR:
        return SIMULATOR_CONFIG
    return GPU_CONFIG_64 if padded_head_dim(head_dim) <= 64 else GPU_CONFIG_128


def padded_head_dim(head_dim: int) -> int:
    """The next power of two from 16: a slice of ``dQ``'s columns per warpgroup stays inside one 64-column atom of
    K or is whole atoms (the zero columns past headdim cost MMA work only)."""
    return max(16, 1 << (int(head_dim) - 1).bit_length())


def supports(dtype: str, head_dim: int, *arrays) -> bool:
    """True when this kernel takes the call on this device: float16 / bfloat16, a padded head dim up to
    ``MAX_HEAD_DIM``, arrays (if given) whose rows copy in aligned 16-byte pieces, sm_90 (the simulator runs it
    too), and the default tiles fit the block's shared memory."""
    if dtype not in DTYPES or not 1 <= head_dim <= MAX_HEAD_DIM:
        return False
    if not common.runs_here(MIN_COMPUTE_CAPABILITY) or not common.vector_loads_ok(*arrays):
        return False
    return SIMULATOR or default_config(head_dim).shared_bytes(padded_head_dim(head_dim)) <= max_shared_per_block()


def stats_multiple(config: WgmmaBackwardConfig) -> int:
    """The ``stats`` rows must be a multiple of this (whole query tiles)."""
    return config.block_m


_OPERAND = types.Array(types.uint16, 4, "A")
_FLOATS = types.Array(types.float32, 4, "A")
#: ``kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale)``
KEY_SIGNATURE = types.void(_OPERAND, _OPERAND, _OPERAND, _OPERAND, _FLOATS, _FLOATS, _OPERAND, _OPERAND,
                           types.boolean, types.float32, types.float32)


@lru_cache(maxsize=None)
def key_block_kernel(config: WgmmaBackwardConfig, d_pad: int, bf16: bool, atomic_dq: bool):
    """The compiled key-block kernel of one specialisation (``wgmma_kernels.key_block_source``)."""
    if d_pad != padded_head_dim(d_pad) or d_pad > MAX_HEAD_DIM:
        raise ValueError(f"d_pad must be a power of two in [16, {MAX_HEAD_DIM}], got {d_pad}")
    return kernel_jit(config.launch_bounds(), KEY_SIGNATURE)(
        _kernels.key_block_source(config, d_pad, bf16, atomic_dq))


def launch_dkdv(q, k, v, dout, stats, dq_acc, dk, dv, sm_scale: float, causal: bool, stream,
                config: WgmmaBackwardConfig | None = None, dtype: str | None = None) -> None:
    """``dk``, ``dv`` (and, unless ``dq_acc`` is None, ``sm_scale dS K`` added to ``dq_acc``: float32 ``(batch,
    heads, seqlen_q, >= padded head dim)``, zeroed before; with ``config.dq_tiled`` ``core.dq_tile``'s layout,
    ``check_accumulator``) from views ``(batch, heads, seqlen, headdim)`` of float16
    or bfloat16 (bit views) that ``supports`` accepts; ``stats`` from ``preprocess`` (rows a multiple of
    ``stats_multiple``)."""
    batch, kv_heads, seqlen_k, head_dim = k.shape
    config = config or default_config(head_dim)
    dtype = common.sixteen_bit_dtype(q, dtype)
    if dtype not in DTYPES:
        raise TypeError(f"dtype: the warpgroup backward takes float16 or bfloat16, got {dtype}")
    q, k, v, dout, dk, dv = (common.bits(x, name) for x, name in
                             zip((q, k, v, dout, dk, dv), ("q", "k", "v", "dout", "dk", "dv")))
    if not supports(dtype, head_dim, q, k, v, dout):
        raise ValueError("q, k, v, dout: the wgmma backward needs 16-byte aligned rows with a unit-stride last axis, "
                         f"headdim % 8 == 0 and headdim <= {MAX_HEAD_DIM} on sm_90; got {dtype}, headdim {head_dim}")
    d_pad = padded_head_dim(head_dim)
    atomic = dq_acc is not None
    if atomic and dq_acc.shape[3] < d_pad:
        raise ValueError(f"dq_acc: needs at least {d_pad} columns (the padded head dim), got {dq_acc.shape[3]}")
    if atomic and config.dq_tiled:
        dq_tile.check_accumulator(dq_acc, q.shape[2], config.block_m, d_pad)
    if stats.shape[2] * 2 % stats_multiple(config):
        raise ValueError(f"stats: rows must be a multiple of {stats_multiple(config)}, got {stats.shape[2] * 2}")
    nbytes = config.shared_bytes(d_pad)
    common.check_shared_memory(nbytes)
    kernel = key_block_kernel(config, d_pad, dtype == "bfloat16", atomic)
    # (key blocks, kv heads, batch): with the heads on x, the blocks resident at once each added into another
    # head's dQ, and the accumulator went back and forth to DRAM (77 % of its bandwidth, H100, D128 4k)
    shape = grid(QUERY_MAJOR, batch, kv_heads, seqlen_k, config.block_n)
    # without atomics the kernel never touches dq_acc: the float32 stats stand in (one compiled type)
    device_launch(kernel, shape, config.threads, stream, nbytes, q, k, v, dout, stats, dq_acc if atomic else stats,
                  dk, dv, bool(causal), np.float32(sm_scale * LOG2E), np.float32(sm_scale))


def stats_rows(seqlen_q: int, *multiples: int) -> int:
    """``seqlen_q`` rounded up to a common multiple of ``multiples`` (the tiles of every kernel reading ``stats``)."""
    multiple = math.lcm(*multiples)
    return -(-seqlen_q // multiple) * multiple
