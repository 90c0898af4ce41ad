"""FlashAttention-2 backward for float32 on tensor cores: ``mma.sync.m16n8k8`` with tf32 operands as 3xTF32.

Same interface as ``mma`` (views ``(batch, heads, seqlen, headdim)``, any strides, grouped-query heads, the
bottom-right causal mask, rows with ``lse = -inf`` contribute nothing, the per-row ``stats`` of ``preprocess``), with
float32 arrays. The float32 default of ``flash_backward`` on sm_80+ (backend "tf32").

Accuracy
    Every operand of every product is split as it is read, ``x = hi + lo`` (``core.tf32``: ``hi`` rounded to tf32,
    ``lo`` exact), and each product is three MMAs into one float32 accumulator (``a_lo b_hi + a_hi b_lo + a_hi b_hi``),
    as the forward (``forward.tf32``) and torch's memory-efficient float32 kernels do; ``allow_tf32=True``
    (``tf32_only``) keeps ``a_hi b_hi`` alone (a third of the MMAs, about 1e-3 error). The tensor cores round each
    MMA's float32 sum toward zero, so a sum chained through the C operand over many MMAs shrinks (``core.tf32``; the
    first GPU run's errors, 2.5-6x torch's and growing with the head dim, came from the 3 x head dim / 8 MMAs of
    ``S`` and ``dP``): each k-step's ``S`` / ``dP`` products go into fresh accumulators (``core.tf32.mma3_add``) and
    ``dV``, ``dK``, ``dQ`` chain ``k_chunk`` k-steps before a float32 add; ``dQ`` of the key-block kernel is added
    with float32 atomics.

Work split (as ``mma``; its docstring has the walk)
    Key-block kernel, grid ``(key blocks, kv_heads, batch)``: ``warps`` warps of ``16 key_tiles`` keys each; K and V
    of the block resident in shared memory, ``dK`` and ``dV`` in registers; the query tiles of every query head of the
    group streamed with ``cp.async`` (Q, dO, stats; ``stages`` deep). Per tile and warp: ``S^T = K Q^T`` and ``dP^T =
    V dO^T`` (A: K / V row pairs; B: Q / dO row pairs), ``P^T`` and ``dS^T`` (``core.gradients``), split once into
    A fragments (C fragment ``(c0, c1, c2, c3)`` of n8 block ``j`` = A fragment ``(c0, c2, c1, c3)`` of k-step ``j``),
    then ``dV += P^T dO`` and ``dK += dS^T Q`` (B: dO / Q as column pairs). Unless deterministic, ``dS^T`` (float32)
    goes to shared memory and the warps split ``dQ_tile = dS K`` (A: ``dS^T`` as column pairs; B: K as column pairs;
    ``dq_row_tiles`` m-tiles x a share of the n8 blocks per warp), added with ``red.global.add`` (``.v2`` on sm_90).
    Padded head dims above ``max_single_pass_dim`` take two launches (``dV``; ``dK`` and ``dQ``).
    Query-block kernel (``deterministic=True``), grid ``(query blocks, heads, batch)``: Q, dO and stats resident, K /
    V tiles double-buffered; ``S = Q K^T``, ``dP = dO V^T``, ``dS`` split in registers, ``dQ += dS K`` (B: K as column
    pairs); ``dQ`` written once.

Shared memory
    Float32 tiles in rows of whole 32-word lines, fragment-swizzled (``core.tf32``): Q, dO and K are read both as row
    pairs (8-byte loads) and as column pairs (4-byte loads), and the swizzle keeps both free of bank conflicts
    without padding. Rows past a sequence and columns past headdim are zeros.

This module: the configuration (``Tf32BackwardConfig``), which calls it takes (``supports``), the compiled kernels of
each specialisation (``lru_cache``d builders over the sources in ``tf32_kernels``) and the launches. Runs under the
CUDA simulator with the ``ptx`` twins (``SIMULATOR_CONFIG``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import types

from ..core.block_info import QUERY_MAJOR, grid
from ..core.constants import LOG2E
from ..core.tf32 import swizzled_row_words
from ..forward import common
from ..runtime.device import SIMULATOR, kernel_jit, max_shared_per_block
from ..runtime.launch import launch as device_launch
from . import tf32_kernels as _kernels
from .mma import KeyQueryTiles

DTYPES = ("float32",)
#: mma.sync.m16n8k8 with tf32 operands and cp.async need sm_80; red.add.v2.f32 needs sm_90
MIN_COMPUTE_CAPABILITY = (8, 0)
VECTOR_RED_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class Tf32BackwardConfig(KeyQueryTiles):
    """Tiles of both kernels, validated where made (whether they fit a device's shared memory at a head dim is the
    launch's question: ``shared_bytes``, ``common.check_shared_memory``)."""

    warps: int = 8  # key-block kernel: warps per block
    key_tiles: int = 1  # 16-key MMA tiles per warp: block_n = 16 key_tiles warps keys per block
    block_m: int = 32  # query rows per streamed tile
    dq_row_tiles: int = 1  # 16-row m-tiles of a tile's dQ = dS K per warp (the warps of one group split the columns)
    stages: int = 2  # cp.async stages of (Q, dO, stats) tiles
    min_warps: int = 8  # launch bound, as warps per SM to keep resident
    max_single_pass_dim: int = 128  # padded head dims above this take two key-block launches (dV, then dK and dQ)
    k_chunk: int = 2  # dV, dK, dQ: k-steps of 8 chained through the MMAs' C before a float32 add (core.tf32)
    dq_warps: int = 4  # query-block kernel: warps per block
    dq_m_tiles: int = 1  # 16-row m-tiles per warp there: dq_block_m = 16 dq_m_tiles dq_warps
    dq_block_n: int = 32  # keys per K / V tile there
    dq_stages: int = 2

    def __post_init__(self):
        common.check_fields(self, k_chunk=(1, 32, 1), warps=(1, 32, 1), key_tiles=(1, 8, 1), block_m=(16, 256, 16),
                            dq_row_tiles=(1, 16, 1), stages=(2, 4, 1), min_warps=(1, None, 1),
                            max_single_pass_dim=(16, common.MAX_HEAD_DIM, 16), dq_warps=(1, 32, 1),
                            dq_m_tiles=(1, 8, 1), dq_block_n=(8, 256, 8), dq_stages=(2, 4, 1))
        self.check_dq_row_tiles()

    def key_shared_bytes(self, d_pad: int, want_dk: bool, atomic_dq: bool) -> int:
        """K (, V); ``stages`` x (Q, dO, stats); ``dS^T`` when ``dQ`` is added by atomics (``tf32_kernels``)."""
        row = swizzled_row_words(d_pad)
        stage = 2 * self.block_m * row + 2 * self.block_m
        ds = self.block_n * swizzled_row_words(self.block_m) if atomic_dq else 0
        return 4 * ((2 if want_dk else 1) * self.block_n * row + self.stages * stage + ds)

    def query_shared_bytes(self, d_pad: int) -> int:
        """Q, dO, stats; ``dq_stages`` x (K, V)."""
        row = swizzled_row_words(d_pad)
        return 4 * (2 * self.dq_block_m * row + 2 * self.dq_block_m + self.dq_stages * 2 * self.dq_block_n * row)

    def shared_bytes(self, d_pad: int) -> int:
        """The most any launch needs at this padded head dim."""
        return max(max(self.key_shared_bytes(d_pad, dk, dk) for _, dk in key_block_passes(self, d_pad)),
                   self.query_shared_bytes(d_pad))


#: GPU tiles by padded head dim (not yet timed; ``scripts/check_backward_tf32.py --compile-only`` gives ptxas's
#: registers and spills). Up to 64: 128-key blocks, 64-row query tiles (161 KB); up to 128: 128-key blocks, 32-row
#: tiles (209 KB); above (two key-block launches): 64-key blocks, 16-row tiles, 16-key tiles in the query-block kernel.
GPU_CONFIG_64 = Tf32BackwardConfig(block_m=64)
GPU_CONFIG_128 = Tf32BackwardConfig()
GPU_CONFIG_256 = Tf32BackwardConfig(warps=4, block_m=16, dq_block_n=16)
#: where a block's shared memory is smaller (sm_80: 163 KB): 64-key blocks up to 128 (137 KB at 128), 32-key blocks
#: and 2-warp query blocks above (132 KB at 256)
SMALL_CONFIG_128 = Tf32BackwardConfig(warps=4)
SMALL_CONFIG_256 = Tf32BackwardConfig(warps=2, block_m=16, dq_warps=2, dq_block_n=16)
#: alternatives for ``scripts/check_backward_tf32.py --configs``
GPU_CANDIDATES = {
    "w8m32": GPU_CONFIG_128,
    "w8m64": GPU_CONFIG_64,
    "w4m32": Tf32BackwardConfig(warps=4),  # 64-key blocks (two blocks per SM at 64)
    "w4m64": Tf32BackwardConfig(warps=4, block_m=64),
    "w8m32k1": Tf32BackwardConfig(k_chunk=1),  # every k-step of dV / dK / dQ added in float32
    "w8m32k4": Tf32BackwardConfig(k_chunk=4),
    "w8m64k4": Tf32BackwardConfig(block_m=64, k_chunk=4),
    "w8m32q2": Tf32BackwardConfig(dq_row_tiles=2),  # dQ: both m-tiles x a quarter of the columns per warp
    "w4m16": GPU_CONFIG_256,
    "w2m16": SMALL_CONFIG_256,
}
#: one warp, 16-key blocks and 16-row tiles; two passes above 32 (every thread is a Python thread there)
SIMULATOR_CONFIG = Tf32BackwardConfig(warps=1, block_m=16, dq_warps=1, dq_block_n=16, max_single_pass_dim=32)


def default_config(head_dim: int = 128) -> Tf32BackwardConfig:
    """The simulator's tiles, or ``gpu_config`` for this head dim and the device's shared memory per block."""
    if SIMULATOR:
        return SIMULATOR_CONFIG
    return gpu_config(head_dim, max_shared_per_block())


def gpu_config(head_dim: int, shared_limit: int = 227 * 1024) -> Tf32BackwardConfig:
    """The GPU tiles for this head dim: the large ones where they fit ``shared_limit`` bytes (sm_90's by default),
    else the small ones."""
    d_pad = padded_head_dim(head_dim)
    if d_pad <= 128:
        large, small = (GPU_CONFIG_64 if d_pad <= 64 else GPU_CONFIG_128), SMALL_CONFIG_128
    else:
        large, small = GPU_CONFIG_256, SMALL_CONFIG_256
    return large if large.shared_bytes(d_pad) <= shared_limit else small


def padded_head_dim(head_dim: int) -> int:
    """A multiple of 8 (one tf32 k-step; dK / dV / dQ in n8 blocks)."""
    return common.padded_head_dim(head_dim, 8)


def supports(dtype: str, head_dim: int) -> bool:
    """True when these kernels take the call on this device: float32, head dims up to 256 whose default tiles fit
    a block's shared memory, any strides, sm_80 or newer."""
    if dtype not in DTYPES or not 1 <= head_dim <= common.MAX_HEAD_DIM:
        return False
    if not common.runs_here(MIN_COMPUTE_CAPABILITY):
        return False
    return SIMULATOR or default_config(head_dim).shared_bytes(padded_head_dim(head_dim)) <= max_shared_per_block()


def stats_rows(seqlen_q: int, config: Tf32BackwardConfig) -> int:
    """Rows of the ``stats`` scratch (``preprocess``): ``seqlen_q`` rounded up to whole tiles of both kernels."""
    multiple = math.lcm(config.block_m, config.dq_block_m)
    return -(-seqlen_q // multiple) * multiple


_FLOATS = types.Array(types.float32, 4, "A")
#: ``kernel(q, k, v, dout, stats, dq_acc, dk, dv, causal, scale_log2, sm_scale)``
KEY_SIGNATURE = types.void(_FLOATS, _FLOATS, _FLOATS, _FLOATS, _FLOATS, _FLOATS, _FLOATS, _FLOATS, types.boolean,
                           types.float32, types.float32)
#: ``kernel(q, k, v, dout, stats, dq, causal, scale_log2, sm_scale)``
QUERY_SIGNATURE = types.void(_FLOATS, _FLOATS, _FLOATS, _FLOATS, _FLOATS, _FLOATS, types.boolean, types.float32,
                             types.float32)


@lru_cache(maxsize=None)
def key_block_kernel(config: Tf32BackwardConfig, d_pad: int, tf32_only: bool, vector_loads: bool, want_dv: bool,
                     want_dk: bool, atomic_dq: bool, vector_red: bool):
    """The compiled key-block kernel of one specialisation (``tf32_kernels.key_block_source``)."""
    source = _kernels.key_block_source(config, d_pad, tf32_only, vector_loads, want_dv, want_dk, atomic_dq,
                                       vector_red)
    return kernel_jit(config.key_launch_bounds(), KEY_SIGNATURE)(source)


@lru_cache(maxsize=None)
def query_block_kernel(config: Tf32BackwardConfig, d_pad: int, tf32_only: bool, vector_loads: bool):
    """The compiled query-block kernel of one specialisation (``tf32_kernels.query_block_source``)."""
    return kernel_jit(config.query_launch_bounds(), QUERY_SIGNATURE)(
        _kernels.query_block_source(config, d_pad, tf32_only, vector_loads))


def key_block_passes(config: Tf32BackwardConfig, d_pad: int) -> tuple:
    """``(want_dv, want_dk)`` of each key-block launch: one, or two above ``max_single_pass_dim``."""
    if d_pad <= config.max_single_pass_dim:
        return ((True, True),)
    return ((True, False), (False, True))


def _check_float32(*named):
    for name, x in named:
        if np.dtype(x.dtype) != np.float32:
            raise TypeError(f"{name}: the tf32 tensor-core backward takes float32, got {np.dtype(x.dtype)}")


def launch_dkdv(q, k, v, dout, stats, dq_acc, dk, dv, sm_scale: float, causal: bool, stream,
                config: Tf32BackwardConfig | None = None, tf32_only: bool = False) -> None:
    """``dk``, ``dv`` (and, unless ``dq_acc`` is None, ``sm_scale dS K`` added to ``dq_acc``: float32 ``(batch,
    heads, seqlen_q, padded head dim)``, zeroed before) from float32 views ``(batch, heads, seqlen, headdim)``;
    ``stats`` from ``preprocess`` (``stats_rows`` rows). ``tf32_only``: one tf32 product per multiply."""
    batch, kv_heads, seqlen_k, head_dim = k.shape
    config = config or default_config(head_dim)
    _check_float32(("q", q), ("k", k), ("v", v), ("dout", dout), ("dk", dk), ("dv", dv))
    d_pad = padded_head_dim(head_dim)
    atomic = dq_acc is not None
    vector_red = atomic and not SIMULATOR and common.runs_here(VECTOR_RED_CAPABILITY)
    vector = common.vector_loads_ok(q, k, v, dout)
    shape = grid(QUERY_MAJOR, batch, kv_heads, seqlen_k, config.block_n)
    for want_dv, want_dk in key_block_passes(config, d_pad):
        shared_bytes = config.key_shared_bytes(d_pad, want_dk, atomic and want_dk)
        common.check_shared_memory(shared_bytes)
        kernel = key_block_kernel(config, d_pad, bool(tf32_only), vector, want_dv, want_dk, atomic and want_dk,
                                  vector_red)
        # without atomics the kernel never touches dq_acc: the float32 stats stand in (one compiled type)
        device_launch(kernel, shape, config.warps * 32, stream, shared_bytes, q, k, v, dout, stats,
                      dq_acc if atomic else stats, dk, dv, bool(causal), np.float32(sm_scale * LOG2E),
                      np.float32(sm_scale))


def launch_dq(q, k, v, dout, stats, dq, sm_scale: float, causal: bool, stream,
              config: Tf32BackwardConfig | None = None, tf32_only: bool = False) -> None:
    """``dq`` (float32, any strides) from the query-block kernel; arguments as ``launch_dkdv``."""
    batch, heads, seqlen_q, head_dim = q.shape
    config = config or default_config(head_dim)
    _check_float32(("q", q), ("k", k), ("v", v), ("dout", dout), ("dq", dq))
    d_pad = padded_head_dim(head_dim)
    shared_bytes = config.query_shared_bytes(d_pad)
    common.check_shared_memory(shared_bytes)
    kernel = query_block_kernel(config, d_pad, bool(tf32_only), common.vector_loads_ok(q, k, v, dout))
    device_launch(kernel, grid(QUERY_MAJOR, batch, heads, seqlen_q, config.dq_block_m), config.dq_warps * 32,
                  stream, shared_bytes, q, k, v, dout, stats, dq, bool(causal), np.float32(sm_scale * LOG2E),
                  np.float32(sm_scale))
