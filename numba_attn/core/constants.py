"""Numbers the attention kernels share: the base-2 softmax's conversions and the accumulators' start value."""
from __future__ import annotations

import numpy as np

#: log2(e): scores scaled by ``sm_scale * LOG2E`` go through ``exp2``, one FFMA per exponent
LOG2E = 1.4426950408889634
#: ln(2): a base-2 log-sum-exp times ``LN2`` is the natural-log lse the kernels return
LN2 = 0.6931471805599453
#: register accumulators start at -0.0, not 0.0: LLVM turns a loop of zero stores into a memset, which keeps the
#: array in local memory (adding to -0.0 is exact, so the MMAs and FMAs give what they give from +0.0)
ACC_INIT = np.float32(-0.0)
