"""Helpers shared by the decode tests: inputs, the check against ``reference.attention``, bfloat16 bit views."""
from __future__ import annotations

import numpy as np

import numba_attn
import reference
from numba_attn.core import ptx
from tests.kernel_checks import TOLERANCE, assert_close_lse, rel_error, to_host

DTYPES = ("float32", "float16")
BF16_NAN = 0x7FC0  # poison: unwritten output elements show as NaN


def qkv(rng, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, dtype):
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim)).astype(dtype)
    return q, k, v


def check_attention(out, lse, q, k, v, causal, sm_scale=None):
    ref_out, ref_lse = reference.attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
    out = to_host(out)
    assert out.dtype == q.dtype
    assert not np.isnan(out).any(), "out has NaN"
    err = rel_error(out, ref_out)
    assert err <= TOLERANCE[str(q.dtype)], f"relative error {err:.3g}"
    assert_close_lse(lse, ref_lse)
    # rows that see no key: exactly 0 and -inf
    empty = np.isneginf(ref_lse)
    assert (out[empty] == 0).all()


def dev(x):
    """A kernel-level argument: NumPy under the simulator, a Numba device array on a GPU."""
    if numba_attn.SIMULATOR:
        return x
    from numba import cuda

    return cuda.to_device(x)


def bf16_inputs(rng, *shape_args):
    """bfloat16 bit views of q, k, v and their exact values (float64) for the reference."""
    arrays = qkv(rng, *shape_args, "float32")
    bits = [ptx.float32_to_bf16_bits(x) for x in arrays]
    return bits, [ptx.bf16_bits_to_float32(x).astype(np.float64) for x in bits]


def bf16_values(bits):
    return ptx.bf16_bits_to_float32(to_host(bits)).astype(np.float64)
