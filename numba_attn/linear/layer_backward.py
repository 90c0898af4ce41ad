"""Backward of the linear-attention layer (``reference.linear_attention_backward``: ``phi = elu + 1``, the
normaliser, ``eps``) from the causal dot product's backward (or the non-causal products) and a few small kernels.

``out_i = n_i / z_i`` with the numerator ``n = prod(phi(Q), phi(K), V)`` (the causal product; non-causal
``prod(A, B, C) = A (B^T C)``) and ``z_i - eps = phi(q_i) . sum_{j <= i} phi(k_j)``. The gradients of the loss with
respect to ``n`` and ``z`` are::

    dn_i = dout_i / z_i            dz_i = -(dout_i . out_i) / z_i       (0 where z_i = 0: out is 0)

``dphi(Q)`` and ``dphi(K)`` are the numerator product's backward ``(dn, phi(Q), phi(K), V)`` (which also gives
``dV``) plus the normaliser's part; then ``dq = dphi(Q) phi'(q)`` and ``dk = dphi(K) phi'(k)`` with ``phi'(x) = 1``
for ``x > 0``, ``exp(x)`` otherwise. The non-causal backward of ``A (B^T C)`` given ``G`` is three such products:
``dA = G (C^T B)``, ``dB = C (G^T A)``, ``dC = B (A^T G)``.

Non-causal (``NONCAUSAL_KEY_SUMS``), the normaliser needs two E-vectors per (batch, head), both from one column-sum
kernel (``column_sums``, a deterministic two-stage reduction): the key sum ``s = sum_j phi(k_j)`` (then ``z_i - eps =
phi(q_i) . s`` in ``rows``) and ``w = sum_i dz_i phi(q_i)``; its part of ``dphi(q_i)`` is ``dz_i s`` and of
``dphi(k_j)`` ``w`` for every key row, added in ``finish``. Steps: ``prepare`` (phi(Q), phi(K), V in float32),
``s``, the numerator product (recomputed: the forward keeps nothing), ``rows`` (``n -> dn`` in place and ``dz``, a
warp per row), the numerator's backward, ``w``, ``finish`` (``dq``, ``dk``, ``dv`` in the inputs' dtype). The
compiled kernels of a call: these four, and the product's (the ``E x M`` operand shapes only).

Causal, ``z_i`` needs a prefix sum of the keys and ``dphi(k_j)`` a suffix sum of ``dz_i phi(q_i)``: the normaliser
runs as the same product with a column of ones for V, ``z - eps = prod(phi(Q), phi(K), U)``, ``U = [1, 0, 0, 0]``
per row (four columns: whole 16-byte pieces for the kernels' vector loads), ``dz_i = [dz_i, 0, 0, 0]``, and its part
of ``dphi`` is that product's backward ``(dz, phi(Q), phi(K), U)`` (its ``dU`` not needed: no ``dv`` walk).
``prepare`` also writes ``U``, ``rows`` reads ``z`` from the normaliser's product, ``finish`` adds its backward
row by row. (Until the column sums the non-causal layer did the same: its products of the 4-wide operands compiled
six more kernels, three tile shapes of ``STATES`` and ``APPLY``, and cost nine more launches.)

The intermediates are float32: ``z`` reaches ``seqlen * E`` scale and ``dout / z`` falls below float16's normal
range, so 16-bit intermediates would lose range; the products run on the float32 path of the kernels as 3xTF32, or
in one tf32 term for bfloat16 inputs or with ``allow_tf32``. Not one term for float16 inputs: the parts of ``dphi``
through the numerator and through the normaliser cancel to a fraction of either, and with the scores rounded to tf32
the gradients of float16 inputs came out at 1e-3 to 2e-3 relative error (simulator, seqlen 13, causal), against
2e-4 with 3xTF32. The column sums and ``phi(q_i) . s`` are plain float32.

The normaliser as a fifth column of V (one product, one backward) was the first version: its 65- and 68-wide
operands took the float32 register walk to E' = 80 (spilling with 3xTF32) and to three 32-column M tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import float32

from ..core import ptx
from ..core.staging import device_function
from ..runtime.device import SIMULATOR, cuda, kernel_jit, multiprocessor_count
from ..runtime.launch import launch as device_launch
from . import chunked_backward, column_sums, launch, recurrent, recurrent_backward
from .arguments import BFLOAT16, FLOAT32, input_kind, sizes
from .chunk_plan import cdiv

#: launch bound of ``prepare`` / ``finish`` (blocks of 256 threads per SM: at most 80 registers; left to itself the
#: compiler took 116-120 and two blocks per SM; with 64, ``finish`` of 16-bit outputs spilled 8 bytes)
ROW_KERNEL_BLOCKS = 3
#: columns of the ones block ``U`` and of the normaliser's product (whole 16-byte pieces of float32)
UNIT_COLS = 4
#: non-causal: the normaliser from two column sums per (batch, head) (``column_sums``) instead of the products of
#: ``U`` (module docstring); False takes the causal path's way, for comparison (tests, timings)
NONCAUSAL_KEY_SUMS = True


@dataclass(frozen=True)
class LayerBackwardConfig:
    """Launch shape of the three small kernels."""

    threads: int = 256  # prepare / finish: threads per block (a grid-stride loop over rows)
    blocks_per_sm: int = 8
    row_threads: int = 32  # threads per row (a power of two <= 32: rows' warp shuffles sum their parts)
    rows_per_block: int = 8

    def __post_init__(self):
        for name in ("threads", "blocks_per_sm", "row_threads", "rows_per_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"LayerBackwardConfig.{name}: expected >= 1, got {getattr(self, name)}")
        if self.row_threads > 32 or self.row_threads & (self.row_threads - 1):
            raise ValueError(f"LayerBackwardConfig.row_threads: expected a power of two <= 32, got {self.row_threads}")
        if self.threads % self.row_threads:
            raise ValueError("LayerBackwardConfig: threads must be a multiple of row_threads")
        if self.row_threads * self.rows_per_block % 32 and self.row_threads > 1:
            raise ValueError("LayerBackwardConfig: row_threads * rows_per_block must fill whole warps")


GPU_CONFIG = LayerBackwardConfig()
#: the simulator runs each thread as a Python thread: a thread per row needs no shuffles
SIMULATOR_CONFIG = LayerBackwardConfig(threads=32, blocks_per_sm=1, row_threads=1, rows_per_block=32)


def default_config() -> LayerBackwardConfig:
    return SIMULATOR_CONFIG if SIMULATOR else GPU_CONFIG


def _element_functions(dtype: str):
    """``(read, write)``: an input element (float32, or the uint16 bits of 16-bit data) -> float32, and float32 ->
    an output element of ``dtype`` (rounded to nearest)."""
    F32 = dtype == FLOAT32
    to_float = ptx.bf16_to_float if dtype == BFLOAT16 else ptx.half_to_float
    pack = ptx.pack_bf16x2 if dtype == BFLOAT16 else ptx.pack_half2
    low_u16 = ptx.low_u16

    @device_function
    def read(x):
        if F32:
            return float32(x)
        return to_float(x)

    @device_function
    def write(x):
        if F32:
            return float32(x)
        return low_u16(pack(x, float32(0.0)))

    return read, write


@device_function
def _row(r, shape_heads, rows):
    """Flat row ``r`` of a ``(batch, heads, rows, ...)`` array -> (b, h, row)."""
    bh = r // rows
    return bh // shape_heads, bh % shape_heads, r % rows


@lru_cache(maxsize=None)
def prepare_kernel(dtype: str, threads: int, lanes: int, unit: bool = True):
    """``(q, k, v, phi_q, phi_k, vf, ones)``: ``phi(q)``, ``phi(k)``, ``v`` and (``unit``: the causal path) the rows
    ``[1, 0, 0, 0]`` in float32 (without ``unit``, ``ones`` is not touched); ``lanes`` threads per row (a
    grid-stride loop over the rows of q, then those of k and v). A row's position is worked out once: per element,
    its three integer divisions (64-bit) cost more than the copy."""
    read, _ = _element_functions(dtype)
    LANES = lanes
    ROWS = threads // lanes
    UNIT = unit

    @device_function
    def phi(x):
        return x + float32(1.0) if x > float32(0.0) else float32(math.exp(x))

    @kernel_jit(launch_bounds=(threads, ROW_KERNEL_BLOCKS))
    def kernel(q, k, v, phi_q, phi_k, vf, ones):
        tid = cuda.threadIdx.x
        lane = tid % LANES
        heads = q.shape[1]
        e_dim = q.shape[3]
        m_dim = v.shape[3]
        rows_q = q.shape[0] * heads * q.shape[2]
        total = rows_q + k.shape[0] * heads * k.shape[2]
        for r in range(cuda.blockIdx.x * ROWS + tid // LANES, total, cuda.gridDim.x * ROWS):
            if r < rows_q:
                b, h, i = _row(r, heads, q.shape[2])
                q_row = q[b, h, i]
                phi_q_row = phi_q[b, h, i]
                for c in range(lane, e_dim, LANES):
                    phi_q_row[c] = phi(read(q_row[c]))
            else:
                b, h, i = _row(r - rows_q, heads, k.shape[2])
                k_row = k[b, h, i]
                phi_k_row = phi_k[b, h, i]
                for c in range(lane, e_dim, LANES):
                    phi_k_row[c] = phi(read(k_row[c]))
                v_row = v[b, h, i]
                vf_row = vf[b, h, i]
                for c in range(lane, m_dim, LANES):
                    vf_row[c] = read(v_row[c])
                if UNIT:
                    for c in range(lane, UNIT_COLS, LANES):
                        ones[b, h, i, c] = float32(1.0) if c == 0 else float32(0.0)

    return kernel


@lru_cache(maxsize=None)
def rows_kernel(dtype: str, row_threads: int, rows_per_block: int, key_sums: bool = False):
    """``(num, den, dout, eps, phi_q, sums)``: per row, ``num`` (``n``) becomes ``dn = dout / z`` and ``den`` becomes
    ``dz`` in column 0 (zeros in its other columns), in place (float32). ``z - eps`` is ``den``'s column 0 (the
    causal path's normaliser product), or with ``key_sums`` (non-causal) ``phi_q[b, h, i] . sums[b, h, 0]``, the key
    sum ``s``; ``row_threads`` threads per row, their parts of the dot products summed by warp shuffles."""
    read, _ = _element_functions(dtype)
    TPR = row_threads
    RPB = rows_per_block
    KEY_SUMS = key_sums
    shfl_xor = ptx.shfl_xor_f32
    ZERO = float32(0.0)

    @kernel_jit(launch_bounds=(TPR * RPB,))
    def kernel(num, den, dout, eps, phi_q, sums):
        tid = cuda.threadIdx.x
        lane = tid % TPR
        row = cuda.blockIdx.x * RPB + tid // TPR
        heads = num.shape[1]
        seqlen = num.shape[2]
        m_dim = num.shape[3]
        inside = row < num.shape[0] * heads * seqlen
        b, h, i = _row(row, heads, seqlen)
        dot = ZERO
        z = ZERO
        if inside:
            if KEY_SUMS:  # (lanes' parts, summed below)
                for c in range(lane, phi_q.shape[3], TPR):
                    z += phi_q[b, h, i, c] * sums[b, h, 0, c]
            else:  # read before the shuffles: after them lane 0 overwrites it
                z = den[b, h, i, 0]
            for c in range(lane, m_dim, TPR):
                dot += read(dout[b, h, i, c]) * num[b, h, i, c]
        mask = 1
        while mask < TPR:  # every lane takes part, those of rows past the end too
            dot += shfl_xor(dot, mask)
            if KEY_SUMS:
                z += shfl_xor(z, mask)
            mask *= 2
        if inside:
            z += eps  # the forward's order: eps after the dot product
            inv = float32(1.0) / z if z != ZERO else ZERO  # no keys and eps = 0: out is 0, no gradient
            for c in range(lane, m_dim, TPR):
                num[b, h, i, c] = read(dout[b, h, i, c]) * inv
            for c in range(lane, den.shape[3], TPR):
                den[b, h, i, c] = -(dot * inv) * inv if c == 0 else ZERO  # -(dout . out) / z

    return kernel


@lru_cache(maxsize=None)
def finish_kernel(dtype: str, threads: int, lanes: int, key_sums: bool = False):
    """``(dphi_q, norm_q, q, dq, dphi_k, norm_k, k, dk, dvf, dv, dz)``: ``dq = (dphi_q + g_q) phi'(q)``, ``dk =
    (dphi_k + g_k) phi'(k)``, ``dv = dvf``, in the inputs' dtype, with ``g`` the normaliser's part of ``dphi``:
    ``norm_q``, ``norm_k`` row by row (the causal path's products), or with ``key_sums`` (non-causal) ``g_q =
    dz[b, h, i, 0] norm_q[b, h, 0]`` (``norm_q`` the key sum ``s``) and ``g_k = norm_k[b, h, 0]`` (``sum_i dz_i
    phi(q_i)``), the same for every row of a head; ``lanes`` threads per row (as ``prepare``)."""
    read, write = _element_functions(dtype)
    LANES = lanes
    ROWS = threads // lanes
    KEY_SUMS = key_sums

    @device_function
    def derivative(x):
        return float32(1.0) if x > float32(0.0) else float32(math.exp(x))

    @kernel_jit(launch_bounds=(threads, ROW_KERNEL_BLOCKS))
    def kernel(dphi_q, norm_q, q, dq, dphi_k, norm_k, k, dk, dvf, dv, dz):
        tid = cuda.threadIdx.x
        lane = tid % LANES
        heads = q.shape[1]
        e_dim = q.shape[3]
        m_dim = dv.shape[3]
        rows_q = q.shape[0] * heads * q.shape[2]
        total = rows_q + k.shape[0] * heads * k.shape[2]
        for r in range(cuda.blockIdx.x * ROWS + tid // LANES, total, cuda.gridDim.x * ROWS):
            scale = float32(1.0)
            if r < rows_q:
                b, h, i = _row(r, heads, q.shape[2])
                x_row, grad, out_row = q[b, h, i], dphi_q[b, h, i], dq[b, h, i]
                if KEY_SUMS:
                    scale = dz[b, h, i, 0]
                    grad_norm = norm_q[b, h, 0]
                else:
                    grad_norm = norm_q[b, h, i]
            else:
                b, h, i = _row(r - rows_q, heads, k.shape[2])
                x_row, grad, out_row = k[b, h, i], dphi_k[b, h, i], dk[b, h, i]
                grad_norm = norm_k[b, h, 0] if KEY_SUMS else norm_k[b, h, i]
                dvf_row = dvf[b, h, i]
                dv_row = dv[b, h, i]
                for c in range(lane, m_dim, LANES):
                    dv_row[c] = write(dvf_row[c])
            for c in range(lane, e_dim, LANES):
                out_row[c] = write((grad[c] + scale * grad_norm[c]) * derivative(read(x_row[c])))

    return kernel


def _grid(rows: int, config: LayerBackwardConfig) -> int:
    """Blocks of a row kernel (``prepare``, ``finish``: ``threads // row_threads`` rows a block, grid-stride)."""
    return max(1, min(cdiv(rows, config.threads // config.row_threads), config.blocks_per_sm * multiprocessor_count()))


class _Products:
    """The products of one backend on float32 device views (``tf32``: one tf32 term)."""

    def __init__(self, chunked: bool, causal: bool, tf32: bool, stream, scratch):
        self.chunked, self.causal, self.tf32, self.stream, self.scratch = chunked, causal, tf32, stream, scratch

    def forward(self, a, b, c, out):
        """``out = prod(a, b, c)``: the causal product, or ``a (b^T c)``."""
        if self.causal and self.chunked:
            launch.launch_causal(a, b, c, out, self.stream, tf32=self.tf32, scratch=self.scratch)
        elif self.causal:
            recurrent.launch_causal_dot_product(a, b, c, out, self.stream)
        elif self.chunked:
            launch.launch_noncausal(a, b, c, out, 0.0, self.stream, tf32=self.tf32, scratch=self.scratch, layer=False)
        else:
            recurrent.launch_noncausal(a, b, c, out, 0.0, self.stream, layer=False, scratch=self.scratch)

    def backward(self, grad, a, b, c, da, db, dc):
        """``da, db`` and ``dc`` (None: not computed) of ``prod(a, b, c)`` given ``grad``, its output's gradient."""
        if not self.causal:
            self.forward(grad, c, b, da)  # grad (c^T b)
            self.forward(c, grad, a, db)  # c (grad^T a)
            if dc is not None:
                self.forward(b, a, grad, dc)  # b (a^T grad)
        elif self.chunked:
            chunked_backward.launch_causal_backward(grad, a, b, c, da, db, dc, self.stream, tf32=self.tf32,
                                                    scratch=self.scratch)
        else:
            recurrent_backward.launch_causal_dot_product_backward(grad, a, b, c, da, db, dc, self.stream)


def launch_linear_attention_backward(dout, q, k, v, dq, dk, dv, stream, *, causal: bool, eps: float, chunked: bool,
                                     tf32: bool = False, dtype: str | None = None, scratch,
                                     config: LayerBackwardConfig | None = None):
    """``dq, dk, dv`` of the layer on device views ``(batch, heads, seqlen, E | M)`` (k, v of their own seqlen when
    not causal), any strides; float16 / float32 arrays or uint16 bit views of ``dtype`` data. ``chunked``: the
    tensor-core products, else the recurrent ones; ``tf32``: the products in one tf32 term (bfloat16 inputs always
    are; module docstring); ``scratch(shape)``: a float32 device array (several are needed)."""
    config = config or default_config()
    q, dtype = input_kind(q, dtype)
    k, v, dout, dq, dk, dv = (input_kind(x, dtype)[0] for x in (k, v, dout, dq, dk, dv))
    bh, seqlen_q, seqlen_k, e, m = sizes(q, v)
    if bh == 0:
        return
    batch, heads = q.shape[:2]
    key_sums = not causal and NONCAUSAL_KEY_SUMS
    phi_q, dphi_q = (scratch((batch, heads, seqlen_q, e)) for _ in range(2))
    phi_k, dphi_k = (scratch((batch, heads, seqlen_k, e)) for _ in range(2))
    vf, dvf = (scratch((batch, heads, seqlen_k, m)) for _ in range(2))
    num = scratch((batch, heads, seqlen_q, m))  # n, then dn
    # z - eps, then dz (causal: the normaliser's product, UNIT_COLS wide; non-causal: dz alone)
    den = scratch((batch, heads, seqlen_q, 1 if key_sums else UNIT_COLS))
    if key_sums:  # the key sum s and sum_i dz_i phi(q_i): one E-vector per (batch, head) each
        norm_q, norm_k = (scratch((batch, heads, 1, e)) for _ in range(2))
        ones = den  # (not touched by prepare)
    else:  # the normaliser products' backwards, row by row
        norm_q, norm_k = scratch((batch, heads, seqlen_q, e)), scratch((batch, heads, seqlen_k, e))
        ones = scratch((batch, heads, seqlen_k, UNIT_COLS))
    threads, lanes = config.threads, config.row_threads
    rows = bh * (seqlen_q + seqlen_k)
    device_launch(prepare_kernel(dtype, threads, lanes, not key_sums), _grid(rows, config), threads, stream, 0,
                  q, k, v, phi_q, phi_k, vf, ones)
    if key_sums:
        column_sums.launch_column_sums(phi_k, den, norm_q, stream, scratch=scratch, weighted=False)

    products = _Products(chunked, causal, tf32 or dtype == BFLOAT16, stream, scratch)
    products.forward(phi_q, phi_k, vf, num)
    if not key_sums:
        products.forward(phi_q, phi_k, ones, den)
    if bh * seqlen_q:
        rows_per_block = config.rows_per_block
        device_launch(rows_kernel(dtype, config.row_threads, rows_per_block, key_sums),
                      cdiv(bh * seqlen_q, rows_per_block), config.row_threads * rows_per_block, stream, 0,
                      num, den, dout, np.float32(eps), phi_q, norm_q if key_sums else phi_k)
    products.backward(num, phi_q, phi_k, vf, dphi_q, dphi_k, dvf)
    if key_sums:
        column_sums.launch_column_sums(phi_q, den, norm_k, stream, scratch=scratch, weighted=True)
    else:
        products.backward(den, phi_q, phi_k, ones, norm_q, norm_k, None)
    device_launch(finish_kernel(dtype, threads, lanes, key_sums), _grid(rows, config), threads, stream, 0,
                  dphi_q, norm_q, q, dq, dphi_k, norm_k, k, dk, dvf, dv, den)
