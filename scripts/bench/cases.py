"""The sweep grids and their cases: shapes, dtypes, and the FLOPs or bytes each case counts for its rate."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: cli and environment import this module
    from .cli import Options
    from .environment import Env

SWEEPS = ("flash", "flash_bwd", "flash_fwdbwd", "decode", "linear", "linear_bwd", "linear_fwdbwd")
#: what ``--sweeps`` runs when not given (``--direction`` swaps or adds the ``_bwd`` / ``_fwdbwd`` sweeps of
#: ``flash`` and ``linear``)
DEFAULT_SWEEPS = ("flash", "decode", "linear")
#: sweeps whose inputs include the output's gradient ``dout`` and whose providers return ``dq``
GRADIENT_SWEEPS = ("flash_bwd", "flash_fwdbwd", "linear_bwd", "linear_fwdbwd")

#: dtype name -> its short form in labels and tolerance keys
SHORT = {"float16": "fp16", "float32": "fp32", "bfloat16": "bf16"}

#: Grids by mode. Values given on the command line override them.
GRIDS = {
    "full": dict(
        seqlens=[1024, 2048, 4096, 8192, 16384], flash_configs=[(64, 48), (128, 32)], flash_batch=4,
        flash_dtypes=["float16"], decode_batch=8, decode_heads=32, decode_kv_heads=[32, 4], decode_headdim=128,
        decode_lengths=[4096, 8192, 16384, 32768, 65536], decode_dtypes=["float16"], linear_batch=4,
        linear_heads=8, linear_dim=64, linear_dtypes=["float16", "float32"], reps=30, warmup=3, budget=2.0,
        rotate=3, min_reps=3,
    ),
    "quick": dict(
        seqlens=[1024, 4096], flash_configs=[(128, 32)], flash_batch=4, flash_dtypes=["float16"], decode_batch=8,
        decode_heads=32, decode_kv_heads=[32, 4], decode_headdim=128, decode_lengths=[4096, 16384],
        decode_dtypes=["float16"], linear_batch=4, linear_heads=8, linear_dim=64, linear_dtypes=["float16"],
        reps=10, warmup=2, budget=0.5, rotate=2, min_reps=3,
    ),
    "simulator": dict(
        seqlens=[16, 32], flash_configs=[(16, 1)], flash_batch=1, flash_dtypes=["float32"], decode_batch=1,
        decode_heads=2, decode_kv_heads=[2, 1], decode_headdim=16, decode_lengths=[32, 64],
        decode_dtypes=["float32"], linear_batch=1, linear_heads=1, linear_dim=16, linear_dtypes=["float32"],
        reps=2, warmup=0, budget=1.0, rotate=2, min_reps=1,
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

    @property
    def label(self) -> str:
        return f"{self.sweep} {SHORT[self.dtype]} {self.config} {size_label(self.size)}"

    def shapes(self) -> dict:
        """The random inputs of the case: q, k, v (and, for the backward, the output's gradient ``dout``)."""
        b, h, hk = self.batch, self.heads, self.kv_heads
        shapes = {
            "q": (b, h, self.seqlen_q, self.head_dim),
            "k": (b, hk, self.seqlen_k, self.head_dim),
            "v": (b, hk, self.seqlen_k, self.value_dim),
        }
        if self.sweep in GRADIENT_SWEEPS:
            shapes["dout"] = self.out_shape()
        return shapes

    def out_shape(self) -> tuple:
        return (self.batch, self.heads, self.seqlen_q, self.value_dim)

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


CASES = {"flash": flash_cases, "flash_bwd": flash_backward_cases, "flash_fwdbwd": flash_forward_backward_cases,
         "decode": decode_cases, "linear": linear_cases, "linear_bwd": linear_gradient_cases("linear_bwd"),
         "linear_fwdbwd": linear_gradient_cases("linear_fwdbwd")}


def make_inputs(env: Env, case: Case, seed: int) -> dict:
    """Normal random q, k, v (never zeros) in the environment's array library."""
    return {name: env.randn(shape, case.dtype, seed * 3 + i) for i, (name, shape) in enumerate(case.shapes().items())}
