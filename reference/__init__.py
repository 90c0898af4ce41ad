"""NumPy float64 reference implementations: the ground truth for every GPU kernel in numba_attn.

Readable rather than fast. Shapes are ``(batch, heads, seqlen, headdim)``; every
function but the two of :mod:`reference.varlen` also takes ``(seqlen, headdim)``
inputs. See the module docstrings of
:mod:`reference.attention` and :mod:`reference.decode` for the conventions the
kernels share (bottom-right causal mask, sliding windows ``window=(left, right)``
and soft-capping ``softcap`` around the same diagonal, grouped-query heads, rows
that see no key give output 0 and ``lse = -inf``, the split-KV partition rule).

Real batches, in :mod:`reference.varlen`: :func:`attention_varlen` (sequences of
different lengths packed as ``(total_tokens, heads, headdim)`` with
``cu_seqlens`` offsets) and :func:`attention_with_kvcache` (a dense or paged KV
cache, each batch row seeing its own ``cache_seqlens`` keys); every sequence is
an independent problem under the same conventions.

float8 e4m3 inputs, in :mod:`reference.fp8`: :func:`attention_fp8` (the float64
reference of the dequantised inputs, per-tensor or per-head descale factors),
:func:`decode_e4m3` (the exact table of the 256 values), :func:`encode_e4m3`, and
:func:`flash_fp8_model`, the fp8 kernel's rounding of ``P`` modelled in float64.

Backward passes, float64 gradients under the same conventions:
:func:`attention_backward` (the definition) and :func:`flash_attention_v2_backward`
(FlashAttention-2's blockwise order) in :mod:`reference.attention_backward`;
:func:`attention_varlen_backward` (packed sequences) in :mod:`reference.varlen`;
:func:`causal_dot_product_backward` (and its recurrent and chunked forms) and
:func:`linear_attention_backward` in :mod:`reference.linear_backward`.

Arguments: flags (``causal``, ``return_lse``, ``return_state``) must be
``bool`` (NumPy bools too), numbers (``sm_scale``, ``eps``, ``softcap``) real
numbers, and ``window`` None or a pair of (ints >= 0 or None); a wrong type
raises ``ArgumentTypeError`` (a ``TypeError`` and a ``ValueError``), every
other bad argument a ``ValueError`` naming it. The
defaults are those of ``numba_attn``'s functions of the same name.

NaN and inf, the rules every kernel follows too (scores
``s_ij = sm_scale * q_i . k_j``, IEEE arithmetic everywhere else):

* a NaN or ``+inf`` score makes that row's output and lse NaN; with ``softcap``
  the rules apply to the capped score ``c * tanh(s / c)``, so a raw ``+-inf``
  score counts as the finite ``+-c`` (only NaN survives the cap);
* a ``-inf`` score is a key of weight 0; a row whose scores are all ``-inf``
  (or that sees no key) gives exactly 0 and ``lse = -inf``, whatever ``v`` holds;
* NaN in ``v`` gives NaN in its column; ``+-inf`` gives ``+-inf`` where its
  weight is positive and NaN where the weight is 0 or ``+inf`` meets ``-inf``;
* keys a row does not see (causal mask, window, other sequences of a packed
  batch, cache entries past ``cache_seqlens``, later positions of the causal
  linear functions) never affect it, whatever they hold (the kernels promise
  this only for finite values: they multiply whole tiles, and ``0 * NaN`` is
  NaN);
* :func:`combine_lse`: a NaN or ``+inf`` part lse makes the row NaN; parts with
  ``lse = -inf`` have weight 0 (their ``o`` must be finite); all ``-inf``: 0
  and ``-inf``;
* linear attention: a NaN reaches exactly the outputs that depend on it; an
  inf gives ``+-inf`` or NaN there, depending on the order of the sums (the
  quadratic form ``(q . k) v`` and the state form ``q . (k v^T)`` differ).
"""

from .attention import attention, flash_attention_v1, flash_attention_v2
from .attention_backward import attention_backward, flash_attention_v2_backward
from .decode import combine_lse, split_boundaries, split_kv_attention
from .fp8 import attention_fp8, decode_e4m3, dequantize, encode_e4m3, flash_fp8_model
from .linear import (
    causal_dot_product,
    causal_dot_product_chunked,
    causal_dot_product_quadratic,
    causal_dot_product_recurrent,
    elu_feature_map,
    linear_attention,
)
from .linear_backward import (
    causal_dot_product_backward,
    causal_dot_product_backward_chunked,
    causal_dot_product_backward_recurrent,
    linear_attention_backward,
)
from .softmax import (
    merge_softmax_states,
    naive_softmax,
    online_softmax,
    safe_softmax,
    softmax_state,
)
from .varlen import attention_varlen, attention_varlen_backward, attention_with_kvcache

__all__ = [
    "naive_softmax",
    "safe_softmax",
    "softmax_state",
    "merge_softmax_states",
    "online_softmax",
    "attention",
    "flash_attention_v1",
    "flash_attention_v2",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "attention_backward",
    "flash_attention_v2_backward",
    "attention_fp8",
    "decode_e4m3",
    "encode_e4m3",
    "dequantize",
    "flash_fp8_model",
    "split_boundaries",
    "split_kv_attention",
    "combine_lse",
    "elu_feature_map",
    "causal_dot_product",
    "causal_dot_product_quadratic",
    "causal_dot_product_recurrent",
    "causal_dot_product_chunked",
    "linear_attention",
    "causal_dot_product_backward",
    "causal_dot_product_backward_recurrent",
    "causal_dot_product_backward_chunked",
    "linear_attention_backward",
]
