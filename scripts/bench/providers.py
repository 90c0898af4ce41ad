"""The provider registry: numba_attn's variants and the installed peers, one dict of ``Provider`` per sweep."""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import numba_attn

from . import peers
from .cases import SWEEPS, Case
from .environment import Env

OURS = "numba_attn"


@dataclass
class Prepared:
    """A provider bound to one input set: ``fn()`` is the timed call.

    ``post`` maps fn's result to ``(batch, heads, seqlen_q, dim)`` (outside the timed region); ``context`` is entered
    around the correctness call and around the whole timing loop (e.g. a forced SDPA backend).
    """

    fn: Callable[[], Any]
    post: Callable[[Any], Any] = lambda out: out
    context: Callable[[], Any] = contextlib.nullcontext


@dataclass
class Provider:
    """One implementation in the registry.

    ``prepare(case, inputs, env)`` turns an input set (q, k, v in the environment's library and numba_attn's layout)
    into a ``Prepared`` call; it runs outside the timed region, so layout changes made there are not timed.
    ``check(case, env)`` returns a reason to skip the case before anything is allocated (or None).
    ``tf32_dtypes``: input dtypes the provider computes with TF32 tensor cores (they get the ``tf32`` bound).
    """

    prepare: Callable[[Case, dict, Env], Prepared]
    ours: bool = False
    check: Callable[[Case, Env], str | None] = lambda case, env: None
    tf32_dtypes: tuple = ()
    note: str = ""
    graphs: bool = True  # its calls launch on the current torch stream, so a CUDA graph capture takes them


def _backend_variants(fn, names) -> list:
    """``[None]`` plus the backend names when ``fn`` takes ``backend=``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return [None]
    if "backend" not in params:
        return [None]
    return [None] + [str(n) for n in names]


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _float32_only(case: Case, env: Env) -> str | None:
    return None if case.dtype == "float32" else "tf32 applies to float32 inputs only"


def numba_attn_providers(sweep: str) -> dict:
    """``numba_attn`` (default dispatch), ``numba_attn[<backend>]`` for each backend the function offers, and
    ``numba_attn[tf32]`` (float32 inputs in one tf32 term) where it offers ``allow_tf32``."""
    fn = {"flash": numba_attn.flash_forward, "decode": numba_attn.flash_decode,
          "linear": numba_attn.causal_dot_product}[sweep]
    names = {"flash": getattr(numba_attn, "BACKENDS", ("simt", "mma")),
             "linear": getattr(numba_attn, "LINEAR_BACKENDS", ())}.get(sweep, ())
    variants = [(backend, {} if backend is None else {"backend": backend}) for backend in _backend_variants(fn, names)]
    if _takes(fn, "allow_tf32"):
        variants.append(("tf32", {"allow_tf32": True}))
    providers = {}
    for variant, kwargs in variants:

        def prepare(case, x, env, kwargs=kwargs):
            if sweep == "flash":
                return Prepared(lambda: fn(x["q"], x["k"], x["v"], causal=case.causal, **kwargs))
            return Prepared(lambda: fn(x["q"], x["k"], x["v"], **kwargs))

        name = OURS if variant is None else f"{OURS}[{variant}]"
        if variant == "tf32":
            providers[name] = Provider(prepare, ours=True, check=_float32_only, tf32_dtypes=("float32",),
                                       note=f"numba_attn.{fn.__name__}(allow_tf32=True)")
        else:
            providers[name] = Provider(prepare, ours=True, note=f"numba_attn.{fn.__name__}")
    return providers


def _torch_only(case: Case, env: Env) -> str | None:
    return None if env.kind == "torch" else f"needs torch tensors (arrays are {env.kind})"


def _naive_check(budget: float):
    def check(case: Case, env: Env) -> str | None:
        from .peers.naive import score_bytes

        need = score_bytes(case.batch, case.heads, case.seqlen_q, case.seqlen_k)
        if need > budget:
            return f"materialised scores need {need / 1e9:.1f} GB > --naive-mem-gb {budget / 1e9:.1f}"
        return None

    return check


def _all_checks(*checks):
    def check(case, env):
        for c in checks:
            reason = c(case, env)
            if reason:
                return reason
        return None

    return check


def _sdpa_providers(mod, opts: Options) -> dict:
    flash, decode = {}, {}
    for backend in mod.BACKENDS:
        context = mod.backend_context(backend)

        def prep_flash(case, x, env, context=context):
            return Prepared(lambda: mod.attention(x["q"], x["k"], x["v"], case.causal), context=context)

        def prep_decode(case, x, env, context=context):
            return Prepared(lambda: mod.decode(x["q"], x["k"], x["v"]), context=context)

        check = _torch_only
        if backend == "math":
            check = _all_checks(_torch_only, _naive_check(opts.naive_mem_bytes))
        flash[f"torch-sdpa-{backend}"] = Provider(prep_flash, check=check, note=f"SDPA, {backend} backend forced")
        if backend != "math":
            decode[f"torch-sdpa-{backend}"] = Provider(
                prep_decode, check=_torch_only, note=f"SDPA, {backend} backend forced, GQA heads packed as rows")
    return {"flash": flash, "decode": decode}


def _triton_providers(mod) -> dict:
    def check(case, env):
        if env.kind != "torch":
            return _torch_only(case, env)
        if case.head_dim not in mod.HEAD_DIMS:
            return f"headdim {case.head_dim} not in {mod.HEAD_DIMS}"
        return None

    def prep_flash(case, x, env):
        return Prepared(lambda: mod.flash_forward(x["q"], x["k"], x["v"], causal=case.causal))

    def prep_decode(case, x, env):
        return Prepared(lambda: mod.flash_forward(x["q"], x["k"], x["v"], causal=False))

    tf32 = ("float32",)
    note = "peers/triton_flash.py: FA2 forward, autotuned, no split-KV"
    return {
        "flash": {"triton-fa2": Provider(prep_flash, check=check, tf32_dtypes=tf32, note=note)},
        "decode": {"triton-fa2": Provider(prep_decode, check=check, tf32_dtypes=tf32, note=note)},
    }


def _cupy_naive_providers(naive, opts: Options) -> dict:
    import cupy

    def as_cupy(x):
        if type(x).__module__.startswith("torch"):
            if "bfloat16" in str(x.dtype):
                raise TypeError("CuPy has no bfloat16")
            return cupy.asarray(x.detach())
        return x

    def prep(case, x, env):
        q, k, v = (as_cupy(x[n]) for n in ("q", "k", "v"))
        bias = naive.causal_bias(cupy, case.seqlen_q, case.seqlen_k) if case.causal else None
        return Prepared(lambda: naive.attention(cupy, q, k, v, bias=bias))

    note = "materialised scores: cuBLAS in the input dtype, float32 softmax, P in the input dtype"
    provider = Provider(prep, check=_naive_check(opts.naive_mem_bytes), note=note, graphs=False)
    return {"flash": {"cupy-naive": provider}, "decode": {"cupy-naive": provider}}


def _fla_providers(mod) -> dict:
    linear = {}
    for name, kernel in mod.KERNELS.items():

        def prep(case, x, env, kernel=kernel):
            import torch

            q, k, v = (mod.to_fla_layout(x[n]) for n in ("q", "k", "v"))  # not timed: see fla_linear.py

            @contextlib.contextmanager
            def no_grad():
                with torch.no_grad():
                    yield

            return Prepared(lambda: kernel(q, k, v), post=mod.from_fla_layout, context=no_grad)

        tf32 = ("float32",) if name == "chunk" else ()
        note = f"fla {name}_linear_attn(scale=1, normalize=False), (B,T,H,D) inputs prepared outside timing"
        if mod.EINOPS_STUBBED:
            note += "; einops missing, stubbed for fla's import"
        linear[f"fla-{name}"] = Provider(prep, check=_torch_only, tf32_dtypes=tf32, note=note)
    return {"linear": linear}


def _numpy_naive_providers() -> dict:
    from .peers import naive

    def prep_attention(case, x, env):
        bias = naive.causal_bias(np, case.seqlen_q, case.seqlen_k) if case.causal else None
        return Prepared(lambda: naive.attention(np, x["q"], x["k"], x["v"], bias=bias))

    def prep_linear(case, x, env):
        return Prepared(lambda: naive.causal_dot_product(np, x["q"], x["k"], x["v"]))

    note = "NumPy on the host, materialised float32 scores"
    attention = Provider(prep_attention, note=note)
    return {"flash": {"numpy-naive": attention}, "decode": {"numpy-naive": attention},
            "linear": {"numpy-naive": Provider(prep_linear, note=note)}}


def build_registry(env: Env, opts: Options) -> tuple[dict, dict]:
    """``({sweep: {name: Provider}}, {peer: reason unavailable})`` for this environment; numba_attn first."""
    registry = {s: numba_attn_providers(s) for s in SWEEPS}
    unavailable = {}

    def merge(groups: dict):
        for sweep, providers in groups.items():
            registry[sweep].update(providers)

    if env.kind == "numpy":
        merge(_numpy_naive_providers())
        return registry, unavailable
    loaders = {
        "torch-sdpa": ("torch_sdpa", lambda m: _sdpa_providers(m, opts)),
        "triton-fa2": ("triton_flash", _triton_providers),
        "cupy-naive": ("naive", lambda m: _cupy_naive_providers(m, opts)),
        "fla": ("fla_linear", _fla_providers),
    }
    for label, (module, make) in loaders.items():
        mod, reason = peers.load(module)
        if mod is not None:
            try:
                merge(make(mod))
            except Exception as exc:  # noqa: BLE001
                reason = f"{type(exc).__name__}: {exc}"
        if reason:
            unavailable[label] = reason
    return registry, unavailable


def filter_registry(registry: dict, patterns: list | None) -> dict:
    if not patterns:
        return registry
    def keep(name: str) -> bool:
        return any(name == pat[1:] if pat.startswith("=") else pat in name for pat in patterns)

    return {s: {n: p for n, p in provs.items() if keep(n)} for s, provs in registry.items()}
