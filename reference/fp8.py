"""float8 e4m3 inputs for the reference: exact decoding, per-tensor or per-head descale factors, attention in float64.

``e4m3`` here is the ``float8_e4m3fn`` format (torch's, the tensor cores'): 1 sign bit, 4 exponent bits (bias 7), 3
mantissa bits, no infinities, NaN at ``S.1111.111``; largest finite value 448, smallest subnormal ``2^-9``. The 256
values are decoded from that definition (``E4M3``), never by a library.

:func:`attention_fp8` is the ground truth of numba_attn's fp8 forward: the float64 reference attention of the
*dequantised* inputs ``descale_x * decode(x)``. It does not model the kernel's own rounding (``P`` rounded to e4m3
before ``P V``, float32 accumulation, a 16-bit output); the tests measure that error against this reference.
:func:`flash_fp8_model` does model the rounding of ``P`` (in float64 otherwise): the error of the fp8 forward
against :func:`attention_fp8` is this model's, to within the 16-bit output's rounding, which gives the tests a bound
that follows the inputs (about 2.5e-2 relative for unit-variance scores spread over many keys, 5e-3 for peaked
ones: P's three mantissa bits).
"""

from __future__ import annotations

import numpy as np

from ._masks import cap_scores, check_softcap, check_window, mask_band
from .attention import attention


def _decode_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8.0 * 2.0 ** -6
    values = sign * np.where(exponent == 0, subnormal, normal)
    return np.where((codes & 0x7F) == 0x7F, np.nan, values)


#: the float64 value of each of the 256 e4m3 bit patterns (NaN for 0x7F and 0xFF)
E4M3 = _decode_table()
E4M3.flags.writeable = False


def decode_e4m3(codes) -> np.ndarray:
    """The float64 values of an array of e4m3 bit patterns (any integer dtype holding 0..255)."""
    codes = np.asarray(codes)
    if codes.dtype.kind not in "iu" or (codes.size and (codes.min() < 0 or codes.max() > 255)):
        raise ValueError("codes: expected integers in [0, 255] (e4m3 bit patterns)")
    return E4M3[codes.astype(np.intp)]


def encode_e4m3(x) -> np.ndarray:
    """The e4m3 bit patterns (uint8) nearest to ``x`` (ties to the even pattern), magnitudes beyond 448 (and
    infinities) saturated to +-448, NaN to 0x7F: the hardware's ``cvt.rn.satfinite`` and torch's conversion of
    clamped values."""
    x = np.asarray(x, dtype=np.float64)
    finite = E4M3[:0x7F]  # 0, 2^-9, ..., 448: increasing
    magnitude = np.minimum(np.abs(np.nan_to_num(x, nan=0.0, posinf=448.0, neginf=-448.0)), 448.0)
    upper = np.clip(np.searchsorted(finite, magnitude), 0, 0x7E)
    lower = np.maximum(upper - 1, 0)
    below, above = magnitude - finite[lower], finite[upper] - magnitude
    code = np.where((above < below) | ((above == below) & (upper % 2 == 0)), upper, lower)
    code = np.where(np.signbit(x), code | 0x80, code)
    return np.where(np.isnan(x), 0x7F, code).astype(np.uint8)


def _per_head(descale, batch: int, heads: int, kv_heads: int, name: str) -> np.ndarray:
    """``descale`` as a ``(batch, heads, 1, 1)`` float64 factor per query head: None (1), a number or size-1 array,
    or ``(batch, heads)`` / ``(batch, kv_heads)`` (a kv head's factor for each query head of its group)."""
    if descale is None:
        return np.ones((batch, heads, 1, 1))
    d = np.asarray(descale, dtype=np.float64)
    if d.size == 1:
        return np.full((batch, heads, 1, 1), float(d.reshape(())))
    if d.shape == (batch, heads):
        return d[:, :, None, None]
    if d.shape == (batch, kv_heads):
        return np.repeat(d, heads // kv_heads, axis=1)[:, :, None, None]
    raise ValueError(f"{name}: expected a number, a size-1 array, (batch, heads) = {(batch, heads)} or (batch, "
                     f"kv_heads) = {(batch, kv_heads)}, got shape {d.shape}")


def dequantize(q, k, v, descale_q=None, descale_k=None, descale_v=None):
    """``(q, k, v)`` in float64 from ``(batch, heads, seqlen, headdim)`` e4m3 bit patterns and their descale
    factors. The k and v factors are per kv head: a ``(batch, heads)`` array for them needs ``heads == kv_heads``."""
    q, k, v = (decode_e4m3(x) for x in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v: expected (batch, heads, seqlen, headdim) bit patterns")
    batch, heads, kv_heads = q.shape[0], q.shape[1], k.shape[1]
    q = q * _per_head(descale_q, batch, heads, kv_heads, "descale_q")
    # k and v: per kv head (a query-head shape is only meaningful when the heads are the kv heads)
    k = k * _per_head(descale_k, batch, kv_heads, kv_heads, "descale_k")
    v = v * _per_head(descale_v, batch, kv_heads, kv_heads, "descale_v")
    return q, k, v


def attention_fp8(q, k, v, descale_q=None, descale_k=None, descale_v=None, *, causal=False, sm_scale=None,
                  return_lse=False, window=None, softcap=None):
    """:func:`reference.attention` in float64 of the dequantised e4m3 inputs (``dequantize``); same arguments and
    returns. A per-query-head ``descale_v`` (``(batch, heads)`` with grouped heads) scales each head's output."""
    batch, heads, kv_heads = np.shape(q)[0], np.shape(q)[1], np.shape(k)[1]
    v_factor = None
    if descale_v is not None and np.size(descale_v) > 1 and np.shape(descale_v) == (batch, heads) \
            and heads != kv_heads:
        v_factor, descale_v = _per_head(descale_v, batch, heads, kv_heads, "descale_v"), None
    qf, kf, vf = dequantize(q, k, v, descale_q, descale_k, descale_v)
    result = attention(qf, kf, vf, causal=causal, sm_scale=sm_scale, return_lse=return_lse, window=window,
                       softcap=softcap)
    if v_factor is None:
        return result
    if return_lse:
        return result[0] * v_factor, result[1]
    return result * v_factor


def flash_fp8_model(q, k, v, *, causal=False, sm_scale=None, block_n=128, window=None, softcap=None,
                    rounded_sums=False, return_lse=False, p_exponent=0):
    """The fp8 forward's arithmetic on dequantised float64 ``(batch, heads, seqlen, headdim)`` inputs (grouped heads
    allowed): the online softmax over ``block_n``-key tiles from key 0, each tile's ``P = exp(s - m_running)``
    rounded to e4m3 (nearest even) for ``P V`` while the row sums take it unrounded, as the kernel does; float64
    everywhere else. ``rounded_sums``: the row sums of the rounded P (the warp-specialised kernel's ``fp8_sums``,
    which sums P in its P V MMA). ``p_exponent``: P times ``2 ** p_exponent`` before its rounding (the
    warp-specialised kernel's 8: small values stay above e4m3's subnormals). Rows that see no key give 0 (and an lse
    of -inf). ``return_lse``: ``(out, lse)``, the lse ``m + log(sum)`` of the sums the model takes."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, heads, seqlen_q, headdim = q.shape
    seqlen_k = k.shape[2]
    sm_scale = 1.0 / np.sqrt(headdim) if sm_scale is None else float(sm_scale)
    band = mask_band(bool(causal), check_window(window))
    visible = band.visible(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k)
    group = heads // k.shape[1]
    out = np.zeros_like(q)
    lse = np.full(q.shape[:3], -np.inf)
    for b in range(batch):
        for h in range(heads):
            s = cap_scores(sm_scale * q[b, h] @ k[b, h // group].T, check_softcap(softcap))
            s = np.where(visible, s, -np.inf)
            m = np.full(seqlen_q, -np.inf)
            total = np.zeros(seqlen_q)
            acc = np.zeros((seqlen_q, headdim))
            for n0 in range(0, seqlen_k, block_n):
                tile = s[:, n0:n0 + block_n]
                m_new = np.maximum(m, tile.max(axis=1))
                shift = np.where(np.isneginf(m_new), 0.0, m_new)
                alpha = np.exp(m - shift)
                p = np.exp(tile - shift[:, None]) * 2.0 ** p_exponent
                rounded = decode_e4m3(encode_e4m3(p))
                total = total * alpha + (rounded if rounded_sums else p).sum(axis=1)
                acc = acc * alpha[:, None] + rounded @ v[b, h // group, n0:n0 + block_n]
                m = m_new
            out[b, h] = acc / np.where(total > 0, total, 1.0)[:, None]
            seen = total > 0
            lse[b, h, seen] = m[seen] + np.log(total[seen]) - p_exponent * np.log(2.0)
    return (out, lse) if return_lse else out
