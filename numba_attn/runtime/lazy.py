"""Modules imported on first use, so that ``import numba_attn`` loads only what a first forward call needs.

``import numba_attn`` on top of torch was 0.9-1.2 s on the H100 machines, most of it numba.cuda's own import and
then ours: the backward, decode and linear families (kernel sources, intrinsics, configurations) are a quarter of
it and most programs call one family. ``lazy_module`` stands in for such a module in the importing namespace;
``lazy_exports`` gives a package ``__getattr__`` (PEP 562) for names that live in a module loaded on first access.
"""
from __future__ import annotations

import importlib
import sys


class lazy_module:
    """A module imported on its first attribute read (thread-safe through the import lock); every read after that
    is one ``__getattr__`` call and a module attribute read, so module globals that change stay current."""

    __slots__ = ("_name", "_package", "_module")

    def __init__(self, name: str, package: str | None = None):
        self._name, self._package, self._module = name, package, None

    def __getattr__(self, attr: str):
        module = self._module
        if module is None:
            module = importlib.import_module(self._name, self._package)
            self._module = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r} ({'loaded' if self._module else 'not loaded'})>"


def lazy_exports(package: str, names: dict[str, str]):
    """A module ``__getattr__`` for ``package``: ``names`` maps an exported name to the module (relative to
    ``package``) that defines it, imported on the first read of the name; ``"module:other"`` exports that module's
    ``other`` under the name. The value is then set on ``package`` itself, so later reads are plain attribute reads
    (through ``__getattr__`` and ``import_module`` every ``numba_attn.linear_attention`` cost ~2-5 us, more than a
    tenth of a replayed call)."""

    def __getattr__(name: str):
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attr = where.partition(":")
        value = getattr(importlib.import_module(module, package), attr or name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
