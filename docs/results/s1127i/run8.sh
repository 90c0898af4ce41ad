# Call 8 (H100, tree of 71310a6): the WS-parametrised fp8 tests again, after the fp8 kernels' prewarm (call 7's run
# ran out of time in them).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
timeout 80 python3 scripts/prewarm_ws.py 128:fp8 64:fp8 2>&1 | tail -1
timeout 200 python3 -m pytest -q -p no:benchmark -m gpu -n 8 tests/forward/test_flash_fp8.py -k wgmma_ws 2>&1 | tail -2
