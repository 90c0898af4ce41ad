# Call 3 (H100, working tree: WsConfig.transpose_v, the register pool check): the 24/240 transposing kernel against
# the pre-pass form (outputs bitwise, then rates at 4k and 16k beside our bf16); then whether a block whose budgets
# exceed its launch's registers (32 + 2 x 240) finishes.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 200 python3 -u docs/results/s1127j/probe_transpose.py n=4096 rounds=3 configs=224p,224pt 2>&1 \
  | grep -v -i warn | tee $OUT/transpose_4k.log
date -u +%H:%M:%S
timeout 170 python3 -u docs/results/s1127j/probe_transpose.py n=16384 rounds=2 configs=224p,224pt check=0 2>&1 \
  | grep -v -i warn | tee $OUT/transpose_16k.log
date -u +%H:%M:%S
timeout 60 python3 -u docs/results/s1127j/check_register_pool.py 24 2>&1 | grep -v -i warn | tee $OUT/pool.log
timeout 60 python3 -u docs/results/s1127j/check_register_pool.py 32 2>&1 | grep -v -i warn | tee -a $OUT/pool.log
echo "rc ${PIPESTATUS[0]}" | tee -a $OUT/pool.log
date -u +%H:%M:%S
