# Call 7 (H100, tree of 71310a6: narrow tiles only where a call can meet one): the WS kernel's GPU test file and the
# WS-parametrised fp8 tests, then the fp8 rows at 16k (default: 224-key persistent) against our bf16.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 250 python3 -m pytest -q -p no:benchmark -m gpu -n 16 tests/forward/test_flash_wgmma_ws.py 2>&1 | tail -2 \
  | tee $OUT/tests_ws.log
date -u +%H:%M:%S
timeout 170 python3 -m pytest -q -p no:benchmark -m gpu -n 16 tests/forward/test_flash_fp8.py -k wgmma_ws 2>&1 \
  | tail -2 | tee $OUT/tests_fp8.log
date -u +%H:%M:%S
timeout 150 python3 -u docs/results/s1127h/probe_fp8_store.py n=16384 rounds=2 configs=224p stores=tma 2>&1 \
  | grep -v -i warn | tee $OUT/fp8_16k.log
date -u +%H:%M:%S
