"""The float8 (e4m3) flash forward on Hopper's warpgroup MMAs (``wgmma.mma_async ... k32.f32.e4m3.e4m3``, sm_90a).

Inputs: Q, K, V as e4m3 bit patterns (uint8 views; ``flash_forward`` takes torch ``float8_e4m3fn`` tensors) with
their descale factors -- per tensor (folded into the launch's scalars) or per (batch, head) (float32 arrays read
once per block): the scores are ``sm_scale * descale_q * descale_k * q.k`` of the e4m3 values, the output is
``descale_v * softmax(...) v`` in bfloat16 or float16. Same semantics as ``wgmma.launch`` otherwise (shapes
``(batch, heads, seqlen, headdim)``, GQA, bottom-right causal mask, sliding window and soft-capping as compile-time
variants, rows that see no key give 0 and ``lse = -inf``, natural-log lse).

The kernel is ``forward.wgmma``'s, one body (``wgmma._kernel_source(fp8=True)``) with 8-bit operands (one warpgroup =
64 query rows per block; the softmax of tile ``j`` runs under the MMAs ``O += P_(j-1) V_(j-1)``; ``core.softmax``
and ``core.epilogue`` unchanged). The differences, all from the 8-bit MMA (``core.warpgroup``, ``core.fp8``):

* k = 32 per MMA: ``d_pad / 32`` MMAs for S, ``block_n / 32`` for P V; a 128-byte atom row holds 128 elements, so a
  tile of up to 128 head-dim columns is one atom column.
* P is rounded to e4m3 for the P V product (``core.fp8.probabilities``; FlashAttention-3 does the same), packed
  straight from the S accumulators thanks to a fixed permutation of the keys inside each 16-key group.
* V must be K-major (keys contiguous) for the B operand and 8-bit MMAs cannot transpose: each V tile is copied to a
  staging tile and transposed in the kernel into a ``V^T`` tile (``core.fp8.v_transposer``: 32-bit loads, byte
  permutes, 16-byte stores) while the MMAs of the tile run; the stores are published with ``fence.proxy.async`` and
  read by the tile's P V, issued after the next barrier.

Shared memory (uint16 units, 1024-byte aligned tiles): Q (64 rows of 128 bytes), two stages each of K (``block_n``
rows), V staging (``block_n`` rows) and ``V^T`` (``d_pad`` rows). Per tile ``j`` (tile 0 peeled, as in ``wgmma``):

    1. ``cp_async_wait_all`` + ``fence.proxy.async`` + barrier: K_j and the staged V_j have landed; ``V^T_(j-1)``
       (stored last iteration) is visible to the tensor cores; everyone is done with K_(j-1), staging j - 1 and
       ``V^T_(j-2)``.
    2. Issue ``S_j = Q K_j^T`` and ``O += P_(j-1) V_(j-1)``; start the copies of tile ``j + 1``.
    3. Transpose staging ``j`` into ``V^T_j`` (under the MMAs); ``fence.proxy.async``.
    4. ``wait_group 1``; the online softmax of ``S_j``; ``wait_group 0``; rescale O; pack ``P_j``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import types

from ..core import warpgroup as wg
from ..core.block_info import QUERY_MAJOR
from ..runtime.device import SIMULATOR, kernel_jit
from ..runtime.launch import launch as device_launch
from ..runtime.views import restride
from . import common
from . import wgmma
from .common import PLAIN, Variant

MIN_COMPUTE_CAPABILITY = (9, 0)
#: head dims up to this (padded to a multiple of 32): one 128-byte atom column per row, O beside S in registers
MAX_HEAD_DIM = 128
BLOCK_M = wg.ROWS
THREADS = wg.WARPGROUP_THREADS
DTYPE = "float8_e4m3fn"
OUT_DTYPES = ("bfloat16", "float16")


V_TRANSPOSES = ("staging", "ldmatrix")


@dataclass(frozen=True)
class Fp8Config(wgmma.OneWarpgroup):
    """Tuning knobs of the fp8 kernel (validated where made)."""

    block_n: int = 128  # keys per K/V tile (a multiple of 32, at most 128: one atom row of V^T)
    blocks_per_sm: int = 2  # launch bound: resident blocks per SM ptxas must allow (caps the registers)
    #: how V becomes V^T: "staging" (V copied in ``core.fp8``'s staging layout, 32-bit loads, ``v_transposer``) or
    #: "ldmatrix" (V in the hardware's 128-byte swizzle, as the TMA would write it; ``v_transposer_swizzled``)
    v_transpose: str = "staging"

    def __post_init__(self):
        common.check_fields(self, block_n=(32, 128, 32), blocks_per_sm=(1, None, 1))
        if self.v_transpose not in V_TRANSPOSES:
            raise ValueError(f"Fp8Config.v_transpose: expected one of {V_TRANSPOSES}, got {self.v_transpose!r}")


DEFAULT_CONFIG = Fp8Config()
SIMULATOR_CONFIG = Fp8Config(block_n=32, blocks_per_sm=1)
#: a sliding window and soft-capping together: with 128-key tiles NVVM keeps the 64 scores of a lane in local memory
#: (a 256-byte stack frame, ptxas -v); 64-key tiles stay in registers
WINDOW_SOFTCAP_CONFIG = Fp8Config(block_n=64, blocks_per_sm=2)
TUNING_CANDIDATES = (DEFAULT_CONFIG, Fp8Config(block_n=64, blocks_per_sm=2), Fp8Config(v_transpose="ldmatrix"))


def default_config(window=None, softcap=None) -> Fp8Config:
    if SIMULATOR:
        return SIMULATOR_CONFIG
    return WINDOW_SOFTCAP_CONFIG if window is not None and softcap is not None else DEFAULT_CONFIG


def padded_head_dim(head_dim: int) -> int:
    return common.padded_head_dim(head_dim, 32)


def shared_bytes(config: Fp8Config, d_pad: int) -> int:
    """Q, two stages of K, of staged V and of V^T, rows of 128 bytes, plus 1 KB to align the first tile."""
    return 128 * (BLOCK_M + 4 * config.block_n + 2 * d_pad) + 1024


def supports(head_dim: int, *arrays) -> bool:
    """True when this kernel takes the call: a head dim that is a multiple of 16 (whole 16-byte pieces) up to
    ``MAX_HEAD_DIM``, rows that copy in aligned 16-byte pieces, sm_90 (the simulator runs it too)."""
    return (head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM and common.runs_here(MIN_COMPUTE_CAPABILITY)
            and common.vector_loads_ok(*arrays))


def _signature() -> types.Signature:
    operand = types.Array(types.uint8, 4, "A")
    descale = types.Array(types.float32, 2, "A")
    return types.void(operand, operand, operand, types.Array(types.uint16, 4, "A"),
                      types.Array(types.float32, 3, "A"), types.boolean, types.boolean, types.float32, types.float32,
                      descale, descale, descale)


SIGNATURE = _signature()


@lru_cache(maxsize=None)
def flash_fp8_kernel(config: Fp8Config, head_dim_pad: int, bf16_out: bool, scale_first: bool = False,
                     per_head: bool = False, variant: Variant = PLAIN, transpose: bool = True):
    """The compiled kernel of one specialisation: ``wgmma._kernel_source``'s 8-bit form (``transpose=False``: its
    timing probe)."""
    if head_dim_pad % 32 or not 32 <= head_dim_pad <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim_pad must be a multiple of 32 in [32, {MAX_HEAD_DIM}], got {head_dim_pad}")
    source = wgmma._kernel_source(config, head_dim_pad, bf16_out, scale_first, variant, fp8=True, per_head=per_head,
                                  transpose=transpose)
    return kernel_jit((THREADS, config.blocks_per_sm), SIGNATURE)(source)


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream, descale=None,
           config: Fp8Config | None = None, out_dtype: str = "bfloat16", window=None, softcap: float | None = None,
           _transpose: bool = True):
    """Launch on device views of shape (batch, heads, seqlen, headdim): ``q``, ``k``, ``v`` e4m3 bit patterns
    (uint8), ``out`` 16-bit bit patterns of ``out_dtype`` (bfloat16 or float16), ``lse`` (batch, heads, seqlen_q)
    float32. ``descale``: None (all 1), ``(dq, dk, dv)`` floats (per tensor), or three float32 2-D device views
    ``(batch, heads)`` / ``(batch, kv_heads)`` (per head; any strides, zero strides broadcast one value), the
    factors that take the e4m3 values back to the quantised tensors'. ``window``, ``softcap``: as
    ``wgmma.launch``."""
    config = config or default_config(window, softcap)
    check_operands(q, k, v, out_dtype)
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    out = common.bits(out, "out")
    if not supports(head_dim, q, k, v):
        raise ValueError("q, k, v: the fp8 kernel needs headdim % 16 == 0 up to 128, a unit-stride last axis and "
                         f"16-byte aligned rows, on sm_90; got headdim {head_dim}")
    d_pad = padded_head_dim(head_dim)
    nbytes = shared_bytes(config, d_pad)
    common.check_shared_memory(nbytes)
    per_head, scale_log2, scale_first, scalars = scale_arguments(descale, sm_scale, softcap, lse)
    kernel = flash_fp8_kernel(config, d_pad, out_dtype == "bfloat16", scale_first, per_head,
                              Variant.of(bool(causal), window, softcap, False), _transpose)
    shape = common.launch_grid(QUERY_MAJOR, batch, heads, seqlen_q, BLOCK_M)
    device_launch(kernel, shape, THREADS, stream, nbytes, q, k, v, out, lse, bool(write_lse), bool(causal),
                  scale_log2, *scalars)


def check_operands(q, k, v, out_dtype: str):
    """ValueError / TypeError, naming the argument, for an output dtype the fp8 kernels do not write or operands that
    are not e4m3 bit patterns (uint8)."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype!r}")
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if np.dtype(x.dtype) != np.uint8:
            raise TypeError(f"{name}: expected float8 e4m3 bit patterns (uint8), got {np.dtype(x.dtype)}")


def scale_arguments(descale, sm_scale: float, softcap: float | None, lse):
    """``(per_head, scale_log2, scale_first, scalars)`` of the fp8 kernels' launches (``launch``'s ``descale``):
    per-tensor factors fold into the score scale (``common.scale_args``) and the output's factor; ``scalars``, the
    kernel's last four arguments: that factor (float32) and the three per-head descale arrays (per tensor:
    placeholders never read)."""
    per_head = descale is not None and not all(isinstance(x, (int, float)) for x in descale)
    factors = (1.0, 1.0, 1.0) if descale is None or per_head else tuple(float(x) for x in descale)
    scale_log2, scale_first = common.scale_args(sm_scale * factors[0] * factors[1], softcap)
    arrays = descale if per_head else (_placeholder(lse),) * 3
    return per_head, scale_log2, scale_first, (float(np.float32(factors[2])), *arrays)


def _placeholder(lse):
    """A float32 2-D view that per-tensor launches never read: ``lse``'s memory seen as one element (under the
    simulator a small array)."""
    if SIMULATOR:
        return np.zeros((1, 1), np.float32)
    return restride(lse, (1, 1), (0, 0))
