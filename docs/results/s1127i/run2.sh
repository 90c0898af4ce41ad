# Call 2 (H100): narrow tiles (working tree after ee4fd2e) -- the A/B probe against the same kernel with every tile
# whole, then the GPU tests of the WS kernels (16-bit, fp8, packed sequences, windows / soft-capping).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 230 python3 -u docs/results/s1127i/probe_narrow.py rounds=3 2>&1 | grep -v -i warn | tee $OUT/narrow.log
date -u +%H:%M:%S
timeout 200 python3 -m pytest -q -p no:benchmark -m gpu -n 10 tests/forward/test_flash_wgmma_ws.py 2>&1 | tail -4 \
  | tee $OUT/tests_ws.log
date -u +%H:%M:%S
timeout 140 python3 -m pytest -q -p no:benchmark -m gpu -n 10 tests/forward/test_flash_fp8_ws.py \
  tests/forward/test_flash_varlen.py tests/forward/test_flash_variants.py 2>&1 | tail -4 | tee $OUT/tests_more.log
date -u +%H:%M:%S
