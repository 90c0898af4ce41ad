"""The chunked backend's entry: input kinds, and the choice between the register-state kernels (``mma``,
``mma_f32``) and the shared-memory-state kernel (``shared_state``) for a call."""
from __future__ import annotations

from . import mma, mma_f32, shared_state
from .arguments import FLOAT32, input_kind, sizes
from .chunk_plan import ChunkConfig
from .register_launch import MAX_E

#: mma.sync m16n8k8 tf32 and cvt.rna.tf32 need sm_80.
MIN_COMPUTE_CAPABILITY = (8, 0)
#: kernels of the causal dot product: "registers" (``mma`` / ``mma_f32``: the state in registers, cp.async staging,
#: float16 / bfloat16 MMAs for 16-bit inputs and tf32 for float32; the plain product, E <= 128) or "shared"
#: (``shared_state``: the state in shared memory; the layer, E up to 256); None takes "registers" where it applies
KERNELS = ("registers", "shared")


def _inputs(q, k, v, out, dtype):
    q, dtype = input_kind(q, dtype)
    return (q,) + tuple(input_kind(x, dtype)[0] for x in (k, v, out)) + (dtype,)


def launch_causal(q, k, v, out, stream, *, initial_state=None, final_state=None, normalise=False, eps=0.0,
                  tf32=False, dtype=None, segments=None, config: ChunkConfig | None = None, scratch=None,
                  kernel: str | None = None):
    """Causal dot product (``normalise=False``) or the causal layer with ``phi = elu + 1`` (``normalise=True``) on
    device views ``(batch, heads, seqlen, E | M)``, any strides.

    ``initial_state`` / ``final_state``: float32 ``(batch, heads, E, M)`` views (plain product only), read before /
    written after the sequence. ``tf32``: float32 inputs in one tf32 term instead of three. ``segments``: sequence
    blocks per (head, M tile), None for the plan's choice. ``kernel``: see ``KERNELS``; ``config`` tunes the
    shared-memory-state kernel only (the register-state kernels have their own).
    """
    bh, _, _, e, m = sizes(q, v)
    if bh == 0:
        return
    q, k, v, out, dtype = _inputs(q, k, v, out, dtype)
    if kernel not in (None,) + KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS} or None, got {kernel!r}")
    registers = mma_f32 if dtype == FLOAT32 else mma
    registers_ok = not normalise and registers.supports(e, m)
    if kernel == "registers" and not registers_ok:
        raise ValueError(f"kernel: 'registers' takes the plain causal product with E <= {MAX_E}")
    state = {"initial_state": initial_state, "final_state": final_state, "segments": segments, "scratch": scratch}
    if registers_ok and kernel != "shared":
        if dtype == FLOAT32:
            mma_f32.launch_causal(q, k, v, out, stream, terms=1 if tf32 else 3, **state)
        else:
            mma.launch_causal(q, k, v, out, stream, dtype=dtype, **state)
        return
    shared_state.launch_causal(q, k, v, out, stream, dtype=dtype, split=dtype == FLOAT32 and not tf32,
                               normalise=normalise, eps=eps, config=config, **state)


def launch_causal_walks(walks, stream, *, final_state=None, final_walk: int = -1, borrow: bool = False, tf32=False,
                        dtype=None, segments=None, scratch=None, split_3xtf32: bool = False) -> bool:
    """Several plain causal products in one pair of launches on the register-state kernels (``mma.
    launch_causal_walks``), where they apply: every walk ``(q, k, v, out, initial_state or None)`` of the same
    sizes, E <= ``MAX_E``. Returns False (nothing launched) otherwise. ``final_state`` / ``final_walk``, ``borrow``:
    ``register_launch.launch_walks``; ``tf32``, ``dtype``, ``segments``: as ``launch_causal``; ``split_3xtf32``:
    float32 in 3xTF32 walks in one launch per walk (``register_launch.launch_walks``'s ``split``)."""
    first = walks[0]
    shape = tuple(first[0].shape) + (first[2].shape[3],)
    if any(tuple(w[0].shape) + (w[2].shape[3],) != shape or tuple(w[1].shape) != tuple(w[0].shape)
           or tuple(w[2].shape[:3]) != tuple(w[0].shape[:3]) or tuple(w[3].shape) != tuple(w[2].shape)
           for w in walks):
        return False
    bh, _, _, e, m = sizes(first[0], first[2])
    if bh == 0 or not mma.supports(e, m):
        return False
    dtype = input_kind(first[0], dtype)[1]
    walks = [tuple(input_kind(x, dtype)[0] for x in w[:4]) + (w[4],) for w in walks]
    state = {"final_state": final_state, "final_walk": final_walk, "borrow": borrow, "segments": segments,
             "scratch": scratch}
    if dtype == FLOAT32:
        mma_f32.launch_causal_walks(walks, stream, terms=1 if tf32 else 3, split=split_3xtf32 and not tf32, **state)
    else:
        mma.launch_causal_walks(walks, stream, dtype=dtype, **state)
    return True


def launch_noncausal(q, k, v, out, eps, stream, *, tf32=False, dtype=None, segments=None,
                     config: ChunkConfig | None = None, scratch=None, layer: bool = True):
    """Non-causal linear attention with ``phi = elu + 1`` and the normaliser (``shared_state.launch_noncausal``;
    ``layer=False``: the plain product ``Q (K^T V)``); k, v may have a seqlen different from q's."""
    bh, seqlen_q, _, _, _ = sizes(q, v)
    if bh == 0 or seqlen_q == 0:
        return
    q, k, v, out, dtype = _inputs(q, k, v, out, dtype)
    shared_state.launch_noncausal(q, k, v, out, eps, stream, dtype=dtype, split=dtype == FLOAT32 and not tf32,
                                  segments=segments, config=config, scratch=scratch, layer=layer)
