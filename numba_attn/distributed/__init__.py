"""Attention across several processes with ``torch.distributed`` (context parallelism).

``ring_attention`` (ring attention over sequence shards, contiguous or zig-zag), ``shard`` / ``unshard`` (the
sharding layouts) and ``gather`` (all-gather a sharded tensor). torch is imported only when these are called, so
``import numba_attn`` (and this package) never needs torch. Forward only; tested on the CPU with gloo
(``docs/design/distributed.md``).
"""
from .ring import LAYOUTS, gather, ring_attention, shard, unshard

__all__ = ["LAYOUTS", "ring_attention", "shard", "unshard", "gather"]
