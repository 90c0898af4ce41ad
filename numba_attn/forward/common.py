"""Host-side pieces every forward kernel module uses: operand views, the kernel signature, the launch scalars,
padded head dims, the device checks and config validation.

Each kernel module (``simt``, ``mma``, ``tf32``, ``wgmma``) offers the same interface: a frozen config validated
where it is made, ``supports(dtype, head_dim, *arrays)`` (does it take this call on this device), the compiled kernel
of a specialisation (an ``lru_cache``d builder) and ``launch(q, k, v, out, lse, write_lse, sm_scale, causal,
stream, config=None, ...)``. What changes a kernel's code beyond its tiles -- a sliding window, soft-capping,
packed sequences -- is one ``Variant``; every kernel's body is one function run by its entry kernels
(``entry_kernel``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import types

from ..core.block_info import QUERY_MAJOR, SCHEDULE_WORDS, grid, packed_grid
from ..core.scores import kernel_scale
from ..core.mask import NO_WINDOW, UNBOUNDED, window_sides
from ..runtime.device import SIMULATOR, compute_capability, max_shared_per_block
from ..runtime.shapes import MAX_HEAD_DIM  # noqa: F401  (the kernels' bound, re-exported for them)
from ..runtime.views import rows_in_pieces

_UINT16 = np.dtype(np.uint16)


class WarpTiles:
    """What the tensor-core kernels' configs and tiles derive from ``warps`` warps of ``m_tiles`` 16-row MMA tiles
    (and, for the configs, the ``min_warps`` launch bound)."""

    @property
    def block_m(self) -> int:
        """Query rows per block: each MMA tile 16 rows, ``m_tiles`` per warp."""
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def launch_bounds(self) -> tuple[int, int]:
        """(max threads per block, min blocks per SM) for ``cuda.jit(launch_bounds=...)``: ``min_warps`` warps per
        SM to keep resident (at least one block), which caps the registers at 64K / (32 * warps * blocks)."""
        return self.threads, max(1, self.min_warps // self.warps)


@dataclass(frozen=True)
class PassTiles(WarpTiles):
    """Compile-time shape of one tensor-core specialisation: ``block_n``-key tiles, the head dim padded to
    ``d_pad``, output columns ``d_pass`` at a time (``passes`` passes over the keys)."""

    warps: int
    m_tiles: int
    block_n: int
    d_pad: int
    d_pass: int

    @property
    def passes(self) -> int:
        return self.d_pad // self.d_pass


@dataclass(frozen=True)
class Variant:
    """The compile-time features of a forward kernel specialisation besides its tiles: ``window``, the sides of a
    sliding window (``mask.window_sides``; ``NO_WINDOW``: none), ``softcap``, the cap ``c`` of the scores
    (``core.scores``; None: none), and ``packed``: packed sequences of different lengths, one more kernel argument
    (the schedule, ``forward.varlen``) and the ``block_info.PACKED`` grid. ``PLAIN``, the default, builds the kernels as they were before these features
    existed (``scripts/forward_ptx.py`` checks that their PTX is unchanged)."""

    window: tuple = NO_WINDOW
    softcap: float | None = None
    packed: bool = False

    def __post_init__(self):
        window = self.window
        if (type(window) is not tuple or len(window) != 2
                or any(type(side) is not int or side < UNBOUNDED for side in window)):
            raise ValueError(f"Variant.window: expected (left, right) of ints >= 0 or UNBOUNDED, got {window!r}")
        if self.softcap is not None and not (type(self.softcap) is float and 0 < self.softcap < float("inf")):
            raise ValueError(f"Variant.softcap: expected None or a finite float > 0, got {self.softcap!r}")
        if type(self.packed) is not bool:
            raise ValueError(f"Variant.packed: expected a bool, got {self.packed!r}")

    @classmethod
    def of(cls, causal: bool, window=None, softcap: float | None = None, packed: bool = False) -> "Variant":
        """The variant of a call: ``window`` checked (``runtime.arguments.check_window``) or None, ``softcap``
        checked (``runtime.arguments.check_softcap``) or None, ``packed``: packed sequences with a schedule."""
        return cls(window_sides(window, causal), None if softcap is None else float(softcap), bool(packed))


PLAIN = Variant()


def entry_kernel(body, packed: bool, causal_argument: bool = True):
    """The kernel function (not yet jitted) that runs ``body(q, k, v, out, lse, write_lse, causal, scale_log2,
    schedule)`` (``core.staging.kernel_body``): ``kernel(q, k, v, out, lse, write_lse, causal, scale_log2)`` for
    dense batches, where the body's ``schedule`` is ``lse`` (never read there), and with ``schedule`` as a last
    argument for packed sequences (``Variant.packed``). ``causal_argument=False``: kernels whose causality is a
    compile-time constant take no ``causal`` argument (the body neither)."""
    if packed and causal_argument:
        def packed_kernel(q, k, v, out, lse, write_lse, causal, scale_log2, schedule):
            body(q, k, v, out, lse, write_lse, causal, scale_log2, schedule)

        return packed_kernel
    if packed:
        def packed_static_kernel(q, k, v, out, lse, write_lse, scale_log2, schedule):
            body(q, k, v, out, lse, write_lse, scale_log2, schedule)

        return packed_static_kernel
    if causal_argument:
        def kernel(q, k, v, out, lse, write_lse, causal, scale_log2):
            body(q, k, v, out, lse, write_lse, causal, scale_log2, lse)

        return kernel

    def static_kernel(q, k, v, out, lse, write_lse, scale_log2):
        body(q, k, v, out, lse, write_lse, scale_log2, lse)

    return static_kernel


def signature(element, variant: "Variant") -> types.Signature:
    """``kernel_signature(element)``, and the int32 schedule after it for packed sequences."""
    base = kernel_signature(element)
    if not variant.packed:
        return base
    return types.void(*base.args, types.Array(types.int32, 1, "A"))


def kernel_signature(element) -> types.Signature:
    """``kernel(q, k, v, out, lse, write_lse, causal, scale_log2)`` with 4-D operands of ``element`` (uint16 bit
    patterns or float32). Layout 'A' takes contiguous and strided views alike: one compile per specialisation."""
    operand = types.Array(element, 4, "A")
    return types.void(operand, operand, operand, operand, types.Array(types.float32, 3, "A"), types.boolean,
                      types.boolean, types.float32)


def bits(x, name: str):
    """The uint16 bit view of a float16 / bfloat16 (uint16 or int16 bits) device or simulator array; no copy."""
    if x.dtype is _UINT16:
        return x
    dtype = np.dtype(x.dtype)
    if dtype.itemsize != 2 or dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected 16-bit elements (float16, or bfloat16 as uint16 / int16 bits), got {dtype}")
    return x if dtype == np.uint16 else x.view(np.uint16)


def sixteen_bit_dtype(q, dtype: str | None) -> str:
    """``dtype`` as given, or float16 for float16 arrays and bfloat16 for 16-bit bit views (how bfloat16 travels)."""
    if dtype is None:
        return "float16" if np.dtype(q.dtype) == np.float16 else "bfloat16"
    return dtype


def vector_loads_ok(*arrays) -> bool:
    """True when the rows of every array (Q, K and V: one loader copies them all) can be read in aligned 16-byte
    pieces: headdim a whole number of pieces, unit stride along headdim, and every row start 16-byte aligned (base
    address and the other strides multiples of 16 bytes)."""
    return all(rows_in_pieces(x, 16 // np.dtype(x.dtype).itemsize) for x in arrays)


def padded_head_dim(head_dim: int, k_step: int, single_pass_max: int | None = None) -> int:
    """The head dim a kernel computes with: a multiple of its MMA's ``k_step``, and of ``2 k_step`` above
    ``single_pass_max``, where two passes each take a half of whole ``k_step`` blocks."""
    pad = -(-head_dim // k_step) * k_step
    if single_pass_max is not None and pad > single_pass_max:
        pad = -(-head_dim // (2 * k_step)) * 2 * k_step
    return pad


def scale_args(sm_scale: float, softcap: float | None = None) -> tuple:
    """``(scale_log2, scale_first)``: the kernels' base-2 score scale, and whether scores must be scaled before the
    running max (a scale <= 0 does not commute with max); with ``softcap`` its ``sm_scale / c`` instead
    (``core.scores.kernel_scale``)."""
    return kernel_scale(sm_scale, softcap)


def runs_here(min_compute_capability: tuple) -> bool:
    """The current device can run a kernel that needs ``min_compute_capability`` (the simulator runs them all)."""
    return SIMULATOR or compute_capability() >= min_compute_capability


def check_shared_memory(nbytes: int) -> None:
    """ValueError when a block needs more dynamic shared memory than the current device gives one."""
    limit = max_shared_per_block()
    if nbytes > limit:
        raise ValueError(f"tiles need {nbytes} bytes of shared memory, more than the {limit} a block may use on this "
                         "device (fewer warps, m-tiles or keys per tile)")


def launch_grid(layout: str, batch: int, heads: int, seqlen_q: int, block_m: int, schedule=None) -> tuple:
    """A forward launch's grid: ``layout``'s for a dense batch, ``block_info.PACKED`` over the entries of the
    ``schedule`` for packed sequences (``forward.varlen``)."""
    if schedule is None:
        return grid(layout, batch, heads, seqlen_q, block_m)
    return packed_grid(schedule.shape[0] // SCHEDULE_WORDS, heads)


def check_grid(batch: int, heads: int) -> None:
    """ValueError when a ``QUERY_MAJOR`` grid (heads on y, batch on z) cannot hold ``batch`` x ``heads``."""
    grid(QUERY_MAJOR, batch, heads, 1, 1)


#: an SM's 32-bit registers
SM_REGISTERS = 65536


def check_register_budgets(config, threads: int, producer: int, consumers: int, consumer: int) -> None:
    """ValueError unless the ``setmaxnreg`` budgets of a warp-specialised block -- one producer warpgroup at
    ``producer`` registers a thread, ``consumers`` at ``consumer`` -- fit the registers its launch holds: as many
    per thread as fit the SM, in steps of 8 (384 threads: 168 each, 64512 in all). ``setmaxnreg`` only moves
    registers within that pool: a budget above it leaves the consumers' ``setmaxnreg.inc`` waiting forever (on an
    H100, 24 + 2 x 240 ran; 32 + 2 x 240 hung)."""
    pool = SM_REGISTERS // threads // 8 * 8 * threads
    used = 128 * (producer + consumers * consumer)
    if used > pool:
        raise ValueError(f"{type(config).__name__}: producer_registers + {consumers} x consumer_registers must fit "
                         f"the {pool} registers a block of {threads} threads holds, over 128 threads each, got {used}")


def check_fields(config, **rules) -> None:
    """Validate a config's integer fields: ``name=(low, high, multiple)`` (``high`` None: no upper bound)."""
    for name, (low, high, multiple) in rules.items():
        value = getattr(config, name)
        if type(value) is not int or value < low or (high is not None and value > high) or value % multiple:
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            step = f", a multiple of {multiple}" if multiple > 1 else ""
            raise ValueError(f"{type(config).__name__}.{name}: expected an integer {bound}{step}, got {value!r}")
