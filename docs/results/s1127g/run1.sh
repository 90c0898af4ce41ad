# Call 1 (issue #30, 2026-11-27 second session): the forward sweeps against cuDNN on main (bf16, fp16), fp8 against
# our bf16, the never-run 16-bit part probes, and the GPU tests of a6fe993 (tuning keys) / 3d60a68 (probes).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 2>&1 | grep -v -i warn
for dt in bf16 fp16; do
  timeout 120 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes $dt \
    --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/sweep_$dt > $OUT/sweep_$dt.log 2>&1; grep "^| [0-9]" $OUT/sweep_$dt/results.md
done
date -u +%H:%M:%S
timeout 70 python3 docs/results/s1127e/probe_fp8_persistent.py 4096 16384 2>&1 | grep -v -i warn | tee $OUT/fp8.log
timeout 110 python3 docs/results/s1127f/probe_parts.py n=1024,4096 rounds=3 2>&1 | grep -v -i warn | tee $OUT/parts.log
date -u +%H:%M:%S
timeout 120 python3 -m pytest -q -p no:benchmark -x -m gpu tests/forward/test_autotune.py \
  tests/forward/test_flash_wgmma_ws.py 2>&1 | tail -5 | tee $OUT/tests.log
date -u +%H:%M:%S
