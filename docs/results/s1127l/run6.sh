# Call 6 (issue #30): the D64 1k key's candidates beside cuDNN (probe_d64_1k.py), main's kernels.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 150 python3 scripts/prewarm_ws.py 64:bfloat16,float16 2>&1 | tail -1
date -u +%H:%M:%S
timeout 200 python3 -u docs/results/s1127l/probe_d64_1k.py rounds=5 2>&1 | grep -v -i warn
date -u +%H:%M:%S
