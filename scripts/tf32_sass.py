"""SASS instruction counts per key tile of the float32 tensor-core forward, offline (no GPU): a proxy for A/B timings.

    CUDA_HOME=/usr/local/cuda-13.0 NUMBA_ENABLE_CUDASIM=0 python scripts/tf32_sass.py 64 64:split=qkv 128:split=qkv
    ... --keep DIR          # also write each specialisation's PTX, cubin and SASS to DIR

Each argument is a head dim and ``Tf32Config`` overrides (``D[:key=value...]``) on the tiles ``gpu_config(D, split=...)``
picks (3xTF32). The kernel is compiled for sm_90 with the masked-softmax path compiled out (``tile_is_partial`` always
false: the code a full tile runs; such a kernel is never launched), then ``ptxas`` and ``nvdisasm``. Printed per key
tile (one thread's, i.e. one warp's instructions): every instruction, HMMAs,
shared loads / stores, barriers and the float / integer ALU instructions the split costs, per key tile and as
instructions per 16 query rows x 32 keys (the same work at every tile shape) and per MMA. The key loop is the
smallest loop that holds the tile's barrier; a loop inside it with MMAs (NVVM keeps the ``Q K^T`` k-steps a loop at
some shapes) counts its trip count times, solved from the tile's known number of MMAs.

Needs ``ptxas`` and ``nvdisasm`` (PATH, ``$CUDA_HOME/bin``, or the copies bundled with Triton).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def find_tool(name: str) -> str | None:
    """``ptxas`` / ``nvdisasm``: on PATH, under ``$CUDA_HOME/bin`` or /usr/local/cuda*/bin, or bundled with Triton."""
    found = shutil.which(name)
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)]
    candidates += sorted(glob.glob(f"/usr/local/cuda*/bin/{name}"))
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name))
    except Exception:  # noqa: BLE001  (no Triton: fine)
        pass
    return found or next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def parse_sass(text: str):
    """[(opcode, text)] and {label: index} of ``nvdisasm -c`` output."""
    ins, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ins)
            continue
        m = re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            body = m.group(1).strip()
            ins.append((re.sub(r"^@!?U?P[T0-9]+\s+", "", body).split()[0], body))
    return ins, labels


def loops(ins, labels):
    """(start, end) of every backward branch's loop."""
    found = []
    for i, (op, body) in enumerate(ins):
        target = re.search(r"\((\.L_x_\d+)\)", body) if op.startswith("BRA") else None
        if target and labels[target.group(1)] <= i:
            found.append((labels[target.group(1)], i))
    return found


def key_loop_counts(sass: str, mmas_per_tile: int):
    """(counts per key tile, spill instructions in the key loop): the key loop (the smallest loop that holds a
    barrier and MMAs) with an inner MMA loop's body counted as often as its solved trip count."""
    ins, labels = parse_sass(sass)
    spans = loops(ins, labels)

    def has(span, prefix):
        return any(op.startswith(prefix) for op, _ in ins[span[0]:span[1] + 1])

    key = min((s for s in spans if has(s, "HMMA") and has(s, "BAR.SYNC")), key=lambda s: s[1] - s[0])
    counts = collections.Counter(op for op, _ in ins[key[0]:key[1] + 1])
    inner = [s for s in spans if s != key and key[0] <= s[0] and s[1] <= key[1] and has(s, "HMMA")]
    if len(inner) == 1:
        body = collections.Counter(op for op, _ in ins[inner[0][0]:inner[0][1] + 1])
        extra_trips = (mmas_per_tile - counts["HMMA.1688.F32.TF32"]) / body["HMMA.1688.F32.TF32"]
        for op, n in body.items():
            counts[op] += extra_trips * n
    spills = sum(1 for op, _ in ins[key[0]:key[1] + 1] if op.startswith(("STL", "LDL")))
    return counts, spills


def mmas_per_tile(tiles, tf32_only: bool = False) -> int:
    terms = 1 if tf32_only else 3
    return tiles.m_tiles * (tiles.block_n // 8) * (tiles.d_pad // 8 + tiles.d_pass // 8) * terms


def summary(counts) -> dict:
    groups = {"all": lambda op: True, "HMMA": lambda op: op.startswith("HMMA"),
              "LDS": lambda op: op.startswith("LDS"), "STS": lambda op: op.startswith("STS"),
              "BAR": lambda op: op.startswith("BAR"),
              "FADD": lambda op: op.startswith("FADD"), "FSETP": lambda op: op.startswith("FSETP"),
              "SEL": lambda op: op == "SEL" or op.startswith("SEL."),
              "LOP3": lambda op: op.startswith("LOP3"), "IADD": lambda op: op.startswith(("VIADD", "IADD3"))}
    return {name: sum(n for op, n in counts.items() if test(op)) for name, test in groups.items()}


def compile_sass(source, config, keep: str | None = None, name: str = "k"):
    """(ptxas -v report, SASS text) of a kernel's Python function for sm_90."""
    from numba_attn.runtime.device import cuda
    from numba_attn.forward import tf32 as flash_tf32

    ptx, _ = cuda.compile_ptx(source, flash_tf32.SIGNATURE.args, cc=(9, 0), launch_bounds=config.launch_bounds())
    folder = keep or tempfile.mkdtemp()
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, name)
    with open(base + ".ptx", "w") as f:
        f.write(ptx)
    res = subprocess.run([find_tool("ptxas"), "-arch=sm_90a", "-v", base + ".ptx", "-o", base + ".cubin"],
                         capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    sass = subprocess.run([find_tool("nvdisasm"), "-c", base + ".cubin"], capture_output=True, text=True,
                          check=True).stdout
    if keep:
        with open(base + ".sass", "w") as f:
            f.write(sass)
    else:
        shutil.rmtree(folder, ignore_errors=True)
    report = " | ".join(line.split("info    :")[-1].strip() for line in res.stderr.splitlines()
                        if "Used" in line or "spill" in line)
    return report, sass


def fake_sm90():
    """Device functions ask the current device for its compute capability: give them sm_90 (no GPU needed)."""
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:
        compute_capability = (9, 0)

    dispatcher.get_current_device = lambda: _Sm90()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", help="D[:key=value...], e.g. 128:split=qkv:m_tiles=1")
    parser.add_argument("--keep", help="write PTX, cubin and SASS here")
    args = parser.parse_args()
    import numba_attn  # noqa: F401
    from numba_attn.core.staging import device_function
    from numba_attn.runtime.device import SIMULATOR
    from numba_attn.forward import tf32 as flash_tf32

    if SIMULATOR or not find_tool("ptxas") or not find_tool("nvdisasm"):
        print("needs NUMBA_ENABLE_CUDASIM=0, ptxas and nvdisasm")
        return 1
    fake_sm90()

    def never_partial(block_n, *rest):  # the code a full tile runs (measurement only: never launched)
        return device_function(lambda n0, m0, key_end, causal, diag_offset: False)

    flash_tf32.tile_is_partial = never_partial
    for spec in args.specs:
        d, *items = spec.split(":")
        changes = {k: (v if k == "split" else int(v)) for k, v in (item.split("=") for item in items)}
        config = flash_tf32.gpu_config(int(d), split=changes.get("split", "cvt")).replace(**changes)
        d_pad = flash_tf32.padded_head_dim(int(d), config)
        tiles = flash_tf32.tiles_for(config, d_pad)
        report, sass = compile_sass(flash_tf32._kernel_source(tiles, False), config, args.keep,
                                    spec.replace(":", "_").replace("=", ""))
        counts, spills = key_loop_counts(sass, mmas_per_tile(tiles))
        sums = summary(counts)
        scale = 32 / (tiles.m_tiles * tiles.block_n)  # per 16-row m-tile x 32 keys
        line = " ".join(f"{k}={v:.0f}" for k, v in sums.items())
        print(f"{spec:26s} {tiles.warps}w x {tiles.m_tiles}m x {tiles.block_n} keys, {tiles.shared_bytes} B: "
              f"{sums['all'] * scale:5.0f} per 16 rows x 32 keys, {sums['all'] / sums['HMMA']:.2f} per MMA | per "
              f"tile {line} | spills in key loop {spills} | {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
