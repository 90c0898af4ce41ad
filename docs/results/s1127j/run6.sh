# Call 6 (H100, main + the register-pool check + the re-tuned keys: 6 causal, 11 without a mask): the bf16 and fp16
# sweeps against cuDNN, then the fp8 rows at 4k beside our bf16 (whose D128 4k key changed).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 128:bfloat16,float16 64:bfloat16,float16 2>&1 | tail -1
for dt in bf16 fp16; do
  date -u +%H:%M:%S
  timeout 160 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes $dt \
    --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot --out $OUT/sweep_$dt \
    > $OUT/sweep_$dt.log 2>&1; grep -A7 "^flash: " $OUT/sweep_$dt.log | grep -v "^--\|size"
done
date -u +%H:%M:%S
timeout 130 python3 -u docs/results/s1127h/probe_fp8_store.py n=4096 rounds=3 configs=224p stores=tma 2>&1 \
  | grep -v -i warn | tee $OUT/fp8_4k.log
date -u +%H:%M:%S
