"""Probe: the special-function unit's exp2 throughput on this GPU, float32 (``ex2.approx.ftz.f32``) against packed
half (``ex2.approx.f16x2``) and bfloat16 (``ex2.approx.ftz.bf16x2``) -- whether an 8-bit P computed in half
precision would take the SFU for half as long (ptxas for sm_90a lowers a packed ex2 to two ``MUFU.EX2.F16``; their
rate is the question). Each thread runs 8 independent chains; exp2 values per SM per clock from the event time and
the SM clock nvidia-smi reports. Run from the tree."""
import numpy as np
from llvmlite import ir
from numba import cuda, types, uint32
from numba.cuda.extending import intrinsic

I32, F32 = ir.IntType(32), ir.FloatType()


def unary(text, ty, llty, constraint):
    @intrinsic
    def op(typingctx, x):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(llty, [llty]), text, f"={constraint},{constraint}")
            return builder.call(asm, [args[0]])
        return ty(ty), codegen
    return op


ex2_f32 = unary("ex2.approx.ftz.f32 $0, $1;", types.float32, F32, "f")
ex2_f16x2 = unary("ex2.approx.f16x2 $0, $1;", types.uint32, I32, "r")
ex2_bf16x2 = unary("ex2.approx.ftz.bf16x2 $0, $1;", types.uint32, I32, "r")
ITERS = 4096
SIGNS = np.uint32(0x80008000)


def make(op, dtype, start):
    @cuda.jit
    def kernel(out):
        x = cuda.local.array(8, dtype)
        for c in range(8):
            x[c] = start
        for _ in range(ITERS):
            for c in range(8):  # x -> -2**x: a chain that stays near -0.64
                x[c] = op(x[c]) ^ SIGNS if dtype is uint32 else -op(x[c])
        acc = x[0]
        for c in range(1, 8):
            acc = acc ^ x[c] if dtype is uint32 else acc + x[c]
        out[cuda.grid(1)] = acc
    return kernel


if __name__ == "__main__":
    from numba.cuda import get_current_device

    dev = get_current_device()
    sms = dev.MULTIPROCESSOR_COUNT
    import subprocess
    mhz = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    clock_hz = float(mhz[0]) * 1e6 if mhz else None
    half_one = np.uint32(0xBC00BC00)  # (-1, -1) in half: values stay in (0, 1]
    bf_one = np.uint32(0xBF80BF80)
    cases = [("f32", ex2_f32, types.float32, np.float32(-1.0), 1),
             ("f16x2", ex2_f16x2, uint32, half_one, 2), ("bf16x2", ex2_bf16x2, uint32, bf_one, 2)]
    blocks, threads = sms * 8, 256
    for name, op, dtype, start, per in cases:
        k = make(op, dtype, start)
        out = cuda.device_array(blocks * threads, np.float32 if per == 1 else np.uint32)
        k[blocks, threads](out)
        cuda.synchronize()
        s, e = cuda.event(), cuda.event()
        times = []
        for _ in range(7):
            s.record(); k[blocks, threads](out); e.record(); e.synchronize()
            times.append(cuda.event_elapsed_time(s, e))
        ms = float(np.median(times))
        values = blocks * threads * ITERS * 8 * per
        rate = values / (ms * 1e-3) / sms
        line = f"{name}: {ms:.3f} ms, {rate / 1e9:.2f} G exp2/s per SM"
        if clock_hz:
            line += f" ({rate / clock_hz:.1f} per SM clock at {clock_hz / 1e9:.2f} GHz)"
        print(line, flush=True)
