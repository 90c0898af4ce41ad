# Call 1 (H100, tree of a868991 = the kernels of f3d688a / 71310a6): the V^T pre-pass's share of the fp8 call, then
# the GPU tests left unfinished last session: the fp8 file's WS tests and the WS kernel's test file, to the end.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 100 python3 -u docs/results/s1127j/probe_prepass.py 2>&1 | grep -v -i warn | tee $OUT/prepass.log
date -u +%H:%M:%S
timeout 230 python3 -m pytest -q -p no:benchmark -m gpu -n 16 --durations=8 tests/forward/test_flash_fp8.py \
  -k wgmma_ws 2>&1 | tail -14 | tee $OUT/tests_fp8.log
date -u +%H:%M:%S
timeout 240 python3 -m pytest -q -p no:benchmark -m gpu -n 16 --durations=8 tests/forward/test_flash_wgmma_ws.py \
  2>&1 | tail -14 | tee $OUT/tests_ws.log
date -u +%H:%M:%S
