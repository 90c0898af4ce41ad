# Call 1 (H100): the SFU's exp2 rates; the fp8 WS tests on branch h/fp8-224p (224-key persistent default; includes
# the three GPU tests 1890e7b's runs missed); host time per replayed call; fp8 rows 4k and 16k, causal and not.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader; date -u +%H:%M:%S
timeout 60 python3 -u docs/results/s1127i/probe_mufu.py 2>&1 | grep -v -i warn | tee $OUT/mufu.log
timeout 90 python3 scripts/prewarm_ws.py 128:fp8 64:fp8 2>&1 | tail -1; date -u +%H:%M:%S
timeout 200 python3 -m pytest -q -p no:benchmark -m gpu -n 8 tests/forward/test_flash_fp8_ws.py \
  "tests/forward/test_flash_fp8.py" -k "wgmma_ws or test_flash_fp8_ws" 2>&1 | tail -3 | tee $OUT/fp8_tests.log
date -u +%H:%M:%S
timeout 45 python3 -u docs/results/s1127h/profile_host.py 2>&1 | grep -v -i warn | head -30 | tee $OUT/host.log
date -u +%H:%M:%S
timeout 170 python3 -u docs/results/s1127h/probe_fp8_store.py n=4096,16384 rounds=3 configs=192,224p stores=tma 2>&1 \
  | grep -v -i warn | tee $OUT/fp8_rows.log
date -u +%H:%M:%S
