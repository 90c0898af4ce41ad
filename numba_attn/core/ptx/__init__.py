"""Inline-PTX (and small LLVM-IR) intrinsics for the tensor-core kernels, via Numba ``@intrinsic``.

Every intrinsic is a plain function call inside a ``@cuda.jit`` kernel. A 32-bit operand that holds two 16-bit
values is passed as one integer (any Numba integer type; it is truncated to 32 bits); the element with the smaller
index sits in the LOW half, as the PTX fragment layouts require ("elements low to high").

Warp-level MMA ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32``. For lane ``l`` of the warp let
``g = l // 4`` (PTX "groupID") and ``t = l % 4`` ("threadID_in_group"), and let ``X[r][c0, c1]`` be one 32-bit
register holding ``X[r][c0]`` (low half) and ``X[r][c1]`` (high half). From the PTX ISA, "Matrix Fragments for
mma.m16n8k16 with floating point type"::

    A (16 x 16, row major), four registers      a0 = A[g    ][2t    , 2t + 1]
                                                a1 = A[g + 8][2t    , 2t + 1]
                                                a2 = A[g    ][2t + 8, 2t + 9]
                                                a3 = A[g + 8][2t + 8, 2t + 9]
    B (16 x 8, "col": columns contiguous),      b0 = B[2t    , 2t + 1][g]      (two consecutive k of column g)
      two registers                             b1 = B[2t + 8, 2t + 9][g]
    C, D (16 x 8, float32), four registers      c0 = C[g    ][2t]   c1 = C[g    ][2t + 1]
                                                c2 = C[g + 8][2t]   c3 = C[g + 8][2t + 1]

Consequences the attention kernel relies on:

* ``S = Q K^T`` with K stored ``[key][d]``: B = K^T, so ``b0`` is the 32-bit word of K row ``g`` holding columns
  ``2t, 2t + 1`` of the 16-column k-slice and ``b1`` the word 4 further on.
* ``O += P V``: the C fragments of two neighbouring n8 blocks ``2j`` and ``2j + 1`` of ``S`` (keys ``16j .. 16j + 15``),
  packed pairwise, ARE the A fragment of k-step ``j``: ``a0 = (c0, c1)`` and ``a1 = (c2, c3)`` of block ``2j`` (key
  columns ``16j + 2t, +1`` of rows ``g``, ``g + 8``), ``a2 = (c0, c1)`` and ``a3 = (c2, c3)`` of block ``2j + 1`` (key
  columns ``16j + 8 + 2t, +1``). No shuffles and no shared memory between the two GEMMs.
* For V as B (``B[k = key][n = d]``) a register needs two consecutive KEYS of one column ``d``: from a ``[key][d]``
  tile ``ldmatrix_x4_trans`` delivers exactly that (or V is stored transposed ``[d][key]``).
* ``ldmatrix_x4`` on a ``[row][d]`` tile: matrices (rows +0, cols +0), (+8, +0), (+0, +8), (+8, +8) are the A
  fragment ``a0..a3`` of a 16x16 block; matrices (rows +0, cols +0), (+0, +8), (+8, +0), (+8, +8) of a K tile are the
  B fragments ``(b0, b1)`` of two n8 blocks.

Warp-level MMA ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` (PTX "Matrix Fragments for mma.m16n8k8" with
``.tf32``), one 32-bit register per element (float32 bits; the hardware reads the top 19)::

    A (16 x 8), four registers     a0 = A[g][t]   a1 = A[g + 8][t]   a2 = A[g][t + 4]   a3 = A[g + 8][t + 4]
    B (8 x 8), two registers       b0 = B[t][g]   b1 = B[t + 4][g]
    C, D                           as for m16n8k16

The k index of one MMA may be permuted freely as long as A and B use the same permutation. With ``A col t <-> k 2t``
and ``A col t + 4 <-> k 2t + 1`` the C fragment of one n8 block of a product IS the A fragment of a k8 step of the
next product: ``(a0, a1, a2, a3) = (c0, c2, c1, c3)``, and the matching B registers are rows ``2t`` and ``2t + 1``.

One module per instruction family; every name is re-exported here, so kernels write ``ptx.mma_m16n8k16_f16(...)``:

* ``mma``: ``mma.sync`` (m16n8k16 float16 / bfloat16, m16n8k8 tf32, the layouts above; ``mma_m16n8k8_tf32x3``: the
  three MMAs of a 3xTF32 product), ``to_tf32`` and the integer roundings ``round_tf32``, ``round_tf32_keep_inf``.
* ``ldmatrix``: ``ldmatrix.x4`` and ``.trans`` (shared memory straight into A / B fragments; ``_short``: the
  address in 32-bit arithmetic).
* ``cp_async``: ``cp.async`` copies from global to shared memory, commit groups and their waits.
* ``memory``: loads and stores without negative-index wraparound, vector widths and byte offsets (plain LLVM).
* ``atomics``: ``atom.acq_rel.gpu.inc``, ``red.global.add.f32`` (scalar and, sm_90, ``.v2``, ``.v4``).
* ``convert``: ``cvt`` packs of float32 pairs to float16 / bfloat16 and of quadruples to float8 e4m3, 16-bit floats
  to float32, raw bit moves and byte permutes (``prmt``), and the host (NumPy) bfloat16 and e4m3 helpers.
* ``warp``: ``shfl.sync.bfly``, ``shfl.sync.idx`` (``warp_uniform``), ``vote.sync.all``, ``bar.warp.sync``.
* ``sfu``: ``ex2.approx``, ``tanh.approx``.
* ``_asm`` (private): the GPU-or-simulator switch and the shared code-generation helpers; ``_sim`` (private): how the
  simulator twins of warp-collective instructions see the other lanes.

The warpgroup MMAs of Hopper (``wgmma``) live in ``core.warpgroup``; its asynchronous machinery (mbarriers, TMA
copies, named barriers, ``setmaxnreg``, ``elect.sync``) in ``tma``, imported as ``from numba_attn.core.ptx import
tma`` (not re-exported here).

Under Numba's CUDA simulator (``numba_attn.runtime.device.SIMULATOR``) inline PTX cannot run: the same names are then
pure-Python twins with the same semantics, defined beside each intrinsic. The warp-collective ones (``mma_*``,
``ldmatrix_x4*``, ``shfl_xor_f32``, ``all_lanes``) exchange operands through the thread block's barrier and
``warp_sync`` is that barrier, so under the simulator every thread of the block must call them the same number of
times in the same order (the kernels of this package do); that lets the tensor-core kernel's index arithmetic be
tested without a GPU.
"""
from __future__ import annotations

from .atomics import atomic_inc_acq_rel, red_add_f32, red_add_f32x2, red_add_f32x4
from .convert import (E4M3_MAX, E4M3_VALUES, bf16_bits_to_float32, bf16_to_float, bits_float, byte_perm,
                      e4m3_bits_to_float32, float32_to_bf16_bits, float32_to_e4m3_bits, float_bits, half_to_float,
                      high_u16, interleave_high, interleave_low, low_u16, pack_bf16x2, pack_e4m3x4, pack_half2,
                      pack_u16x2)
from .cp_async import cp_async_16, cp_async_16_prefetch, cp_async_commit, cp_async_wait_all, cp_async_wait_group
from .ldmatrix import ldmatrix_x4, ldmatrix_x4_short, ldmatrix_x4_trans, ldmatrix_x4_trans_short
from .memory import (load1, load2, load_f32_at, load_f32x2, load_f32x4, load_f32x4_1d, load_u16x2, load_u16x4,
                     load_u16x8, store1, store2, store_f32x2, store_f32x2_at, store_f32x4, store_pair, store_u32_at,
                     store_u16x2, store_u32x2_1d, store_u32x4, store_u32x4_1d)
from .mma import (TF32_HUGE, mma_m16n8k8_tf32, mma_m16n8k8_tf32x3, mma_m16n8k16_bf16, mma_m16n8k16_f16, round_tf32,
                  round_tf32_keep_inf, to_tf32)
from .sfu import exp2_approx, tanh_approx
from .warp import all_lanes, shfl_xor_f32, warp_sync, warp_uniform

__all__ = [
    # mma
    "mma_m16n8k16_f16",
    "mma_m16n8k16_bf16",
    "mma_m16n8k8_tf32",
    "mma_m16n8k8_tf32x3",
    "to_tf32",
    "round_tf32",
    "round_tf32_keep_inf",
    "TF32_HUGE",
    # ldmatrix
    "ldmatrix_x4",
    "ldmatrix_x4_trans",
    "ldmatrix_x4_short",
    "ldmatrix_x4_trans_short",
    # cp_async
    "cp_async_16",
    "cp_async_16_prefetch",
    "cp_async_commit",
    "cp_async_wait_all",
    "cp_async_wait_group",
    # memory
    "load1",
    "store1",
    "load2",
    "store2",
    "load_u16x8",
    "store_u32x4",
    "store_u32x2_1d",
    "store_u32x4_1d",
    "store_u16x2",
    "load_f32x4",
    "load_u16x4",
    "store_pair",
    "load_f32x2",
    "load_f32x4_1d",
    "load_u16x2",
    "store_f32x2",
    "store_f32x4",
    "store_u32_at",
    "store_f32x2_at",
    "load_f32_at",
    # atomics
    "atomic_inc_acq_rel",
    "red_add_f32",
    "red_add_f32x2",
    "red_add_f32x4",
    # convert
    "float32_to_bf16_bits",
    "bf16_bits_to_float32",
    "pack_half2",
    "pack_bf16x2",
    "half_to_float",
    "bf16_to_float",
    "pack_u16x2",
    "interleave_low",
    "interleave_high",
    "low_u16",
    "high_u16",
    "float_bits",
    "bits_float",
    "E4M3_VALUES",
    "E4M3_MAX",
    "e4m3_bits_to_float32",
    "float32_to_e4m3_bits",
    "pack_e4m3x4",
    "byte_perm",
    # warp
    "shfl_xor_f32",
    "all_lanes",
    "warp_sync",
    "warp_uniform",
    # sfu
    "exp2_approx",
    "tanh_approx",
]
