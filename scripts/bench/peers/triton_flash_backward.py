"""A FlashAttention-2 backward pass in Triton, written for this benchmark as a peer of ``numba_attn.flash_backward``
(Dao, "FlashAttention-2", 2023, Algorithm 2, with dQ in a kernel of its own instead of atomic adds), on the ``out``
and ``lse`` of ``triton_flash.flash_forward(..., return_lse=True)``. Three launches:

* Preprocess: ``delta = rowsum(dO * O)`` in float32 (the ``rowsum(dP * P)`` of the softmax gradient), and the
  log-sum-exp converted once to base 2 (``-inf`` rows to ``+inf``, so that their P is 0, not NaN).
* dK/dV: one program per (key block of ``BLOCK_N``, batch * head) keeps K, V and float32 dK, dV in registers and
  streams query tiles of ``BLOCK_M``: ``P = exp2(S * c - lse2)`` recomputed (no softmax state needed),
  ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dK += dS^T Q`` (scaled once at the end), all
  computed transposed (keys x queries) so that each product's output is the next one's operand as it stands.
* dQ: one program per (query block, batch * head) keeps Q, dO and float32 dQ and walks the key tiles as the
  forward does: ``dQ += dS K``. Recomputing S, P and dP costs two extra products over an atomic-add dQ, but needs
  no zeroed float32 buffer and gives the same bits every run.
* Causal, bottom-right: the dK/dV kernel starts at the first query tile that sees any key of its block (row
  ``j - (seqlen_k - seqlen_q)`` for key ``j``), masks only the tiles that cross the diagonal and the ragged last
  one; the dQ kernel skips and masks exactly as the forward does. Each kernel is autotuned (tiles, warps, stages)
  on head dim, dtype, causality and power-of-two buckets of the two sequence lengths.
* Grouped-query attention: dK/dV programs run per query head into float32 ``(batch, heads, seqlen_k, headdim)``
  buffers that torch sums over each group afterwards (simple and exact; not the fastest way).

Inputs as ``triton_flash``'s: torch CUDA tensors ``(batch, heads, seqlen, headdim)``, any strides; float32 runs the
products as TF32.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_flash import _LOG2E, _SHARED_MEMORY_BYTES, _check_qkv, _configs, _smallest, check_case, flash_forward

__all__ = ["flash_backward", "flash_forward", "providers"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages). dK/dV kernel: BLOCK_N keys held, query tiles of BLOCK_M streamed.
_DKDV_TILES = (
    (64, 128, 8, 2),  # FlashAttention-2's choice for headdim 128
    (64, 128, 8, 3),
    (128, 128, 8, 2),  # headdim <= 64
    (32, 128, 4, 3),  # the Triton tutorial's (headdim 64)
    (64, 64, 4, 3),
    (32, 64, 4, 3),
    (64, 64, 8, 2),  # headdim 256
    (32, 32, 4, 2),  # the fallback that fits everything
)
# dQ kernel: BLOCK_M query rows held, key tiles of BLOCK_N streamed.
_DQ_TILES = (
    (128, 64, 8, 2),
    (128, 32, 8, 3),
    (128, 128, 8, 2),
    (64, 128, 8, 2),
    (64, 64, 4, 3),
    (64, 32, 4, 3),
    (32, 32, 4, 2),
)
_DKDV_CONFIGS = _configs(_DKDV_TILES)
_DQ_CONFIGS = _configs(_DQ_TILES)
_MAX_BWD_REGISTERS = 192  # float32 accumulator + score-tile words per thread beyond which a tile would spill


def _prune_backward(held: str):
    """An ``early_config_prune`` for a backward kernel whose program holds ``held`` ("BLOCK_N": keys, dK and dV;
    "BLOCK_M": query rows, dQ) and streams the other tile. Rough shared memory: the streamed tiles (two tensors
    per stage), the held ones and one score tile's layout conversion; registers: the float32 accumulators (two for
    dK/dV) and two float32 score tiles. Not calibrated (float32's TF32 layout conversions may need more):
    configurations that still do not fit fail to compile and the autotuner discards them (OutOfResources)."""
    streamed = "BLOCK_M" if held == "BLOCK_N" else "BLOCK_N"
    accumulators = 2 if held == "BLOCK_N" else 1

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        head_dim, itemsize = args["HEAD_DIM"], args["Q"].element_size()

        def fits(cfg):
            bh, bs = cfg.kwargs[held], cfg.kwargs[streamed]
            tile = cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"]
            shared = itemsize * (2 * bs * head_dim * cfg.num_stages + 2 * bh * head_dim + tile)
            words = (accumulators * bh * head_dim + 2 * tile) // (32 * cfg.num_warps)
            return shared <= _SHARED_MEMORY_BYTES and words <= _MAX_BWD_REGISTERS

        return [c for c in configs if fits(c)] or _smallest(configs)

    return prune


def _seqlen_bucket(n: int) -> int:
    """The autotuning key's sequence length: the power of two at or above ``n`` (128 .. 16384), so that a sweep's
    neighbouring lengths share one tuning run."""
    return min(max(triton.next_power_of_2(max(n, 1)), 128), 16384)


@triton.jit(do_not_specialize=["N_Q"])
def _bwd_preprocess_kernel(
    O, DO, LSE, DELTA, LSE2,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    H, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) in float32, and the log-sum-exp in the main kernels' units: base 2 (``exp2(s * c -
    lse2)`` is P), ``-inf`` (a row that sees no key) turned into ``+inf`` so that its P is 0 rather than NaN."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < N_Q
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + rows * stride_lm, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    offs = pid_bh.to(tl.int64) * N_Q + rows
    tl.store(DELTA + offs, delta, mask=row_ok)
    tl.store(LSE2 + offs, lse2, mask=row_ok)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v, q_base, do_base, lse2_base, delta_base,
    stride_qm, stride_qd, stride_dom, stride_dod,
    offs_n, offs_d, lo, hi, N_Q, diag, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dK/dV of one key block from the query tiles starting at lo, lo + BLOCK_M, ... < hi. Everything is computed
    transposed (keys x queries), so that P^T and dS^T come out of the products in the shape the next product
    takes. MASKED: rows past N_Q (loaded as zeros, lse2 = +inf: P = 0) and, if CAUSAL, the diagonal. Key columns
    past N_K need no mask here: they only feed dK/dV rows that are never stored."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_ptrs = q_base + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd
        do_ptrs = do_base + rows[:, None] * stride_dom + offs_d[None, :] * stride_dod
        if MASKED:
            row_ok = rows < N_Q
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(lse2_base + rows, mask=row_ok, other=float("inf"))
        else:
            q = tl.load(q_ptrs)
            lse2 = tl.load(lse2_base + rows)
        p_t = tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :])  # P^T, (BLOCK_N, BLOCK_M)
        if MASKED:
            if CAUSAL:
                p_t = tl.where(offs_n[:, None] <= rows[None, :] + diag, p_t, 0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        else:
            do = tl.load(do_ptrs)
            delta = tl.load(delta_base + rows)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))  # dP^T = V dO^T
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.autotune(
    configs=_DKDV_CONFIGS,
    key=["HEAD_DIM", "CAUSAL", "Q_BUCKET", "K_BUCKET"],  # the autotuner adds the tensors' dtypes to the key
    prune_configs_by={"early_config_prune": _prune_backward("BLOCK_N")},
)
@triton.jit(do_not_specialize=["N_Q", "N_K", "Q_BUCKET", "K_BUCKET"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV,
    qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, query head); dK, dV of those keys for that query head (DK, DV have
    H heads: the GQA wrapper sums the group afterwards). Causal: the grid's first key blocks are the ones the most
    query rows see, so the longest programs start first."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP

    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    lse2_base = LSE2 + pid_bh.to(tl.int64) * N_Q
    delta_base = DELTA + pid_bh.to(tl.int64) * N_Q

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n[:, None] < N_K
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=col_ok, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=col_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)

    diag = N_K - N_Q  # bottom-right alignment: row i sees keys j <= i + diag, i.e. key j is seen by rows i >= j - diag
    full_end = (N_Q // BLOCK_M) * BLOCK_M  # query tiles below this have no ragged rows
    if CAUSAL:
        # query tiles wholly above the block's first key's first row see none of it: skipped
        lo = (tl.minimum(tl.maximum(start_n - diag, 0), N_Q) // BLOCK_M) * BLOCK_M
        # tiles from the first row that sees the block's last key on see every key of it: no diagonal mask
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
        mid = tl.maximum(mid, lo)
        tail = tl.maximum(mid, full_end)  # (mid past full_end: the diagonal tiles took the ragged one too)
        # the diagonal-crossing tiles [lo, mid), then below the plain ones [mid, full_end), the ragged one [tail, N_Q)
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_base, do_base, lse2_base, delta_base, stride_qm, stride_qd, stride_dom, stride_dod,
            offs_n, offs_d, lo, tl.minimum(mid, N_Q), N_Q, diag, qk_scale,
            CAUSAL=CAUSAL, MASKED=True, BLOCK_M=BLOCK_M,
        )
    else:
        mid = 0
        tail = full_end
    dk, dv = _dkdv_tiles(
        dk, dv, k, v, q_base, do_base, lse2_base, delta_base, stride_qm, stride_qd, stride_dom, stride_dod,
        offs_n, offs_d, mid, full_end, N_Q, diag, qk_scale,
        CAUSAL=CAUSAL, MASKED=False, BLOCK_M=BLOCK_M,
    )
    dk, dv = _dkdv_tiles(
        dk, dv, k, v, q_base, do_base, lse2_base, delta_base, stride_qm, stride_qd, stride_dom, stride_dod,
        offs_n, offs_d, tail, N_Q, N_Q, diag, qk_scale,
        CAUSAL=CAUSAL, MASKED=True, BLOCK_M=BLOCK_M,
    )

    dk = dk * sm_scale  # dS carries no scale: dK = scale * dS^T Q
    tl.store(DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, k_base, v_base,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, lo, hi, N_K, diag, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ (unscaled) of one query block from the key tiles starting at lo, lo + BLOCK_N, ... < hi. MASKED: key
    columns past N_K and, if CAUSAL, the diagonal."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            k = tl.load(k_ptrs, mask=cols[:, None] < N_K, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < N_K, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])  # (BLOCK_M, BLOCK_N)
        if MASKED:
            keep = cols[None, :] < N_K
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.autotune(
    configs=_DQ_CONFIGS,
    key=["HEAD_DIM", "CAUSAL", "Q_BUCKET", "K_BUCKET"],  # the autotuner adds the tensors' dtypes to the key
    prune_configs_by={"early_config_prune": _prune_backward("BLOCK_M")},
)
@triton.jit(do_not_specialize=["N_Q", "N_K", "Q_BUCKET", "K_BUCKET"])
def _bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ,
    qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head), their dQ = scale * dS K over the keys they see; the
    key-tile walk is the forward's (unmasked tiles, then the diagonal-crossing and ragged ones)."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # the longest rows (most key tiles) are scheduled first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < N_Q
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=row_ok[:, None], other=0.0)
    row_offs = pid_bh.to(tl.int64) * N_Q + offs_m
    lse2 = tl.load(LSE2 + row_offs, mask=row_ok, other=float("inf"))  # rows past N_Q: P = 0
    delta = tl.load(DELTA + row_offs, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    diag = N_K - N_Q
    if CAUSAL:
        first_row = pid_m * BLOCK_M
        unmasked_end = tl.minimum(tl.maximum(first_row + diag + 1, 0), N_K)
        unmasked_end = (unmasked_end // BLOCK_N) * BLOCK_N
        end = tl.minimum(tl.maximum(first_row + BLOCK_M + diag, 0), N_K)
    else:
        unmasked_end = (N_K // BLOCK_N) * BLOCK_N
        end = N_K
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, 0, unmasked_end, N_K, diag, qk_scale,
        CAUSAL=CAUSAL, MASKED=False, BLOCK_N=BLOCK_N,
    )
    dq = _dq_tiles(
        dq, q, do, lse2, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_d, unmasked_end, end, N_K, diag, qk_scale,
        CAUSAL=CAUSAL, MASKED=True, BLOCK_N=BLOCK_N,
    )
    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


def flash_backward(dout, q, k, v, out, lse, causal=False, sm_scale=None):
    """``(dq, dk, dv)`` of ``out = flash_forward(q, k, v, causal, sm_scale)`` for the output gradient ``dout``.

    ``out`` and ``lse`` (float32 ``(batch, heads, seqlen_q)``, natural log, ``-inf`` for rows that see no key) as
    ``flash_forward(..., return_lse=True)`` returns them; ``dout`` and ``out`` shaped like ``q``, same dtype. dk and
    dv come in k's shape (GQA: summed over each kv head's query heads) and q's dtype. Any strides. float32 runs the
    products as TF32. Raises ``ValueError`` / ``TypeError`` naming the argument that does not fit.
    """
    _check_qkv("flash_backward", q, k, v)
    for arg, x in (("dout", dout), ("out", out)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(q.shape):
            raise ValueError(f"triton flash_backward: {arg} must have q's shape {tuple(q.shape)}, "
                             f"not {tuple(getattr(x, 'shape', ()))}")
        if x.dtype != q.dtype:
            raise TypeError(f"triton flash_backward: {arg} dtype {x.dtype} differs from q's {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"triton flash_backward: {arg} is on {x.device}, q on {q.device}")
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (batch, heads, seqlen_q):
        raise ValueError(f"triton flash_backward: lse must be (batch, heads, seqlen_q) = {(batch, heads, seqlen_q)}, "
                         f"not {tuple(getattr(lse, 'shape', ()))}")
    if lse.dtype != torch.float32 or lse.device != q.device:
        raise TypeError(f"triton flash_backward: lse must be float32 on {q.device} (got {lse.dtype} on {lse.device})")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    group = heads // kv_heads
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if group == 1:
        dk = dk_heads = torch.empty(k.shape, dtype=q.dtype, device=q.device)
        dv = dv_heads = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    else:
        # GQA: each query head's share in float32, summed over the group below (no atomics, no rounding twice)
        dk_heads = torch.empty((batch, heads, seqlen_k, head_dim), dtype=torch.float32, device=q.device)
        dv_heads = torch.empty_like(dk_heads)
    if dq.numel() == 0 or dk_heads.numel() == 0:  # nothing to launch (a query row that sees no key has dq 0)
        return dq.zero_(), torch.zeros_like(k, dtype=q.dtype), torch.zeros_like(v, dtype=q.dtype)

    # delta = rowsum(dO * O) and lse in base 2, contiguous (batch * heads, seqlen_q)
    delta = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    block = max(16, min(128, 8192 // head_dim))
    _bwd_preprocess_kernel[(triton.cdiv(seqlen_q, block), batch * heads)](
        out, dout, lse, delta, lse2, *out.stride(), *dout.stride(), *lse.stride(), heads, seqlen_q,
        HEAD_DIM=head_dim, BLOCK_M=block, num_warps=4,
    )

    buckets = (_seqlen_bucket(seqlen_q), _seqlen_bucket(seqlen_k))
    common = (sm_scale * _LOG2E, sm_scale, *q.stride(), *k.stride(), *v.stride(), *dout.stride())
    _bwd_dkdv_kernel[lambda meta: (triton.cdiv(seqlen_k, meta["BLOCK_N"]), batch * heads)](
        q, k, v, dout, lse2, delta, dk_heads, dv_heads, *common, *dk_heads.stride(), *dv_heads.stride(),
        heads, group, seqlen_q, seqlen_k, *buckets, HEAD_DIM=head_dim, CAUSAL=bool(causal),
    )
    _bwd_dq_kernel[lambda meta: (triton.cdiv(seqlen_q, meta["BLOCK_M"]), batch * heads)](
        q, k, v, dout, lse2, delta, dq, *common, *dq.stride(),
        heads, group, seqlen_q, seqlen_k, *buckets, HEAD_DIM=head_dim, CAUSAL=bool(causal),
    )
    if group > 1:
        dk = dk_heads.view(batch, kv_heads, group, seqlen_k, head_dim).sum(2).to(q.dtype)
        dv = dv_heads.view(batch, kv_heads, group, seqlen_k, head_dim).sum(2).to(q.dtype)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------------------------------
# The sweep's plug-in hook (bench/peers/__init__.py)
# --------------------------------------------------------------------------------------------------------------------
def providers(opts) -> dict:
    """``triton-fa2`` for flash_bwd (the backward alone, on the ``out`` and ``lse`` of one forward made when
    prepared, untimed) and flash_fwdbwd (forward with ``lse``, then backward, in one timed call); both return
    ``(dq, dk, dv)`` and the check takes ``dq``. float32 inputs run TF32: they get the tf32 bound."""
    from ..providers import Prepared, Provider  # the sweep's, not the kernel's

    def prep_backward(case, x, env):
        out, lse = flash_forward(x["q"], x["k"], x["v"], causal=case.causal, return_lse=True)
        return Prepared(lambda: flash_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, causal=case.causal),
                        post=lambda grads: grads[0])

    def prep_fwdbwd(case, x, env):
        def step():
            out, lse = flash_forward(x["q"], x["k"], x["v"], causal=case.causal, return_lse=True)
            return flash_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, causal=case.causal)

        return Prepared(step, post=lambda grads: grads[0])

    tf32 = ("float32",)
    note = "peers/triton_flash_backward.py: FA2 backward (dK/dV kernel over key blocks, dQ kernel over query blocks)"
    return {
        "flash_bwd": {"triton-fa2": Provider(prep_backward, check=check_case, tf32_dtypes=tf32, note=note)},
        "flash_fwdbwd": {"triton-fa2": Provider(prep_fwdbwd, check=check_case, tf32_dtypes=tf32,
                                                note="peers/triton_flash*.py: FA2 forward with lse, then backward")},
    }
