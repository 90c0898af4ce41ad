"""Model only (CPU, reference.flash_fp8_model's arithmetic with a factor 2 ** offset on P before its e4m3 rounding):
the fp8 forward's error against float64 with the softmax's float32 sums (f32) and with the rounded P's sums (mma, the
P V MMA's), at offsets 0 and 8, on three shapes (B1 H2 D128, 224-key tiles, q and k scaled by `scale`)."""
import sys

import numpy as np

sys.path.insert(0, ".")
import reference
from reference.fp8 import decode_e4m3, encode_e4m3
def model(q, k, v, causal, block_n, rounded_sums, offset):
    sm = 1/np.sqrt(q.shape[-1]); out = np.zeros_like(q)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = sm * q[b,h] @ k[b,h].T
            n = s.shape[1]; m = np.full(s.shape[0], -np.inf); tot = np.zeros(s.shape[0]); acc = np.zeros((s.shape[0], q.shape[-1]))
            for n0 in range(0, n, block_n):
                t = s[:, n0:n0+block_n]; mn = np.maximum(m, t.max(1)); al = np.exp(m - mn)
                p = np.exp(t - mn[:, None]) * 2.0**offset
                r = decode_e4m3(encode_e4m3(p))
                tot = tot*al + (r if rounded_sums else p).sum(1); acc = acc*al[:, None] + r @ v[b,h,n0:n0+block_n]; m = mn
            out[b,h] = acc/tot[:, None]
    return out
for (lq, lk, scale, seed) in [(512, 2048, 1.5, 21), (333, 4113, 1.0, 3), (256, 1024, 3.0, 4)]:
    rng = np.random.default_rng(seed)
    q = reference.encode_e4m3(rng.standard_normal((1, 2, lq, 128)) * scale)
    k = reference.encode_e4m3(rng.standard_normal((1, 2, lk, 128)) * scale)
    v = reference.encode_e4m3(rng.standard_normal((1, 2, lk, 128)))
    qf, kf, vf = reference.dequantize(q, k, v)
    ref = reference.attention_fp8(q, k, v)
    res = []
    for rs in (False, True):
        for off in (0, 8):
            o = model(qf, kf, vf, False, 224, rs, off)
            res.append(f"sums={'mma' if rs else 'f32'} off={off}: {np.linalg.norm(o-ref)/np.linalg.norm(ref):.3e}")
    print(lq, lk, scale, "; ".join(res), flush=True)
