# Call 6 (H100, the session's last device time): after P's factor 2^8 (core.fp8.P_EXPONENT), the GPU tests that
# call 5 stopped at (the MMA-sums default's error against wgmma_fp8's) and those nearest it, verbose.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 140 python3 -m pytest -v -p no:benchmark -n 10 --tb=short tests/forward/test_flash_fp8.py \
  tests/forward/test_flash_fp8_ws.py -k "tile_configs and 128-wgmma_ws-config4 or lengths and 1000-1000-wgmma_ws \
or lengths and 1000-1-wgmma_ws or same_as or torch_float8 or peaky and wgmma_ws" 2>&1 \
  | grep -v -i "warn\|SKIPPED" | grep -E "PASSED|FAILED|Error|^E |assert|passed|failed" | tail -60 \
  | tee $OUT/tests_fp8.log
date -u +%H:%M:%S
