"""numba_attn: attention kernels in Python with Numba CUDA, checked against the NumPy `reference` package.

Public functions (each mirrors a `reference` function of the same signature):
``flash_forward``, ``flash_forward_varlen``, ``flash_backward``, ``flash_backward_varlen``, ``flash_decode``,
``combine_lse``,
``causal_dot_product``, ``causal_dot_product_backward``, ``linear_attention``, ``linear_attention_backward``; and
``autotune()``, a context manager under which calls tune the tile configurations of new keys on their own inputs
(``numba_attn.runtime.autotune``).
Without a usable GPU the same calls run under Numba's CUDA simulator (see ``numba_attn.runtime.device``).
"""
from .runtime import device as _device  # noqa: F401  (decides GPU vs simulator before numba.cuda is imported)
from .runtime.device import SIMULATOR
from .runtime.autotune import autotune
from .api import (BACKENDS, combine_lse, flash_backward, flash_backward_varlen, flash_decode, flash_forward,
                  flash_forward_varlen)
from .runtime.lazy import lazy_exports as _lazy_exports

#: the linear-attention family loads on first use (``runtime.lazy``)
__getattr__ = _lazy_exports(__name__, {
    **{name: ".linear.api" for name in ("causal_dot_product", "causal_dot_product_backward", "linear_attention",
                                        "linear_attention_backward")},
    "LINEAR_BACKENDS": ".linear.dispatch:BACKENDS"})

__version__ = "0.1.0"
__all__ = ["BACKENDS", "LINEAR_BACKENDS", "flash_forward", "flash_forward_varlen", "flash_backward",
           "flash_backward_varlen", "flash_decode",
           "combine_lse", "causal_dot_product", "causal_dot_product_backward", "linear_attention",
           "linear_attention_backward", "autotune", "SIMULATOR"]
