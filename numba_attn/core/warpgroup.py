"""Hopper warpgroup MMA (``wgmma.mma_async``, sm_90a) as Numba intrinsics, with simulator twins.

A warpgroup is 4 consecutive warps (128 threads, the first warp's index a multiple of 4) that issue one
``wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}`` together: ``D (64 x N, float32) = A (64 x 16) B
(16 x N) (+ D)``. B always comes from shared memory through a 64-bit *matrix descriptor*; A from shared memory too
(``ss``) or from registers (``rs``). The factories below build one intrinsic per (N, k-steps, dtype, layout): it
issues ``k_steps`` MMAs over consecutive 16-wide k-slices in one inline-asm block and commits them as one group.
By default it also waits for the group, so the accumulators are complete when the call returns. With
``wait=False`` the group stays in flight, and ``wgmma_wait(n, pending)`` later waits with the accumulators as
read-write asm operands: LLVM cannot move a read of them above the wait, and the caller must not touch them (or the
A registers) in between. Two groups can then overlap other work, e.g. a softmax under the P V MMAs.

Register fragments (PTX ISA "Register Fragments", ``m64nNk16``): warp ``w`` of the warpgroup owns rows
``16 w .. 16 w + 15`` and, inside them, the layout of ``mma.sync.m16n8k16`` (``ptx`` module docstring): with
``g = lane // 4`` and ``t = lane % 4`` the float32 accumulator ``d[4 j + e]`` of n8 block ``j`` is row ``16 w + g +
8 (e // 2)``, column ``8 j + 2 t + e % 2`` -- the ``s[mt, nb, e]`` layout of the ``mma.sync`` kernels with one
m-tile, so their online softmax runs on it unchanged. A in registers: four 32-bit words per k-step, ``a0 = A[g][2t,
2t + 1]``, ``a1 = A[g + 8][..]``, ``a2 = A[g][2t + 8, 2t + 9]``, ``a3 = A[g + 8][2t + 8, ..]`` (rows of the warp's
16): the packed C fragments of two neighbouring n8 blocks, as with ``mma.sync``.

Shared-memory layout: 128-byte swizzle (PTX "Shared Memory Matrix Layout", canonical layouts). This package stores
a tile of ``R`` rows x ``D`` 16-bit columns as ``D / 64`` *atom columns* of ``R`` rows of 128 bytes (64 columns):
column ``c`` of row ``r`` sits at byte ``(c // 64) 128 R + 128 r + 2 (c % 64)`` -- then, as the hardware expects,
the 16-byte piece index inside the 128-byte row (address bits 4..6) is XORed with the row index mod 8 (address bits
7..9), measured from a 1024-byte aligned tile start (``swizzle``). So the 8 rows of any 16-byte column sit in 8
different bank groups, for the copies and for the tensor cores alike. The same bytes serve

* as a K-major operand (rows = M or N, columns = K: Q and K for ``S = Q K^T``): 8-row groups every ``SBO = 1024``
  bytes; the k-slice ``16 kk .. 16 kk + 15`` starts at ``(kk // 4) 128 R + 32 (kk % 4)`` (LBO is unused);
* as an MN-major B operand (``B[k][n]`` with n contiguous: V for ``O += P V``, k = key, n = head-dim column) with
  ``imm-trans-b = 1``: 8-key groups every ``SBO = 1024`` bytes, the next 64 columns ``LBO = 128 R`` bytes on; the
  k-slice of keys ``16 kk ..`` starts at ``2048 kk``; likewise as an MN-major A operand (``A[k][m]``, m
  contiguous, ``imm-trans-a = 1``, ``wgmma_ss`` only: the backward's ``dS`` read from its stored transpose). An
  operand may start inside an atom column (a slice of the columns, 16-byte aligned) as long as it does not cross
  into the next one: the swizzle is a function of the address bits, so only the start moves.

float8 e4m3 (``wgmma_ss_e4m3`` / ``wgmma_rs_e4m3``): ``m64nNk32.f32.e4m3.e4m3``, k = 32 per MMA. Both operands must
be K-major in shared memory (no ``imm-trans`` for 8-bit types). A 128-byte atom row then holds 128 elements, and a
k-step is again 32 bytes: ``k_major`` gives the byte offsets unchanged (a tile of ``R`` rows of ``D`` bytes is ``D /
128`` atom columns). A in registers (CUTLASS's ``ALayout_64x32``): four 32-bit words per k-step, four elements each
(element ``k`` in byte ``k % 4``): ``a0 = A[g][4t .. 4t + 3]``, ``a1 = A[g + 8][4t ..]``, ``a2 = A[g][16 + 4t ..]``,
``a3 = A[g + 8][16 + 4t ..]`` -- not the C layout's ``(2t, 2t + 1)`` pairs, so a P tile's C fragments are not its A
fragments as they are: ``core.fp8`` permutes the keys instead.

Shared memory written by ordinary stores or ``cp.async`` must be published to the tensor cores' (async) proxy:
``fence_proxy_async`` in every writing thread before the barrier that precedes the MMAs.

Under the simulator the same names are pure-Python twins (``_warpgroup_sim``): they decode the descriptors' strides
exactly as above from the shared array and exchange register fragments through the block's barrier (every thread of
the warpgroup must call them the same number of times).
"""
from __future__ import annotations

from functools import lru_cache

from ..runtime.device import SIMULATOR
from . import ptx
from .ptx._asm import _is_int, _pointer1, _shared_address, _void_asm
from .staging import device_function

#: the warpgroup: 4 warps, 64 accumulator rows
WARPGROUP_THREADS = 128
ROWS = 64


#: swizzle mode field (bits 62..63) of a descriptor: 128-byte swizzle
_SWIZZLE_128B = 1


def swizzle(offset):
    """The 128-byte-swizzled position of byte ``offset`` (from a 1024-byte aligned start): address bits 4..6 XOR
    bits 7..9. Works on Python ints, NumPy arrays and inside kernels."""
    return offset ^ (((offset >> 7) & 7) << 4)


def atom_columns(d_pad: int) -> int:
    """128-byte atom columns of a tile whose rows hold ``d_pad`` 16-bit columns."""
    return -(-d_pad // 64)


def k_major(rows: int, k_steps: int):
    """(LBO, SBO, byte offsets of the k-steps) of a swizzled tile of ``rows`` rows read as a K-major operand."""
    return 16, 1024, tuple((kk // 4) * 128 * rows + 32 * (kk % 4) for kk in range(k_steps))


def mn_major(rows: int, k_steps: int):
    """(LBO, SBO, byte offsets of the k-steps) of a swizzled tile of ``rows`` rows (the k dimension) read as an
    MN-major operand (B with ``trans_b``, A with ``trans_a``)."""
    return 128 * rows, 1024, tuple(2048 * kk for kk in range(k_steps))


def a_fragments(k_steps: int, bf16: bool):
    """``pack(c, words)``: the float32 C fragments ``c[0, nb, e]`` of a ``64 x 16 k_steps`` accumulator rounded to
    float16 (bfloat16) pairs as the register A operand of a ``wgmma_rs``: the C fragments of n8 blocks ``2 kk`` and
    ``2 kk + 1`` are the A fragment of k-step ``kk`` (module docstring). Word ``4 (nb // 2) + 2 (nb % 2) + h`` is
    the pair of block ``nb`` in fragment row ``g + 8 h``."""
    K_STEPS = k_steps
    pack2 = ptx.pack_bf16x2 if bf16 else ptx.pack_half2

    @device_function
    def pack(c, words):
        for kk in range(K_STEPS):
            words[4 * kk] = pack2(c[0, 2 * kk, 0], c[0, 2 * kk, 1])
            words[4 * kk + 1] = pack2(c[0, 2 * kk, 2], c[0, 2 * kk, 3])
            words[4 * kk + 2] = pack2(c[0, 2 * kk + 1, 0], c[0, 2 * kk + 1, 1])
            words[4 * kk + 3] = pack2(c[0, 2 * kk + 1, 2], c[0, 2 * kk + 1, 3])

    return pack


def attention_products(block_n: int, d_pad: int, bf16: bool, fp8: bool = False, width: int | None = None,
                       sum_rows: int = 0):
    """``(q_times_k, p_times_v)``: a flash forward's two MMA groups over one warpgroup's 64 query rows, issued
    without waiting (``wgmma_wait``): ``q_times_k(s, smem, q_offset, k_offset)``, ``S = Q K^T`` of a K-major Q tile
    and a K-major ``block_n``-row K tile, and ``p_times_v(acc, p, smem, v_offset)``, ``O += P V`` with P in registers
    and V an MN-major ``block_n``-row tile of ``d_pad`` columns. ``fp8``: e4m3 operands (``bf16`` unused) and, as
    8-bit MMAs take B K-major only, a ``V^T`` tile (``d_pad`` rows of ``block_n`` keys) in place of V. ``width``
    (default ``block_n``; whole k-steps): only the tile's first ``width`` keys -- S's first ``width / 8`` n8 blocks,
    P's first ``width / k`` k-steps -- for a tile whose later keys no row sees (``mask.tile_width``). ``sum_rows``
    (8-bit): the V^T tile has that many more rows (ones), and P V that many more output columns (the row sums)."""
    k = 32 if fp8 else 16
    width = block_n if width is None else width
    if width % k or not 0 < width <= block_n:
        raise ValueError(f"width: a multiple of {k} in [{k}, {block_n}], got {width}")
    qk_steps, pv_steps = d_pad // k, width // k
    if fp8:
        lbo, sbo, offsets = k_major(d_pad + sum_rows, block_n // k)
        return (wgmma_ss_e4m3(width, qk_steps, k_major(ROWS, qk_steps), k_major(block_n, qk_steps), wait=False),
                wgmma_rs_e4m3(d_pad + sum_rows, pv_steps, (lbo, sbo, offsets[:pv_steps]), wait=False))
    lbo, sbo, offsets = mn_major(block_n, block_n // k)
    return (wgmma_ss(width, qk_steps, bf16, k_major(ROWS, qk_steps), k_major(block_n, qk_steps), wait=False),
            wgmma_rs(d_pad, pv_steps, bf16, (lbo, sbo, offsets[:pv_steps]), True, wait=False))


def _check(n: int, k_steps: int, *layouts):
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"wgmma: N must be a multiple of 8 in [8, 256], got {n}")
    if k_steps < 1:
        raise ValueError(f"wgmma: k_steps must be >= 1, got {k_steps}")
    for lbo, sbo, offsets in layouts:
        if len(offsets) != k_steps or any(x % 16 for x in (lbo, sbo, *offsets)) or max(lbo, sbo) >= 1 << 18:
            raise ValueError(f"wgmma: a layout needs {k_steps} k-step offsets and 16-byte strides, got "
                             f"{lbo}, {sbo}, {offsets}")


# ---------------------------------------------------------------------------------------------------------------------
# Intrinsics
# ---------------------------------------------------------------------------------------------------------------------
if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _I64 = ir.IntType(64)
    _F32 = ir.FloatType()

    def _descriptor(context, builder, aryty, ary, i_ty, i, lbo: int, sbo: int):
        """The 64-bit matrix descriptor of ``ary[i]`` (a shared array): start address, LBO and SBO in 16-byte
        units, 128-byte swizzle."""
        addr = _shared_address(builder, _pointer1(context, builder, aryty, ary, i_ty, i))
        start = builder.zext(builder.and_(builder.lshr(addr, _I32(4)), _I32(0x3FFF)), _I64)
        return builder.or_(start, _I64(((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (_SWIZZLE_128B << 62)))

    def _accumulator_pointers(context, builder, aryty, ary, count: int):
        array = context.make_array(aryty)(context, builder, value=ary)
        return [builder.gep(array.data, [_I64(n)]) for n in range(count)]

    def _mma_text(n: int, k_steps: int, ab: str, regs: int, a_first: int | None, desc_a: int | None, desc_b: int,
                  flag: int, offsets_a, offsets_b, trans_b: int | None, wait: bool, trans_a: int = 0,
                  accumulate: bool = False) -> str:
        """One asm block: fence, ``k_steps`` MMAs (the first overwrites D when A comes from shared memory, i.e.
        ``a_first`` is None, unless ``accumulate``), commit and, with ``wait``, wait. Step ``s`` adds
        ``offsets[s]`` bytes to the descriptors' start. ``trans_b`` None: an 8-bit type (k = 32, no transpose
        operands)."""
        k = 32 if trans_b is None else 16
        trans_ss = "" if trans_b is None else f", {trans_a}, {trans_b}"
        trans_rs = "" if trans_b is None else f", {trans_b}"
        d = "{" + ", ".join(f"${x}" for x in range(regs)) + "}"
        lines = ["{", ".reg .pred p_zero, p_one;", ".reg .b64 da, db;",
                 f"setp.ne.b32 p_zero, ${flag}, ${flag};", f"setp.eq.b32 p_one, ${flag}, ${flag};",
                 "wgmma.fence.sync.aligned;"]
        for s in range(k_steps):
            lines.append(f"add.s64 db, ${desc_b}, {offsets_b[s] >> 4};")
            if desc_a is not None:  # A from shared memory: the first step overwrites D
                lines.append(f"add.s64 da, ${desc_a}, {offsets_a[s] >> 4};")
                scale = "p_zero" if s == 0 and not accumulate else "p_one"
                lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ab}.{ab} {d}, da, db, {scale}, "
                             f"1, 1{trans_ss};")
            else:
                a = "{" + ", ".join(f"${a_first + 4 * s + x}" for x in range(4)) + "}"
                lines.append(f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ab}.{ab} {d}, {a}, db, p_one, "
                             f"1, 1{trans_rs};")
        lines.append("wgmma.commit_group.sync.aligned;")
        if wait:
            lines.append("wgmma.wait_group.sync.aligned 0;")
        lines.append("}")
        return "\n".join(lines)

    def _ss_intrinsic(n: int, k_steps: int, ab: str, a_layout, b_layout, trans_b: int | None, wait: bool,
                      trans_a: int, accumulate: bool):
        _check(n, k_steps, a_layout, b_layout)
        regs = n // 2
        ins = regs if accumulate else 0  # the accumulator's old values, tied to the outputs
        text = _mma_text(n, k_steps, ab, regs, None, regs + ins, regs + ins + 1, regs + ins + 2, a_layout[2],
                         b_layout[2], trans_b, wait, trans_a, accumulate)
        constraints = ",".join(["=f"] * regs + [str(x) for x in range(ins)] + ["l", "l", "r", "~{memory}"])

        def typer(typingctx, acc, smem, a_offset, b_offset):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and isinstance(smem, types.Array)
                    and smem.ndim == 1 and smem.dtype == types.uint16 and _is_int(a_offset, b_offset)):
                return None
            sig = types.void(acc, smem, a_offset, b_offset)

            def codegen(context, builder, sig, args):
                acc_ty, smem_ty, a_ty, b_ty = sig.args
                desc_a = _descriptor(context, builder, smem_ty, args[1], a_ty, args[2], *a_layout[:2])
                desc_b = _descriptor(context, builder, smem_ty, args[1], b_ty, args[3], *b_layout[:2])
                ptrs = _accumulator_pointers(context, builder, acc_ty, args[0], regs)
                old = [builder.load(p) for p in ptrs] if accumulate else []
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_F32] * regs),
                                                   [_F32] * ins + [_I64, _I64, _I32]), text, constraints,
                                   side_effect=True)
                res = builder.call(asm, old + [desc_a, desc_b, _I32(0)], attrs=("convergent",))
                for x, ptr in enumerate(ptrs):
                    builder.store(builder.extract_value(res, x), ptr)
                return context.get_dummy_value()

            return sig, codegen

        return intrinsic(typer)

    def _rs_intrinsic(n: int, k_steps: int, ab: str, b_layout, trans_b: int | None, wait: bool):
        _check(n, k_steps, b_layout)
        regs = n // 2
        a_first = 2 * regs
        desc = a_first + 4 * k_steps
        text = _mma_text(n, k_steps, ab, regs, a_first, None, desc, desc + 1, None, b_layout[2], trans_b, wait)
        constraints = ",".join(["=f"] * regs + [str(x) for x in range(regs)] + ["r"] * (4 * k_steps)
                               + ["l", "r", "~{memory}"])

        def typer(typingctx, acc, a_regs, smem, b_offset):
            if not (isinstance(acc, types.Array) and acc.dtype == types.float32 and isinstance(a_regs, types.Array)
                    and a_regs.dtype == types.uint32 and isinstance(smem, types.Array) and smem.ndim == 1
                    and smem.dtype == types.uint16 and _is_int(b_offset)):
                return None
            sig = types.void(acc, a_regs, smem, b_offset)

            def codegen(context, builder, sig, args):
                acc_ty, a_ty, smem_ty, b_ty = sig.args
                acc_ptrs = _accumulator_pointers(context, builder, acc_ty, args[0], regs)
                a_ptrs = _accumulator_pointers(context, builder, a_ty, args[1], 4 * k_steps)
                ins = [builder.load(p) for p in acc_ptrs] + [builder.load(p) for p in a_ptrs]
                ins += [_descriptor(context, builder, smem_ty, args[2], b_ty, args[3], *b_layout[:2]), _I32(0)]
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_F32] * regs),
                                                   [_F32] * regs + [_I32] * (4 * k_steps) + [_I64, _I32]),
                                   text, constraints, side_effect=True)
                res = builder.call(asm, ins, attrs=("convergent",))
                for x, ptr in enumerate(acc_ptrs):
                    builder.store(builder.extract_value(res, x), ptr)
                return context.get_dummy_value()

            return sig, codegen

        return intrinsic(typer)

    @lru_cache(maxsize=None)
    def wgmma_ss(n: int, k_steps: int, bf16: bool, a_layout, b_layout, trans_b: bool = False, wait: bool = True,
                 trans_a: bool = False, accumulate: bool = False):
        """Intrinsic ``(acc, smem, a_offset, b_offset)``: ``acc = A B`` (``acc += A B`` with ``accumulate``) for A
        ``64 x 16 k_steps`` (K-major, or
        MN-major -- ``A[k][m]`` with m contiguous, ``imm-trans-a = 1`` -- with ``trans_a``; ``a_layout``) at element
        ``a_offset`` and B ``16 k_steps x n`` (K-major, or MN-major with ``trans_b``; ``b_layout``) at ``b_offset``
        of the 1-D uint16 shared array ``smem``; ``acc`` a float32 local array whose first ``n / 2`` elements (C
        order) are this thread's accumulator fragment.

        ``wait=False`` returns once the MMAs are issued and committed as one group: ``acc`` must then pass through
        ``wgmma_wait`` before anything reads it (and nothing may write it meanwhile)."""
        return _ss_intrinsic(n, k_steps, "bf16" if bf16 else "f16", a_layout, b_layout, int(trans_b), wait,
                             int(trans_a), accumulate)

    @lru_cache(maxsize=None)
    def wgmma_rs(n: int, k_steps: int, bf16: bool, b_layout, trans_b: bool = True, wait: bool = True):
        """Intrinsic ``(acc, a_regs, smem, b_offset)``: ``acc += A B`` with A ``64 x 16 k_steps`` in registers
        (``a_regs``: a uint32 local array, four words per k-step in the fragment order of the module docstring)
        and B ``16 k_steps x n`` in shared memory (MN-major with ``trans_b``, else K-major; ``b_layout``).
        ``wait=False``: as for ``wgmma_ss``; ``a_regs`` too must keep its values until the wait."""
        return _rs_intrinsic(n, k_steps, "bf16" if bf16 else "f16", b_layout, int(trans_b), wait)

    @lru_cache(maxsize=None)
    def wgmma_ss_e4m3(n: int, k_steps: int, a_layout, b_layout, wait: bool = True, accumulate: bool = False):
        """Intrinsic ``(acc, smem, a_offset, b_offset)``: ``acc = A B`` (``acc += A B`` with ``accumulate``) for
        float8 e4m3 A ``64 x 32 k_steps`` and B ``32 k_steps x n``, both K-major (``a_layout``, ``b_layout``: byte
        offsets, ``k_major``) in the uint16 shared array ``smem`` (offsets in its elements); otherwise as
        ``wgmma_ss``."""
        return _ss_intrinsic(n, k_steps, "e4m3", a_layout, b_layout, None, wait, 0, accumulate)

    @lru_cache(maxsize=None)
    def wgmma_rs_e4m3(n: int, k_steps: int, b_layout, wait: bool = True):
        """Intrinsic ``(acc, a_regs, smem, b_offset)``: ``acc += A B`` with float8 e4m3 A ``64 x 32 k_steps`` in
        registers (four words of four elements per k-step, the 8-bit fragment order of the module docstring) and
        B ``32 k_steps x n`` K-major in shared memory (``b_layout``); otherwise as ``wgmma_rs``."""
        return _rs_intrinsic(n, k_steps, "e4m3", b_layout, None, wait)

    @lru_cache(maxsize=None)
    def wgmma_wait(n: int, pending: int, after: bool = False):
        """Intrinsic ``(acc)``: wait until at most ``pending`` of this warp's committed MMA groups are still in
        flight (``wgmma.wait_group.sync.aligned pending``). The ``n / 2`` accumulator registers of ``acc`` pass
        through the asm block as read-write operands, so no read of them can move above the wait. With ``after``
        it is ``(acc, x)``: a shared-memory store of float32 ``x`` that is never made (predicated on ``%smid >
        65535``) precedes the wait, so the code that computes ``x`` stays above it -- a wait reads no register, and
        ptxas otherwise schedules it where it likes (it put the wait for P V above the softmax meant to run under
        P V: ``forward.wgmma_ws_kernel``'s ``softmax_under_pv``)."""
        regs = n // 2
        text = f"wgmma.wait_group.sync.aligned {int(pending)};"
        if after:
            text = ("{ .reg .pred never; .reg .b32 sm, at; mov.u32 sm, %smid; setp.gt.u32 never, sm, 65535; "
                    f"mov.u32 at, 0; @never st.shared.f32 [at], ${2 * regs}; " + text + " }")
        extra = 1 if after else 0
        constraints = ",".join(["=f"] * regs + [str(x) for x in range(regs)] + ["f"] * extra + ["~{memory}"])

        def codegen(context, builder, sig, args):
            ptrs = _accumulator_pointers(context, builder, sig.args[0], args[0], regs)
            ins = [builder.load(p) for p in ptrs] + list(args[1:])
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_F32] * regs), [_F32] * (regs + extra)),
                               text, constraints, side_effect=True)
            res = builder.call(asm, ins, attrs=("convergent",))
            for x, ptr in enumerate(ptrs):
                builder.store(builder.extract_value(res, x), ptr)
            return context.get_dummy_value()

        def accumulator(acc):
            return isinstance(acc, types.Array) and acc.dtype == types.float32

        if after:
            def typer(typingctx, acc, x):
                return (types.void(acc, types.float32), codegen) if accumulator(acc) and x == types.float32 else None
        else:
            def typer(typingctx, acc):
                return (types.void(acc), codegen) if accumulator(acc) else None

        return intrinsic(typer)

    @intrinsic
    def shared_address(typingctx, smem):
        """(smem) -> the 32-bit shared-window address of ``smem[0]`` (a 1-D shared array), for aligning tiles."""
        if not (isinstance(smem, types.Array) and smem.ndim == 1):
            return None
        sig = types.uint32(smem)

        def codegen(context, builder, sig, args):
            return _shared_address(builder, _pointer1(context, builder, sig.args[0], args[0], types.int64,
                                                      context.get_constant(types.int64, 0)))

        return sig, codegen

    @intrinsic
    def fence_proxy_async(typingctx):
        """``fence.proxy.async.shared::cta``: this thread's earlier shared-memory writes (stores, landed
        ``cp.async`` copies) become visible to the tensor cores' reads after the next barrier."""
        return _void_asm("fence.proxy.async.shared::cta;")()

else:  # the simulator's pure-Python twins
    from ._warpgroup_sim import (fence_proxy_async, shared_address, wgmma_rs, wgmma_rs_e4m3,  # noqa: F401
                                 wgmma_ss, wgmma_ss_e4m3, wgmma_wait)
