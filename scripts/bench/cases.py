"""The sweep grids and their cases: shapes, dtypes, and the FLOPs or bytes each case counts for its rate."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from .layouts import cu_seqlens, mixed_lengths, ragged_lengths, window_pairs

if TYPE_CHECKING:  # annotations only: cli and environment import this module
    from .cli import Options
    from .environment import Env

SWEEPS = ("flash", "flash_bwd", "flash_fwdbwd", "decode", "linear", "linear_bwd", "linear_fwdbwd", "varlen", "paged",
          "window")
#: what ``--sweeps`` runs when not given (``--direction`` swaps or adds the ``_bwd`` / ``_fwdbwd`` sweeps of
#: ``flash`` and ``linear``); the real-batch sweeps (varlen, paged, window) compile kernels of their own: asked by name
DEFAULT_SWEEPS = ("flash", "decode", "linear")
#: sweeps whose inputs include the output's gradient ``dout`` and whose providers return ``dq``
GRADIENT_SWEEPS = ("flash_bwd", "flash_fwdbwd", "linear_bwd", "linear_fwdbwd")

#: dtype name -> its short form in labels and tolerance keys
SHORT = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}

#: Grids by mode. Values given on the command line override them. The simulator's keep each case to a few seconds on
#: a CPU (varlen: 2 sequences; paged: pages of 16, ragged rows only).
GRIDS = {
    "full": dict(
        seqlens=[1024, 2048, 4096, 8192, 16384], flash_configs=[(64, 48), (128, 32)], flash_batch=4,
        flash_dtypes=["float16"], decode_batch=8, decode_heads=32, decode_kv_heads=[32, 4], decode_headdim=128,
        decode_lengths=[4096, 8192, 16384, 32768, 65536], decode_dtypes=["float16"], linear_batch=4,
        linear_heads=8, linear_dim=64, linear_dtypes=["float16", "float32"], varlen_seqs=16, window=4096,
        page_sizes=[16, 64, 256], paged_rows=["full", "ragged"], reps=30, warmup=3, budget=2.0, rotate=3, min_reps=3,
    ),
    "quick": dict(
        seqlens=[1024, 4096], flash_configs=[(128, 32)], flash_batch=4, flash_dtypes=["float16"], decode_batch=8,
        decode_heads=32, decode_kv_heads=[32, 4], decode_headdim=128, decode_lengths=[4096, 16384],
        decode_dtypes=["float16"], linear_batch=4, linear_heads=8, linear_dim=64, linear_dtypes=["float16"],
        varlen_seqs=16, window=1024, page_sizes=[16, 64, 256], paged_rows=["full", "ragged"], reps=10, warmup=2,
        budget=0.5, rotate=2, min_reps=3,
    ),
    "simulator": dict(
        seqlens=[16, 32], flash_configs=[(16, 1)], flash_batch=1, flash_dtypes=["float32"], decode_batch=1,
        decode_heads=2, decode_kv_heads=[2, 1], decode_headdim=16, decode_lengths=[32, 64],
        decode_dtypes=["float32"], linear_batch=1, linear_heads=1, linear_dim=16, linear_dtypes=["float32"],
        varlen_seqs=2, window=8, page_sizes=[16], paged_rows=["ragged"], reps=2, warmup=0, budget=1.0, rotate=2,
        min_reps=1,
    ),
}


def size_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass
class Case:
    """One point of a sweep: shapes, dtype and the work it represents."""

    sweep: str
    config: str  # the table / subplot the case belongs to
    dtype: str
    size: int  # x axis: seqlen (flash, linear) or KV length (decode)
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int  # q/k feature dim (E for linear)
    value_dim: int  # v / out feature dim (M for linear)
    causal: bool = False
    flops: float = 0.0  # counted FLOPs for TFLOP/s (0: not reported)
    nbytes: float = 0.0  # counted bytes for GB/s (0: not reported)
    lengths: tuple = ()  # varlen: the packed sequences' lengths; paged: each row's valid keys (empty: full rows)
    window: int = 0  # window: the left size W of the causal window (W, 0); 0: no window

    @property
    def label(self) -> str:
        return f"{self.sweep} {SHORT[self.dtype]} {self.config} {size_label(self.size)}"

    def shapes(self) -> dict:
        """The random inputs of the case: q, k, v (and, for the backward, the output's gradient ``dout``); varlen's
        are packed, ``(total_tokens, heads, dim)``."""
        b, h, hk = self.batch, self.heads, self.kv_heads
        if self.sweep == "varlen":
            total = sum(self.lengths)
            return {"q": (total, h, self.head_dim), "k": (total, hk, self.head_dim), "v": (total, hk, self.value_dim)}
        shapes = {
            "q": (b, h, self.seqlen_q, self.head_dim),
            "k": (b, hk, self.seqlen_k, self.head_dim),
            "v": (b, hk, self.seqlen_k, self.value_dim),
        }
        if self.sweep in GRADIENT_SWEEPS:
            shapes["dout"] = self.out_shape()
        return shapes

    def out_shape(self) -> tuple:
        if self.sweep == "varlen":
            return (sum(self.lengths), self.heads, self.value_dim)
        return (self.batch, self.heads, self.seqlen_q, self.value_dim)

    def index_arrays(self) -> dict:
        """The integer inputs, as host int32 arrays: varlen's ``cu_seqlens`` (queries and keys alike), a ragged paged
        case's ``cache_seqlens``; ``make_inputs`` puts them where the random inputs live."""
        if self.sweep == "varlen":
            return {"cu_seqlens": cu_seqlens(self.lengths)}
        if self.sweep == "paged" and self.lengths:
            return {"cache_seqlens": np.asarray(self.lengths, dtype=np.int32)}
        return {}

    def input_bytes(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return itemsize * sum(math.prod(s) for s in self.shapes().values())


def flash_cases(o: Options):
    for dtype in o.flash_dtypes:
        for d, h in o.flash_configs:
            for causal in o.flash_causal:
                config = f"D={d} H={h} {'causal' if causal else 'non-causal'}"
                for n in o.seqlens:
                    flops = 4.0 * o.flash_batch * h * n * n * d * (0.5 if causal else 1.0)
                    yield Case("flash", config, dtype, n, o.flash_batch, h, h, n, n, d, d, causal, flops=flops)


def flash_backward_cases(o: Options):
    """The flash grid, timed as the backward (gradients of q, k, v from ``dout``, ``out`` and ``lse``): FLOPs are
    2.5 times the forward's (five products of the forward's size instead of two, as FlashAttention-2 counts)."""
    for case in flash_cases(o):
        case.sweep = "flash_bwd"
        case.flops *= 2.5
        yield case


def flash_forward_backward_cases(o: Options):
    """The flash grid, timed as one training step of the layer: the forward (with ``lse``) and then the backward
    on its output. FLOPs 3.5 times the forward's (2 + 5 products)."""
    for case in flash_cases(o):
        case.sweep = "flash_fwdbwd"
        case.flops *= 3.5
        yield case


def decode_cases(o: Options):
    h, d = o.decode_heads, o.decode_headdim
    for dtype in o.decode_dtypes:
        itemsize = 4 if dtype == "float32" else 2
        for hk in o.decode_kv_heads:
            if hk < 1 or h % hk:
                print(f"decode: kv heads {hk} do not divide heads {h}; skipped", flush=True)
                continue
            config = f"H={h} Hkv={hk} D={d}" + (f" (GQA {h // hk})" if hk != h else "")
            for lk in o.decode_lengths:
                b = o.decode_batch
                nbytes = itemsize * (2 * b * hk * lk * d + 2 * b * h * 1 * d)  # K, V read; q read, out written
                yield Case("decode", config, dtype, lk, b, h, hk, 1, lk, d, d, False, nbytes=nbytes)


def linear_cases(o: Options):
    h, e = o.linear_heads, o.linear_dim
    for dtype in o.linear_dtypes:
        config = f"H={h} E=M={e}"
        for n in o.seqlens:
            yield Case("linear", config, dtype, n, o.linear_batch, h, h, n, n, e, e, True)


def linear_gradient_cases(sweep: str):
    """The linear grid as the backward alone (``linear_bwd``) or forward and backward (``linear_fwdbwd``): ms only."""
    def cases(o: Options):
        for case in linear_cases(o):
            case.sweep = sweep
            yield case

    return cases


def varlen_cases(o: Options):
    """The flash grid's (headdim, heads), dtypes and masking, on ``--varlen-seqs`` packed sequences whose lengths are
    spread evenly around each ``--seqlens`` value N (``layouts.mixed_lengths``: (2i + 1) N / n, mean N; N is the x
    axis). FLOPs on the real tokens: 4 * H * D * sum(L_i^2), halved for causal."""
    n = o.varlen_seqs
    for dtype in o.flash_dtypes:
        for d, h in o.flash_configs:
            for causal in o.flash_causal:
                config = f"D={d} H={h} {n} seqs {'causal' if causal else 'non-causal'}"
                for mean in o.seqlens:
                    lengths = mixed_lengths(mean, n)
                    flops = 4.0 * h * d * sum(x * x for x in lengths) * (0.5 if causal else 1.0)
                    longest = max(lengths)
                    yield Case("varlen", config, dtype, mean, n, h, h, longest, longest, d, d, causal, flops=flops,
                               lengths=lengths)


def paged_cases(o: Options):
    """The decode grid with the cache in pages (the page size is the provider's): every row full (``full``) and, with
    ``ragged``, row b holding ``layouts.ragged_lengths`` keys (L/2 .. L, device ``cache_seqlens``). Bytes: K and V of
    the keys the rows hold, q read, out written."""
    base = list(decode_cases(o))
    for rows in o.paged_rows:
        for case in base:
            case = replace(case, sweep="paged")
            if rows == "ragged":
                itemsize = 4 if case.dtype == "float32" else 2
                lengths = ragged_lengths(case.seqlen_k, case.batch)
                keys = sum(lengths) * case.kv_heads * case.head_dim
                nbytes = itemsize * (2 * keys + 2 * case.batch * case.heads * case.head_dim)
                case = replace(case, config=case.config + " ragged", lengths=lengths, nbytes=nbytes)
            yield case


def window_cases(o: Options):
    """The flash grid's (headdim, heads) and dtypes, causal with the window (W, 0), W = ``--window``, on the sizes
    N > W (a window as long as the sequence is plain causal: those sizes are skipped). FLOPs on the pairs the window
    keeps: 4 * B * H * D * sum_i (min(i, W) + 1)."""
    w = o.window
    skipped = [n for n in o.seqlens if n <= w]
    if skipped:
        print(f"window: N <= W = {size_label(w)} skipped ({','.join(size_label(n) for n in skipped)}): the window "
              "covers the whole sequence", flush=True)
    for dtype in o.flash_dtypes:
        for d, h in o.flash_configs:
            config = f"D={d} H={h} W={size_label(w)}"
            for n in (n for n in o.seqlens if n > w):
                flops = 4.0 * o.flash_batch * h * d * window_pairs(n, w)
                yield Case("window", config, dtype, n, o.flash_batch, h, h, n, n, d, d, True, flops=flops, window=w)


def without_window(case: Case) -> Case:
    """A window case as the full causal call on the same inputs (the window sweep's reference point), FLOPs counted
    as the flash sweep counts causal: 4 * B * H * N * N * D / 2."""
    flops = 2.0 * case.batch * case.heads * case.seqlen_q * case.seqlen_k * case.head_dim
    return replace(case, window=0, flops=flops)


CASES = {"flash": flash_cases, "flash_bwd": flash_backward_cases, "flash_fwdbwd": flash_forward_backward_cases,
         "decode": decode_cases, "linear": linear_cases, "linear_bwd": linear_gradient_cases("linear_bwd"),
         "linear_fwdbwd": linear_gradient_cases("linear_fwdbwd"), "varlen": varlen_cases, "paged": paged_cases,
         "window": window_cases}


def make_inputs(env: Env, case: Case, seed: int) -> dict:
    """Normal random q, k, v (never zeros) and the case's integer arrays, in the environment's array library."""
    inputs = {name: env.randn(shape, case.dtype, seed * 3 + i) for i, (name, shape) in enumerate(case.shapes().items())}
    inputs.update({name: env.from_numpy(array) for name, array in case.index_arrays().items()})
    return inputs
