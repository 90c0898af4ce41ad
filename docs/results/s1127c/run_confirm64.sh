# One device call (H100, 2026-11-27): D64 H48 B4 as users get it (D64 WS tuned, WS from 1024 keys per row on
# average) against cuDNN, bf16 and fp16, 1k-16k.
# (prewarm_ws.py ran as docs/results/s1127c/prewarm.py then, the same code)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 scripts/prewarm_ws.py 64:bfloat16,float16 2>&1 | grep -v -i warn
for dt in bf16 fp16; do
  timeout 170 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes $dt \
    --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/confirm64_$dt > $OUT/confirm64_$dt.log 2>&1; grep -A8 "^| size" $OUT/confirm64_$dt/results.md
done
