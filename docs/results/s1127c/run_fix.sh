# One device call (H100, 2026-11-27): the three-consumer barrier fix's GPU tests, the D64 candidates probe, and
# the D64 tuning of the warp-specialised kernel (written to $OUT/sm90.json, merged into the shipped table).
# (prewarm_ws.py ran as docs/results/s1127c/prewarm.py then, the same code)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 2>&1 | grep -v -i warn
timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:benchmark tests/forward/test_flash_wgmma_ws.py \
  -k "queued or tile_configs_many_tiles" 2>&1 | grep -v -i warn | tail -6
timeout 170 python3 docs/results/s1127c/probe_configs.py 2>&1 | grep -v -i warn | tee $OUT/probe_configs.log | tail -20
cp numba_attn/forward/tuned/sm90.json $OUT/sm90.json
timeout 170 python3 scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 64 --backend wgmma_ws \
  --time-limit 120 > $OUT/tune64.log 2>&1; tail -25 $OUT/tune64.log
