# Call 7 (issue #30): the D64 1k keys of the shipped table never timed the three-consumer persistent candidate for
# bfloat16 (and float16 causal); it won float16's non-causal key by 6 %. Re-tune those keys (tune_defaults.py --merge
# --take: only keys the new candidate wins change), then the D64 sweep beside cuDNN with the table before (A) and
# after (B), alternating A B A B.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 150 python3 scripts/prewarm_ws.py 64:bfloat16,float16 2>&1 | tail -1
table=numba_attn/forward/tuned/sm90.json
cp $table /tmp/sm90_a.json
T="timeout 120 python3 scripts/tune_defaults.py --merge --take consumers=3,persistent=True --headdims 64"
$T --dtypes bfloat16 --masks full --time-limit 35 2>&1 | grep -v -i warn | tail -14
$T --dtypes bfloat16 --masks causal --time-limit 35 2>&1 | grep -v -i warn | tail -14
$T --dtypes float16 --masks causal --time-limit 25 2>&1 | grep -v -i warn | tail -14
cp $table $OUT/sm90_b.json; cp $table /tmp/sm90_b.json
date -u +%H:%M:%S
for round in 1 2; do
  for side in a b; do
    cp /tmp/sm90_$side.json $table
    timeout 60 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes bf16,fp16 \
      --seqlens 1k,2k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot --out $OUT/d64_$side$round \
      > $OUT/d64_$side$round.log 2>&1 || tail -3 $OUT/d64_$side$round.log
    echo "round $round side $side $(date -u +%H:%M:%S)"
    grep -A6 "^flash: D=64" $OUT/d64_$side$round/results.md | grep -E "^flash|^1k|^2k"
  done
done
cp /tmp/sm90_b.json $table
date -u +%H:%M:%S
