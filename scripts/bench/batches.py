"""numba_attn's providers of the real-batch sweeps, each with the reference point its tables compare against.

* ``varlen`` -- ``flash_forward_varlen`` on the packed sequences, ``cu_seqlens`` where the inputs live (on the
  device on a GPU: no host copy, no schedule made on the host; under the simulator they are NumPy, the host path).
* ``paged``  -- ``flash_decode`` on the dense cache (``numba_attn``, the baseline) and on the same keys in pages of
  each ``--page-sizes`` value (``numba_attn[paged<size>]``: pools ``(num_pages, page_size, kv_heads, headdim)`` in a
  shuffled order with an int32 ``block_table`` on the device, made when the provider is prepared, untimed); ragged
  cases pass the device ``cache_seqlens`` to both.
* ``window`` -- ``flash_forward(causal=True, window=(W, 0))`` (``numba_attn``) and the full causal call on the same
  inputs (``numba_attn[causal]``, the baseline, checked and counted as that call: ``cases.without_window``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numba_attn

from .cases import without_window
from .layouts import paged_cache
from .providers import OURS, Prepared, Provider

if TYPE_CHECKING:
    from .cli import Options

SWEEPS = ("varlen", "paged", "window")


def varlen_providers() -> dict:
    def prepare(case, x, env):
        longest, cu = max(case.lengths), x["cu_seqlens"]
        return Prepared(lambda: numba_attn.flash_forward_varlen(
            x["q"], x["k"], x["v"], cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=case.causal))

    return {OURS: Provider(prepare, ours=True, note="numba_attn.flash_forward_varlen, cu_seqlens on the device")}


def _page_fits(page: int):
    def check(case, env):
        if case.seqlen_k % page:
            return f"KV length {case.seqlen_k} is not a multiple of the page size {page}"
        return None

    return check


def paged_providers(page_sizes: list) -> dict:
    def dense(case, x, env):
        return Prepared(lambda: numba_attn.flash_decode(x["q"], x["k"], x["v"], cache_seqlens=x.get("cache_seqlens")))

    providers = {OURS: Provider(dense, ours=True, baseline=True,
                                note="numba_attn.flash_decode on the dense cache (the paged providers' baseline)")}
    for page in page_sizes:
        def prepare(case, x, env, page=page):
            k, v, table = paged_cache(env, x["k"], x["v"], page, seed=page)
            return Prepared(lambda: numba_attn.flash_decode(x["q"], k, v, cache_seqlens=x.get("cache_seqlens"),
                                                            block_table=table))

        providers[f"{OURS}[paged{page}]"] = Provider(
            prepare, ours=True, check=_page_fits(page),
            note=f"numba_attn.flash_decode, pages of {page} keys in a shuffled order, int32 block_table on the device")
    return providers


def window_providers() -> dict:
    def windowed(case, x, env):
        return Prepared(lambda: numba_attn.flash_forward(x["q"], x["k"], x["v"], causal=True,
                                                         window=(case.window, 0)))

    def full(case, x, env):
        return Prepared(lambda: numba_attn.flash_forward(x["q"], x["k"], x["v"], causal=True))

    return {OURS: Provider(windowed, ours=True, note="numba_attn.flash_forward(causal=True, window=(W, 0))"),
            f"{OURS}[causal]": Provider(full, ours=True, baseline=True, variant=without_window,
                                        note="numba_attn.flash_forward(causal=True), no window: the baseline, "
                                        "TFLOP/s on the full causal pairs")}


def providers(opts: Options) -> dict:
    """``{sweep: {name: Provider}}`` of numba_attn for the real-batch sweeps."""
    return {"varlen": varlen_providers(), "paged": paged_providers(opts.page_sizes), "window": window_providers()}
