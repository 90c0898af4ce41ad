"""Causal dot product and linear attention ("Transformers are RNNs"), as a recurrence over a register-resident state.

``out_i = sum_{j <= i} (q_i . k_j) v_j`` is an RNN over the state ``S_i = S_{i-1} + k_i v_i^T`` of shape ``E x M``:
``out_i = q_i^T S_i``. As in the fast-transformers CUDA kernel (Katharopoulos et al., 2020), one thread block walks
the whole sequence of one (batch, head) and never writes the state to memory.

State layout. ``TE * TM`` threads; thread ``(te, tm)`` (``tid = te + TE * tm``) owns the ``RE x RM`` entries of
``S`` at rows ``e = te + TE * i`` and columns ``m = tm + TM * j``. The entries live in registers: every loop that
indexes them runs over closure constants and is fully unrolled (``ptxas -v``, sm_90: 90-190 registers, no stack
frame, no spills, for float16 and float32, E = M = 64 and 256, every mode). Per row, a thread
adds ``k[e] v[m]`` to its entries and forms ``RM`` partial dot products ``sum_i q[e] S[e, m]`` over its rows; the
``TE`` partials of a column (one per E-slice) are summed through shared memory by whichever thread writes that
output element, so the stores of a row are coalesced and no atomics are needed.

Pipelining. Rows are handled in chunks of ``R`` rows per barrier. The q/k/v rows of a chunk are staged in
double-buffered shared memory, and so are the partial sums: in one iteration a thread (1) issues the global loads of
chunk ``c + 1`` into registers, (2) reduces and writes the outputs of chunk ``c - 1``, (3) runs the recurrence over
chunk ``c``, (4) stores the loaded rows into the free buffer; then one ``syncthreads``. The loads are in flight
during (2) and (3), and every hazard between the two buffers is separated by exactly that one barrier. Rows past the
end of the sequence are staged as zeros, so the recurrence itself needs no bounds checks.

Low occupancy: splitting M. ``batch * heads`` blocks rarely fill a GPU, and the walk is latency bound. The value
columns are independent, so ``m_splits`` blocks per (batch, head) each own ``M / m_splits`` columns of the state
(each reads all of q and k, which stays in L2). The state must fit in registers, so large ``E * M`` (E = M = 256)
needs some split anyway (``recurrent_plan.min_m_splits``); ``choose_m_splits`` adds more when the SMs would idle.

Linear attention. ``phi(x) = elu(x) + 1`` is applied as rows are staged. The normaliser ``z = sum phi(k_j)`` is a
register vector beside the state (``RE`` entries per thread, the same in all ``TM`` threads of an E-slice) whose
partial dot ``phi(q) . z`` is reduced with the outputs; ``out = num / (den + eps)``, eps after the dot product as in
``reference.linear_attention``. Causal: the same walk. Non-causal: the sums are over the whole sequence, so there is
no recurrence to respect: a REDUCE pass splits the sequence over blocks, each writing its partial ``KV`` and ``z``
(float32 scratch), a combine kernel adds the partials in a fixed order (deterministic, no atomics), and an APPLY pass
loads the final state into registers and produces rows in parallel blocks. All three modes are one kernel body.

Everything also runs under ``NUMBA_ENABLE_CUDASIM=1`` (no warp shuffles are used), so the layout is a parameter and
the simulator configuration is tiny.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import float32

from ..core.staging import device_function
from ..runtime.device import cuda, kernel_jit, multiprocessor_count
from ..runtime.launch import launch as device_launch
from .arguments import FLOAT16, FLOAT32, scratch_state, sizes
from .chunk_plan import cdiv
from .recurrent_plan import (APPLY, CAUSAL, REDUCE, Layout, LinearConfig, Staging, choose_m_splits, default_config,
                             min_m_splits, plan, sequence_blocks, staging)



def row_copier(pattern: Staging, rows: int, width: int, phi: bool, first: bool, second: bool, reverse: bool = False):
    """``(origin, load, store)``: how a thread copies its share (``pattern``) of ``rows`` rows of ``width`` staged
    columns. ``origin(tid)`` -> ``at = (c0, r0, lane_ok)``, its first column and row (lanes past the last whole row
    group stay idle); ``load(x, rx, y, ry, b, h, t0, row_end, col_base, dim, at)`` reads rows ``t0 ..`` (before
    ``row_end``), columns ``col_base ..`` (before ``dim``) of ``x[b, h]`` into registers ``rx`` when ``first`` and of
    ``y[b, h]`` into ``ry`` when ``second`` (q and k in one pass over their rows), ``phi = elu + 1`` applied when
    ``phi``, zeros outside (not phi(0)); ``store(bx, rx, by, ry, lb, at)`` writes them to rows of ``bx[lb]``,
    ``by[lb]``. ``reverse``: row ``t`` of the walk is row ``row_end - 1 - t`` of memory (the backward's sweeps from
    the last row; ``row_begin`` must be 0)."""
    BY_ROW, ROW_STEP, COL_STEP = pattern.by_row, pattern.row_step, pattern.col_step
    N_ROWS, N_COLS = pattern.n_rows, pattern.n_cols
    R = rows
    WIDTH = width
    PHI = phi
    FIRST, SECOND = first, second
    REVERSE = reverse

    @device_function
    def element(x, b, h, row, col, ok):
        value = float32(0.0)
        if ok:
            value = float32(x[b, h, row, col])
            if PHI:
                value = value + float32(1.0) if value > float32(0.0) else math.exp(value)
        return value

    @device_function
    def origin(tid):
        c0, r0 = (tid % WIDTH, tid // WIDTH) if BY_ROW else (tid, 0)
        return c0, r0, r0 < ROW_STEP

    @device_function
    def load(x, rx, y, ry, b, h, t0, row_end, col_base, dim, at):
        c0, r0, lane_ok = at
        for a in range(N_ROWS):
            r = r0 + ROW_STEP * a
            row_ok = lane_ok and r < R and t0 + r < row_end
            row = row_end - 1 - (t0 + r) if REVERSE else t0 + r
            for c in range(N_COLS):
                col = col_base + c0 + COL_STEP * c
                ok = row_ok and col < dim
                if FIRST:
                    rx[a * N_COLS + c] = element(x, b, h, row, col, ok)
                if SECOND:
                    ry[a * N_COLS + c] = element(y, b, h, row, col, ok)

    @device_function
    def store(bx, rx, by, ry, lb, at):
        c0, r0, lane_ok = at
        for a in range(N_ROWS):
            r = r0 + ROW_STEP * a
            if lane_ok and r < R:
                for c in range(N_COLS):
                    col = c0 + COL_STEP * c
                    if col < WIDTH:
                        if FIRST:
                            bx[lb, r * WIDTH + col] = rx[a * N_COLS + c]
                        if SECOND:
                            by[lb, r * WIDTH + col] = ry[a * N_COLS + c]

    return origin, load, store


@lru_cache(maxsize=None)
def row_walk_kernel(layout: Layout, mode: int, feature_map: bool, normalise: bool, reverse: bool = False,
                    read_init: bool = False, write_final: bool = False):
    """The walk over rows, specialised on layout and mode.

    CAUSAL: state from 0, updated then read at every row. REDUCE: state from 0, updated, written to ``part`` at the
    end. APPLY: state read from ``part``, never updated, read at every row. ``feature_map`` applies phi to q and k on
    load, ``normalise`` keeps ``z`` and divides by ``phi(q) . z + eps``.

    CAUSAL only (the backward's walks, ``recurrent_backward``): ``reverse`` walks from the last row to the first,
    ``read_init`` starts the state from ``init[b, h]`` (float32 ``E x M``, any strides) instead of 0, and
    ``write_final`` writes the state after the last row to ``final[b, h]``. Each state entry is read and written by
    the one thread that owns it, so ``init`` and ``final`` may be the same array.
    """
    TE, TM, RE, RM, R = layout.te, layout.tm, layout.re, layout.rm, layout.rows
    NT = layout.threads
    E_PAD, M_COLS = layout.e_pad, layout.m_cols
    MODE = mode
    PHI, NORM = feature_map, normalise
    REVERSE, INIT, FINAL = reverse and mode == CAUSAL, read_init and mode == CAUSAL, write_final and mode == CAUSAL
    EMIT = mode != REDUCE  # rows produce outputs
    UPDATE = mode != APPLY  # the state accumulates k v^T
    # unused buffers keep a size of 1 so that every mode shares one body
    Q_WORDS = R * E_PAD if EMIT else 1
    K_WORDS = R * E_PAD if UPDATE else 1
    V_WORDS = R * M_COLS if UPDATE else 1
    RED_ROWS = R if EMIT else 1
    QK = staging(E_PAD, NT, R)
    VS = staging(M_COLS, NT, R)
    LQ = QK.count if EMIT else 1
    LK = QK.count if UPDATE else 1
    LV = VS.count if UPDATE else 1
    origin_qk, load_qk, store_qk = row_copier(QK, R, E_PAD, PHI, EMIT, UPDATE, REVERSE)
    origin_v, load_v, store_v = row_copier(VS, R, M_COLS, False, UPDATE, False, REVERSE)
    # the partial sums of one column sit TE + 1 words apart: the reading threads (one per column) hit distinct banks
    TE_PAD = TE + 1

    @kernel_jit(launch_bounds=(NT,))  # the exact block size: ptxas budgets registers for it
    def kernel(q, k, v, out, part, eps, rows_per_block, init, final):
        tid = cuda.threadIdx.x
        te = tid % TE
        tm = tid // TE
        bh = cuda.blockIdx.x
        heads = q.shape[1]
        b = bh // heads
        h = bh % heads
        m_base = cuda.blockIdx.z * M_COLS
        e_dim = q.shape[3]
        m_dim = v.shape[3]
        if MODE == CAUSAL:
            row_begin = 0
            row_end = q.shape[2]
        else:
            # non-causal passes: this block's slice of the sequence (k's rows for REDUCE, q's for APPLY)
            seqlen = k.shape[2] if MODE == REDUCE else q.shape[2]
            row_begin = cuda.blockIdx.y * rows_per_block
            row_end = min(seqlen, row_begin + rows_per_block)
        n_chunks = (max(0, row_end - row_begin) + R - 1) // R
        # this thread's share of the staged rows and columns (recurrent_plan.Staging)
        qk_at = origin_qk(tid)
        v_at = origin_v(tid)

        q_buf = cuda.shared.array((2, Q_WORDS), float32)
        k_buf = cuda.shared.array((2, K_WORDS), float32)
        v_buf = cuda.shared.array((2, V_WORDS), float32)
        red = cuda.shared.array((2, RED_ROWS, RM, TM, TE_PAD), float32)
        den_red = cuda.shared.array((2, RED_ROWS, TE), float32)

        st = cuda.local.array((RE, RM), float32)
        zs = cuda.local.array(RE, float32)
        pq = cuda.local.array(LQ, float32)
        pk = cuda.local.array(LK, float32)
        pv = cuda.local.array(LV, float32)
        kr = cuda.local.array(RE, float32)
        qr = cuda.local.array(RE, float32)
        vr = cuda.local.array(RM, float32)

        for i in range(RE):
            e = te + TE * i
            zs[i] = float32(0.0)
            if MODE == APPLY and NORM and e < e_dim:
                zs[i] = float32(part[bh, 0, e, m_dim])
            for j in range(RM):
                st[i, j] = float32(0.0)
                m = m_base + tm + TM * j
                if MODE == APPLY and e < e_dim and m < m_dim:
                    st[i, j] = float32(part[bh, 0, e, m])
                if INIT and e < e_dim and m < m_dim:
                    st[i, j] = float32(init[b, h, e, m])

        # iteration `it` loads chunk it, reduces chunk it - 2 and computes chunk it - 1 (see the module docstring)
        for it in range(n_chunks + 2):
            # (1) global loads of the next chunk, into registers; padding rows and columns are zeros (not phi(0))
            if it < n_chunks:
                t0 = row_begin + it * R
                load_qk(q, pq, k, pk, b, h, t0, row_end, 0, e_dim, qk_at)
                if UPDATE:
                    load_v(v, pv, v, pv, b, h, t0, row_end, m_base, m_dim, v_at)

            # (2) outputs of chunk it - 2: sum the E-slices' partials; consecutive threads write consecutive columns
            if EMIT and it >= 2:
                rb = it & 1
                t0 = row_begin + (it - 2) * R
                for o in range(tid, R * M_COLS, NT):
                    r = o // M_COLS
                    c = o % M_COLS
                    t = t0 + r
                    if t < row_end and m_base + c < m_dim:
                        j = c // TM
                        tmc = c % TM
                        acc = float32(0.0)
                        for x in range(TE):
                            acc += red[rb, r, j, tmc, x]
                        if NORM:
                            den = float32(0.0)
                            for x in range(TE):
                                den += den_red[rb, r, x]
                            acc = acc / (den + eps)
                        out[b, h, row_end - 1 - t if REVERSE else t, m_base + c] = acc

            # (3) the recurrence over chunk it - 1, from shared memory; state indices are all constants
            if it >= 1 and it <= n_chunks:
                cb = (it - 1) & 1
                for r in range(R):
                    if UPDATE:
                        for i in range(RE):
                            kr[i] = k_buf[cb, r * E_PAD + te + TE * i]
                        for j in range(RM):
                            vr[j] = v_buf[cb, r * M_COLS + tm + TM * j]
                        for i in range(RE):
                            for j in range(RM):
                                st[i, j] += kr[i] * vr[j]
                        if NORM:
                            for i in range(RE):
                                zs[i] += kr[i]
                    if EMIT:
                        for i in range(RE):
                            qr[i] = q_buf[cb, r * E_PAD + te + TE * i]
                        for j in range(RM):
                            acc = float32(0.0)
                            for i in range(RE):
                                acc += qr[i] * st[i, j]
                            red[cb, r, j, tm, te] = acc
                        if NORM:
                            den = float32(0.0)
                            for i in range(RE):
                                den += qr[i] * zs[i]
                            if tm == 0:
                                den_red[cb, r, te] = den

            # (4) the loaded rows into the buffer that chunk it - 2 used (free since the last barrier)
            if it < n_chunks:
                lb = it & 1
                store_qk(q_buf, pq, k_buf, pk, lb, qk_at)
                if UPDATE:
                    store_v(v_buf, pv, v_buf, pv, lb, v_at)
            cuda.syncthreads()

        if FINAL:
            for i in range(RE):
                e = te + TE * i
                for j in range(RM):
                    m = m_base + tm + TM * j
                    if e < e_dim and m < m_dim:
                        final[b, h, e, m] = st[i, j]

        if MODE == REDUCE:
            split = cuda.blockIdx.y
            for i in range(RE):
                e = te + TE * i
                if e < e_dim:
                    for j in range(RM):
                        m = m_base + tm + TM * j
                        if m < m_dim:
                            part[bh, split, e, m] = st[i, j]
                    # z is the same in every column thread and every M split: one writer
                    if NORM and tm == 0 and cuda.blockIdx.z == 0:
                        part[bh, split, e, m_dim] = zs[i]

    return kernel


@lru_cache(maxsize=None)
def combine_kernel(threads: int):
    @kernel_jit(launch_bounds=(threads,))
    def combine(part):
        """``part[:, 0] += part[:, 1:]``, one thread per state entry, splits added in order (deterministic)."""
        splits = part.shape[1]
        e_dim = part.shape[2]
        cols = part.shape[3]
        total = part.shape[0] * e_dim * cols
        start = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        for idx in range(start, total, cuda.gridDim.x * cuda.blockDim.x):
            c = idx % cols
            e = (idx // cols) % e_dim
            bh = idx // (cols * e_dim)
            acc = part[bh, 0, e, c]
            for s in range(1, splits):
                acc += part[bh, s, e, c]
            part[bh, 0, e, c] = acc

    return combine


def supports(dtype: str, stateful: bool = False) -> bool:
    """float16 and float32 inputs, no state in or out."""
    return dtype in (FLOAT16, FLOAT32) and not stateful


def _m_splits(m_splits, batch_heads, e, m, config) -> int:
    if m_splits is None:
        return choose_m_splits(batch_heads, e, m, multiprocessor_count(), config)
    return m_splits


def launch_causal_dot_product(q, k, v, out, stream, *, m_splits=None, config: LinearConfig | None = None):
    """``out_i = sum_{j <= i} (q_i . k_j) v_j`` on device views ``(batch, heads, seqlen, E | M)``, any strides.

    ``m_splits``: blocks per (batch, head) along M (None: ``recurrent_plan.choose_m_splits``); at least
    ``min_m_splits``.
    """
    _walk(q, k, v, out, stream, False, float32(0.0), m_splits, config or default_config())


def _walk(q, k, v, out, stream, layer: bool, eps, m_splits, config: LinearConfig, *, reverse=False, init=None,
          final=None):
    """The causal walk: the plain product, or the layer (``phi``, the normaliser, ``eps``); ``reverse``, ``init``,
    ``final`` (float32 ``(batch, heads, E, M)`` views, or None) as in :func:`row_walk_kernel`. ``part`` is unused in
    this mode, and so are ``init`` / ``final`` when None: q stands in for them."""
    bh, seqlen, _, e, m = sizes(q, v)
    if bh == 0 or (seqlen == 0 and final is None):
        return
    p = plan(e, m, CAUSAL, layer, _m_splits(m_splits, bh, e, m, config), config)
    kernel = row_walk_kernel(p.layout, CAUSAL, layer, layer, reverse, init is not None, final is not None)
    device_launch(kernel, (bh, 1, p.m_splits), p.layout.threads, stream, 0, q, k, v, out, q, eps, 0,
                  q if init is None else init, q if final is None else final)


def launch_linear_attention(
    q, k, v, out, causal, eps, stream, *, m_splits=None, seq_splits=None, config: LinearConfig | None = None,
    scratch=None,
):
    """The linear-attention layer with ``phi = elu + 1`` on device views; eps added after ``phi(q) . z``.

    ``m_splits`` as in :func:`launch_causal_dot_product` (None: the causal heuristic, or the minimum when non-causal,
    which splits the sequence instead). ``seq_splits``: sequence blocks of the non-causal passes (None: heuristic).
    Non-causal also accepts k, v with a seqlen different from q's.
    """
    config = config or default_config()
    if causal:
        _walk(q, k, v, out, stream, True, float32(eps), m_splits, config)
        return
    launch_noncausal(q, k, v, out, eps, stream, m_splits=m_splits, seq_splits=seq_splits, config=config,
                     scratch=scratch)


def launch_noncausal(q, k, v, out, eps, stream, *, layer: bool = True, m_splits=None, seq_splits=None,
                     config: LinearConfig | None = None, scratch=None):
    """The non-causal layer (``layer``: phi, the normaliser, ``eps``) or the plain product ``out = Q (K^T V)``: a
    REDUCE pass, the combine kernel, an APPLY pass (module docstring); arguments as :func:`launch_linear_attention`.
    """
    config = config or default_config()
    eps32 = float32(eps)
    bh, seqlen_q, seqlen_k, e, m = sizes(q, v)
    if bh == 0 or seqlen_q == 0:
        return
    if m_splits is None:
        m_splits = min_m_splits(e, m, config)
    if seq_splits is not None and (
        isinstance(seq_splits, bool) or not isinstance(seq_splits, (int, np.integer)) or seq_splits < 1
    ):
        raise ValueError(f"seq_splits: expected an integer >= 1 or None, got {seq_splits!r}")
    reduce_plan = plan(e, m, REDUCE, layer, m_splits, config)
    apply_plan = plan(e, m, APPLY, layer, m_splits, config)
    sm_count = multiprocessor_count()
    seq_splits, reduce_rows = sequence_blocks(seqlen_k, bh * reduce_plan.m_splits, sm_count, config, seq_splits)
    apply_splits, apply_rows = sequence_blocks(seqlen_q, bh * apply_plan.m_splits, sm_count, config)

    # partial KV | z per sequence block, float32; column m holds z (the layer's)
    part = scratch_state(scratch, (bh, seq_splits, e, m + 1), stream)
    reduce_kernel = row_walk_kernel(reduce_plan.layout, REDUCE, layer, layer)
    device_launch(reduce_kernel, (bh, seq_splits, reduce_plan.m_splits), reduce_plan.layout.threads, stream, 0,
                  q, k, v, out, part, eps32, reduce_rows, q, q)
    if seq_splits > 1:
        threads = config.combine_threads
        blocks = min(cdiv(bh * e * (m + 1), threads), config.combine_blocks_per_sm * sm_count)
        device_launch(combine_kernel(threads), blocks, threads, stream, 0, part)
    apply_kernel = row_walk_kernel(apply_plan.layout, APPLY, layer, layer)
    device_launch(apply_kernel, (bh, apply_splits, apply_plan.m_splits), apply_plan.layout.threads, stream, 0,
                  q, k, v, out, part, eps32, apply_rows, q, q)
