# Call 5: main after the snake rounds and the causal keys' persistent entries (249e77d): the forward sweeps against
# cuDNN, bf16 then fp16, B4 D128 H32 / D64 H48, 1k-16k; then fp8's default and persistent forms against our bf16.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 2>&1 | grep -v -i warn
for dt in bf16 fp16; do
  timeout 210 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes $dt \
    --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/sweep_$dt > $OUT/sweep_$dt.log 2>&1; grep -A20 "^| size" $OUT/sweep_$dt/results.md | grep "^| [0-9]"
  date -u +%H:%M:%S
done
timeout 70 python3 docs/results/s1127e/probe_fp8_persistent.py 2>&1 | grep -v -i warn | tee $OUT/fp8.log
