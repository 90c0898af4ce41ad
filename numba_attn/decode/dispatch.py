"""Which split-KV kernel runs a ``flash_decode`` call.

float16 / bfloat16 on sm_80+ (and the simulator) take the tensor-core split kernel (``launch.DecodeLaunch``) whenever
the query rows of a GQA group regroup into one sequence without a copy and its grids fit the device; everything else
takes the SIMT split kernel (``simt``) and the combine kernel (``combine``). A tensor-core call of torch or CuPy
arrays leaves a plan (``cached``) that later calls of the same kind take without the checks.

Calls with KV-cache options (``kvcache``: ragged lengths, pages, a window, a softcap) take the same two kernels,
specialised on them; the tensor-core kernel only where the query rows share one position or no mask applies.
"""
from __future__ import annotations

from ..runtime.arrays import BFLOAT16
from ..runtime.attention_args import AttentionArgs
from ..core.mask import NO_WINDOW
from ..runtime.device import SIMULATOR, compute_capability, multiprocessor_count
from . import cached as _decode_plan
from . import combine as _combine
from . import launch as _decode_launch
from . import mma as _decode_mma
from . import kvcache as _kvcache
from . import simt as _decode

#: GQA groups of at least this many query heads per kv head take the tensor-core split kernel. 1: multi-head caches
#: too -- its cp.async tiles stream faster than the SIMT kernel's loads (docs/benchmarks.md).
MMA_MIN_GROUP = 1


def check_dtype(dtype: str) -> None:
    if dtype == BFLOAT16 and not SIMULATOR and compute_capability() < (8, 0):
        raise TypeError("q: bfloat16 decoding needs a GPU of compute capability >= 8.0 (its output is rounded by "
                        "cvt.rn.bf16x2)")


def on_tensor_cores(dtype: str, shape, args: AttentionArgs, kv: _kvcache.KvCache | None = None):
    """The regrouped ``(q, out, lse)`` views when ``flash_decode`` takes the tensor-core kernel, else None."""
    group = shape.heads // shape.kv_heads
    if group < MMA_MIN_GROUP or not _decode_mma.supports(dtype, shape.batch, shape.kv_heads, group * shape.seqlen_q):
        return None
    if not _combine.supports(shape.batch * shape.heads * shape.seqlen_q):
        return None  # (the SIMT path takes any rows with one split)
    masked = args.causal or (kv is not None and kv.options.window != NO_WINDOW)
    return _decode_launch.grouped_views(args.q, args.out, args.lse, args.write_lse, shape.kv_heads, masked)


def run(call, shape, args: AttentionArgs, num_splits, plan_key=None, kv: _kvcache.KvCache | None = None) -> None:
    """Launch the split kernel (and the merge) for ``args`` (and the KV-cache arguments ``kv``, with k and v as
    ``kvcache`` describes them); register a plan under ``plan_key`` where one applies."""
    grouped = on_tensor_cores(call.dtype, shape, args, kv)
    if grouped is None:
        if num_splits is None:
            keys = shape.seqlen_k if kv is None else kv.span(shape.seqlen_q)
            num_splits = _decode.choose_num_splits(
                shape.batch, shape.heads, shape.kv_heads, shape.seqlen_q, keys, multiprocessor_count())
        _decode.launch(*args.launch_args(), num_splits, call.stream, scratch=call.scratch, dtype=call.dtype, kv=kv)
        return
    q_rows, out_rows, lse_rows = grouped
    kv_rows = None if kv is None else kv.for_rows(shape.seqlen_q)
    launch = _decode_launch.DecodeLaunch(
        q_rows, out_rows, args.write_lse, args.sm_scale, num_splits, multiprocessor_count(), dtype=call.dtype,
        vector_loads=_decode_launch.vector_loads_ok(q_rows, args.k, args.v),
        device_id=call.device_id if call.device_id >= 0 else None, kv=kv_rows)
    kv_args = None if kv_rows is None else (kv.seqlens, kv.table, kv.capacity)
    launch(q_rows, args.k, args.v, out_rows, lse_rows, call.stream, call.scratch, kv_args=kv_args)
    # later calls like this one skip the checks; a cache without index arrays may grow from call to call
    growing = kv is None or not (kv.options.ragged or kv.options.paged)
    if plan_key is not None and (shape.seqlen_k > 0 or not growing):
        _decode_plan.register(plan_key, _decode_plan.DecodePlan(
            call, shape.out_shape(), shape.lse_shape() if args.write_lse else None, q_rows, out_rows, lse_rows,
            launch, args.k, args.v, kv_args, growing))


def checked_with_cache(q, k_cache, v_cache, cache_seqlens, block_table, causal: bool, sm_scale, window,
                       softcap, return_lse: bool, num_splits, lse_placeholder, plan_key=None):
    """``flash_decode`` with KV-cache options (checked ``window`` and ``softcap``): check the arrays
    (``kvcache.check_inputs``), bring them to the device and launch; returns ``out`` or ``(out, lse)``."""
    import math

    from ..runtime.arrays import prepare
    from ..runtime.device import on_device
    from ..runtime.shapes import attention_shape
    from ..runtime.views import lift

    if cache_seqlens is None and block_table is None:  # a dense cache of full rows (2-d arrays too)
        shape = attention_shape(q, k_cache, v_cache)
        inputs = _kvcache.KvInputs(shape, False, False, {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    else:
        inputs = _kvcache.check_inputs(q, k_cache, v_cache, cache_seqlens, block_table)
    shape = inputs.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(shape.head_dim)
    call = prepare(inputs.arrays, own_dtype={"cache_seqlens": (_kvcache.INDEX_DTYPE,),
                                             "block_table": (_kvcache.INDEX_DTYPE,)})
    with on_device(call.device_id):
        out = call.output(shape.out_shape())
        lse = call.output(shape.lse_shape(), "float32") if return_lse else None
        check_dtype(call.dtype)
        if shape.seqlen_q > 0 and shape.batch * shape.heads > 0:
            k, v = lift(call.inputs["k_cache"], 4), lift(call.inputs["v_cache"], 4)
            if inputs.paged:
                k, v = _kvcache.page_view(k), _kvcache.page_view(v)
            seqlens, table = _kvcache.placeholders()
            options = _kvcache.options_for(inputs.ragged, inputs.paged, window, causal, softcap)
            kv = None
            if options is not None:
                kv = _kvcache.KvCache(options, call.inputs.get("cache_seqlens", seqlens),
                                      call.inputs.get("block_table", table), shape.seqlen_k, window, softcap)
            args = AttentionArgs(lift(call.inputs["q"], 4), k, v, lift(out.view, 4),
                                 lift(lse.view, 3) if return_lse else lse_placeholder(call), return_lse, sm_scale,
                                 causal, window)
            run(call, shape, args, num_splits, plan_key, kv)
        if return_lse:
            return call.result(out), call.result(lse)
        return call.result(out)
