# Call 9 (H100, branch h/fp8-mma-sums: P's row sums from the P V MMA, WsConfig.fp8_sums): errors against float32
# attention of the dequantised inputs, then the rates at 4k and 16k beside our bf16 and the default fp8 form.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 150 python3 -u docs/results/s1127j/probe_sums.py n=4096 rounds=3 configs=224p,224ps 2>&1 \
  | grep -v -i warn | tee $OUT/sums_4k.log
date -u +%H:%M:%S
timeout 150 python3 -u docs/results/s1127j/probe_sums.py n=16384 rounds=2 configs=224p,224ps check=0 2>&1 \
  | grep -v -i warn | tee $OUT/sums_16k.log
date -u +%H:%M:%S
