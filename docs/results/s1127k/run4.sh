# Call 4 (H100): GPU tests after fp8_sums became the fp8 default (lse calls keep the softmax's sums) and the
# persistent schedule moved to core.block_info: the fp8 files, then the 16-bit WS file.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 300 python3 -m pytest -q -p no:benchmark -n 6 --tb=short tests/forward/test_flash_fp8_ws.py \
  tests/forward/test_flash_fp8.py 2>&1 | grep -v -i "warn\|SKIPPED" | tail -40 | tee $OUT/tests_fp8.log
date -u +%H:%M:%S
timeout 230 python3 -m pytest -q -p no:benchmark -n 6 --tb=short tests/forward/test_flash_wgmma_ws.py 2>&1 \
  | grep -v -i "warn\|SKIPPED" | tail -30 | tee $OUT/tests_ws.log
date -u +%H:%M:%S
