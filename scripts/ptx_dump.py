"""Run a Python script, then write the PTX of every CUDA kernel it compiled, with mangled names normalised.

    python scripts/ptx_dump.py --out DIR -- scripts/sweep.py --quick
    python scripts/ptx_dump.py --compare DIR_A DIR_B

Two trees that run the same script compile the same kernels; where code only moved between modules, the PTX differs
only in mangled symbol names (which spell the module path). Names matching ``_ZN...`` become ``SYM<n>`` numbered by
first appearance, so ``--compare`` reports the kernels whose code really differs. Each kernel's file is named by the
hash of its normalised PTX; ``index.json`` maps the kernel's Python name and argument types to it.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import runpy
import sys

_MANGLED = re.compile(r"_ZN[0-9A-Za-z_]+")


def normalise(ptx: str) -> str:
    names: dict = {}
    body = _MANGLED.sub(lambda m: names.setdefault(m.group(0), f"SYM{len(names)}"), ptx)
    return "\n".join(line for line in body.splitlines() if not line.startswith("//"))


def dump(out: str) -> int:
    from numba.cuda.dispatcher import CUDADispatcher

    from numba import cuda

    cc = tuple(cuda.get_current_device().compute_capability)
    os.makedirs(out, exist_ok=True)
    index = []
    for obj in gc.get_objects():
        # kernel_jit's kernels compile on first use: a kernel of one signature that was built but never launched
        # (a combine kernel a pooled plan skips) is compiled now, as cuda.jit(signature) did when it was built
        if type(obj).__name__ == "CachedKernel" and obj.specialized:
            try:
                obj.dispatcher()
            except Exception as exc:  # noqa: BLE001
                index.append({"kernel": obj.py_func.__qualname__, "args": str(obj.signature), "error": repr(exc)})
    for obj in gc.get_objects():
        if not isinstance(obj, CUDADispatcher) or obj.targetoptions.get("device"):
            continue  # device functions are inlined into the kernels that call them
        for argtypes, kernel in list(obj.overloads.items()):
            try:
                ptx = normalise(kernel.inspect_asm(cc))
            except Exception as exc:  # a kernel the device cannot give PTX for: note it, go on
                index.append({"kernel": obj.py_func.__qualname__, "args": str(argtypes), "error": repr(exc)})
                continue
            digest = hashlib.sha256(ptx.encode()).hexdigest()[:16]
            with open(os.path.join(out, digest + ".ptx"), "w") as f:
                f.write(ptx)
            index.append({"kernel": obj.py_func.__qualname__, "args": str(argtypes), "ptx": digest,
                          "instructions": sum(1 for line in ptx.splitlines() if line.strip().endswith(";"))})
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(sorted(index, key=lambda e: (e["kernel"], e["args"])), f, indent=1)
    return len(index)


def compare(a: str, b: str) -> int:
    """Print the kernels whose normalised PTX differs between two dumps; exit status 1 if any does."""
    def load(folder):
        with open(os.path.join(folder, "index.json")) as f:
            return json.load(f)

    ptx_a = {e["ptx"]: e for e in load(a) if "ptx" in e}
    ptx_b = {e["ptx"]: e for e in load(b) if "ptx" in e}
    same = ptx_a.keys() & ptx_b.keys()
    only_a = sorted((e["kernel"], e["instructions"]) for h, e in ptx_a.items() if h not in same)
    only_b = sorted((e["kernel"], e["instructions"]) for h, e in ptx_b.items() if h not in same)
    print(f"kernels with identical PTX: {len(same)}; only in {a}: {len(only_a)}; only in {b}: {len(only_b)}")
    for name, count in only_a:
        print(f"  A only: {name} ({count} instructions)")
    for name, count in only_b:
        print(f"  B only: {name} ({count} instructions)")
    return 1 if only_a or only_b else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for the PTX files and index.json")
    parser.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"))
    parser.add_argument("script", nargs="*", help="the script and its arguments (after --)")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out or not args.script:
        parser.error("--out DIR -- SCRIPT [ARGS...] or --compare DIR_A DIR_B")
    sys.argv = list(args.script)
    try:
        runpy.run_path(args.script[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    print(f"ptx_dump: {dump(args.out)} kernels written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
