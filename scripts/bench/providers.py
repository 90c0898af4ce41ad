"""The provider registry: numba_attn's variants and the installed peers, one dict of ``Provider`` per sweep.

The peers' own providers come from their plug-in modules in ``peers/``; the checks they share are here.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numba_attn

from . import peers
from .cases import SWEEPS, Case
from .environment import Env

if TYPE_CHECKING:
    from .cli import Options

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
    ``baseline``: the sweep's own reference point (window: the full causal call; paged: the dense cache), neither a
    peer nor compared with them: the other numba_attn providers' rates are divided by its rate.
    ``variant(case)``: the case it computes when that is not the swept one (window's full causal call): its
    reference, FLOPs and bytes are that case's; its row stays in the swept case's table.
    """

    prepare: Callable[[Case, dict, Env], Prepared]
    ours: bool = False
    check: Callable[[Case, Env], str | None] = lambda case, env: None
    tf32_dtypes: tuple = ()
    note: str = ""
    graphs: bool = True  # its calls launch on the current torch stream, so a CUDA graph capture takes them
    baseline: bool = False
    variant: Callable[[Case], Case] | None = None


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


def _backward_backends() -> tuple:
    try:
        from numba_attn.backward.dispatch import BACKENDS
    except ImportError:
        return ()
    return BACKENDS


def _with_grad(x: dict, env: Env) -> tuple:
    """q, k, v as leaves that require grad (torch: the timed call goes through autograd, as in training), or as
    they are for the other array libraries (the forward and backward functions called one after the other)."""
    if env.kind != "torch":
        return x["q"], x["k"], x["v"]
    return tuple(x[n].detach().requires_grad_() for n in ("q", "k", "v"))


def _forward_backward(case: Case, x: dict, env: Env, linear: bool):
    """The timed call of ``flash_fwdbwd`` / ``linear_fwdbwd``: forward, then the gradients of q, k, v from ``dout``
    (torch: ``torch.autograd.grad`` through the differentiable forward; otherwise the two public functions)."""
    q, k, v = _with_grad(x, env)
    dout = x["dout"]
    if env.kind == "torch":
        import torch

        forward = numba_attn.causal_dot_product if linear else (
            lambda q, k, v: numba_attn.flash_forward(q, k, v, causal=case.causal))
        return lambda: torch.autograd.grad(forward(q, k, v), (q, k, v), dout)
    if linear:
        return lambda: (numba_attn.causal_dot_product(q, k, v), numba_attn.causal_dot_product_backward(
            dout, q, k, v))[1]

    def step():
        out, lse = numba_attn.flash_forward(q, k, v, causal=case.causal, return_lse=True)
        return numba_attn.flash_backward(dout, q, k, v, out, lse, causal=case.causal)

    return step


def numba_attn_providers(sweep: str) -> dict:
    """``numba_attn`` (default dispatch), ``numba_attn[<backend>]`` for each backend the function offers, and
    ``numba_attn[tf32]`` (float32 inputs in one tf32 term) where it offers ``allow_tf32`` (``numba_attn[tf32x1]`` where
    "tf32" is a backend's name: the backward's). The backwards (``flash_bwd``, ``linear_bwd``) time
    ``flash_backward`` on the ``out`` and ``lse`` of one ``flash_forward`` call made when the provider is prepared
    (not timed), and ``causal_dot_product_backward``; they return ``dq`` for the check. The forward-and-backward
    sweeps (``*_fwdbwd``) time the default dispatch only, through autograd for torch tensors."""
    fn = {"flash": numba_attn.flash_forward, "flash_bwd": numba_attn.flash_backward,
          "flash_fwdbwd": numba_attn.flash_forward, "decode": numba_attn.flash_decode,
          "linear": numba_attn.causal_dot_product, "linear_bwd": numba_attn.causal_dot_product_backward,
          "linear_fwdbwd": numba_attn.causal_dot_product}[sweep]
    if sweep.endswith("_fwdbwd"):
        def prepare_step(case, x, env):
            return Prepared(_forward_backward(case, x, env, linear=sweep == "linear_fwdbwd"),
                            post=lambda grads: grads[0])

        note = f"numba_attn.{fn.__name__} + its backward (torch: through autograd)"
        return {OURS: Provider(prepare_step, ours=True, note=note)}
    names = {"flash": getattr(numba_attn, "BACKENDS", ("simt", "mma")), "flash_bwd": _backward_backends(),
             "linear": getattr(numba_attn, "LINEAR_BACKENDS", ()),
             "linear_bwd": getattr(numba_attn, "LINEAR_BACKENDS", ())}.get(sweep, ())
    variants = [(backend, {} if backend is None else {"backend": backend}) for backend in _backend_variants(fn, names)]
    # (the backward has a backend named "tf32" -- float32 as 3xTF32 --: its one-term variant is "tf32x1")
    tf32_variant = "tf32x1" if "tf32" in names else "tf32"
    if _takes(fn, "allow_tf32"):
        variants.append((tf32_variant, {"allow_tf32": True}))
    providers = {}
    for variant, kwargs in variants:

        def prepare(case, x, env, kwargs=kwargs):
            if sweep == "flash":
                return Prepared(lambda: fn(x["q"], x["k"], x["v"], causal=case.causal, **kwargs))
            if sweep == "flash_bwd":
                out, lse = numba_attn.flash_forward(x["q"], x["k"], x["v"], causal=case.causal, return_lse=True)
                return Prepared(lambda: fn(x["dout"], x["q"], x["k"], x["v"], out, lse, causal=case.causal, **kwargs),
                                post=lambda grads: grads[0])
            if sweep == "linear_bwd":
                return Prepared(lambda: fn(x["dout"], x["q"], x["k"], x["v"], **kwargs), post=lambda grads: grads[0])
            return Prepared(lambda: fn(x["q"], x["k"], x["v"], **kwargs))

        name = OURS if variant is None else f"{OURS}[{variant}]"
        if variant == tf32_variant:
            providers[name] = Provider(prepare, ours=True, check=_float32_only, tf32_dtypes=("float32",),
                                       note=f"numba_attn.{fn.__name__}(allow_tf32=True)")
        else:
            providers[name] = Provider(prepare, ours=True, note=f"numba_attn.{fn.__name__}")
    return providers


def torch_only(case: Case, env: Env) -> str | None:
    return None if env.kind == "torch" else f"needs torch tensors (arrays are {env.kind})"


def naive_check(budget: float):
    def check(case: Case, env: Env) -> str | None:
        from .peers.naive import score_bytes

        need = score_bytes(case.batch, case.heads, case.seqlen_q, case.seqlen_k)
        if need > budget:
            return f"materialised scores need {need / 1e9:.1f} GB > --naive-mem-gb {budget / 1e9:.1f}"
        return None

    return check


def all_checks(*checks):
    def check(case, env):
        for c in checks:
            reason = c(case, env)
            if reason:
                return reason
        return None

    return check


def build_registry(env: Env, opts: Options) -> tuple[dict, dict]:
    """``({sweep: {name: Provider}}, {peer: reason unavailable})`` for this environment; numba_attn first, then each
    peer plug-in's ``providers(opts)`` in ``peers.plugins()`` order."""
    from . import batches  # (it builds on this module)

    registry = {s: numba_attn_providers(s) for s in SWEEPS if s not in batches.SWEEPS}
    registry.update(batches.providers(opts))
    unavailable = {}

    def merge(groups: dict):
        for sweep, providers in groups.items():
            registry[sweep].update(providers)

    if env.kind == "numpy":  # the simulator: no GPU library to load, only the host NumPy peer
        from .peers import naive

        merge(naive.numpy_providers())
        gpu_peers = ", ".join(label for label in peers.plugins() if label != "cupy-naive")
        unavailable["GPU peers"] = f"not run under the simulator ({gpu_peers})"
        return registry, unavailable
    for label, module in peers.plugins().items():
        mod, reason = peers.load(module)
        if mod is not None:
            try:
                merge(mod.providers(opts))
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
