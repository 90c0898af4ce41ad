"""Dump the forward kernels' sm_90 PTX for every variant set, offline, and compare two dumps kernel by kernel.

    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/ptx_diff.py dump DIR [--rev REV | --tree PATH]
        [--kernels wgmma,fp8] [--sets plain,window] [--jobs 2]
    python scripts/ptx_diff.py compare DIR_BEFORE DIR_AFTER

``dump`` runs ``scripts/forward_ptx.py`` of a tree (this checkout, ``--tree PATH``, or git revision ``--rev REV``
exported to a temporary folder) with that tree's ``numba_attn``, once per variant set: ``plain`` (no window, no
soft-capping, dense batches), ``window`` (a 128-key left window), ``softcap`` (cap 30), ``window_softcap`` and
``varlen`` (packed sequences), each into ``DIR/<set>/``. A refactor that should not change the generated code is
dumped before (``--rev`` of the base) and after (this checkout), then compared.

``compare`` says per kernel of each set:

* ``identical``: the same normalised PTX (mangled names and dynamic-shared-array numbers made neutral, as
  ``forward_ptx.py`` writes them);
* ``same code``: identical once the ``.common .global`` declarations of Numba's per-function environment pointers
  (``_ZN08NumbaEnv...``: one per device function the module compiled, never read by the kernel's code) are left
  out -- a device function added, removed or merged changes only those declarations;
* ``DIFFERS`` (with the number of differing lines) or ``missing`` in one of the dumps.

Exit status 1 when any kernel differs or is missing.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

SETS = {
    "plain": [],
    "window": ["--window", "128", "0"],
    "softcap": ["--softcap", "30"],
    "window_softcap": ["--window", "128", "0", "--softcap", "30"],
    "varlen": ["--varlen"],
}
_SYMBOL = re.compile(r"\bSYM[0-9]+\b")


def _export(rev: str, folder: str) -> str:
    """The tracked files of ``rev`` of this repository, written to ``folder``."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    archive = subprocess.run(["git", "archive", rev], capture_output=True, check=True, cwd=root).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def _dump_set(tree: str, out: str, name: str, kernels: str | None) -> tuple[str, int, str]:
    env = dict(os.environ, PYTHONPATH=tree, NUMBA_ENABLE_CUDASIM="0")
    env.setdefault("CUDA_HOME", "/usr/local/cuda-13.0")
    cmd = [sys.executable, os.path.join(tree, "scripts", "forward_ptx.py"), os.path.join(out, name), *SETS[name]]
    if kernels:
        cmd += ["--kernels", kernels]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    return name, res.returncode, (res.stdout + res.stderr).strip()


def dump(out: str, tree: str, kernels: str | None, sets: list[str], jobs: int) -> int:
    os.makedirs(out, exist_ok=True)
    failed = 0
    with ThreadPoolExecutor(jobs) as pool:
        for name, rc, log in pool.map(lambda s: _dump_set(tree, out, s, kernels), sets):
            count = len(os.listdir(os.path.join(out, name))) - 1 if os.path.isdir(os.path.join(out, name)) else 0
            print(f"{name}: {'OK' if rc == 0 else 'FAILED'} ({max(count, 0)} kernels)", flush=True)
            if rc:
                failed += 1
                print("  " + "\n  ".join(log.splitlines()[-8:]))
    return 1 if failed else 0


def _renumbered(text: str) -> str:
    names: dict = {}
    return _SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"SYM{len(names)}"), text)


def code_of(ptx_normalised: str) -> str:
    """The normalised PTX without the ``.common .global .u64`` environment-pointer declarations, names renumbered.
    (``forward_ptx.py`` has already replaced the mangled names by ``SYMn``: a ``.common .global .align 8 .u64
    SYMn;`` line is such a declaration -- the kernels' own globals are not ``.common``.)"""
    lines = [line for line in ptx_normalised.splitlines()
             if not re.fullmatch(r"\.common \.global \.align 8 \.u64 SYM[0-9]+;", line.strip())]
    return _renumbered("\n".join(lines))


def compare(a: str, b: str) -> int:
    bad = 0
    totals = {"identical": 0, "same code": 0, "DIFFERS": 0, "missing": 0}
    for name in sorted(set(os.listdir(a)) | set(os.listdir(b))):
        da, db = os.path.join(a, name), os.path.join(b, name)
        if not (os.path.isdir(da) or os.path.isdir(db)):
            continue
        files_a = {f for f in os.listdir(da) if f.endswith(".ptx")} if os.path.isdir(da) else set()
        files_b = {f for f in os.listdir(db) if f.endswith(".ptx")} if os.path.isdir(db) else set()
        print(f"[{name}]")
        for f in sorted(files_a | files_b):
            kernel = f[:-4]
            if f not in files_a or f not in files_b:
                verdict = "missing"
                detail = f" (only in {a if f in files_a else b})"
            else:
                with open(os.path.join(da, f)) as fa, open(os.path.join(db, f)) as fb:
                    text_a, text_b = fa.read(), fb.read()
                detail = ""
                if text_a == text_b:
                    verdict = "identical"
                elif code_of(text_a) == code_of(text_b):
                    verdict = "same code"
                    envs = [sum(1 for line in t.splitlines() if line.startswith(".common .global .align 8 .u64"))
                            for t in (text_a, text_b)]
                    detail = f" (environment declarations {envs[0]} -> {envs[1]})"
                else:
                    verdict = "DIFFERS"
                    changed = sum(1 for line in difflib.unified_diff(code_of(text_a).splitlines(),
                                                                     code_of(text_b).splitlines(), n=0)
                                  if line[:1] in "+-" and line[:3] not in ("+++", "---"))
                    detail = f" ({changed} lines differ)"
            totals[verdict] += 1
            bad += verdict in ("DIFFERS", "missing")
            print(f"  {kernel}: {verdict}{detail}")
    print("total: " + ", ".join(f"{v} {k}" for k, v in totals.items()))
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="write DIR/<set>/*.ptx")
    d.add_argument("out")
    where = d.add_mutually_exclusive_group()
    where.add_argument("--rev", help="a git revision of this repository (exported to a temporary folder)")
    where.add_argument("--tree", help="a source tree (default: this checkout)")
    d.add_argument("--kernels", help="forward_ptx.py's --kernels (default: all)")
    d.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    d.add_argument("--jobs", type=int, default=2, help="sets compiled at once")
    c = sub.add_parser("compare", help="per kernel: identical, same code, DIFFERS or missing")
    c.add_argument("before")
    c.add_argument("after")
    args = parser.parse_args()
    if args.command == "compare":
        return compare(args.before, args.after)
    sets = args.sets.split(",")
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        parser.error(f"--sets: unknown {unknown}; expected of {list(SETS)}")
    if args.rev:
        with tempfile.TemporaryDirectory() as tmp:
            return dump(os.path.abspath(args.out), _export(args.rev, tmp), args.kernels, sets, args.jobs)
    tree = os.path.abspath(args.tree or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    return dump(os.path.abspath(args.out), tree, args.kernels, sets, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
