"""The simulator twins of ``core.warpgroup``'s intrinsics (pure Python; ``warpgroup`` imports them under the
simulator -- import them from there). They decode the descriptors' strides from the shared array exactly as the
module docstring of ``warpgroup`` tells, and exchange register fragments through the block's barrier: every thread
of the warpgroup must call them the same number of times, and the first thread computes each product for all.
"""
from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from .ptx._sim import _sim_group_gather
from .ptx.convert import e4m3_bits_to_float32
from .warpgroup import ROWS, WARPGROUP_THREADS, _check, swizzle


def _sim_values(words: np.ndarray, bf16: bool) -> np.ndarray:
    words = np.asarray(words, dtype=np.uint16)
    if bf16:
        return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return words.view(np.float16).astype(np.float64)


def _sim_operand_e4m3(smem, offset: int, rows: int, layout, k_steps: int) -> np.ndarray:
    """The ``rows x 32 k_steps`` K-major float8 e4m3 operand ([row][k]) a descriptor at element ``offset`` of the
    uint16 ``smem`` describes (as ``_sim_operand``: 128-byte swizzle, element 0 aligned)."""
    lbo, sbo, offsets = layout
    r = np.arange(rows)[:, None]
    k = np.arange(32)[None, :]
    within = (r // 8) * sbo + (r % 8) * 128 + k
    raw = np.asarray(smem).view(np.uint8)
    slices = [_sim_e4m3(raw[swizzle(2 * int(offset) + offsets[s] + within)]) for s in range(k_steps)]
    return np.concatenate(slices, axis=1)


def _sim_e4m3(codes) -> np.ndarray:
    return e4m3_bits_to_float32(codes).astype(np.float64)


def _sim_gathered_a_e4m3(words, k_steps: int) -> np.ndarray:
    """The warpgroup's ``64 x 32 k_steps`` e4m3 register A operand from every thread's words (128 rows)."""
    # [thread, k-step, register, byte] -> A[16 warp + g + 8 (reg % 2)][32 s + 4 t + 16 (reg // 2) + byte]
    values = _sim_e4m3(np.asarray(words, dtype=np.uint32).view(np.uint8)).reshape(WARPGROUP_THREADS, k_steps, 2, 2,
                                                                                  4)
    tid = np.arange(WARPGROUP_THREADS)
    row, t = 16 * (tid // 32) + tid % 32 // 4, tid % 4
    a = np.zeros((ROWS, 32 * k_steps))
    for half in range(2):  # register 2 half + dr
        for dr in range(2):
            cols = 32 * np.arange(k_steps)[None, :, None] + 4 * t[:, None, None] + 16 * half + np.arange(4)
            a[(row + 8 * dr)[:, None, None], cols] = values[:, :, half, dr]
    return a


def _sim_operand(smem, offset: int, rows: int, layout, k_steps: int, trans: bool, bf16: bool) -> np.ndarray:
    """The ``rows x 16 k_steps`` (K-major: [row][k]) or ``16 k_steps x rows`` (MN-major: [k][n]) operand a
    descriptor at element ``offset`` of ``smem`` describes, read by the documented canonical layouts with the
    128-byte swizzle (element 0 of ``smem`` stands for a 1024-byte aligned address)."""
    lbo, sbo, offsets = layout
    r = np.arange(rows)[:, None]  # the M / N index
    k = np.arange(16)[None, :]
    if trans:  # 64 n contiguous per 128-byte row, k rows 128 bytes apart
        within = (r // 64) * lbo + (r % 64) * 2 + (k // 8) * sbo + (k % 8) * 128
    else:  # 64 k contiguous per 128-byte row, rows 128 bytes apart
        within = (r // 8) * sbo + (r % 8) * 128 + k * 2
    words = np.asarray(smem).view(np.uint16)
    slices = [_sim_values(words[swizzle(2 * int(offset) + offsets[s] + within) // 2], bf16) for s in range(k_steps)]
    out = np.concatenate(slices, axis=1)  # [row][k]
    return out.T if trans else out


@lru_cache(maxsize=None)
def _sim_c_positions(n: int):
    """``(rows, cols)``, each ``(128, n / 2)``: where accumulator element ``f`` of warpgroup thread ``tid`` lies."""
    tid = np.arange(WARPGROUP_THREADS)[:, None]
    f = np.arange(n // 2)[None, :]
    row = 16 * (tid // 32) + (tid % 32) // 4 + 8 * ((f % 4) // 2)
    col = 8 * (f // 4) + 2 * (tid % 4) + f % 2
    return row, col


@lru_cache(maxsize=None)
def _sim_a_positions(k_steps: int):
    """``(rows, cols)``, each ``(128, 4 k_steps)``: where the low half of A word ``w`` of thread ``tid`` lies (the
    high half: the next column)."""
    tid = np.arange(WARPGROUP_THREADS)[:, None]
    w = np.arange(4 * k_steps)[None, :]
    row = 16 * (tid // 32) + (tid % 32) // 4 + 8 * (w % 2)
    col = 16 * (w // 4) + 2 * (tid % 4) + 8 * ((w % 4) // 2)
    return row, col


def _sim_store(acc, d: np.ndarray, n: int):
    rows, cols = _sim_c_positions(n)
    tid = threading.current_thread().thread_id % WARPGROUP_THREADS
    acc.reshape(-1)[: n // 2] = d[rows[tid], cols[tid]].astype(np.float32)


def _sim_gathered_c(frags, n: int) -> np.ndarray:
    """The warpgroup's ``64 x n`` accumulator from every thread's fragment (``frags``: 128 of them)."""
    rows, cols = _sim_c_positions(n)
    d = np.zeros((ROWS, n))
    d[rows, cols] = np.asarray(frags, dtype=np.float64)
    return d


def _sim_gathered_a(words, k_steps: int, bf16: bool) -> np.ndarray:
    """The warpgroup's ``64 x 16 k_steps`` register A operand from every thread's words (``words``: 128 rows)."""
    rows, cols = _sim_a_positions(k_steps)
    w = np.asarray(words, dtype=np.uint32)
    halves = [w & 0xFFFF, w >> 16]
    a = np.zeros((ROWS, 16 * k_steps))
    for x, half in enumerate(halves):
        a[rows, cols + x] = _sim_values(half.astype(np.uint16), bf16)
    return a


def _sim_leader_result(compute):
    """``compute()`` run by the first thread of the warpgroup only, its result handed to all 128 (a block barrier
    inside): the twins decode whole operands once per warpgroup, not once per thread."""
    tid = threading.current_thread().thread_id
    result = compute() if tid % WARPGROUP_THREADS == 0 else None
    return _sim_group_gather(result, WARPGROUP_THREADS)[0]


def _twin_ss(n: int, accumulate: bool, operands):
    """An ``(acc, smem, a_offset, b_offset)`` twin: ``acc = A B^T`` (``+= ...`` with ``accumulate``) of
    ``operands(smem, a_offset, b_offset) -> (A [m][k], B [n][k])``."""

    def mma(acc, smem, a_offset, b_offset):
        everyone = _sim_group_gather(np.array(acc.reshape(-1)[: n // 2], dtype=np.float64),
                                     WARPGROUP_THREADS) if accumulate else None

        def product():
            a, b = operands(smem, a_offset, b_offset)
            d = a @ b.T
            return d + _sim_gathered_c(everyone, n) if accumulate else d

        _sim_store(acc, _sim_leader_result(product), n)  # the warpgroup moves together, as on the GPU

    return mma


def _twin_rs(n: int, k_steps: int, gathered_a, operand_b):
    """An ``(acc, a_regs, smem, b_offset)`` twin: ``acc += A B^T`` with A gathered from every thread's registers
    (``gathered_a(words)``, 128 rows of ``4 k_steps`` words) and ``operand_b(smem, b_offset) -> B [n][k]``."""

    def mma(acc, a_regs, smem, b_offset):
        mine = (np.array(np.asarray(a_regs).reshape(-1)[: 4 * k_steps], dtype=np.uint32),
                np.array(acc.reshape(-1)[: n // 2], dtype=np.float64))
        everyone = _sim_group_gather(mine, WARPGROUP_THREADS)

        def product():
            a = gathered_a([x[0] for x in everyone])
            return _sim_gathered_c([x[1] for x in everyone], n) + a @ operand_b(smem, b_offset).T

        _sim_store(acc, _sim_leader_result(product), n)

    return mma


@lru_cache(maxsize=None)
def wgmma_ss(n: int, k_steps: int, bf16: bool, a_layout, b_layout, trans_b: bool = False, wait: bool = True,
             trans_a: bool = False, accumulate: bool = False):
    """Simulator twin of ``wgmma_ss`` (see the GPU version; it completes at once, waiting or not)."""
    _check(n, k_steps, a_layout, b_layout)

    def operands(smem, a_offset, b_offset):  # (MN-major operands come as [k][m] / [k][n])
        a = _sim_operand(smem, a_offset, ROWS, a_layout, k_steps, trans_a, bf16)
        b = _sim_operand(smem, b_offset, n, b_layout, k_steps, trans_b, bf16)
        return (a.T if trans_a else a), (b.T if trans_b else b)

    return _twin_ss(n, accumulate, operands)


@lru_cache(maxsize=None)
def wgmma_rs(n: int, k_steps: int, bf16: bool, b_layout, trans_b: bool = True, wait: bool = True):
    """Simulator twin of ``wgmma_rs`` (see the GPU version; it completes at once, waiting or not)."""
    _check(n, k_steps, b_layout)

    def operand_b(smem, b_offset):
        b = _sim_operand(smem, b_offset, n, b_layout, k_steps, trans_b, bf16)
        return b.T if trans_b else b

    return _twin_rs(n, k_steps, lambda words: _sim_gathered_a(words, k_steps, bf16), operand_b)


@lru_cache(maxsize=None)
def wgmma_ss_e4m3(n: int, k_steps: int, a_layout, b_layout, wait: bool = True, accumulate: bool = False):
    """Simulator twin of ``wgmma_ss_e4m3`` (see the GPU version; it completes at once)."""
    _check(n, k_steps, a_layout, b_layout)

    def operands(smem, a_offset, b_offset):
        return (_sim_operand_e4m3(smem, a_offset, ROWS, a_layout, k_steps),
                _sim_operand_e4m3(smem, b_offset, n, b_layout, k_steps))

    return _twin_ss(n, accumulate, operands)


@lru_cache(maxsize=None)
def wgmma_rs_e4m3(n: int, k_steps: int, b_layout, wait: bool = True):
    """Simulator twin of ``wgmma_rs_e4m3`` (see the GPU version; it completes at once)."""
    _check(n, k_steps, b_layout)
    return _twin_rs(n, k_steps, lambda words: _sim_gathered_a_e4m3(words, k_steps),
                    lambda smem, b_offset: _sim_operand_e4m3(smem, b_offset, n, b_layout, k_steps))


@lru_cache(maxsize=None)
def wgmma_wait(n: int, pending: int, after: bool = False):
    """Simulator twin of ``wgmma_wait``: the twins' MMAs complete when issued."""

    def wait(acc, x=None):
        pass

    return wait


def fence_proxy_async():
    pass


def shared_address(smem):
    """Simulator twin: element 0 of a shared array stands for an aligned address."""
    return np.uint32(0)
