"""A FlashAttention-2 forward pass in Triton, written for this benchmark as a peer of ``numba_attn.flash_forward``
(its backward: ``triton_flash_backward``).

What the forward kernel does (Dao, "FlashAttention-2", 2023, Algorithm 1):

* One program owns ``BLOCK_M`` query rows of one (batch, head) and keeps them in registers.
* It walks the keys in tiles of ``BLOCK_N``: ``S = Q K^T`` on tensor cores with float32 accumulation, then the
  online softmax: running row maximum ``m`` and row sum ``l``, ``P = exp2(S * c - m)`` and the float32 output
  accumulator rescaled by ``exp2(m_old - m_new)``. ``c = sm_scale * log2(e)`` folds the softmax scale and the change
  of base into one multiply, so the kernel only ever calls ``exp2``. ``O / l`` is written once at the end.
* Causal (aligned bottom-right, as ``numba_attn``: query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``): key tiles
  right of the diagonal are never visited; tiles entirely left of it run without any mask; only the few tiles that
  cross the diagonal (or the ragged end of the sequence) pay for masking. Query blocks are launched last-first so
  that the ones with the most work do not form the tail of the grid.
* Grouped-query attention: query head ``h`` reads key/value head ``h // group``. Without causality the wrapper packs
  the query heads of a group into one program's rows (the usual decode trick), so each K/V tile is read once per
  group rather than once per query head.
* Tiles and launch shape are autotuned over a few configurations (``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
  ``num_stages``); configurations that cannot fit shared memory or registers for the head dim and dtype are pruned
  before benchmarking. Tiles of 16 query rows exist for decoding (a handful of query rows).
* ``return_lse=True`` also stores each row's log-sum-exp (natural log, float32), which the backward needs; the
  store is behind a constexpr flag, so the plain forward compiles to the same kernel as without it.


Inputs are torch CUDA tensors ``(batch, heads, seqlen, headdim)`` of float16, bfloat16 or float32, any strides;
headdim one of 16, 32, 64, 128, 256. With float32 inputs ``tl.dot`` uses TF32 tensor cores (Triton's default), so
expect TF32-level accuracy (about 1e-3 relative), not float32's.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["flash_forward", "HEAD_DIMS", "DTYPES", "check_case", "providers"]

HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634

# (BLOCK_M, BLOCK_N, num_warps, num_stages). The 16-row tiles serve decoding, the others prefill.
_TILES = (
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 32, 4, 4),
    (16, 64, 4, 3),
    (16, 128, 4, 3),
    (16, 128, 8, 2),
)


def _configs(tiles) -> list:
    """``triton.Config`` per ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


def _smallest(configs):
    """The configuration with the smallest tile: what is left when none is estimated to fit."""
    return [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


_CONFIGS = _configs(_TILES)

_SHARED_MEMORY_BYTES = 220 * 1024  # an H100 block may use up to 227 KiB
_MAX_ACC_REGISTERS = 128  # float32 accumulator words per thread beyond which a tile would spill


def _shared_memory_estimate(itemsize: int, head_dim: int, block_n: int, stages: int) -> int:
    """Rough shared memory of one program: the pipelined K/V tiles (float32 inputs need about twice as much for
    the layout conversions of the TF32 path). Calibrated against sm_90 compiles of this kernel; configurations
    it lets through that still do not fit are discarded by the autotuner (OutOfResources)."""
    return itemsize * head_dim * block_n * stages * (2 if itemsize == 4 else 1)


def _prune_configs(configs, named_args, **kwargs):
    """Keep the tiles that suit the problem: sized to the query rows, within shared memory and registers."""
    args = {**named_args, **kwargs}
    rows, head_dim = args["N_Q"], args["HEAD_DIM"]
    itemsize = args["Q"].element_size()

    def fits(cfg):
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
        shared = _shared_memory_estimate(itemsize, head_dim, bn, cfg.num_stages)
        acc_words = bm * head_dim // (32 * cfg.num_warps)
        return shared <= _SHARED_MEMORY_BYTES and acc_words <= _MAX_ACC_REGISTERS

    def suits(cfg):
        bm = cfg.kwargs["BLOCK_M"]
        if rows <= 16:
            return bm == 16  # decoding: a bigger tile would be mostly padding
        if bm == 16:
            return False
        return not (rows <= 64 and bm == 128)

    kept = [c for c in configs if fits(c) and suits(c)]
    if not kept:
        kept = [c for c in configs if fits(c)] or _smallest(configs)
    return kept


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_base, v_base,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d,
    lo, hi, N_K, diag, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with the key tiles starting at lo, lo + BLOCK_N, ... < hi."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            k = tl.load(k_ptrs, mask=cols[:, None] < N_K, other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # scores in base 2
        if MASKED:
            keep = cols[None, :] < N_K
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen no key yet keeps m = -inf; shift by 0 instead so that exp2 gives 0, not NaN
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < N_K, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(
    configs=_CONFIGS,
    key=["N_Q", "N_K", "HEAD_DIM", "CAUSAL", "GROUP", "RETURN_LSE"],  # the autotuner adds the tensors' dtypes
    prune_configs_by={"early_config_prune": _prune_configs},
)
@triton.jit(do_not_specialize=["N_Q", "N_K"])
def _flash_forward_kernel(
    Q, K, V, O, LSE,
    qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, N_Q, N_K,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, RETURN_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # the longest rows (most key tiles) are scheduled first
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP

    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    o_base = O + b * stride_ob + h * stride_oh

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < N_Q
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=row_ok, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    diag = N_K - N_Q  # bottom-right alignment: row i sees keys j <= i + diag
    if CAUSAL:
        first_row = pid_m * BLOCK_M
        # keys left of the block's first row's diagonal are visible to every row: whole tiles of them need no mask
        unmasked_end = tl.minimum(tl.maximum(first_row + diag + 1, 0), N_K)
        unmasked_end = (unmasked_end // BLOCK_N) * BLOCK_N
        # keys right of the last row's diagonal are never visited
        end = tl.minimum(tl.maximum(first_row + BLOCK_M + diag, 0), N_K)
    else:
        unmasked_end = (N_K // BLOCK_N) * BLOCK_N
        end = N_K

    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, 0, unmasked_end, N_K, diag, qk_scale,
        CAUSAL=CAUSAL, MASKED=False, BLOCK_N=BLOCK_N,
    )
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, unmasked_end, end, N_K, diag, qk_scale,
        CAUSAL=CAUSAL, MASKED=True, BLOCK_N=BLOCK_N,
    )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # a row that saw no key gives 0
    out = acc / l_safe[:, None]
    o_ptrs = o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok)
    if RETURN_LSE:
        # natural log of the row's sum of exp(scaled score): m and l are in base 2, so (m + log2 l) * ln 2; a row
        # that saw no key gets -inf. LSE is contiguous (programs' rows): one row of N_Q per (batch, head).
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + pid_bh.to(tl.int64) * N_Q + offs_m, lse, mask=offs_m < N_Q)


def _launch(q, k, v, out, causal, sm_scale, group, lse=None):
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]

    def grid(meta):
        return (triton.cdiv(seqlen_q, meta["BLOCK_M"]), batch * heads)

    _flash_forward_kernel[grid](
        q, k, v, out, lse,  # lse None: RETURN_LSE is off and the store is compiled out
        sm_scale * _LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        heads, group, seqlen_q, seqlen_k,
        HEAD_DIM=head_dim, CAUSAL=bool(causal), RETURN_LSE=lse is not None,
    )
    return out


def _check_qkv(name, q, k, v):
    """The checks the forward and the backward share; clear errors that name the argument."""
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"triton {name}: {arg} must be a torch tensor (batch, heads, seqlen, headdim)")
    batch, heads, _, head_dim = q.shape
    kv_heads = k.shape[1]
    if tuple(v.shape) != tuple(k.shape) or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"triton {name}: incompatible shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"triton {name}: kv_heads {kv_heads} (k.shape[1]) must divide heads {heads} (q.shape[1])")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"triton {name}: headdim {head_dim} not in {HEAD_DIMS}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"triton {name}: dtype {q.dtype} not supported (float16, bfloat16, float32, all alike)")
    if not q.is_cuda or k.device != q.device or v.device != q.device:
        raise ValueError(f"triton {name}: q, k, v must be on one CUDA device")


def flash_forward(q, k, v, causal=False, sm_scale=None, return_lse=False):
    """``softmax(sm_scale q k^T) v`` for torch CUDA tensors ``(batch, heads, seqlen, headdim)``; returns q's shape.

    ``k``, ``v``: ``(batch, kv_heads, seqlen_k, headdim)`` with ``heads % kv_heads == 0``. Causal masking is aligned
    bottom-right. ``return_lse``: also return the log-sum-exp of each query row's scaled scores, float32
    ``(batch, heads, seqlen_q)``, natural log (``-inf`` for a row that sees no key, whose output is 0), which is what
    :func:`flash_backward` takes. Raises ``ValueError`` / ``TypeError`` for shapes and dtypes the kernel does not
    handle.
    """
    _check_qkv("flash_forward", q, k, v)
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads = k.shape[1]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    group = heads // kv_heads
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None

    if group > 1 and not causal:
        # Without a mask every query row is independent: the ``group`` query heads sharing a kv head become
        # ``group * seqlen_q`` rows of one (batch, kv head) problem, so K and V are streamed once per group.
        # (lse's rows are contiguous per (batch, head), so the packed rows land where the unpacked ones belong.)
        packed = q.reshape(batch, kv_heads, group * seqlen_q, head_dim)
        out = torch.empty(packed.shape, dtype=q.dtype, device=q.device)
        _launch(packed, k, v, out, False, sm_scale, 1, lse)
        out = out.view(batch, heads, seqlen_q, head_dim)
    else:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _launch(q, k, v, out, causal, sm_scale, group, lse)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------------------------------
# The sweep's plug-in hook (bench/peers/__init__.py)
# --------------------------------------------------------------------------------------------------------------------
def check_case(case, env) -> str | None:
    """Why a sweep case is skipped by the Triton providers (None: it runs): torch tensors, a supported head dim."""
    from ..providers import torch_only  # the sweep's

    if env.kind != "torch":
        return torch_only(case, env)
    if case.head_dim not in HEAD_DIMS:
        return f"headdim {case.head_dim} not in {HEAD_DIMS}"
    return None


def providers(opts) -> dict:
    """``triton-fa2`` for flash and decode. float32 inputs run TF32: they get the tf32 bound."""
    from ..providers import Prepared, Provider  # the sweep's, not the kernel's

    def prep_flash(case, x, env):
        return Prepared(lambda: flash_forward(x["q"], x["k"], x["v"], causal=case.causal))

    def prep_decode(case, x, env):
        return Prepared(lambda: flash_forward(x["q"], x["k"], x["v"], causal=False))

    tf32 = ("float32",)
    note = "peers/triton_flash.py: FA2 forward, autotuned, no split-KV"
    return {
        "flash": {"triton-fa2": Provider(prep_flash, check=check_case, tf32_dtypes=tf32, note=note)},
        "decode": {"triton-fa2": Provider(prep_decode, check=check_case, tf32_dtypes=tf32, note=note)},
    }
