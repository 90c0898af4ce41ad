"""The command line: options, their parsing, and the settings of one run (mode defaults under the user's values)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .cases import DEFAULT_SWEEPS, GRIDS, SHORT, SWEEPS
from .checks import DEFAULT_TOLERANCES

_DTYPE_ALIASES = {
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}


def parse_size(text: str) -> int:
    """``"4k"`` -> 4096, ``"512"`` -> 512."""
    text = text.strip().lower()
    if text.endswith("k"):
        return int(float(text[:-1]) * 1024)
    return int(text)


def _list(convert):
    def parse(text: str):
        items = [t for t in text.split(",") if t.strip()]
        try:
            return [convert(t.strip()) for t in items]
        except (KeyError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"cannot parse {text!r}: {exc}") from None

    return parse


def _dtype(text: str) -> str:
    try:
        return _DTYPE_ALIASES[text.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r} (fp16, fp32, bf16)") from None


#: --direction name -> the suffix of its sweep (forward: the plain flash / linear sweep)
DIRECTION_SUFFIX = {"forward": "", "backward": "_bwd", "fwdbwd": "_fwdbwd"}


def _directions(text: str) -> list:
    names = []
    for item in (t.strip().lower() for t in text.split(",") if t.strip()):
        expanded = {"both": ["forward", "backward"], "all": list(DIRECTION_SUFFIX)}.get(item, [item])
        for name in expanded:
            if name not in DIRECTION_SUFFIX:
                raise argparse.ArgumentTypeError(
                    f"--direction: unknown {name!r} (forward, backward, fwdbwd, both, all)")
            if name not in names:
                names.append(name)
    if not names:
        raise argparse.ArgumentTypeError("--direction: empty")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _size_positive(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot parse {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size >= 1, got {text!r}")
    return value


def _flash_config(text: str) -> tuple[int, int]:
    d, h = text.lower().replace("x", ":").split(":")
    return int(d), int(h)


def _tolerances(text: str) -> dict:
    out = {}
    for item in text.split(","):
        if item.strip():
            key, value = item.split("=")
            key = SHORT.get(_DTYPE_ALIASES.get(key.strip().lower(), ""), key.strip().lower())
            if key not in DEFAULT_TOLERANCES:
                raise argparse.ArgumentTypeError(f"--tol: unknown key {key!r} (fp32, tf32, fp16, bf16)")
            out[key] = float(value)
    return out


_EPILOG = """\
modes (defaults in [brackets] are the full grid's):
  full       the grid above: roughly 10-20 minutes on an H100 (an estimate), much of it compiling
  --quick    flash D=128 H=32 N=1k,4k; decode Lk=4k,16k; linear fp16 N=1k,4k; 10 reps, 0.5 s per case;
             varlen 16 seqs; paged pages 16,64,256 full and ragged; window W=1k (so N=4k only)
  simulator  no GPU: flash D=16 H=1 B=1 N=16,32 fp32; decode H=2 Hkv=2,1 D=16 Lk=32,64; linear E=M=16
             N=16,32; varlen 2 seqs; paged pages 16, ragged rows; window W=8; numba_attn vs a NumPy naive
             peer, perf_counter timing (checks the pipeline, not speed)

real-batch sweeps (asked by name; not in the default list):
  varlen     flash_forward_varlen on --varlen-seqs packed sequences of (2i+1)N/n tokens for each --seqlens N
             (mean N), the flash grid's D:H, dtypes and --causal; vs FlexAttention (document mask, compiled) and
             SDPA on jagged nested tensors; TFLOP/s on the real tokens
  paged      flash_decode on the decode grid with the cache in pages of each --page-sizes value (shuffled pages,
             device block_table) vs the same keys in a dense cache; --paged-rows full (every row at L keys)
             and/or ragged (L/2..L keys, device cache_seqlens); GB/s, % of copy, CUDA graphs as decode
  window     flash_forward(causal=True, window=(W, 0)), W = --window, on the flash grid's N > W vs FlexAttention
             (sliding-window mask) and the full causal call; TFLOP/s on the visible pairs

examples:
  python scripts/sweep.py                              # everything installed, full grid
  python scripts/sweep.py --quick                      # < 2 minutes smoke test
  python scripts/sweep.py --sweeps flash --dtypes fp16,bf16 --seqlens 2k,8k --providers numba,triton,flash
  python scripts/sweep.py --sweeps decode --decode-kv-heads 8 --decode-lengths 16k,128k
  python scripts/sweep.py --sweeps flash --direction backward --seqlens 2k,4k,8k --providers numba,flash,cudnn
  python scripts/sweep.py --sweeps linear --direction backward,fwdbwd --dtypes fp16,bf16,fp32
  python scripts/sweep.py --sweeps varlen --seqlens 1k,4k --varlen-seqs 16 --causal causal --dtypes fp16,bf16
  python scripts/sweep.py --sweeps paged --decode-lengths 16k,64k --page-sizes 16,64,256 --paged-rows both
  python scripts/sweep.py --sweeps window --seqlens 16k,64k --window 4k --flash-configs 128:16
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sweep.py",
        description="Benchmark numba_attn against the installed peers (torch SDPA, Triton, CuPy, fla) on the same\n"
        "inputs, after checking every provider against the float64 reference. Without a GPU a tiny grid runs\n"
        "under Numba's CUDA simulator. Sizes accept a k suffix (4k = 4096); lists are comma-separated.\n"
        "Options left unset take the defaults of the mode (full, --quick or simulator; see the end).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    add = p.add_argument
    add("--sweeps", type=_list(str), default=list(DEFAULT_SWEEPS),
        help="sweeps to run: flash, decode, linear, varlen, paged, window (and by name flash_bwd, flash_fwdbwd, "
             "linear_bwd, linear_fwdbwd; see --direction) [flash,decode,linear]")
    add("--direction", type=_directions, default=["forward"],
        help="for the flash and linear sweeps, comma-separated: forward (flash_forward / causal_dot_product), "
             "backward (the backward alone on a recorded forward: sweeps flash_bwd, linear_bwd; flash FLOPs "
             "2.5x the forward's), fwdbwd (forward then backward in one timed call: flash_fwdbwd, linear_fwdbwd; "
             "flash FLOPs 3.5x); both = forward,backward; all = the three [forward]")
    add("--quick", action="store_true",
        help="smoke-test grid: flash N=1k,4k with D=128 H=32; decode Lk=4k,16k; linear N=1k,4k fp16; window "
             "W=1k; 10 reps")
    add("--seqlens", type=_list(parse_size),
        help="flash, linear and window sequence lengths; varlen: the mean length of its sequences [1k,2k,4k,8k,16k]")
    add("--dtypes", type=_list(_dtype),
        help="dtypes for every sweep: fp16, fp32, bf16 [flash, decode: fp16; linear: fp16,fp32]")
    add("--providers", type=_list(str),
        help="keep only providers whose name contains one of these substrings (e.g. numba,triton); =name keeps "
             "exactly that provider (e.g. =numba_attn for the default dispatch alone)")
    add("--batch", type=int,
        help="batch size for every sweep but varlen (--varlen-seqs) [flash, window 4; decode, paged 8; linear 4]")
    add("--flash-configs", type=_list(_flash_config),
        help="flash (headdim:heads) configurations [64:48,128:32]")
    add("--headdims", type=_list(int), help="flash head dims, paired with --heads (alternative to --flash-configs)")
    add("--heads", type=_list(int), help="flash head counts, paired with --headdims")
    add("--causal", choices=("both", "causal", "noncausal"), default="both", help="flash masking [both]")
    add("--decode-lengths", type=_list(parse_size), help="decode KV-cache lengths [4k,8k,16k,32k,64k]")
    add("--decode-heads", type=int, help="decode query heads [32]")
    add("--decode-kv-heads", type=_list(int), help="decode KV head counts, one case each [32,4]")
    add("--decode-headdim", type=int, help="decode head dim [128]")
    add("--varlen-seqs", type=_positive, help="varlen: packed sequences per batch, (2i+1)N/n tokens each [16]")
    add("--page-sizes", type=_list(_positive), help="paged: page sizes, a provider each [16,64,256]")
    add("--paged-rows", choices=("full", "ragged", "both"),
        help="paged: every row holding the whole cache, rows holding L/2..L keys (device cache_seqlens), or both "
             "[both; simulator: ragged]")
    add("--window", type=_size_positive,
        help="window: the left window W of window=(W, 0); sizes N <= W are skipped [4k; --quick 1k]")
    add("--linear-heads", type=int, help="linear heads [8]")
    add("--linear-dim", type=int, help="linear feature and value dim E = M [64]")
    add("--reps", type=int, help="timed calls per case and provider, at most [30]")
    add("--warmup", type=int, help="untimed calls before timing [3]")
    add("--budget", type=float, help="seconds of timed calls per case and provider; cuts --reps down [2.0]")
    add("--rotate", type=int, help="fresh random input sets rotated between calls [3]")
    add("--graph-sweeps", type=_list(str), default=["decode", "paged"],
        help="sweeps whose calls are also timed as CUDA graph replays (torch arrays; 'none': no graphs) "
             "[decode,paged]")
    add("--graph-steps", type=int, default=20, help="calls captured in one CUDA graph [20]")
    add("--graph-replays", type=int, default=15, help="timed replays of the graph; the median counts [15]")
    add("--check-rows", type=int, default=128,
        help="query rows (the last ones) of batch 0, first and last head, compared with the reference [128]")
    add("--tol", type=_tolerances, default={},
        help="rel. error bounds by dtype; tf32 is for float32 inputs of TF32 providers "
        "[fp32=1e-5,tf32=5e-3,fp16=2e-3,bf16=1e-2]")
    add("--naive-mem-gb", type=float, default=8.0,
        help="skip providers that materialise the scores (CuPy naive, SDPA math) above this many GB [8]")
    add("--input-mem-gb", type=float, default=12.0,
        help="memory for the rotated input sets of one case; fewer sets when they do not fit [12]")
    add("--out", default="bench_out",
        help="output folder: results.csv, results.json, results.md, <sweep>.png [bench_out]")
    add("--no-plot", action="store_true", help="do not write the PNG plots")
    add("--list-providers", action="store_true", help="print the providers of each sweep and exit")
    return p


@dataclass
class Options:
    """The resolved settings of one run (mode defaults with the command line's values on top)."""

    mode: str
    sweeps: list
    seqlens: list
    flash_configs: list
    flash_causal: list
    flash_batch: int
    flash_dtypes: list
    decode_batch: int
    decode_heads: int
    decode_kv_heads: list
    decode_headdim: int
    decode_lengths: list
    decode_dtypes: list
    linear_batch: int
    linear_heads: int
    linear_dim: int
    linear_dtypes: list
    varlen_seqs: int
    page_sizes: list
    paged_rows: list  # "full" and / or "ragged"
    window: int
    reps: int
    warmup: int
    budget: float
    rotate: int
    min_reps: int
    check_rows: int
    graph_sweeps: list
    graph_steps: int
    graph_replays: int
    tolerances: dict
    naive_mem_bytes: float
    input_mem_bytes: float
    providers: list | None
    out: str
    plot: bool


def resolve_options(args: argparse.Namespace, simulator: bool) -> Options:
    mode = "simulator" if simulator else ("quick" if args.quick else "full")
    g = dict(GRIDS[mode])
    unknown = [s for s in args.sweeps if s not in SWEEPS]
    if unknown:
        raise SystemExit(f"--sweeps: unknown {unknown}; choose from {','.join(SWEEPS)}")
    sweeps = list(args.sweeps)
    for base in ("flash", "linear"):
        if base in sweeps:
            sweeps += [base + DIRECTION_SUFFIX[d] for d in args.direction if d != "forward"]
            if "forward" not in args.direction:
                sweeps.remove(base)
    configs = g["flash_configs"]
    if args.flash_configs:
        configs = args.flash_configs
    elif args.headdims or args.heads:
        dims = args.headdims or [d for d, _ in configs]
        heads = args.heads or [h for _, h in configs]
        if len(dims) == 1:
            dims = dims * len(heads)
        if len(heads) == 1:
            heads = heads * len(dims)
        if len(dims) != len(heads):
            raise SystemExit("--headdims and --heads must have the same length (or one value)")
        configs = list(zip(dims, heads))
    pick = lambda name, key: getattr(args, name) if getattr(args, name) is not None else g[key]  # noqa: E731
    tolerances = dict(DEFAULT_TOLERANCES, **args.tol)
    return Options(
        mode=mode,
        sweeps=[s for s in SWEEPS if s in sweeps],
        seqlens=pick("seqlens", "seqlens"),
        flash_configs=configs,
        flash_causal={"both": [False, True], "causal": [True], "noncausal": [False]}[args.causal],
        flash_batch=pick("batch", "flash_batch"),
        flash_dtypes=pick("dtypes", "flash_dtypes"),
        decode_batch=pick("batch", "decode_batch"),
        decode_heads=pick("decode_heads", "decode_heads"),
        decode_kv_heads=pick("decode_kv_heads", "decode_kv_heads"),
        decode_headdim=pick("decode_headdim", "decode_headdim"),
        decode_lengths=pick("decode_lengths", "decode_lengths"),
        decode_dtypes=pick("dtypes", "decode_dtypes"),
        linear_batch=pick("batch", "linear_batch"),
        linear_heads=pick("linear_heads", "linear_heads"),
        linear_dim=pick("linear_dim", "linear_dim"),
        linear_dtypes=pick("dtypes", "linear_dtypes"),
        varlen_seqs=pick("varlen_seqs", "varlen_seqs"),
        page_sizes=pick("page_sizes", "page_sizes"),
        paged_rows={"both": ["full", "ragged"], None: g["paged_rows"]}.get(args.paged_rows, [args.paged_rows]),
        window=pick("window", "window"),
        reps=max(1, pick("reps", "reps")),
        warmup=max(0, pick("warmup", "warmup")),
        budget=pick("budget", "budget"),
        rotate=max(1, pick("rotate", "rotate")),
        min_reps=min(g["min_reps"], max(1, pick("reps", "reps"))),
        check_rows=max(1, args.check_rows),
        graph_sweeps=[] if simulator else [s for s in SWEEPS if s in args.graph_sweeps],
        graph_steps=max(1, args.graph_steps),
        graph_replays=max(1, args.graph_replays),
        tolerances=tolerances,
        naive_mem_bytes=args.naive_mem_gb * 1e9,
        input_mem_bytes=args.input_mem_gb * 1e9,
        providers=args.providers,
        out=args.out,
        plot=not args.no_plot,
    )
