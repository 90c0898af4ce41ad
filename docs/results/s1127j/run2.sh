# Call 2 (H100, working tree on a868991 + WsConfig.transpose_v: V transposed by the fp8 WS kernel's producer warps
# 1..3): outputs against the pre-pass form (bitwise), then the rates at 4k and 16k beside our bf16.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 200 python3 -u docs/results/s1127j/probe_transpose.py n=4096 rounds=3 configs=224p,224pt,224pt32 2>&1 \
  | grep -v -i warn | tee $OUT/transpose_4k.log
date -u +%H:%M:%S
timeout 200 python3 -u docs/results/s1127j/probe_transpose.py n=16384 rounds=2 configs=224p,224pt 2>&1 \
  | grep -v -i warn | grep "N16384\|Error\|error" | tee $OUT/transpose_16k.log
date -u +%H:%M:%S
