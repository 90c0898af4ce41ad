# Call 7 (H100, the final tree: the register-pool check, the 17 re-tuned keys): the GPU tests of the dispatch and its
# tables (test_flash_kernels, test_autotune, test_tune_defaults) and the WS file's config tests.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 280 python3 -m pytest -q -p no:benchmark -m gpu -n 16 tests/forward/test_flash_kernels.py \
  tests/forward/test_autotune.py tests/forward/test_tune_defaults.py 2>&1 | tail -3 | tee $OUT/tests.log
timeout 60 python3 -m pytest -q -p no:benchmark tests/forward/test_flash_wgmma_ws.py -k "validated or register" 2>&1 \
  | tail -1 | tee -a $OUT/tests.log
date -u +%H:%M:%S
