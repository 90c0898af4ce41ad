"""The arguments every forward and decode kernel's ``launch`` takes, as one typed object instead of a tuple."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionArgs:
    """One attention call on the device: batched views ``(batch, heads, seqlen, headdim)`` of ``q``, ``k``, ``v``
    and ``out``, the ``(batch, heads, seqlen_q)`` lse view (a placeholder the kernels never write when
    ``write_lse`` is False), the score scale and the mask: ``causal`` and a checked sliding ``window`` (None or
    ``(left, right)``), and a checked ``softcap`` (None or ``c > 0``); the forward kernels take the last two as
    ``variant_options``, ``launch_args`` leaves them out."""

    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    write_lse: bool
    sm_scale: float
    causal: bool
    window: tuple | None = None
    softcap: float | None = None

    def __post_init__(self):
        if type(self.write_lse) is not bool or type(self.causal) is not bool:
            raise TypeError("write_lse, causal: expected bool")
        if type(self.sm_scale) is not float:
            raise TypeError(f"sm_scale: expected a float, got {type(self.sm_scale).__name__}")
        if self.window is not None and type(self.window) is not tuple:
            raise TypeError(f"window: expected None or a checked (left, right) tuple, got {self.window!r}")
        if self.softcap is not None and type(self.softcap) is not float:
            raise TypeError(f"softcap: expected None or a checked float, got {self.softcap!r}")

    def launch_args(self) -> tuple:
        """In the order of the kernels' ``launch(q, k, v, out, lse, write_lse, sm_scale, causal, stream, ...)``."""
        return (self.q, self.k, self.v, self.out, self.lse, self.write_lse, self.sm_scale, self.causal)

    def variant_options(self) -> dict:
        """The forward kernels' ``launch`` keywords of the compile-time variant: the window and the cap (each only
        when there is one, so that launches without keep their calls)."""
        options = {}
        if self.window is not None:
            options["window"] = self.window
        if self.softcap is not None:
            options["softcap"] = self.softcap
        return options

    def writing(self, out, lse, write_lse: bool) -> "AttentionArgs":
        """The same inputs into other outputs (the autotuner times candidates into scratch)."""
        return dataclasses.replace(self, out=out, lse=lse, write_lse=write_lse)


@dataclass(frozen=True)
class BackwardArgs:
    """One backward call on the device: batched views ``(batch, heads, seqlen, headdim)`` of the inputs ``dout``,
    ``q``, ``k``, ``v``, ``out`` and the gradients ``dq``, ``dk``, ``dv`` it writes, the forward's ``(batch, heads,
    seqlen_q)`` natural-log ``lse``, the score scale, the mask (``causal`` and a checked ``window``) and a checked
    ``softcap``, as ``AttentionArgs``."""

    dout: Any
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    dq: Any
    dk: Any
    dv: Any
    sm_scale: float
    causal: bool
    window: tuple | None = None
    softcap: float | None = None

    def __post_init__(self):
        if type(self.causal) is not bool:
            raise TypeError("causal: expected bool")
        if type(self.sm_scale) is not float:
            raise TypeError(f"sm_scale: expected a float, got {type(self.sm_scale).__name__}")
        if self.window is not None and type(self.window) is not tuple:
            raise TypeError(f"window: expected None or a checked (left, right) tuple, got {self.window!r}")
        if self.softcap is not None and type(self.softcap) is not float:
            raise TypeError(f"softcap: expected None or a checked float, got {self.softcap!r}")

    def variant_options(self) -> dict:
        """The backward kernels' ``launch`` keywords of the compile-time variant (as ``AttentionArgs``')."""
        return AttentionArgs.variant_options(self)
