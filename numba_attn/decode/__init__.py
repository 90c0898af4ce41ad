"""Decoding: split-KV attention of a few query rows over a long KV cache (``flash_decode``), and the LSE merge of
parts (``combine_lse``).

``dispatch`` picks the kernel of a call and ``cached`` keeps plans for repeated calls; ``simt`` (SIMT split kernel)
and ``mma`` (tensor-core split kernel) stream the keys, ``plan`` cuts them into ranges, ``pool`` holds the counters of
pooled launches, ``launch`` launches the tensor-core path, ``combine`` merges the parts, and ``kvcache`` has the
KV-cache options (ragged lengths, pages, windows, softcap) and their checks.
"""
