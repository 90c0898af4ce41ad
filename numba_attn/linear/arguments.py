"""Host-side arguments of the linear launches: the problem's sizes, input kinds, float32 scratch for the states
passed between launches, and stand-ins for arguments a kernel does not touch."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..runtime.device import SIMULATOR, cuda
from ..runtime.views import with_unit_axes

#: Input kinds: 16-bit float patterns (uint16 views) or float32.
FLOAT16, BFLOAT16, FLOAT32 = "float16", "bfloat16", "float32"
DTYPES = (FLOAT16, BFLOAT16, FLOAT32)


class Sizes(NamedTuple):
    """Sizes of a call on views ``q (batch, heads, seqlen_q, E)``, ``v (batch, heads, seqlen_k, M)``."""

    batch_heads: int
    seqlen_q: int
    seqlen_k: int
    e: int
    m: int


def sizes(q, v) -> Sizes:
    batch, heads, seqlen_q, e = q.shape
    return Sizes(batch * heads, seqlen_q, v.shape[2], e, v.shape[3])


def input_kind(x, dtype):
    """(array for the kernel, dtype name): 16-bit inputs travel as uint16 bit views."""
    np_dtype = np.dtype(x.dtype)
    if np_dtype == np.float32:
        return x, FLOAT32
    if np_dtype.itemsize != 2:
        raise TypeError(f"expected float16, bfloat16 (16-bit bits) or float32, got {np_dtype}")
    name = dtype or (FLOAT16 if np_dtype == np.float16 else BFLOAT16)
    return (x if np_dtype == np.uint16 else x.view(np.uint16)), name


def unused4(state):
    """A 4-D float32 stand-in for an argument the kernel does not touch. On a GPU a view of ``state``; under the
    simulator a separate array, because the simulator copies array arguments back after a launch and a stale alias
    would overwrite ``state``."""
    if SIMULATOR:
        return np.zeros((1, 1, 1, 1), np.float32)
    return with_unit_axes(state, 0, 1)


def scratch_state(scratch, shape, stream):
    """Float32 scratch of ``shape``: from the caller's ``scratch(shape)`` allocator when given."""
    if scratch:
        return scratch(shape)
    if SIMULATOR:
        return np.empty(shape, dtype=np.float32)
    return cuda.device_array(shape, dtype=np.float32, stream=stream)
