# Call 8 (issue #30): call 7's re-tuning wrote nothing (--take stopped at the wgmma tuner's keys, which lack the
# fields: fixed in tune_defaults.py). Again for bfloat16 D64 non-causal (the 1k key chose three consumers, persistent,
# in call 7), then the 1k-2k sweep with the table before (A) and after (B), A B A B. Same machine as call 7.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache
date -u +%H:%M:%S
table=numba_attn/forward/tuned/sm90.json
cp $table /tmp/sm90_a.json
timeout 80 python3 scripts/tune_defaults.py --merge --take consumers=3,persistent=True --headdims 64 \
  --dtypes bfloat16 --masks full --time-limit 25 2>&1 | grep -v -i warn | grep -E "^flash|taken|written|Error" | head -20
cp $table $OUT/sm90_b.json; cp $table /tmp/sm90_b.json
for round in 1 2; do
  for side in a b; do
    cp /tmp/sm90_$side.json $table
    timeout 40 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes bf16 \
      --causal noncausal --seqlens 1k,2k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
      --out $OUT/d64_$side$round 2>&1 | grep -E "^\[flash" | sed "s/^/$side$round /"
  done
done
cp /tmp/sm90_b.json $table
date -u +%H:%M:%S
