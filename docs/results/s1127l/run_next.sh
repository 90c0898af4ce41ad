# For the next session (issue #30). The shipped table's bfloat16|64|False|262144|1024 entry (two consumers,
# persistent) was tuned before the three-consumer persistent candidate was timed for it; call 7 (H100, 2026-11-27
# 23:35 UTC) chose that candidate (the default 26.3 % slower) but wrote nothing (--take, fixed since). Here: the
# tuning again (unbuffered: call 8's run printed nothing), then D64 1k-2k beside cuDNN with the table before (A)
# and after (B), A B A B. If B holds, commit the table (numba_attn/forward/tuned/sm90.json from $OUT/sm90_b.json).
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD NUMBA_ATTN_CACHE_DIR=$PWD/.gpu/cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader; date -u +%H:%M:%S
timeout 150 python3 scripts/prewarm_ws.py 64:bfloat16,float16 2>&1 | tail -1
table=numba_attn/forward/tuned/sm90.json
cp $table /tmp/sm90_a.json
timeout 120 python3 scripts/tune_defaults.py --merge --take consumers=3,persistent=True --headdims 64 \
  --dtypes bfloat16 --masks full --time-limit 35 2>&1 | grep -v -i warn | tail -25
cp $table $OUT/sm90_b.json; cp $table /tmp/sm90_b.json
python3 - <<'PY'
import json
a, b = (json.load(open(f"/tmp/sm90_{x}.json")) for x in "ab")
for t in a["tuners"]:
    for k, e in b["tuners"][t]["entries"].items():
        if a["tuners"][t]["entries"].get(k) != e:
            print("changed:", t, k, e["config"])
PY
for round in 1 2; do
  for side in a b; do
    cp /tmp/sm90_$side.json $table
    timeout 60 python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 64:48 --dtypes bf16,fp16 \
      --seqlens 1k,2k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot --out $OUT/d64_$side$round \
      2>&1 | grep -E "^\[flash" | sed "s/^/$side$round /"
  done
done
cp /tmp/sm90_b.json $table
date -u +%H:%M:%S
