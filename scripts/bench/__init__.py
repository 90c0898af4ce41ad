"""The benchmark sweep of numba_attn against the peers that are installed, on the same inputs (``scripts/sweep.py``).

Sweeps (``--sweeps``):

* ``flash``  -- ``numba_attn.flash_forward`` vs torch SDPA (flash / cuDNN / memory-efficient backends forced one at a
  time, the math backend only where its score matrix fits the memory budget), our Triton FlashAttention-2 forward
  (``peers/triton_flash.py``) and a naive CuPy attention, over sequence length, causal and not, per (headdim, heads)
  configuration. Metric: TFLOP/s with FLOPs = 4 * B * H * Lq * Lk * D (two matrix products), **halved for causal**
  (the masked half is not counted, whatever a kernel actually computes).
* ``flash_bwd`` (``--sweeps flash --direction backward`` or ``both``) -- ``numba_attn.flash_backward`` vs the
  backward of torch SDPA's forced backends and of our Triton FlashAttention-2 backward (``peers/triton_flash_backward.py``)
  on the flash grid: each provider records one forward when prepared
  (untimed) and the backward alone is timed (SDPA: ``torch.autograd.grad`` with the graph retained); the check
  compares ``dq`` (a row's depends on that row only, so the slice is exact). Metric: TFLOP/s with FLOPs = 2.5 times
  the forward's (five products of its size instead of two), halved for causal.
* ``flash_fwdbwd`` (``--direction fwdbwd``) -- one training step of the layer per timed call: the forward and
  then the backward on its output (numba_attn and SDPA with torch tensors: ``torch.autograd.grad`` through the
  differentiable forward). Metric: TFLOP/s with FLOPs = 3.5 times the forward's; ``dq`` checked.
* ``decode`` -- ``numba_attn.flash_decode`` (one query row against a long KV cache) vs torch SDPA and the Triton
  kernel, plain multi-head and grouped-query. Metric: GB/s = bytes of K and V read plus q read and out written, per
  second, and its percentage of the device-to-device copy bandwidth measured in the same run (read + written
  bytes of a 1 GiB buffer copy).
* ``linear`` -- ``numba_attn.causal_dot_product`` vs flash-linear-attention's chunked and fused-recurrent kernels
  (``scale=1``, ``normalize=False``: the same unnormalised causal sum); fla's chunked kernel runs float32 in TF32,
  ``fla-chunk[tf32x3]`` (float32 only) compiles it with Triton's 3xTF32 products, float32's precision. Metric: ms only.
* ``linear_bwd`` / ``linear_fwdbwd`` (``--sweeps linear --direction backward`` / ``fwdbwd``) --
  ``numba_attn.causal_dot_product_backward`` vs the backward of fla's kernels through autograd (a forward recorded
  when prepared, timed alone), and forward plus backward in one call. Metric: ms; ``dq`` checked against
  ``reference.causal_dot_product_backward_chunked``.

Real batches (issue #29; asked by name, not in the default list: each compiles kernels of its own):

* ``varlen`` -- ``numba_attn.flash_forward_varlen`` on packed ``(total_tokens, heads, headdim)`` inputs with
  ``cu_seqlens`` on the device vs FlexAttention (``torch.compile``d, a document(-causal) block mask;
  ``peers/torch_flex.py``) and SDPA on jagged nested tensors (flash / efficient / cuDNN forced;
  ``peers/torch_nested.py``), on the flash grid's (headdim, heads), dtypes and ``--causal``. For each ``--seqlens``
  value N, ``--varlen-seqs`` n sequences of (2i + 1) N / n tokens (i < n: evenly spread over [N/n, 2N - N/n], mean
  N, in a fixed shuffled order; ``layouts.mixed_lengths``); N is the x axis. Metric: TFLOP/s on the real tokens,
  FLOPs = 4 * H * D * sum(L_i^2), halved for causal. Checked: the last ``--check-rows`` rows of the first and the
  last packed sequence (the last one follows every other: leaks across sequences show there) against
  ``reference.attention_varlen``.
* ``paged`` -- ``numba_attn.flash_decode`` on the decode grid with the cache in pages of each ``--page-sizes`` value
  (``numba_attn[paged<size>]``; FlashAttention's layout: pools ``(num_pages, page_size, kv_heads, headdim)`` with
  the pages in a shuffled order and an int32 ``block_table (batch, max_pages)`` on the device; sizes that do not
  divide the KV length are skipped) vs the same keys in the dense cache (``numba_attn``, the baseline), each
  ``--paged-rows``: ``full`` (every row holds L keys) and ``ragged`` (row b holds L/2 + b L / (2B) keys, device
  ``cache_seqlens``). Metric: GB/s as decode's (ragged: K and V of the keys the rows hold), % of the copy
  bandwidth, CUDA graphs as decode; checked against ``reference.attention_with_kvcache`` (batch row 0, the
  shortest).
* ``window`` -- ``numba_attn.flash_forward(causal=True, window=(W, 0))``, W = ``--window``, on the flash grid's
  (headdim, heads), dtypes and the sizes N > W (a window as long as the sequence is plain causal: skipped) vs
  FlexAttention with a sliding-window block mask and, as the baseline, numba_attn's full causal call on the same
  inputs (``numba_attn[causal]``, checked and counted as that call). Metric: TFLOP/s on the visible pairs (row i
  sees min(i, W) + 1 keys: FLOPs = 4 * B * H * D * sum_i(min(i, W) + 1)); the baseline's on the causal half.
  Checked against ``reference.attention(..., causal=True, window=(W, 0))``.

Baselines: the tables of ``paged`` and ``window`` add ``<ours> / <baseline> rate`` columns: a numba_attn provider's
rate (GB/s, TFLOP/s, each counted on its own work) over the baseline's (> 1: higher rate); tables without peers
(``paged``) have no best-peer columns.

How each (case, provider) pair is measured:

1. Correctness first: the provider runs once on input set 0 and a slice of its output (batch 0, the first and last
   heads, the last ``--check-rows`` query rows; varlen: those of the first and last sequences) is compared with the
   float64 ``reference`` package computed on the same slice of the inputs (bottom-right causal alignment makes the
   last rows against all keys an exact sub-problem). ``rel_err = ||out - ref|| / ||ref||``. Above the dtype's
   bound (``--tol``; providers that compute float32 with TF32 tensor cores get the ``tf32`` bound) the provider
   is marked FAIL and not timed. A provider that raises (unsupported dtype or shape, out of memory, missing
   kernel) is recorded as skipped with the error text; nothing a provider does stops the sweep.
2. Timing: ``--warmup`` calls, then up to ``--reps`` calls (fewer if they would exceed ``--budget`` seconds, at
   least 3), rotating over a few freshly drawn normal random input sets (``--rotate``) so that no call finds its
   inputs in L2. On a GPU every call is bracketed by CUDA events on one stream, the stream all providers run on
   (torch's current stream, which CuPy and numba_attn are pointed at too); calls are queued back to back and the
   host synchronises every few calls, so host launch overhead is only visible when it exceeds the GPU work (as it
   would be in an application). The reported time is the median. Under the simulator, ``time.perf_counter``.
3. Decode steps (decode, paged) are also timed in CUDA graphs (``--graph-sweeps``, torch arrays only):
   ``--graph-steps`` calls over the rotated input sets captured in one ``torch.cuda.CUDAGraph``, replayed
   ``--graph-replays`` times between CUDA events; the median replay over the number of steps is the GPU time of
   one call without host time or launch gaps, the way a serving loop runs a decoding step (queued, a short step
   measures the lease's CPU too: a planned GQA call took 59 and 117 us of host time on two H100 leases of one
   day, and 16k-key steps queued at 228 us each on a third against 103 us in graphs). Tables and plots show
   both; providers that launch on a stream of their own (the CuPy naive peer) are not captured.

Without a GPU (``numba_attn.SIMULATOR``) the same pipeline runs a tiny grid under Numba's CUDA simulator against a
NumPy naive peer (flash, decode, linear; the real-batch sweeps have no peer there, and their offsets and tables are
host arrays; the GPU peers are reported as not run): it checks that the sweep and the kernels work, not how fast
anything is.

Outputs in ``--out``: ``results.csv``, ``results.json`` (device, date, versions, command line, copy bandwidth, every
row), ``results.md`` (markdown tables), one ``<sweep>.png`` per sweep; progress lines and a table per sweep on
stdout. Providers are kept in a registry (``providers.build_registry``): one dict per sweep, name -> ``Provider``;
new numba_attn backends appear automatically when the public functions grow a ``backend=`` keyword, and a new peer
is one module in ``peers/`` (see ``peers/__init__.py``).

Modules, one job each: ``cli`` (options), ``cases`` (grids and the work each case counts), ``layouts`` (packed
sequences, paged caches, window pairs), ``environment`` (arrays, streams, device and software info), ``timing`` (how
calls are timed), ``checks`` (accuracy against the reference), ``providers`` (the registry), ``batches``
(numba_attn's providers of the real-batch sweeps), ``peers/`` (the outside implementations), ``runner`` (one case,
every provider), ``report`` (tables, files, plots), ``main`` (the whole run).
"""
import numba_attn  # noqa: F401  (first: decides GPU vs simulator before numba.cuda is imported)
