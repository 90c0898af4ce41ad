# Call 5 (issue #30), branch h/block-turn against main (A: .ab/base = git archive main): the persistent kernel's
# turn (a block's last P V beside the next block's tile 0). 16-bit: the sweep of our own calls, bf16, D128 H32 and
# D64 H48, 1k-4k, alternating A B A B; fp8: probe_sums.py's default form on each tree (4k, beside our bf16).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
here=$PWD; base=$PWD/.ab/base; mkdir -p $OUT/ab
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
for tree in $base $here; do
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 90 python3 scripts/prewarm_ws.py 128:bfloat16 64:bfloat16 2>&1 | tail -1)
done
date -u +%H:%M:%S
for round in 1 2; do
  for side in a b; do
    tree=$([ $side = a ] && echo $base || echo $here)
    (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 80 python3 scripts/sweep.py --sweeps flash --direction forward \
      --flash-configs 128:32,64:48 --dtypes bf16 --seqlens 1k,2k,4k --providers =numba_attn --budget 0.3 --no-plot \
      --out $OUT/ab/$side$round > $OUT/ab/$side$round.log 2>&1) || tail -5 $OUT/ab/$side$round.log
    echo "round $round side $side $(date -u +%H:%M:%S)"
  done
done
for round in 1 2; do
  python3 scripts/ab_compare.py $OUT/ab/a$round/results.json $OUT/ab/b$round/results.json 2>&1 | tail -16
done
for side in a b; do
  tree=$([ $side = a ] && echo $base || echo $here)
  (cd $tree && PYTHONPATH=/tmp/site:$tree timeout 75 python3 -u $here/docs/results/s1127j/probe_sums.py n=4096 \
    rounds=2 configs=224ps check=short 2>&1 | grep -v -i warn | sed "s/^/$side: /")
done
date -u +%H:%M:%S
PYTHONPATH=/tmp/site:$here timeout 60 python3 -u scripts/ws_timeline.py --stores tma --batch 4 --heads 48 \
  --seqlen 1024 --head-dim 64 --full --config block_n=128,persistent=1 2>&1 | grep -v -i warn
date -u +%H:%M:%S
