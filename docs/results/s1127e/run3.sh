# Call 3 (H100): the backward sweep on main and on h/uniform-bwd; then h/snake against main again at D128 1k-2k with
# calls replayed (NUMBA_ATTN_REPLAY=1: less host time per call) and the 4k window on 64k keys, both trees.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache
tree() { local d=$1; shift; (cd "$d" && PYTHONPATH=/tmp/site:$d "$@"); }
date -u +%H:%M:%S
for t in "$ROOT" "$ROOT/.ab/bwd"; do
  tree "$t" timeout 130 python3 scripts/sweep.py --sweeps flash --direction backward --flash-configs 128:32,64:48 \
    --dtypes bf16 --seqlens 4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/bwd_$(basename $t) > /dev/null 2>&1; grep -A8 "^| size" $OUT/bwd_$(basename $t)/results.md
done
date -u +%H:%M:%S
for t in "$ROOT" "$ROOT/.ab/snake"; do
  tree "$t" env PREWARM=0 NUMBA_ATTN_REPLAY=1 timeout 110 python3 $ROOT/docs/results/s1127d/probe_uniform.py \
    "$(basename $t)-replay" d128:1024,2048 window 2>&1 | grep -v -i warn | tee -a $OUT/snake_ab2.log
done
date -u +%H:%M:%S
