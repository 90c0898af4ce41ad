"""Accuracy checks: a slice of each provider's output against the float64 ``reference`` package."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

import reference

from .cases import SHORT, Case
from .environment import to_numpy

if TYPE_CHECKING:
    from .providers import Provider

#: ||out - ref|| / ||ref|| bounds by input dtype; "tf32" applies to float32 inputs of providers that use TF32.
DEFAULT_TOLERANCES = {"fp32": 1e-5, "tf32": 5e-3, "fp16": 2e-3, "bf16": 1e-2}


@dataclass
class CheckSlice:
    """Batch 0, ``heads`` (first and last), the last ``rows`` query rows, all keys."""

    heads: list
    rows: int

    def of(self, x):
        """The slice of a ``(batch, heads, seqlen_q, dim)`` array, in its own library."""
        return x[0][self.heads][:, x.shape[2] - self.rows:]


@dataclass(frozen=True)
class PackedSlice:
    """Packed sequences (varlen): ``heads`` (first and last) of the query rows ``rows`` (``(start, end)`` ranges:
    the last rows of the first and the last sequence, against all their keys, ``keys``)."""

    heads: list
    rows: tuple
    keys: tuple

    def of(self, x) -> np.ndarray:
        """The slice of a ``(total_tokens, heads, dim)`` array, the ranges concatenated, as float64 NumPy."""
        return np.concatenate([to_numpy(x[a:b][:, self.heads]) for a, b in self.rows])


def check_slice(case: Case, rows: int) -> CheckSlice | PackedSlice:
    heads = sorted({0, case.heads - 1})
    if case.sweep == "varlen":
        # the first and the last packed sequence: both ends of the buffer, and the last one follows every other
        # sequence (a kernel that let it see their keys, or a causal mask across sequences, shows there)
        cu = np.concatenate([[0], np.cumsum(case.lengths)])
        seqs = sorted({0, len(case.lengths) - 1})
        ranges = tuple((int(cu[s + 1]) - min(rows, case.lengths[s]), int(cu[s + 1])) for s in seqs)
        return PackedSlice(heads, ranges, tuple((int(cu[s]), int(cu[s + 1])) for s in seqs))
    return CheckSlice(heads, min(rows, case.seqlen_q))


def _varlen_reference(case: Case, inputs: dict, sl: PackedSlice) -> np.ndarray:
    """``reference.attention_varlen`` of the sliced sequences: their last rows against all their keys are an exact
    sub-problem (bottom-right alignment within each sequence)."""
    kv_heads = [h // (case.heads // case.kv_heads) for h in sl.heads]
    q = np.concatenate([to_numpy(inputs["q"][a:b][:, sl.heads]) for a, b in sl.rows])
    k, v = (np.concatenate([to_numpy(inputs[n][a:b][:, kv_heads]) for a, b in sl.keys]) for n in ("k", "v"))
    cu_q = np.concatenate([[0], np.cumsum([b - a for a, b in sl.rows])])
    cu_k = np.concatenate([[0], np.cumsum([b - a for a, b in sl.keys])])
    return reference.attention_varlen(q, k, v, cu_q, cu_k, causal=case.causal)


def reference_output(case: Case, inputs: dict, sl: CheckSlice | PackedSlice) -> np.ndarray:
    """float64 reference for the slice: ``reference.attention`` (window: with ``window=(W, 0)``) /
    ``reference.causal_dot_product`` / ``reference.attention_varlen`` / ``reference.attention_with_kvcache`` (paged:
    batch row 0 of the dense cache, whose keys the pages hold); for the gradient sweeps (``*_bwd``, ``*_fwdbwd``) the
    slice of ``dq`` from ``reference.attention_backward`` / ``reference.causal_dot_product_backward_chunked`` (their
    providers return ``dq``)."""
    if case.sweep == "varlen":
        return _varlen_reference(case, inputs, sl)
    group = case.heads // case.kv_heads
    kv_heads = [h // group for h in sl.heads]
    q = to_numpy(inputs["q"][0][sl.heads])
    k = to_numpy(inputs["k"][0][kv_heads])
    v = to_numpy(inputs["v"][0][kv_heads])
    if case.sweep == "linear":
        out = reference.causal_dot_product(q, k, v, method="chunked", chunk_size=256)
        return out[:, case.seqlen_q - sl.rows:]
    if case.sweep in ("linear_bwd", "linear_fwdbwd"):
        # dq_i = S_i dout_i needs every key up to i: the chunked reference over the whole sequence, then the slice
        dout = to_numpy(inputs["dout"][0][sl.heads])
        dq = reference.causal_dot_product_backward_chunked(dout, q, k, v, chunk_size=256)[0]
        return dq[:, case.seqlen_q - sl.rows:]
    # The last rows of a bottom-right-aligned causal problem against all keys are themselves a bottom-right-aligned
    # causal problem: the reference on the slice is exact.
    q = q[:, case.seqlen_q - sl.rows:]
    if case.sweep in ("flash_bwd", "flash_fwdbwd"):
        # dq of a row depends on that row alone (and on every key): the slice's dq is exact too
        dout = to_numpy(inputs["dout"][0][sl.heads])[:, case.seqlen_q - sl.rows:]
        return reference.attention_backward(dout[None], q[None], k[None], v[None], causal=case.causal)[0][0]
    if case.sweep == "paged":
        lengths = np.array([case.lengths[0] if case.lengths else case.seqlen_k])
        return reference.attention_with_kvcache(q[None], k[None], v[None], cache_seqlens=lengths)[0]
    if case.window:
        # keys before the window of the first checked row are never seen: the reference on the rest is exact
        first = max(0, case.seqlen_k - sl.rows - case.window)
        k, v = k[:, first:], v[:, first:]
    window = (case.window, 0) if case.window else None
    return reference.attention(q[None], k[None], v[None], causal=case.causal, window=window)[0]


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """``||out - ref|| / ||ref||`` in float64; any NaN or inf in ``out`` gives inf."""
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = float(np.linalg.norm(ref))
    diff = float(np.linalg.norm(out - ref))
    return diff / denom if denom > 0 else diff


def tolerance_for(case: Case, provider: "Provider", tolerances: dict) -> tuple[str, float]:
    key = SHORT[case.dtype]
    if case.dtype == "float32" and case.dtype in provider.tf32_dtypes:
        key = "tf32"
    return key, tolerances[key]
