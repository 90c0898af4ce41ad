"""Device building blocks of the shared-memory-state kernel (``shared_state_body``): tf32 operand splits and split
products, element conversion and staging of pieces, output stores, and the state ``H`` with its tf32 parts in
shared memory. Each factory returns inlined device functions specialised on compile-time constants."""
from __future__ import annotations

import math

import numpy as np
from numba import float32, uint32

from ..core import ptx
from ..core.staging import device_function
from .arguments import BFLOAT16, FLOAT32

ZERO = np.float32(0.0)
ONE = np.float32(1.0)


def mma_terms(a_split: bool, b_split: bool):
    """``C += A B`` with tf32 operands given as (hi, lo) pairs: the lo terms only where the operand is split, small
    terms first (they are rounded away least when the big term is added last)."""
    mma = ptx.mma_m16n8k8_tf32

    def terms(a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1, c0, c1, c2, c3):
        if a_split:
            c0, c1, c2, c3 = mma(l0, l1, l2, l3, b0, b1, c0, c1, c2, c3)
        if b_split:
            c0, c1, c2, c3 = mma(a0, a1, a2, a3, m0, m1, c0, c1, c2, c3)
        return mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    return device_function(terms)


def operand(split: bool):
    """float32 -> (hi, lo) tf32 bit patterns; without ``split`` the value is already tf32 (staged rounded):
    (bits, 0)."""
    to_tf32 = ptx.to_tf32
    float_bits = ptx.float_bits
    bits_float = ptx.bits_float

    def operand(x):
        if split:
            hi = to_tf32(x)
            return hi, to_tf32(x - bits_float(hi))
        return float_bits(x), uint32(0)

    return device_function(operand)


def tile_position(per_row: int, width: int):
    """``position(index)`` -> (row, column) of the ``index``-th piece of ``width`` elements in a tile of rows of
    ``per_row`` pieces (staging hands pieces to consecutive threads row by row)."""
    PER_ROW = per_row
    WIDTH = width

    def position(index):
        r = index // PER_ROW
        return r, (index - r * PER_ROW) * WIDTH

    return device_function(position)


def element_functions(dtype: str, split: bool):
    """``(finish, to_value, store_piece, load_piece, store_out)`` for inputs of ``dtype``: staged elements are float32,
    feature-mapped on request and, for single-term products (not ``split``), rounded to tf32 once when staged."""
    F32 = dtype == FLOAT32
    STAGE_ROUNDED = not split  # single-term operands are rounded to tf32 once, when staged
    store2 = ptx.store2
    load_u16x4 = ptx.load_u16x4
    store_f32x4 = ptx.store_f32x4
    store_pair = ptx.store_pair
    load_f32x4 = ptx.load_f32x4
    to_tf32 = ptx.to_tf32
    bits_float = ptx.bits_float
    low_u16 = ptx.low_u16
    half_to_float = ptx.half_to_float
    bf16_to_float = ptx.bf16_to_float
    pack = ptx.pack_bf16x2 if dtype == BFLOAT16 else ptx.pack_half2
    exp = math.exp

    def finish(val, phi):
        """A converted element as the tiles hold it: feature-mapped, rounded for one-term MMAs."""
        if phi:
            val = val + ONE if val > ZERO else float32(exp(val))
        if STAGE_ROUNDED:
            val = bits_float(to_tf32(val))
        return val

    finish = device_function(finish)

    def to_value(raw, phi):
        if F32:
            val = float32(raw)
        elif dtype == BFLOAT16:
            val = bf16_to_float(raw)
        else:
            val = half_to_float(raw)
        return finish(val, phi)

    to_value = device_function(to_value)

    def low_value(word):
        return bf16_to_float(word) if dtype == BFLOAT16 else half_to_float(word)

    def high_value(word):
        return bits_float(word & 0xFFFF0000) if dtype == BFLOAT16 else half_to_float(word >> 16)

    low_value = device_function(low_value)
    high_value = device_function(high_value)

    def store_piece(smem, at, inside, w0, w1, w2, w3, phi):
        """One staged piece of 4 elements at smem[at ...] in one 16-byte store (float32: w0..w3 are the values;
        16-bit inputs: w0, w1 are two words of two elements each). A warp's stores then cover consecutive 16-byte
        slots, free of bank conflicts (element-wise stores 8 words apart would conflict 4 ways)."""
        if not inside:
            store_f32x4(smem, at, ZERO, ZERO, ZERO, ZERO)
        elif F32:
            store_f32x4(smem, at, finish(w0, phi), finish(w1, phi), finish(w2, phi), finish(w3, phi))
        else:
            store_f32x4(smem, at, finish(low_value(w0), phi), finish(high_value(w0), phi),
                        finish(low_value(w1), phi), finish(high_value(w1), phi))

    store_piece = device_function(store_piece)

    def load_piece(arr, row, col):
        if F32:
            return load_f32x4(arr, row, col)
        w0, w1 = load_u16x4(arr, row, col)
        return w0, w1, w0, w1  # (only the first two words are used)

    load_piece = device_function(load_piece)

    def store_out(arr, row, col, x0, x1, pairs):
        """Two neighbouring output elements (col even): one 4- or 8-byte store when ``pairs``."""
        if F32:
            if pairs:
                store_pair(arr, row, col, x0, x1)
            else:
                store2(arr, row, col, x0)
                if col + 1 < arr.shape[1]:
                    store2(arr, row, col + 1, x1)
        else:
            word = pack(x0, x1)
            if pairs:
                store_pair(arr, row, col, low_u16(word), ptx.high_u16(word))
            else:
                store2(arr, row, col, low_u16(word))
                if col + 1 < arr.shape[1]:
                    store2(arr, row, col + 1, ptx.high_u16(word))

    store_out = device_function(store_out)
    return finish, to_value, store_piece, load_piece, store_out


def state_access(tiles):
    """``(store_state, add_state_pair, state_b)``: writes, float32 increments and ``Q H`` operand reads of the state
    ``H`` at ``tiles.h_offset``, and of its tf32 (hi, lo) parts behind it when ``tiles.presplit``."""
    PRESPLIT = tiles.presplit
    H_OFF = tiles.h_offset
    HI_OFF = H_OFF + tiles.h_size  # presplit: tf32 hi parts of H (as float32 bit patterns), then the lo parts
    LO_OFF = HI_OFF + tiles.h_size
    load1 = ptx.load1
    store1 = ptx.store1
    load_f32x2 = ptx.load_f32x2
    store_f32x2 = ptx.store_f32x2
    to_tf32 = ptx.to_tf32
    float_bits = ptx.float_bits
    bits_float = ptx.bits_float
    state_operand = operand(True)

    def store_state(smem, at, value):
        """H[at] = value, and its tf32 parts when the kernel keeps them."""
        store1(smem, H_OFF + at, value)
        if PRESPLIT:
            hi = to_tf32(value)
            store1(smem, HI_OFF + at, bits_float(hi))
            store1(smem, LO_OFF + at, bits_float(to_tf32(value - bits_float(hi))))

    store_state = device_function(store_state)

    def add_state_pair(smem, at, x0, x1):
        """H[at : at + 2] += (x0, x1) with 8-byte accesses (a warp's C-fragment pairs then hit no bank twice), and
        the tf32 parts when kept."""
        h0, h1 = load_f32x2(smem, H_OFF + at)
        h0 += x0
        h1 += x1
        store_f32x2(smem, H_OFF + at, h0, h1)
        if PRESPLIT:
            hi0 = to_tf32(h0)
            hi1 = to_tf32(h1)
            store_f32x2(smem, HI_OFF + at, bits_float(hi0), bits_float(hi1))
            store_f32x2(smem, LO_OFF + at, bits_float(to_tf32(h0 - bits_float(hi0))),
                        bits_float(to_tf32(h1 - bits_float(hi1))))

    add_state_pair = device_function(add_state_pair)

    def state_b(smem, at):
        """(hi, lo) tf32 parts of H[at] as the B operand of Q H."""
        if PRESPLIT:
            return float_bits(load1(smem, HI_OFF + at)), float_bits(load1(smem, LO_OFF + at))
        return state_operand(load1(smem, H_OFF + at))

    state_b = device_function(state_b)
    return store_state, add_state_pair, state_b
