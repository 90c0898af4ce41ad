"""The float8 (e4m3) flash forward on the warp-specialised Hopper kernel: ``wgmma_ws``'s ``fp8`` variant, launched.

Same inputs and semantics as ``wgmma_fp8.launch`` (e4m3 bit patterns as uint8, descale factors per tensor or per
(batch, head), a bfloat16 or float16 output, GQA, causal, sliding windows and soft-capping). A call is two kernels
on its stream: ``forward.fp8_vt``'s pre-pass writes ``V^T`` (keys contiguous, as the 8-bit P V MMAs need their B
operand) into a scratch array, then ``wgmma_ws._kernel_source(..., fp8=True)`` runs: TMA copies of 8-bit Q, K and
``V^T`` tiles (128-byte boxes), two consumer warpgroups with ping-pong, the 16-bit output staged in tiles of its
own and stored by the TMA where it can write it (``wgmma_ws``'s docstring, ``wgmma_ws.output_store``). It takes what
the TMA can read (``supports``) with head dims that are multiples of 16 up to 128 (padded to 32); ``launch`` hands
a call to ``wgmma_fp8`` where no tensor map can be had, and calls without keys too.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
from numba import types

from ..runtime import tensor_map
from ..runtime.device import SIMULATOR, kernel_jit, multiprocessor_count
from ..runtime.launch import launch as device_launch
from ..core.block_info import QUERY_MAJOR
from ..core.mask import may_narrow
from . import common
from . import fp8_vt
from . import wgmma_fp8
from . import wgmma_ws
from .common import PLAIN, Variant
from .wgmma_ws_config import ROWS, SHARED_LIMIT, WsConfig, fits_registers, shared_bytes

MIN_COMPUTE_CAPABILITY = wgmma_ws.MIN_COMPUTE_CAPABILITY
MAX_HEAD_DIM = 128
OUT_DTYPES = wgmma_fp8.OUT_DTYPES

#: 224-key tiles (FlashAttention-3's for fp8 at D128) in two stages, persistent (173 KB of shared memory at head dim
#: 128: Q, rings of K tiles and of V^T tiles of two atom columns with their rows of ones, the output's staging tiles),
#: the 16-bit kernel's register budgets (24 / 240), P's row sums from the P V MMA (``fp8_sums``; where the lse is
#: asked for, the softmax's float32 sums: ``launch``). On the H100 (B4 H32 D128, 2026-11-27, docs/benchmarks.md) the
#: MMA's sums ran 1.04 / 1.06 / 1.04x the softmax's at 4k full / 4k causal / 16k full
DEFAULT_CONFIG = WsConfig(block_n=224, persistent=True, fp8_sums=True)
#: the defaults until 2026-11-27 (the same tiles with the softmax's sums; 192-key tiles, not persistent), candidates
PREVIOUS_DEFAULT = WsConfig(block_n=224, persistent=True)
SIMULATOR_CONFIG = WsConfig(block_n=32, stages=2, fp8_sums=True)
#: what the GPU tests run and the probes time (no tuner: the default is chosen by hand from the probes). 224-key tiles
#: (FlashAttention-3's at D128) and three consumer warpgroups (160 registers: 96- and 64-key tiles), where two
#: warpgroups' softmaxes run beside one's MMAs -- in ping-pong of two, one softmax must hide under the other's MMAs,
#: and in 8 bits it takes longer (2026-11-27, H100: the kernel without its softmax ran ~1.5x faster)
_THREE = dict(consumers=3, producer_registers=32, consumer_registers=160)
TUNING_CANDIDATES = (DEFAULT_CONFIG, PREVIOUS_DEFAULT, WsConfig(block_n=192), WsConfig(), WsConfig(stages=3),
                     WsConfig(block_n=192, stages=3), WsConfig(block_n=64, stages=4),
                     WsConfig(block_n=192, pingpong=False), WsConfig(block_n=224),
                     WsConfig(block_n=96, stages=3, **_THREE), WsConfig(block_n=64, stages=4, **_THREE))


def default_config() -> WsConfig:
    return SIMULATOR_CONFIG if SIMULATOR else DEFAULT_CONFIG


def padded_head_dim(head_dim: int) -> int:
    return common.padded_head_dim(head_dim, 32)


def usable(config: WsConfig, head_dim_pad: int) -> bool:
    """``config`` fits this kernel: key tiles a multiple of 32 (an 8-bit MMA's k), shared memory and the consumers'
    registers."""
    return (config.block_n % 32 == 0
            and shared_bytes(config, head_dim_pad, fp8=True) <= SHARED_LIMIT
            and fits_registers(config, head_dim_pad, fp8=True))


def supports(head_dim: int, *arrays) -> bool:
    """True when this kernel can take the call on this device: a head dim that is a multiple of 16 up to
    ``MAX_HEAD_DIM``, uint8 arrays the TMA reads (``tensor_map.tma_layout_ok``), sm_90 (the simulator runs it)."""
    return (head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM and common.runs_here(MIN_COMPUTE_CAPABILITY)
            and all(np.dtype(x.dtype).itemsize == 1 and tensor_map.tma_layout_ok(x) for x in arrays))


def _signature() -> types.Signature:
    operand = types.Array(types.uint8, 4, "A")
    descale = types.Array(types.float32, 2, "A")
    # (the maps of Q, K, V^T and the output, whose TMA store reads the last)
    return types.void(operand, operand, operand, types.Array(types.uint16, 4, "A"),
                      types.Array(types.float32, 3, "A"), types.boolean, types.boolean, types.float32, types.uint64,
                      types.uint64, types.uint64, types.uint64, types.float32, descale, descale, descale)


SIGNATURE = _signature()


@lru_cache(maxsize=None)
def flash_ws_fp8_kernel(config: WsConfig, head_dim_pad: int, bf16_out: bool, scale_first: bool = False,
                        per_head: bool = False, variant: Variant = PLAIN, probe: str | None = None,
                        store: str = "tma", narrow: bool = True):
    """The compiled kernel of one specialisation (launch bounds: one block per SM, as ``wgmma_ws``'s; ``probe``: a
    timing probe of ``wgmma_ws._kernel_source``, wrong results; ``store``: how it writes the output,
    ``wgmma_ws.output_store``; ``narrow``: narrow tiles, ``mask.may_narrow``)."""
    if head_dim_pad % 32 or not 32 <= head_dim_pad <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim_pad must be a multiple of 32 in [32, {MAX_HEAD_DIM}], got {head_dim_pad}")
    source = wgmma_ws._kernel_source(config, head_dim_pad, bf16_out, scale_first, variant, fp8=True,
                                     per_head=per_head, probe=probe, store=store, narrow=narrow)
    return kernel_jit((config.threads, 1), SIGNATURE)(source)


def _device_array(shape, dtype):
    from ..runtime.device import cuda

    return np.zeros(shape, dtype) if SIMULATOR else cuda.device_array(shape, dtype)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream, descale=None,
           config: WsConfig | None = None, out_dtype: str = "bfloat16", window=None, softcap: float | None = None,
           scratch=None, _probe: str | None = None):
    """As ``wgmma_fp8.launch`` (same arguments; ``config`` a ``WsConfig`` that ``usable`` accepts). ``scratch(shape,
    dtype)``: a device array for ``V^T`` (``runtime.arrays``' call scratch: the caller's stream-ordered pool; None:
    Numba's allocator). Where a tensor map cannot be had now, and for calls without keys, ``wgmma_fp8.launch`` runs
    the call with its default tiles. ``_probe``: a timing probe (``wgmma_ws._kernel_source``), wrong results."""
    config = config or default_config()
    if write_lse and config.fp8_sums:  # (an lse of the rounded P's sums is up to ~2e-2 off: the softmax's float32)
        config = dataclasses.replace(config, fp8_sums=False)
    wgmma_fp8.check_operands(q, k, v, out_dtype)
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    fallback = dict(descale=descale, out_dtype=out_dtype, window=window, softcap=softcap)
    if k.shape[2] == 0:  # no key: nothing to copy (and no map of an empty tensor)
        wgmma_fp8.launch(q, k, v, out, lse, write_lse, sm_scale, causal, stream, **fallback)
        return
    out = common.bits(out, "out")
    if not supports(head_dim, q, k, v):
        raise ValueError("q, k, v: the fp8 wgmma_ws kernel needs uint8 arrays the TMA can read (16-byte aligned "
                         "base, unit-stride last axis, other strides multiples of 16 bytes) and headdim % 16 == 0 up "
                         f"to {MAX_HEAD_DIM} on sm_90; got headdim {head_dim}")
    d_pad = padded_head_dim(head_dim)
    if not usable(config, d_pad):
        raise ValueError(f"config: {config} does not suit the fp8 wgmma_ws kernel at head dim {d_pad}")
    batch_kv, kv_heads, seqlen_k = k.shape[:3]
    vt = (scratch or _device_array)((batch_kv, kv_heads, head_dim, fp8_vt.padded_keys(seqlen_k)), "uint8")
    maps = tuple(tensor_map.tensor_map_address(x, rows, stream) for x, rows in ((q, ROWS),
                                                                                  (k, config.block_n),
                                                                                  (vt, d_pad)))
    if None in maps:
        wgmma_fp8.launch(q, k, v, out, lse, write_lse, sm_scale, causal, stream, **fallback)
        return
    nbytes = shared_bytes(config, d_pad, fp8=True)
    common.check_shared_memory(nbytes)
    per_head, scale_log2, scale_first, scalars = wgmma_fp8.scale_arguments(descale, sm_scale, softcap, lse)
    store, o_map = wgmma_ws.output_store(out, False, stream)
    variant = Variant.of(bool(causal), window, softcap)
    kernel = flash_ws_fp8_kernel(config, d_pad, out_dtype == "bfloat16", scale_first, per_head, variant, _probe, store,
                                 may_narrow(causal, variant.window, False, seqlen_k, config.block_n))
    fp8_vt.transpose(v, vt, stream)
    shape = common.launch_grid(QUERY_MAJOR, batch, heads, seqlen_q, config.block_m)
    if config.persistent:
        shape = (min(shape[0] * shape[1] * shape[2], multiprocessor_count()), 1, 1)
    device_launch(kernel, shape, config.threads, stream, nbytes, q, k, v, out, lse, bool(write_lse), bool(causal),
                  scale_log2, *(np.uint64(m) for m in maps), np.uint64(o_map), *scalars)
