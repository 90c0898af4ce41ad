"""flash-linear-attention (fla) kernels as peers of ``numba_attn.causal_dot_product``.

``numba_attn.causal_dot_product(q, k, v)`` computes ``out_i = sum_{j <= i} (q_i . k_j) v_j`` with no scale and no
normaliser. fla's ``chunk_linear_attn`` / ``fused_recurrent_linear_attn`` compute the same with ``scale=1.0`` and
``normalize=False`` (their defaults are ``scale = 1/sqrt(K)`` and, for the chunked kernel, ``normalize=True``, so
both are passed explicitly). They return ``(o, final_state)``; ``o`` is what we compare.

Layout: fla 0.6 takes ``(batch, seqlen, heads, dim)`` (its ``head_first`` option is gone), numba_attn
``(batch, heads, seqlen, dim)``. :func:`to_fla_layout` makes contiguous ``(B, T, H, D)`` copies once, outside the
timed region (an application using fla keeps its tensors in fla's layout), so only the kernel call is timed;
:func:`from_fla_layout` turns the output back, again outside the timed region, for the correctness check.
"""
from __future__ import annotations

import contextlib
import os
import sys
import types

import torch  # first: fla needs torch, and a missing torch fails this import clearly


def _stub_einops_if_missing() -> bool:
    """Let ``fla`` import without einops; returns True if a stub was installed.

    ``import fla.ops`` pulls in every fla kernel family and some of them do ``from einops import ...`` at import
    time, but the linear-attention kernels timed here never call einops. Where einops is not installed (a GPU
    machine without a package index that got fla-core with ``--no-deps``) a stub whose functions raise takes its
    place, so that a real use of einops would still fail loudly.
    """
    try:
        import einops  # noqa: F401

        return False
    except ImportError:
        pass

    def missing(*args, **kwargs):
        raise ImportError("einops is not installed (a stub stands in so that fla can be imported)")

    stub = types.ModuleType("einops")
    for name in ("rearrange", "reduce", "repeat", "einsum", "pack", "unpack", "parse_shape"):
        setattr(stub, name, missing)
    sys.modules["einops"] = stub
    return True


EINOPS_STUBBED = _stub_einops_if_missing()

from fla.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn  # noqa: E402

__all__ = ["KERNELS", "to_fla_layout", "from_fla_layout", "EINOPS_STUBBED", "providers"]


def _chunk(q, k, v):
    return chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0]


def _fused_recurrent(q, k, v):
    return fused_recurrent_linear_attn(q, k, v, scale=1.0, normalize=False)[0]


#: provider suffix -> callable on (B, T, H, D) tensors returning o (B, T, H, M)
KERNELS = {"chunk": _chunk, "fused-recurrent": _fused_recurrent}

#: fla's ``tl.dot`` calls name no precision, so Triton's default applies to float32 operands: TF32 (about 1e-3
#: relative error). ``fla-chunk[tf32x3]`` runs the same kernels with Triton's 3xTF32 products instead: float32-accurate,
#: the precision of our default float32 path, so the two are compared like for like.
F32_PRECISION = "tf32x3"


def _forget_compiled_fla_kernels() -> None:
    """Drop the in-memory compiled kernels of fla's Triton functions: Triton reads ``TRITON_F32_DEFAULT`` when it
    compiles, but its in-memory cache key does not hold it, so a process that ran fla in TF32 would keep doing so."""
    seen = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in list(vars(module).values()):
            fn = value
            while fn is not None and id(fn) not in seen:  # Autotuner / Heuristics wrap a JITFunction in .fn
                seen.add(id(fn))
                caches = getattr(fn, "device_caches", None)
                if caches is not None and hasattr(caches, "clear"):
                    caches.clear()
                fn = getattr(fn, "fn", None)


@contextlib.contextmanager
def triton_f32_default(precision: str | None):
    """fla's kernels compiled with ``TRITON_F32_DEFAULT=precision`` inside (their own on-disk cache directory, so
    that no TF32 binary is taken from disk), TF32 again outside; None: nothing changed."""
    if precision is None:
        yield
        return
    saved = {key: os.environ.get(key) for key in ("TRITON_F32_DEFAULT", "TRITON_CACHE_DIR")}
    cache = saved["TRITON_CACHE_DIR"] or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    os.environ["TRITON_F32_DEFAULT"] = precision
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, f"f32-{precision}")
    _forget_compiled_fla_kernels()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _forget_compiled_fla_kernels()


def to_fla_layout(x):
    """(batch, heads, seqlen, dim) -> contiguous (batch, seqlen, heads, dim)."""
    return x.transpose(1, 2).contiguous()


def from_fla_layout(x):
    """(batch, seqlen, heads, dim) -> (batch, heads, seqlen, dim) view."""
    return x.transpose(1, 2)


def version() -> str:
    try:
        from importlib.metadata import version as _version

        return _version("fla-core")
    except Exception:  # noqa: BLE001
        import fla

        return getattr(fla, "__version__", "?")



# --------------------------------------------------------------------------------------------------------------------
# The sweep's plug-in hook (bench/peers/__init__.py)
# --------------------------------------------------------------------------------------------------------------------
def providers(opts) -> dict:
    """``fla-chunk`` and ``fla-fused-recurrent`` for the linear sweep (the chunked kernel runs float32 as TF32), and
    ``fla-chunk[tf32x3]`` (float32 inputs only: the chunked kernel with 3xTF32 products, ``F32_PRECISION``); for
    ``linear_bwd`` the backward of a forward recorded when prepared (``torch.autograd.grad`` with the graph
    retained), for ``linear_fwdbwd`` forward and backward in one call; both return ``dq`` for the check."""
    from ..providers import Prepared, Provider, torch_only  # the sweep's, not the wrappers'

    groups = {"linear": {}, "linear_bwd": {}, "linear_fwdbwd": {}}
    variants = [(name, kernel, None) for name, kernel in KERNELS.items()]
    variants.append((f"chunk[{F32_PRECISION}]", KERNELS["chunk"], F32_PRECISION))
    for name, kernel, precision in variants:

        def context(precision=precision, grad=True):
            @contextlib.contextmanager
            def scope():
                with triton_f32_default(precision), (contextlib.nullcontext() if grad else torch.no_grad()):
                    yield

            return scope

        def prep(case, x, env, kernel=kernel, context=context):
            q, k, v = (to_fla_layout(x[n]) for n in ("q", "k", "v"))  # not timed: see the module docstring
            return Prepared(lambda: kernel(q, k, v), post=from_fla_layout, context=context(grad=False))

        def prep_backward(case, x, env, kernel=kernel, context=context):
            q, k, v, dout = (to_fla_layout(x[n]) for n in ("q", "k", "v", "dout"))
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # the shared inputs stay untouched
            with context()():
                out = kernel(q, k, v)
            return Prepared(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                            post=lambda grads: from_fla_layout(grads[0]), context=context())

        def prep_step(case, x, env, kernel=kernel, context=context):
            q, k, v, dout = (to_fla_layout(x[n]) for n in ("q", "k", "v", "dout"))
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            return Prepared(lambda: torch.autograd.grad(kernel(q, k, v), (q, k, v), dout),
                            post=lambda grads: from_fla_layout(grads[0]), context=context())

        # float32 on TF32 tensor cores gets the tf32 bound; the 3xTF32 variant is held to float32's
        tf32 = ("float32",) if name == "chunk" else ()
        check = torch_only if precision is None else _float32_torch
        layout = "(B,T,H,D) inputs prepared outside timing"
        if EINOPS_STUBBED:
            layout += "; einops missing, stubbed for fla's import"
        base = name.split("[")[0]
        label = f"fla {base}_linear_attn(scale=1, normalize=False)"
        if precision is not None:
            label += f" with TRITON_F32_DEFAULT={precision} (float32 products in {precision})"
        for sweep, prepare, what in (("linear", prep, ""), ("linear_bwd", prep_backward, " backward"),
                                     ("linear_fwdbwd", prep_step, " forward + backward")):
            groups[sweep][f"fla-{name}"] = Provider(prepare, check=check, tf32_dtypes=tf32,
                                                    note=f"{label}{what}, {layout}")
    return groups


def _float32_torch(case, env):
    from ..providers import torch_only

    if case.dtype != "float32":
        return "the 3xTF32 variant applies to float32 inputs only"
    return torch_only(case, env)
