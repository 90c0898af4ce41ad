# Call 8 (H100): A/B of the WS softmax's row maxima in 4 interleaved chains (B: this tree) against one chain (A: a868991
# in .ab/base, with this session's tuned table absent there -- so the A/B is of the sweep's numba_attn rows, each side
# with its own table; the fp8 probe forces the 224-key persistent form on both). Sides alternate A B A B.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
here=$PWD; base=$PWD/.ab/base
cp numba_attn/forward/tuned/sm90.json $base/numba_attn/forward/tuned/sm90.json  # (the same table on both sides)
for tree in $base $here; do
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 100 python3 scripts/prewarm_ws.py 128:bfloat16 64:bfloat16 2>&1 | tail -1)
done
date -u +%H:%M:%S
for round in 1 2; do
  for side in a b; do
    tree=$([ $side = a ] && echo $base || echo $here)
    (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 90 python3 scripts/sweep.py --sweeps flash --direction forward \
      --flash-configs 128:32,64:48 --dtypes bf16 --seqlens 1k,2k,4k,16k --providers "=numba_attn" --budget 0.3 \
      --no-plot --out $OUT/$side$round > $OUT/$side$round.log 2>&1)
    (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 80 python3 -u docs/results/s1127h/probe_fp8_store.py n=4096 \
      rounds=2 configs=224p stores=tma 2>&1 | grep -v -i warn | sed "s/^/$side$round /" | tee -a $OUT/fp8.log)
  done
done
date -u +%H:%M:%S
for r in 1 2; do python3 scripts/ab_compare.py $OUT/a$r/results.json $OUT/b$r/results.json > $OUT/ab_round$r.md; tail -1 $OUT/ab_round$r.md; done
python3 scripts/ab_compare.py $OUT/a1/results.json,$OUT/a2/results.json $OUT/b1/results.json,$OUT/b2/results.json > $OUT/ab_best.md
cat $OUT/ab_best.md | tail -25
