"""Where a block of the warp-specialised forward spends its time: per-phase timestamps of every block, on a GPU.

    python scripts/ws_timeline.py [--seqlen 16384] [--heads 16] [--batch 1] [--head-dim 128] [--dtype bf16|fp16|fp8]
        [--windows 512,4096,none | --full] [--stores tma,elements] [--persistent | --config block_n=128,stages=3]

A diagnostic, not the kernel: it rewrites ``forward/wgmma_ws_kernel.py``'s source text so that one thread of each
consumer warpgroup (and the producer thread) reads ``%globaltimer`` after each phase of a block and writes it into
``lse`` (the launch passes ``write_lse=False``, so nothing else writes there), compiles that copy, and launches it
through ``wgmma_ws.launch`` (``--dtype fp8``: ``wgmma_ws_fp8.launch``) on inputs ``(batch, heads, seqlen, head_dim)``,
causal unless ``--full``, with the kernel's default configuration (``--persistent``: its persistent form, whose
blocks are stamped inside the block loop; ``--config``: WsConfig fields, two consumers). Per call it prints
the median over blocks of each consumer phase -- Q landed, K of tile 0 landed, tile 0 (S, its softmax, P) done, the
other tiles done, the last P V done, the epilogue done (with the TMA store: once the unit has read the staged tile)
-- the median gap between one block's end and the next block's start on the same SM (not defined for the persistent
kernel, whose producer starts a block before the consumers end the last), and an SM's time per block (from its first
block's start to its last block's end, over its blocks), for each way of storing the output named in ``--stores``
(``wgmma_ws_kernel.STORES``; "tma" where the launcher would take it). The edits are anchored on exact lines of the
kernel source and fail loudly when it changes. Timestamps are the low 24 bits of the nanosecond timer (exact in
float32; unwrapped modulo 2^24).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from _fields import parse_fields  # noqa: E402

#: the intrinsics the rewritten source uses (GPU only)
TIMER_SOURCE = '''
from llvmlite import ir as _ir
from numba import float32 as _f32, types as _types, uint64 as _u64
from numba.cuda.extending import intrinsic as _intrinsic


@_intrinsic
def _gtimer(typingctx):
    def codegen(context, builder, sig, args):
        asm = _ir.InlineAsm(_ir.FunctionType(_ir.IntType(64), []), "mov.u64 $0, %globaltimer;", "=l",
                            side_effect=True)
        return builder.call(asm, [])
    return _types.uint64(), codegen


@_intrinsic
def _smid(typingctx):
    def codegen(context, builder, sig, args):
        asm = _ir.InlineAsm(_ir.FunctionType(_ir.IntType(32), []), "mov.u32 $0, %smid;", "=r", side_effect=True)
        return builder.call(asm, [])
    return _types.uint32(), codegen
'''
#: slots in lse[b, h, m0 + slot] of a block starting at row m0: consumer c 16 c + phase, producer 32 / 33, SM 40
PHASES = ("start", "Q landed", "K0 landed", "tile 0 done", "other tiles done", "last P V done", "finish done")
_CONSUMER = ("\n{ind}if row0 == m_c and lane == 0:"
             "\n{ind}    lse[b, h, m_c - ROWS * c + 16 * c + {k}] = _f32(_gtimer() & _u64(0xFFFFFF))")
_TIMER = "_f32(_gtimer() & _u64(0xFFFFFF))"


def _stamped(ind: str, k: int) -> str:
    return _CONSUMER.format(ind=ind, k=k)


def _lines(*lines: str) -> str:
    return "\n".join(lines)


def rewritten_source(src: str) -> str:
    """The kernel module's source with the timestamps written in (AssertionError where an anchor moved)."""
    i12, i16, i20 = " " * 12, " " * 16, " " * 20
    k_full = _lines(i12 + "wait(smem, bars + K_FULL + 4 * stage, phase)", i12 + "if narrow:")
    first_done = "causal, diag_offset, scale_log2, post, stage, phase))\n"
    last_pv = _lines(i12 + "last_p_times_v(code, (acc, p, smem, v_base + v_stage * V_TILE))",
                     i12 + "wait_o(acc, l_run)\n")
    own_position = i12 + "b1, h1, m1, _, _, _, out_head = position(q, k, v, out, causal, schedule)\n"
    producer_position = i20 + "b1, h1, m1, _, _, _, _ = position(q, k, v, out, causal, schedule)\n"
    produced = _lines(" " * 32 + "n_first1, n_tiles1, 0, 0, 0)", i12 + "return")
    i8 = " " * 8
    # the persistent kernel's blocks (``produce_block``, ``consume_block``): the producer's start, its last copy
    # issued and the SM; each consumer's start
    tile_of = i8 + "b, h, m0 = tile_of(tile, q, causal)\n"
    loop_producer = "Q's count.\"\"\"\n" + tile_of
    loop_produced = _lines(" " * 35 + "n_first, n_tiles, stage, phase, qn)", i12 + "qn += 1")
    loop_consumer = "        count.\"\"\"\n" + tile_of
    # (the persistent producer's stamps go to lse, which its block function does not take otherwise)
    block_args = "diag_offset, group, stage, phase, qn):\n"
    block_call = "key_start, key_end, diag_offset, group, ring[0], ring[1], ring[2])\n"
    edits = [
        ("from ..runtime.device import cuda\n", "from ..runtime.device import cuda\n" + TIMER_SOURCE),
        (block_args, block_args.replace("qn)", "qn, lse)")),
        (block_call, block_call.replace("ring[2])", "ring[2], lse)")),
        (i12 + "wait(smem, bars, qn & 1)\n", i12 + "wait(smem, bars, qn & 1)" + _stamped(i12, 1) + "\n"),
        (k_full, k_full.replace("phase)\n", "phase)" + _stamped(i12, 2) + "\n", 1)),
        (first_done, first_done[:-1] + _stamped(i12, 3) + "\n"),
        (_lines(" " * 8 + "if n_tiles > 0:", i12 + "wait(smem, bars + V_FULL + 4 * v_stage, v_phase)"),
         _lines(_stamped(" " * 8, 4)[1:], " " * 8 + "if n_tiles > 0:",
                i12 + "wait(smem, bars + V_FULL + 4 * v_stage, v_phase)")),
        (last_pv, last_pv.replace("wait_o(acc, l_run)\n", "wait_o(acc, l_run)" + _stamped(i12, 5) + "\n", 1)),
        (_lines("post, out_scale)", " " * 8 + "return stage, phase"),
         _lines("post, out_scale)" + _stamped(" " * 8, 6), " " * 8 + "return stage, phase")),
        (own_position, own_position + i12 + "if warp % 4 == 0 and lane == 0:\n"
         + i16 + f"lse[b1, h1, m1 + 16 * c] = {_TIMER}\n"),
        (producer_position, producer_position + i20 + f"lse[b1, h1, m1 + 32] = {_TIMER}\n"
         + i20 + "lse[b1, h1, m1 + 40] = _f32(_smid())\n"),
        (produced, produced.replace("0, 0, 0)\n", f"0, 0, 0)\n{i20}lse[b1, h1, m1 + 33] = {_TIMER}\n", 1)),
        (loop_producer, loop_producer + i8 + f"lse[b, h, m0 + 32] = {_TIMER}\n"
         + i8 + "lse[b, h, m0 + 40] = _f32(_smid())\n"),
        (loop_produced, loop_produced + "\n" + i12 + f"lse[b, h, m0 + 33] = {_TIMER}"),
        (loop_consumer, loop_consumer + i8 + "if lane == 0 and row == ROWS * c:\n"
         + i12 + f"lse[b, h, m0 + 16 * c] = {_TIMER}\n"),
    ]
    for old, new in edits:
        assert src.count(old) == 1, f"anchor not found once in wgmma_ws_kernel.py: {old[:60]!r}"
        src = src.replace(old, new)
    return src


def timeline_module():
    """The rewritten kernel module, imported as a module of ``numba_attn.forward`` (its relative imports hold)."""
    path = os.path.join(ROOT, "numba_attn", "forward", "wgmma_ws_kernel.py")
    with open(path) as f:
        src = rewritten_source(f.read())
    tmp = tempfile.NamedTemporaryFile("w", suffix="_ws_timeline.py", delete=False)
    tmp.write(src)
    tmp.close()
    spec = importlib.util.spec_from_file_location("numba_attn.forward._ws_timeline", tmp.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summarise(stamps, say=print) -> None:
    """Medians over blocks of ``stamps`` ``(blocks, 48)`` (float32 low 24 bits of ns)."""
    import numpy as np

    def span(a: int, b: int):
        return ((stamps[:, b] - stamps[:, a]) % (1 << 24)) / 1000.0

    for c in (0, 1):
        parts = [f"{PHASES[k]} +{np.median(span(16 * c + k - 1, 16 * c + k)):.2f}" for k in range(1, len(PHASES))]
        say(f"  consumer {c} (us after the previous phase): " + ", ".join(parts)
            + f"; block {np.median(span(16 * c, 16 * c + 6)):.2f} us")
    sm = stamps[:, 40].astype(int)
    start, end = stamps[:, 32], np.maximum(stamps[:, 6], stamps[:, 22])
    gaps = []
    for s in np.unique(sm):
        order = np.where(sm == s)[0]
        order = order[np.argsort(start[order])]
        gaps += [((start[j] - end[i]) % (1 << 24)) / 1000.0 for i, j in zip(order[:-1], order[1:])]
    gaps = [g for g in gaps if g < 1000]  # (blocks of another wrap of the timer)
    say(f"  gap from a block's end to the next block's start on one SM: median {np.median(gaps):.2f} us")
    per_sm = []  # (an SM's span over its blocks, start to end, per block: what a block costs the SM)
    for s in np.unique(sm):
        order = np.where(sm == s)[0]
        spans = ((end[order] - start[order].min()) % (1 << 24)) / 1000.0
        if len(order) > 1 and spans.max() < 1000:
            per_sm.append(spans.max() / len(order))
    if per_sm:
        say(f"  an SM's time per block (its first start to its last end, over its blocks): median "
            f"{np.median(per_sm):.2f} us")


def _config(text: str, fp8: bool):
    """``--config``: "default" (the kernel's), "persistent" (the default's persistent form) or WsConfig fields as
    ``block_n=128,persistent=True,stages=3`` (``_fields.parse_fields``; two consumers only: the stamps' slots hold
    two)."""
    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8

    base = wgmma_ws_fp8.default_config() if fp8 else wgmma_ws.DEFAULT_CONFIG
    if text == "default":
        return base
    if text == "persistent":
        return dataclasses.replace(base, persistent=True)
    return wgmma_ws.WsConfig(**parse_fields(text))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp8"),
                        help="fp8: e4m3 inputs on wgmma_ws_fp8 (its default configuration; bf16 output)")
    parser.add_argument("--full", action="store_true", help="no causal mask (--windows then ignored)")
    parser.add_argument("--windows", default="512,4096,none", help="left window sides; 'none': plain causal")
    parser.add_argument("--stores", default="tma,elements", help="ways of storing the output (wgmma_ws_kernel.STORES)")
    parser.add_argument("--persistent", action="store_true", help="the persistent configuration (one block per SM)")
    parser.add_argument("--config", default=None, help="'default', 'persistent' or fields: block_n=128,stages=3")
    args = parser.parse_args(argv)
    import torch
    from numba import cuda

    from numba_attn.forward import wgmma_ws, wgmma_ws_fp8
    from numba_attn.runtime.device import kernel_jit

    timeline = timeline_module()
    fp8 = args.dtype == "fp8"

    def stamped_kernel(config, head_dim_pad, bf16, scale_first=False, variant=wgmma_ws.PLAIN, store="elements",
                       probe=None, narrow=True):
        assert probe is None, "the timeline's kernel has no probes"
        source = timeline._kernel_source(config, head_dim_pad, bf16, scale_first, variant, store=store, narrow=narrow)
        return kernel_jit((config.threads, 1), wgmma_ws.SIGNATURE)(source)

    def stamped_fp8_kernel(config, head_dim_pad, bf16_out, scale_first=False, per_head=False, variant=wgmma_ws.PLAIN,
                           probe=None, store="tma", narrow=True):
        assert probe is None, "the timeline's kernel has no probes"
        source = timeline._kernel_source(config, head_dim_pad, bf16_out, scale_first, variant, fp8=True,
                                         per_head=per_head, store=store, narrow=narrow)
        return kernel_jit((config.threads, 1), wgmma_ws_fp8.SIGNATURE)(source)

    wgmma_ws.flash_ws_kernel = stamped_kernel  # (this process only)
    wgmma_ws_fp8.flash_ws_fp8_kernel = stamped_fp8_kernel
    bsz, n, heads, d = args.batch, args.seqlen, args.heads, args.head_dim
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    q, k, v = (torch.randn(bsz, heads, n, d, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.empty(bsz, heads, n, d, device="cuda", dtype=torch.bfloat16 if fp8 else dtype)
    if fp8:
        q, k, v = (x.to(torch.float8_e4m3fn) for x in (q, k, v))

    def bits(x):
        return cuda.as_cuda_array(x.view(torch.uint8 if x.element_size() == 1 else torch.int16))

    chosen = wgmma_ws.output_store
    text = args.config or ("persistent" if args.persistent else "default")
    config = _config(text, fp8)
    if config.consumers != 2:
        raise SystemExit("--config: two consumers only (the stamps' slots hold two)")
    windows = ["full"] if args.full else args.windows.split(",")
    for store, wtext in [(s, t) for s in args.stores.split(",") for t in windows]:
        # (the TMA store needs the output's map: the launcher's own choice, which must then be "tma")
        wgmma_ws.output_store = chosen if store == "tma" else (lambda out, packed, stream, store=store: (store, 0))
        w = None if wtext.strip().lower() in ("none", "full") else int(wtext)
        lse = torch.full((bsz, heads, n), float("nan"), device="cuda", dtype=torch.float32)
        for _ in range(3):  # (compiles on the first)
            if fp8:
                wgmma_ws_fp8.launch(bits(q), bits(k), bits(v), bits(out), cuda.as_cuda_array(lse), False, d ** -0.5,
                                    not args.full, cuda.default_stream(), config=config,
                                    window=(w, 0) if w else None)
            else:
                wgmma_ws.launch(bits(q), bits(k), bits(v), bits(out), cuda.as_cuda_array(lse), False, d ** -0.5,
                                not args.full, cuda.default_stream(), config=config, dtype=args.dtype.replace(
                                    "bf16", "bfloat16").replace("fp16", "float16"), window=(w, 0) if w else None)
        torch.cuda.synchronize()
        rows = config.block_m
        stamps = lse.cpu().numpy().reshape(bsz * heads, n // rows, rows)[:, :, :48].reshape(-1, 48)
        kind = "persistent" if config.persistent else "one block per query block"
        mask = "full" if args.full else f"causal, window {w}"
        print(f"store {store}, {mask}, B{bsz} L{n} H{heads} D{d} {args.dtype}, {config} ({kind}): "
              f"{len(stamps)} blocks", flush=True)
        summarise(stamps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
