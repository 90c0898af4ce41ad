"""NumPy float64 reference implementations: the ground truth for every GPU kernel in numba_attn.

Readable rather than fast. Shapes are ``(batch, heads, seqlen, headdim)``; every
function also takes ``(seqlen, headdim)`` inputs. See the module docstrings of
:mod:`reference.attention` and :mod:`reference.decode` for the conventions the
kernels share (bottom-right causal mask, grouped-query heads, rows that see no
key give output 0 and ``lse = -inf``, the split-KV partition rule).
"""

from .attention import attention, flash_attention_v1, flash_attention_v2
from .decode import combine_lse, split_boundaries, split_kv_attention
from .linear import (
    causal_dot_product,
    causal_dot_product_chunked,
    causal_dot_product_quadratic,
    causal_dot_product_recurrent,
    elu_feature_map,
    linear_attention,
)
from .softmax import (
    merge_softmax_states,
    naive_softmax,
    online_softmax,
    safe_softmax,
    softmax_state,
)

__all__ = [
    "naive_softmax",
    "safe_softmax",
    "softmax_state",
    "merge_softmax_states",
    "online_softmax",
    "attention",
    "flash_attention_v1",
    "flash_attention_v2",
    "split_boundaries",
    "split_kv_attention",
    "combine_lse",
    "elu_feature_map",
    "causal_dot_product",
    "causal_dot_product_quadratic",
    "causal_dot_product_recurrent",
    "causal_dot_product_chunked",
    "linear_attention",
]
