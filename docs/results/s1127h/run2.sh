# Call 2 (H100, warm after call 1): D64 with the seqlen_k threshold (dispatch test, sweeps 1k-2k both dtypes), then
# the fp8 candidates of 9080ec0: GPU tests and alternating rounds against our bf16.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 90 python3 -m pytest -q -p no:benchmark -m gpu tests/forward/test_flash_wgmma_ws.py -k "dispatch_by_head_dim" \
  2>&1 | tail -2 | tee $OUT/dispatch_test.log
for dt in bf16 fp16; do
  timeout 70 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes $dt \
    --seqlens 1k,2k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/sweep_d64_$dt > /dev/null 2>&1; grep "^| [0-9]" $OUT/sweep_d64_$dt/results.md; rm -f $OUT/sweep_d64_$dt/results.csv
done
date -u +%H:%M:%S
timeout 60 python3 scripts/prewarm_ws.py 128:fp8 2>&1 | tail -1
timeout 200 python3 -m pytest -q -p no:benchmark -m gpu -n 8 tests/forward/test_flash_fp8_ws.py tests/forward/test_flash_fp8.py \
  2>&1 | tail -4 | tee $OUT/fp8_tests.log
date -u +%H:%M:%S
timeout 220 python3 docs/results/s1127g/probe_fp8_configs.py n=4096,16384 rounds=3 2>&1 | grep -v -i warn | tee $OUT/fp8_configs.log
date -u +%H:%M:%S
