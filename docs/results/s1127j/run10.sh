# Call 10 (H100, branch h/fp8-mma-sums with each tile's row sums folded into float32 and the MMA's column cleared):
# the errors of call 9's worst shapes, then the 4k rates (two rounds), in what device time was left.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
date -u +%H:%M:%S
timeout 100 python3 -u docs/results/s1127j/probe_sums.py n=4096 rounds=2 configs=224p,224ps check=short 2>&1 \
  | grep -v -i warn | tee $OUT/sums2_4k.log
date -u +%H:%M:%S
