"""Which split-KV kernel runs a ``flash_decode`` call.

float16 / bfloat16 on sm_80+ (and the simulator) take the tensor-core split kernel (``launch.DecodeLaunch``) whenever
the query rows of a GQA group regroup into one sequence without a copy and its grids fit the device; everything else
takes the SIMT split kernel (``simt``) and the combine kernel (``combine``). A tensor-core call of torch or CuPy
arrays leaves a plan (``cached``) that later calls of the same kind take without the checks.
"""
from __future__ import annotations

from ..runtime.arrays import BFLOAT16
from ..runtime.attention_args import AttentionArgs
from ..runtime.device import SIMULATOR, compute_capability, multiprocessor_count
from . import cached as _decode_plan
from . import combine as _combine
from . import launch as _decode_launch
from . import mma as _decode_mma
from . import simt as _decode

#: GQA groups of at least this many query heads per kv head take the tensor-core split kernel. 1: multi-head caches
#: too -- its cp.async tiles stream faster than the SIMT kernel's loads (docs/benchmarks.md).
MMA_MIN_GROUP = 1


def check_dtype(dtype: str) -> None:
    if dtype == BFLOAT16 and not SIMULATOR and compute_capability() < (8, 0):
        raise TypeError("q: bfloat16 decoding needs a GPU of compute capability >= 8.0 (its output is rounded by "
                        "cvt.rn.bf16x2)")


def on_tensor_cores(dtype: str, shape, args: AttentionArgs):
    """The regrouped ``(q, out, lse)`` views when ``flash_decode`` takes the tensor-core kernel, else None."""
    group = shape.heads // shape.kv_heads
    if group < MMA_MIN_GROUP or not _decode_mma.supports(dtype, shape.batch, shape.kv_heads, group * shape.seqlen_q):
        return None
    if not _combine.supports(shape.batch * shape.heads * shape.seqlen_q):
        return None  # (the SIMT path takes any rows with one split)
    return _decode_launch.grouped_views(args.q, args.out, args.lse, args.write_lse, shape.kv_heads, args.causal)


def run(call, shape, args: AttentionArgs, num_splits, plan_key=None) -> None:
    """Launch the split kernel (and the merge) for ``args``; register a plan under ``plan_key`` where one applies."""
    grouped = on_tensor_cores(call.dtype, shape, args)
    if grouped is None:
        if num_splits is None:
            num_splits = _decode.choose_num_splits(
                shape.batch, shape.heads, shape.kv_heads, shape.seqlen_q, shape.seqlen_k, multiprocessor_count())
        _decode.launch(*args.launch_args(), num_splits, call.stream, scratch=call.scratch, dtype=call.dtype)
        return
    q_rows, out_rows, lse_rows = grouped
    launch = _decode_launch.DecodeLaunch(
        q_rows, out_rows, args.write_lse, args.sm_scale, num_splits, multiprocessor_count(), dtype=call.dtype,
        vector_loads=_decode_launch.vector_loads_ok(q_rows, args.k, args.v),
        device_id=call.device_id if call.device_id >= 0 else None)
    launch(q_rows, args.k, args.v, out_rows, lse_rows, call.stream, call.scratch)
    if plan_key is not None and shape.seqlen_k > 0:  # later calls like this one skip the checks
        _decode_plan.register(plan_key, _decode_plan.DecodePlan(
            call, shape.out_shape(), shape.lse_shape() if args.write_lse else None, q_rows, out_rows, lse_rows,
            launch))
