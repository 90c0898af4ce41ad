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


def check_slice(case: Case, rows: int) -> CheckSlice:
    heads = sorted({0, case.heads - 1})
    return CheckSlice(heads, min(rows, case.seqlen_q))


def reference_output(case: Case, inputs: dict, sl: CheckSlice) -> np.ndarray:
    """float64 reference for the slice: ``reference.attention`` / ``reference.causal_dot_product``; for the gradient
    sweeps (``*_bwd``, ``*_fwdbwd``) the slice of ``dq`` from ``reference.attention_backward`` /
    ``reference.causal_dot_product_backward_chunked`` (their providers return ``dq``)."""
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
    return reference.attention(q[None], k[None], v[None], causal=case.causal)[0]


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
