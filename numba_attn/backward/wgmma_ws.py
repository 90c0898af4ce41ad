"""Warp-specialised backward on Hopper (sm_90a), the FlashAttention-3 way: the key-block kernel of
``backward.wgmma`` (same per-tile math, ``wgmma_kernels``) fed by TMA copies through an mbarrier ring, with a
producer warpgroup and consumer warpgroups that only compute, register budgets moved with ``setmaxnreg``.

Same interface as ``wgmma.launch_dkdv``; it takes the inputs the TMA can read (``runtime.tensor_map.tma_layout_ok``)
and hands the rest (and calls where no tensor map can be had now) to ``wgmma.launch_dkdv``.

Roles (one block = ``block_n = 64 consumers`` keys of one (batch, kv head), ``128 (1 + consumers)`` threads, one block
per SM)
    Warpgroup 0, the producer, lowers its registers; one elected thread issues every copy: K and V of the block once
    (TMA, one 64-column box per atom column, K/V "full" mbarrier), then for each walk tile (query head of the group,
    query tile; causal from ``block_info.query_tiles_start``) Q and dO (TMA) and the tile's ``(lse log2 e, D)``
    stats (one ``cp.async.bulk`` of ``8 block_m`` bytes) into stage ``j % stages`` of a ring, after waiting for the
    stage's "empty" mbarrier; all complete on the stage's "full" mbarrier. Its other warps leave.
    Warpgroups 1.., the consumers, raise their registers and each own 64 keys, as the warpgroups of ``wgmma``: per
    tile ``S^T``, ``dP^T`` (ss), ``P^T`` under ``dP^T``, ``dV += P^T dO`` (rs), ``dS^T``, then ``dS^T`` to one of two
    swizzled tiles, a named barrier of the consumers (the only barrier per tile), ``dQ = dS K`` (ss, ``trans-a``)
    and ``dK += dS^T Q`` (rs) behind it, ``dQ`` reduced into the float32 accumulator (``dq_writer``: staged for the
    producer's second warp, whose elected lane adds each tile by one bulk reduction, ``core.dq_tile``), then each
    warp arrives on the stage's "empty" mbarrier.

Tensor maps (``runtime.tensor_map``): q and dout with ``block_m``-row boxes, k and v with ``block_n``-row boxes,
passed as 64-bit addresses of maps in global memory.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import types

from ..core import dq_tile
from ..core.block_info import QUERY_MAJOR, grid
from ..core.constants import LOG2E
from ..forward import common
from ..runtime import tensor_map
from ..runtime.device import SIMULATOR, kernel_jit
from ..runtime.launch import launch as device_launch
from . import wgmma as _wgmma
from . import wgmma_ws_kernels as _kernels

MIN_COMPUTE_CAPABILITY = (9, 0)
MAX_HEAD_DIM = _wgmma.MAX_HEAD_DIM


@dataclass(frozen=True)
class WsBackwardConfig:
    """Tiles, ring depth and register budgets of the warp-specialised kernel (validated where made)."""

    consumers: int = 2  # consumer warpgroups of 64 keys each: block_n = 64 consumers
    block_m: int = 64  # query rows per streamed tile
    stages: int = 2  # (Q, dO, stats) tiles in flight
    producer_registers: int = 24
    consumer_registers: int = 240
    # dQ through shared staging tiles in the tiled layout of core.dq_tile, each added to the accumulator by ONE bulk
    # reduction (cp.reduce.async.bulk) of an elected lane of the producer's second warp, instead of every consumer
    # thread's red.global.add; the accumulator then has that layout (``dq_tiled``)
    dq_writer: bool = True
    # staging tiles (2: the consumers write tile j + 1's while the bulk copy reads tile j's; measured slower at head
    # dim 128 on an H100: 226 KB of shared memory leave little L1 for the consumers' spills)
    dq_buffers: int = 1
    dq_evict_last: bool = False  # dq_writer: the bulk reductions with the L2 policy "evict last" (FA3's)
    probe: str = ""  # timing only, WRONG dq: "no_red" (dQ MMAs, no reductions, no writer)
    dq_quads: bool = False  # without dq_writer: the consumers' reductions as red.global.add.v4.f32 (lane exchange)
    # P^T and dS^T in one pass after both S^T and dP^T have landed (the forward-style step), instead of P^T under
    # the dP^T MMAs: 32 fewer live registers at the peak
    fused_grads: bool = True
    dq_parts: int = 1  # each consumer's dQ columns in this many MMAs (fewer live registers; 1 where they don't split)

    # dK += dS^T Q reads dS^T from its shared tile (where dQ reads it) instead of registers: 16 fewer live
    # registers while dQ runs (with atomic dQ only; the deterministic path keeps the registers)
    dk_smem: bool = True

    def __post_init__(self):
        for name in ("dk_smem", "dq_writer", "fused_grads", "dq_quads", "dq_evict_last"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"WsBackwardConfig.{name}: expected a bool, got {getattr(self, name)!r}")
        common.check_fields(self, consumers=(1, 3, 1), block_m=(64, 256, 64), stages=(1, 4, 1),
                            producer_registers=(24, 256, 8), consumer_registers=(24, 256, 8), dq_parts=(1, 4, 1),
                            dq_buffers=(1, 2, 1))
        if self.probe not in ("", "no_red"):
            raise ValueError(f"WsBackwardConfig.probe: expected '' or 'no_red', got {self.probe!r}")
        m_blocks = self.block_m // 64
        if self.consumers % m_blocks and m_blocks % self.consumers:
            raise ValueError(f"WsBackwardConfig: block_m / 64 ({m_blocks}) and consumers ({self.consumers}) must "
                             "divide one another (how the consumers share a tile's dQ)")
        common.check_register_budgets(self, self.threads, self.producer_registers, self.consumers,
                                      self.consumer_registers)

    @property
    def block_n(self) -> int:
        return 64 * self.consumers

    @property
    def dq_tiled(self) -> bool:
        """Whether ``dQ`` goes to the accumulator in whole tiles (``core.dq_tile``'s layout and row padding)."""
        return self.dq_writer and not self.probe

    @property
    def warpgroups(self) -> int:  # (dq_split reads it: the warpgroups that share dQ)
        return self.consumers

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    def shared_bytes(self, d_pad: int) -> int:
        return 2 * _kernels.layout(self, d_pad)["END"] + 1024


#: two consumers (128-key blocks), 64-row tiles, two stages, 24 / 240 registers: FlashAttention-3's shape at head
#: dim 128; dQ by one bulk reduction per tile from one staging tile (194 KB of shared memory at 128, 114 KB at 64).
#: The dispatch's default up to head dim 128 (docs/design/backward.md)
DEFAULT_CONFIG = WsBackwardConfig()
GPU_CANDIDATES = {
    "ws2": DEFAULT_CONFIG,
    "tile1buf": DEFAULT_CONFIG,  # (its name in issue #28: one staging tile, handed back once the copy has read it)
    "tile": WsBackwardConfig(dq_buffers=2),  # two staging tiles (226 KB at head dim 128)
    "tileL2": WsBackwardConfig(dq_evict_last=True),  # the bulk reductions with the L2 hint "evict last"
    # the producer warpgroup (copies, dQ writer) spills at 24 registers: ptxas -v, head dim 64: 88 bytes of spill
    # stores at 24 / 240, 0 at 40 / 232; 128: 212, 168 at 40 / 232, 152 at 32 / 240 (128 with no dQ at all) -- but
    # 32 / 240 needs more registers than a block of 384 threads holds (``common.check_register_budgets``)
    "tilep40": WsBackwardConfig(producer_registers=40, consumer_registers=232),
    "ws2red": WsBackwardConfig(dq_writer=False),  # dQ by every consumer thread's red.global.add.v2
    "ws2red4": WsBackwardConfig(dq_writer=False, dq_quads=True),  # ... .v4 after a lane exchange
    "ws2regs": WsBackwardConfig(dk_smem=False),  # dK's A (dS^T) from registers
    "ws2split": WsBackwardConfig(fused_grads=False),  # P^T under the dP^T MMAs
    "ws2q2": WsBackwardConfig(dq_parts=2),  # dQ in two MMAs of half the columns each
    "ws2p40": WsBackwardConfig(producer_registers=40, consumer_registers=232),
    "ws2s3": WsBackwardConfig(stages=3),  # (two staging tiles and three stages would be 258 KB at 128)
    "ws2m128": WsBackwardConfig(block_m=128),  # head dim 64
    "ws3": WsBackwardConfig(consumers=3, producer_registers=32, consumer_registers=160),  # head dim 64
    "ws_probe_nored": WsBackwardConfig(probe="no_red"),  # timing probe (wrong dq): dQ MMAs, no reductions
}
SIMULATOR_CONFIG = WsBackwardConfig(consumers=1)


def default_config(head_dim: int = 128) -> WsBackwardConfig:
    return SIMULATOR_CONFIG if SIMULATOR else DEFAULT_CONFIG


def supports(dtype: str, head_dim: int, *arrays) -> bool:
    """``wgmma.supports`` and arrays the TMA can read."""
    return (_wgmma.supports(dtype, head_dim, *arrays) and common.runs_here(MIN_COMPUTE_CAPABILITY)
            and all(tensor_map.tma_layout_ok(x) for x in arrays))


_OPERAND = types.Array(types.uint16, 4, "A")
_FLOATS = types.Array(types.float32, 4, "A")
#: ``kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale, q_map, k_map, v_map, do_map)``
KEY_SIGNATURE = types.void(_OPERAND, _OPERAND, _OPERAND, _OPERAND, _FLOATS, _FLOATS, _OPERAND, _OPERAND,
                           types.boolean, types.float32, types.float32, types.uint64, types.uint64, types.uint64,
                           types.uint64)


@lru_cache(maxsize=None)
def key_block_kernel(config: WsBackwardConfig, d_pad: int, bf16: bool, atomic_dq: bool):
    """The compiled kernel, with launch bounds of one block per SM (so that ptxas honours ``setmaxnreg``)."""
    return kernel_jit((config.threads, 1), KEY_SIGNATURE)(_kernels.key_block_source(config, d_pad, bf16, atomic_dq))


def launch_dkdv(q, k, v, dout, stats, dq_acc, dk, dv, sm_scale: float, causal: bool, stream,
                config: WsBackwardConfig | None = None, dtype: str | None = None) -> None:
    """As ``wgmma.launch_dkdv`` (``stats`` rows a multiple of ``config.block_m``); calls the TMA cannot take, or
    without any key, go to ``wgmma.launch_dkdv`` with its default tiles."""
    batch, kv_heads, seqlen_k, head_dim = k.shape
    config = config or default_config(head_dim)
    dtype = common.sixteen_bit_dtype(q, dtype)
    if dtype not in _wgmma.DTYPES:
        raise TypeError(f"dtype: the warpgroup backward takes float16 or bfloat16, got {dtype}")
    bits = [common.bits(x, name) for x, name in zip((q, k, v, dout, dk, dv), ("q", "k", "v", "dout", "dk", "dv"))]
    q, k, v, dout, dk, dv = bits
    maps = None
    if seqlen_k > 0 and supports(dtype, head_dim, q, k, v, dout):
        maps = tuple(tensor_map.tensor_map_address(x, rows, stream) for x, rows in
                     ((q, config.block_m), (k, config.block_n), (v, config.block_n), (dout, config.block_m)))
    if maps is None or None in maps:
        # (the same dQ layout as this config's: the tiled one by the plain kernel's bulk reductions)
        fallback = _wgmma.default_config(head_dim)
        if config.dq_tiled != fallback.dq_tiled:
            fallback = replace(fallback, dq_bulk=config.dq_tiled, one_barrier=False, stages=2)
        _wgmma.launch_dkdv(q, k, v, dout, stats, dq_acc, dk, dv, sm_scale, causal, stream, config=fallback,
                           dtype=dtype)
        return
    d_pad = _wgmma.padded_head_dim(head_dim)
    if stats.shape[2] * 2 % config.block_m:
        raise ValueError(f"stats: rows must be a multiple of {config.block_m}, got {stats.shape[2] * 2}")
    nbytes = config.shared_bytes(d_pad)
    common.check_shared_memory(nbytes)
    atomic = dq_acc is not None
    if atomic and config.dq_tiled:
        dq_tile.check_accumulator(dq_acc, q.shape[2], config.block_m, d_pad)
    kernel = key_block_kernel(config, d_pad, dtype == "bfloat16", atomic)
    # (key blocks, kv heads, batch): with the heads on x, the blocks resident at once each added into another
    # head's dQ, and the accumulator went back and forth to DRAM (77 % of its bandwidth, H100, D128 4k)
    shape = grid(QUERY_MAJOR, batch, kv_heads, seqlen_k, config.block_n)
    device_launch(kernel, shape, config.threads, stream, nbytes, q, k, v, dout, stats, dq_acc if atomic else stats,
                  dk, dv, bool(causal), np.float32(sm_scale * LOG2E), np.float32(sm_scale),
                  *(np.uint64(m) for m in maps))
