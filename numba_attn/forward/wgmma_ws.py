"""Warp-specialised FlashAttention forward on Hopper (sm_90a), the FlashAttention-3 way: TMA copies through an
mbarrier ring, a producer warp, two consumer warpgroups that only compute, register budgets moved with
``setmaxnreg``, and ping-pong between the consumers. float16 / bfloat16.

Same interface and semantics as ``wgmma.launch`` (shapes ``(batch, heads, seqlen, headdim)``, GQA, bottom-right
causal mask, rows that see no key give 0 and ``lse = -inf``, sliding windows and soft-capping as compile-time
variants); it takes the inputs the TMA can read (``runtime.tensor_map.tma_layout_ok``) with padded head dims up to
``MAX_HEAD_DIM``; ``launch`` hands a call to ``wgmma`` where no tensor map can be had (``supports``). Its
configurations: ``wgmma_ws_config``; its kernel source (the design below): ``wgmma_ws_kernel``.

Packed sequences (``Variant.packed``, ``forward.varlen``): the same code over the views ``(1, heads, total,
headdim)`` of the packed arrays, one block per entry of the schedule (``block_info.block_position_of`` /
``sequence_bounds_of``: the block's first row, its sequence's rows and keys). The maps are the packed arrays' own, so
a box starts at any row: Q's boxes and the last K / V tile of a sequence run into the next sequence's tokens (zeros
past the arrays' end). The masks already hide keys past ``key_end`` from the softmax (``mask.tile_is_partial``:
that tile is partial), so those keys get probability 0 (V's rows there are multiplied by 0: finite values add
nothing), and the epilogue stores rows below the sequence's end only.

Work split (one thread block = 128 query rows of one (batch, head), 384 threads, one block per SM)
    Warpgroup 0, the producer, lowers its registers (``setmaxnreg.dec``); one elected thread of its first warp issues
    every copy: Q once (two 64-row tiles), then K of tile ``j + 1`` and V of tile ``j`` into a ring of ``stages``
    stages, each stage with a "full" mbarrier (armed with the tile's bytes; the TMA completes them) and an "empty"
    one (8 arrivals: every consumer warp once it is done with the stage). Its other warps have nothing to do.
    Warpgroups 1 and 2, the consumers, raise their registers (``setmaxnreg.inc``) and each own 64 query rows (warp
    ``w`` of the warpgroup rows ``16 w .. 16 w + 15``, the ``wgmma`` fragment layout), through the loop of
    ``wgmma.py`` per key tile ``j``: ``S_j = Q K_j^T`` (``wgmma`` from shared memory), and behind it ``O += P_(j-1)
    V_(j-1)`` (P from registers), the online softmax of ``S_j`` (``core.softmax``) while the P V MMAs run, then the
    rescale of O and P_j rounded to 16 bits. Both walk the same key tiles (those of the block's 128 rows,
    ``block_info.key_tile_walk``); tiles that cross the diagonal or the end of the keys for a warpgroup's own 64 rows
    are masked (``mask.tile_is_partial``). Narrow tiles: where the keys a warpgroup's last row sees end inside a
    tile, its S and P V take only the tile's first 64 or 128 keys (``mask.narrow_widths``, ``mask.tile_width``;
    MMAs of that width, a softmax over as many columns), and a tile none of its rows sees (the other warpgroup's
    part of the diagonal) takes no MMA and no softmax: it only waits for the tile and frees it.

Ping-pong (``pingpong``)
    The two consumers take turns issuing their MMAs: named barrier ``1 + c`` (256 threads) is where consumer ``c``
    waits before issuing ``S_j`` and ``P_(j-1) V_(j-1)``, and right after issuing them it arrives on the other's
    barrier. So one warpgroup's MMAs run while the other does its softmax. Consumer 1 arrives once at the start
    (consumer 0 goes first) and consumer 0 waits once more at the end, which leaves both barriers as they began.

Shared memory (dynamic; 1024-byte aligned tiles in ``core.warpgroup``'s 128-byte swizzled layout, which the TMA
writes with ``CU_TENSOR_MAP_SWIZZLE_128B`` -- one 64-column box per atom column; zeros outside the tensor)
    Q (2 x 64 rows), ``stages`` K tiles, ``stages`` V tiles, then the mbarriers (8 bytes each).

Tensor maps (``runtime.tensor_map``) travel as 64-bit addresses of maps in global memory, one per tensor and box;
the producer acquires them (``tensormap_acquire``) before its first copy.

Epilogue (``output_store`` picks it per call)
    Dense calls whose output the TMA can write: each consumer, once all its warps are past their last ``Q K^T``,
    writes its normalised rows into its own Q tile in the swizzled layout (``epilogue.stage_rows``: one
    conflict-free 4-byte store per column pair), fences them for the async proxy, meets its warps at named barrier
    ``3 + c``, and one thread stores the tile with one TMA store per 64-column box (``ptx.bulk.tma_store_4d``; rows
    past the sequence and columns past headdim are clipped by the unit), waits until the unit has read it and only
    then frees Q (the "Q empty" mbarrier then counts one arrival per consumer). The persistent kernel and the 8-bit
    one (whose Q tile is half its output's size) stage in tiles of their own instead (``shared_bytes``): their warps
    free Q after their last ``Q K^T``, so the next block's Q is copied during the last ``P V`` and the epilogue, and
    the storing thread waits for the unit's read only before it stages again and before the block ends. A warp's
    stores straight from the MMA fragments touch eight rows each -- 64 partial-sector stores per lane for a 64 x 128
    tile -- and took a block's consumers longer than a short key walk (``docs/design``). Packed sequences (whose Q
    tiles' last rows belong to the next sequence) and outputs the TMA cannot write store from the registers, in
    4-byte pairs where the rows are aligned to them.

float8 e4m3 inputs (``fp8=True``, launched by ``forward.wgmma_ws_fp8``)
    The same pipeline on 8-bit tiles (one 128-byte box per row: head dims up to 128 are one atom column) and
    ``k32.e4m3`` MMAs, P rounded to e4m3 in registers (``core.fp8.probabilities``). 8-bit MMAs take B K-major only,
    so P V reads ``V^T``, which a pre-pass wrote (``forward.fp8_vt``: ``(batch, kv_heads, headdim, keys)``, the keys
    in ``core.fp8``'s order): the V ring holds ``V^T`` tiles (``d_pad`` rows of 128 keys per atom column, one box
    each) in place of V tiles, and the output is staged in tiles of its own. Descale factors fold into the score
    scale and the epilogue's output scale (``core.fp8.descaled``: per tensor at launch, per head per block).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import types, uint16

from ..core.block_info import QUERY_MAJOR
from ..core.mask import may_narrow
from ..runtime import tensor_map
from ..runtime.device import kernel_jit, multiprocessor_count
from ..runtime.launch import launch as device_launch
from ..runtime.views import rows_in_pieces
from . import common
from . import wgmma as flash_wgmma
from .common import PLAIN, Variant
# (the configurations live in their own module; these names stay importable from here)
from .wgmma_ws_config import DEFAULT_CONFIG, SHARED_LIMIT, SIMULATOR_CONFIG, TUNING_CANDIDATES  # noqa: F401
from .wgmma_ws_config import DTYPES, MAX_HEAD_DIM, MIN_COMPUTE_CAPABILITY, ROWS, WsConfig
from .wgmma_ws_config import default_config, fits_registers, for_window, padded_head_dim, shared_bytes  # noqa: F401
from .wgmma_ws_config import usable  # noqa: F401
# (the kernel source lives in its own module; the name stays importable from here)
from .wgmma_ws_kernel import _kernel_source


def supports(dtype: str, head_dim: int, *arrays) -> bool:
    """True when this kernel can take the call on this device: float16 / bfloat16, a padded head dim up to
    ``MAX_HEAD_DIM``, arrays the TMA reads (``tma_layout_ok``), sm_90 (the simulator runs it too). ``launch`` still
    hands the call to ``wgmma`` where the driver refuses a map or no map slot can be had during a capture."""
    return (dtype in DTYPES and padded_head_dim(head_dim) <= MAX_HEAD_DIM
            and common.runs_here(MIN_COMPUTE_CAPABILITY) and all(tensor_map.tma_layout_ok(x) for x in arrays))


_MAPS = (types.uint64,) * 3
#: the dense kernel's: the maps of Q, K, V and the output (its TMA store)
SIGNATURE = types.void(*common.kernel_signature(uint16).args, *_MAPS, types.uint64)
#: the packed-sequence kernel's: Q, K, V's maps, the int32 schedule last (``forward.varlen``)
PACKED_SIGNATURE = types.void(*common.kernel_signature(uint16).args, *_MAPS, types.Array(types.int32, 1, "A"))


@lru_cache(maxsize=None)
def flash_ws_kernel(config: WsConfig, head_dim_pad: int, bf16: bool, scale_first: bool = False,
                    variant: Variant = PLAIN, store: str = "elements", probe: str | None = None, narrow: bool = True):
    """The compiled kernel of one specialisation, with launch bounds of one 384-thread block per SM (so that ptxas
    knows the registers at entry and honours ``setmaxnreg``); ``store``: how it writes the output
    (``wgmma_ws_kernel.STORES``); ``probe``: a timing probe of ``_kernel_source``, wrong results; ``narrow``: narrow
    tiles (``mask.may_narrow`` says where a call needs them)."""
    if head_dim_pad % 16 or not 16 <= head_dim_pad <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim_pad must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {head_dim_pad}")
    signature = PACKED_SIGNATURE if variant.packed else SIGNATURE
    return kernel_jit((config.threads, 1), signature)(_kernel_source(config, head_dim_pad, bf16, scale_first, variant,
                                                                     store=store, probe=probe, narrow=narrow))


def output_store(out, packed: bool, stream) -> tuple:
    """``(store, map address)`` for the output ``out``: "tma" and its map (64-row boxes, as Q's) for dense calls
    where the TMA can write it, else "pairs" where its rows are in aligned pairs, else "elements" (map 0)."""
    if not packed and tensor_map.tma_layout_ok(out):
        address = tensor_map.tensor_map_address(out, ROWS, stream)
        if address is not None:
            return "tma", address
    return ("pairs" if rows_in_pieces(out, 2) else "elements"), 0


def tensor_maps(q, k, v, config: WsConfig, stream):
    """The addresses of the maps of ``q`` (64-row boxes), ``k`` and ``v`` (``block_n``-row boxes) of arrays
    ``supports`` accepts, written on ``stream`` where new; None where one cannot be had now (no key to map, no slot
    during a capture, the driver refuses)."""
    if k.shape[2] == 0:  # (no map of an empty tensor)
        return None
    maps = tuple(tensor_map.tensor_map_address(x, rows, stream) for x, rows in ((q, ROWS), (k, config.block_n),
                                                                                  (v, config.block_n)))
    return None if None in maps else maps


def launch(q, k, v, out, lse, write_lse: bool, sm_scale: float, causal: bool, stream,
           config: WsConfig | None = None, dtype: str | None = None, window=None,
           softcap: float | None = None, schedule=None, _probe: str | None = None):
    """Launch on device views of shape (batch, heads, seqlen, headdim) that ``supports`` accepts (as
    ``wgmma.launch``). Dense batches: where a tensor map cannot be had now, and for calls without keys,
    ``wgmma.launch`` runs the call with its default tiles. ``schedule``: the int32 schedule of packed sequences made
    for ``config.block_m`` (``forward.varlen``, which checks ``tensor_maps`` first: no fallback here, whose blocks
    would not match the schedule's), the ``block_info.PACKED`` grid; not with ``persistent``. ``_probe``: a timing
    probe (``_kernel_source``: ``"no_softmax"``, ``"no_pack"``), wrong results."""
    config = config or default_config()
    if schedule is not None and config.persistent:
        raise ValueError("config: packed sequences (a schedule) take a non-persistent WsConfig")
    dtype = common.sixteen_bit_dtype(q, dtype)
    batch, heads, seqlen_q, head_dim = q.shape
    if batch * heads == 0 or seqlen_q == 0:
        return
    q, k, v, out = (common.bits(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out")))
    if k.shape[2] == 0 and schedule is None:  # no key: nothing to copy; zeros and -inf
        flash_wgmma.launch(q, k, v, out, lse, write_lse, sm_scale, causal, stream, dtype=dtype, window=window,
                           softcap=softcap)
        return
    if not supports(dtype, head_dim, q, k, v):
        raise ValueError("q, k, v: the wgmma_ws kernel needs float16 / bfloat16 arrays the TMA can read (16-byte "
                         "aligned base, unit-stride last axis, other strides multiples of 16 bytes) and a padded "
                         f"headdim <= {MAX_HEAD_DIM} on sm_90; got {dtype}, headdim {head_dim}")
    d_pad = padded_head_dim(head_dim)
    maps = tensor_maps(q, k, v, config, stream)
    if maps is None and schedule is not None:
        raise RuntimeError("wgmma_ws: no tensor map for these packed sequences now (forward.varlen checks "
                           "tensor_maps before it schedules for this kernel)")
    if maps is None:
        flash_wgmma.launch(q, k, v, out, lse, write_lse, sm_scale, causal, stream, dtype=dtype, window=window,
                           softcap=softcap)
        return
    nbytes = shared_bytes(config, d_pad)
    common.check_shared_memory(nbytes)
    scale_log2, scale_first = common.scale_args(sm_scale, softcap)
    packed = schedule is not None
    store, o_map = output_store(out, packed, stream)
    variant = Variant.of(bool(causal), window, softcap, packed)
    kernel = flash_ws_kernel(config, d_pad, dtype == "bfloat16", scale_first, variant, store, _probe,
                             may_narrow(causal, variant.window, packed, k.shape[2], config.block_n))
    shape = common.launch_grid(QUERY_MAJOR, batch, heads, seqlen_q, config.block_m, schedule)
    if config.persistent:  # one block per SM (or per query block, when there are fewer)
        shape = (min(shape[0] * shape[1] * shape[2], multiprocessor_count()), 1, 1)
    extra = (schedule,) if packed else (np.uint64(o_map),)
    device_launch(kernel, shape, config.threads, stream, nbytes, q, k, v, out, lse, bool(write_lse), bool(causal),
                  scale_log2, *(np.uint64(m) for m in maps), *extra)
