"""Attention across several processes with ``torch.distributed`` (context parallelism).

``ring_attention`` (ring attention over sequence shards, contiguous or zig-zag), ``shard`` / ``unshard`` (the
sharding layouts) and ``gather`` (all-gather a sharded tensor). torch is imported only when these are called, so
``import numba_attn`` (and this package) never needs torch. ``ring_attention_backward`` is its backward (autograd
uses it by itself). Tested on the CPU with gloo and on GPUs with NCCL (``docs/design/distributed.md``).
"""
from .ring import LAYOUTS, gather, ring_attention, shard, unshard
from .ring_backward import ring_attention_backward

__all__ = ["LAYOUTS", "ring_attention", "ring_attention_backward", "shard", "unshard", "gather"]
