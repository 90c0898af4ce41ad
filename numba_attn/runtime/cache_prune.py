"""Keep the on-disk kernel cache under a size cap: least recently used files go first.

Every edit of the package's source (or a new Numba, toolkit or driver) gives every kernel a new key, so without a cap
the folder only grows (0.1-1.6 MB per kernel). After a process saves its first kernel, the folder is scanned once:
if its ``.nbk`` files exceed ``NUMBA_ATTN_KERNEL_CACHE_MAX_MB`` (default 1024; 0 turns pruning off), the files used
longest ago (modification time; a hit touches its file) are removed until the folder is under 80 % of the cap.
Leftover temporary files of interrupted writes older than an hour go too. Removal races with other processes are
harmless: a file gone is a miss, compiled and written again.
"""
from __future__ import annotations

import os
import threading
import time

MAX_MB_ENV = "NUMBA_ATTN_KERNEL_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
#: what is left after a prune, as a share of the cap (so that the next save does not prune again at once)
KEEP_SHARE = 0.8
STALE_TEMPORARY_S = 3600

_LOCK = threading.Lock()
_DONE = set()  # folders pruned by this process


def max_bytes() -> int:
    """The cap in bytes; 0 when pruning is off. A value that is not a number is an error naming the variable."""
    raw = os.environ.get(MAX_MB_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_MB << 20
    try:
        megabytes = float(raw)
    except ValueError:
        raise ValueError(f"{MAX_MB_ENV}: expected a number of megabytes, got {raw!r}") from None
    if megabytes < 0:
        raise ValueError(f"{MAX_MB_ENV}: expected a number of megabytes >= 0, got {raw!r}")
    return int(megabytes * (1 << 20))


def touch(path: str) -> None:
    """Mark a file as used now (a hit), so that pruning keeps it longest."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune_once(folder: str) -> int:
    """Prune ``folder`` unless this process did already; the number of files removed."""
    with _LOCK:
        if folder in _DONE:
            return 0
        _DONE.add(folder)
    return prune(folder, max_bytes())


def prune(folder: str, cap: int, now: float | None = None) -> int:
    """Remove the least recently used ``.nbk`` files of ``folder`` until they take at most ``KEEP_SHARE * cap``
    bytes (nothing when they are within ``cap``, or ``cap`` is 0), and temporary files older than an hour."""
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    files, removed = [], 0
    for entry in entries:
        try:
            stat = entry.stat()
        except OSError:
            continue
        if entry.name.startswith(".tmp-"):  # a write in progress (or an interrupted one, once old)
            if now - stat.st_mtime > STALE_TEMPORARY_S:
                removed += _remove(entry.path)
        elif entry.name.endswith(".nbk") and entry.is_file():
            files.append((stat.st_mtime, stat.st_size, entry.path))
    total = sum(size for _, size, _ in files)
    if cap <= 0 or total <= cap:
        return removed
    for _, size, path in sorted(files):
        if total <= KEEP_SHARE * cap:
            break
        if _remove(path):
            removed += 1
            total -= size
    return removed


def _remove(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0
