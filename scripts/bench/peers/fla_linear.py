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
    """``fla-chunk`` and ``fla-fused-recurrent`` for the linear sweep (the chunked kernel runs float32 as TF32); for
    ``linear_bwd`` the backward of a forward recorded when prepared (``torch.autograd.grad`` with the graph
    retained), for ``linear_fwdbwd`` forward and backward in one call; both return ``dq`` for the check."""
    from ..providers import Prepared, Provider, torch_only  # the sweep's, not the wrappers'

    groups = {"linear": {}, "linear_bwd": {}, "linear_fwdbwd": {}}
    for name, kernel in KERNELS.items():

        def prep(case, x, env, kernel=kernel):
            q, k, v = (to_fla_layout(x[n]) for n in ("q", "k", "v"))  # not timed: see the module docstring

            @contextlib.contextmanager
            def no_grad():
                with torch.no_grad():
                    yield

            return Prepared(lambda: kernel(q, k, v), post=from_fla_layout, context=no_grad)

        def prep_backward(case, x, env, kernel=kernel):
            q, k, v, dout = (to_fla_layout(x[n]) for n in ("q", "k", "v", "dout"))
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # the shared inputs stay untouched
            out = kernel(q, k, v)
            return Prepared(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                            post=lambda grads: from_fla_layout(grads[0]))

        def prep_step(case, x, env, kernel=kernel):
            q, k, v, dout = (to_fla_layout(x[n]) for n in ("q", "k", "v", "dout"))
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            return Prepared(lambda: torch.autograd.grad(kernel(q, k, v), (q, k, v), dout),
                            post=lambda grads: from_fla_layout(grads[0]))

        tf32 = ("float32",) if name == "chunk" else ()
        layout = "(B,T,H,D) inputs prepared outside timing"
        if EINOPS_STUBBED:
            layout += "; einops missing, stubbed for fla's import"
        label = f"fla {name}_linear_attn(scale=1, normalize=False)"
        for sweep, prepare, what in (("linear", prep, ""), ("linear_bwd", prep_backward, " backward"),
                                     ("linear_fwdbwd", prep_step, " forward + backward")):
            groups[sweep][f"fla-{name}"] = Provider(prepare, check=torch_only, tf32_dtypes=tf32,
                                                    note=f"{label}{what}, {layout}")
    return groups
