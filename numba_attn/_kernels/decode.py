"""Split-KV decoding (flash-decoding) and the LSE combine kernel. TO BE WRITTEN (interface fixed by api.py).

launch(q, k, v, out, lse, write_lse, sm_scale, causal, num_splits, stream)
    q (batch, heads, seqlen_q, d), k/v (batch, kv_heads, seqlen_k, d) device views (any strides, fp16/fp32),
    out like q, lse (batch, heads, seqlen_q) float32 (written only if write_lse).
launch_combine(o_parts, lse_parts, out, lse, stream)
    o_parts (num_splits, batch, heads, seqlen_q, d), lse_parts (num_splits, batch, heads, seqlen_q) float32.
choose_num_splits(batch, heads, kv_heads, seqlen_q, seqlen_k, sm_count) -> int
"""
