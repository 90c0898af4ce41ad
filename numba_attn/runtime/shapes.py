"""Shape checks shared by the public functions: ``(batch, heads, seqlen, headdim)`` or ``(seqlen, headdim)`` inputs,
grouped-query heads, and the shapes of the outputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .arrays import _placement

#: Head dims the kernels accept (the tiles hold at most 256 columns).
MAX_HEAD_DIM = 256


def check_array(name: str, x: Any) -> None:
    """A TypeError naming the argument when ``x`` is not an array of a kind the package takes."""
    _placement(name, x)


def check_rank(name: str, x: Any) -> int:
    check_array(name, x)
    ndim = len(x.shape)
    if ndim not in (2, 4):
        raise ValueError(f"{name}: expected shape (batch, heads, seqlen, headdim) or (seqlen, headdim), got {tuple(x.shape)}")
    return ndim


@dataclass
class AttentionShape:
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    ndim: int  # 2 or 4, the rank the caller used

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    def out_shape(self, last: int | None = None) -> tuple:
        last = self.head_dim if last is None else last
        if self.ndim == 2:
            return (self.seqlen_q, last)
        return (self.batch, self.heads, self.seqlen_q, last)

    def kv_shape(self) -> tuple:
        """The shape of k and v (and of their gradients)."""
        if self.ndim == 2:
            return (self.seqlen_k, self.head_dim)
        return (self.batch, self.kv_heads, self.seqlen_k, self.head_dim)

    def lse_shape(self) -> tuple:
        return (self.seqlen_q,) if self.ndim == 2 else (self.batch, self.heads, self.seqlen_q)


def _batched_shapes(q: Any, k: Any, v: Any) -> tuple[tuple, tuple, tuple, int]:
    """The shapes of q, k, v as ``(batch, heads, seqlen, dim)`` and the rank the caller used (2 or 4, the same for
    all three)."""
    ranks = {name: check_rank(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(ranks.values())) != 1:
        raise ValueError(f"q, k, v: must all have the same rank, got {ranks['q']}, {ranks['k']}, {ranks['v']}")
    qs, ks, vs = (tuple(x.shape) for x in (q, k, v))
    if ranks["q"] == 2:
        qs, ks, vs = (1, 1) + qs, (1, 1) + ks, (1, 1) + vs
    return qs, ks, vs, ranks["q"]


def attention_shape(q: Any, k: Any, v: Any) -> AttentionShape:
    """Check q, k, v of ``(batch, heads, seqlen, headdim)`` (k/v may have fewer heads: GQA) or ``(seqlen, headdim)``."""
    qs, ks, vs, ndim = _batched_shapes(q, k, v)
    b, h, lq, d = qs
    if ks[0] != b or vs[0] != b:
        raise ValueError(f"k, v: batch must match q's batch {b}, got k {ks[0]} and v {vs[0]}")
    if ks[1] != vs[1]:
        raise ValueError(f"k, v: must have the same number of heads, got {ks[1]} and {vs[1]}")
    hk = ks[1]
    if hk < 1 or h % hk != 0:
        raise ValueError(f"k: number of heads {hk} must divide q's {h} (grouped-query attention)")
    if ks[2] != vs[2]:
        raise ValueError(f"v: seqlen must equal k's seqlen {ks[2]}, got {vs[2]}")
    if not (1 <= d <= MAX_HEAD_DIM):
        raise ValueError(f"q: headdim must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if ks[3] != d:
        raise ValueError(f"k: headdim must equal q's headdim {d}, got {ks[3]}")
    if vs[3] != d:
        raise ValueError(f"v: headdim must equal q's headdim {d}, got {vs[3]}")
    return AttentionShape(b, h, hk, lq, ks[2], d, ndim)


@dataclass
class LinearShape:
    batch: int
    heads: int
    seqlen: int  # of q (and of the output)
    key_dim: int  # E
    value_dim: int  # M
    ndim: int
    seqlen_k: int = -1  # of k and v; -1: seqlen

    def __post_init__(self):
        if self.seqlen_k < 0:
            self.seqlen_k = self.seqlen

    def out_shape(self) -> tuple:
        if self.ndim == 2:
            return (self.seqlen, self.value_dim)
        return (self.batch, self.heads, self.seqlen, self.value_dim)

    def state_shape(self) -> tuple:
        """Shape of a state ``sum k_j v_j^T``: ``(batch, heads, E, M)``, or ``(E, M)`` for unbatched inputs."""
        if self.ndim == 2:
            return (self.key_dim, self.value_dim)
        return (self.batch, self.heads, self.key_dim, self.value_dim)


def linear_shape(q: Any, k: Any, v: Any, max_dim: int = MAX_HEAD_DIM, same_length: bool = True) -> LinearShape:
    """Check q, k ``(batch, heads, seqlen, E)`` and v ``(batch, heads, seqlen, M)`` (or the same without batch, heads).

    ``same_length=False`` (non-causal linear attention): k and v may have a seqlen of their own, the same for both.
    """
    qs, ks, vs, ndim = _batched_shapes(q, k, v)
    if same_length:
        if ks[:3] != qs[:3]:
            raise ValueError(f"k: (batch, heads, seqlen) must equal q's {qs[:3]}, got {ks[:3]}")
        if vs[:3] != qs[:3]:
            raise ValueError(f"v: (batch, heads, seqlen) must equal q's {qs[:3]}, got {vs[:3]}")
    else:
        if ks[:2] != qs[:2]:
            raise ValueError(f"k: (batch, heads) must equal q's {qs[:2]}, got {ks[:2]}")
        if vs[:3] != ks[:3]:
            if vs[:3] == qs[:3]:  # k is the odd one out
                raise ValueError(f"k: (batch, heads, seqlen) must equal v's {vs[:3]}, got {ks[:3]}")
            raise ValueError(f"v: (batch, heads, seqlen) must equal k's {ks[:3]}, got {vs[:3]}")
    if ks[3] != qs[3]:
        raise ValueError(f"k: feature dim E must equal q's {qs[3]}, got {ks[3]}")
    if not (1 <= qs[3] <= max_dim):
        raise ValueError(f"q: feature dim E must be between 1 and {max_dim}, got {qs[3]}")
    if not (1 <= vs[3] <= max_dim):
        raise ValueError(f"v: value dim M must be between 1 and {max_dim}, got {vs[3]}")
    return LinearShape(qs[0], qs[1], qs[2], qs[3], vs[3], ndim, ks[2])
