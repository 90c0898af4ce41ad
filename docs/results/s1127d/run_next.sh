# For the next session (two H100 calls, ~900 s in all): the three branches this session left untimed, against main.
# Here first:  mkdir -p .ab/snake .ab/bwd && git archive h/snake numba_attn scripts | tar -x -C .ab/snake &&
#              git archive h/uniform-bwd numba_attn scripts tests reference pyproject.toml | tar -x -C .ab/bwd &&
#              mkdir -p .ab/poly && git archive h/poly-exp2 numba_attn scripts docs/results/s1127d | tar -x -C .ab/poly
#              (then carry [".whl", ".ab"]; split the parts over two calls of <= 600 s)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export PYTHONPATH=/tmp/site:$ROOT NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache REPLAY=1 NUMBA_ATTN_REPLAY=1
tree() { local d=$1; shift; (cd "$d" && PYTHONPATH=/tmp/site:$d "$@"); }
# issue #29's decode targets on today's main (its decode kernels' PTX changed with d4bb525 after the last measure)
timeout 200 python3 scripts/bench_issue29.py --part decode --out $OUT/issue29_decode.json 2>&1 | grep -v -i warn | tail -30
# h/snake: persistent rounds in snake order -- causal rows, forced persistent and the dispatch, both trees
for t in "$ROOT" "$ROOT/.ab/snake"; do
  tree "$t" timeout 170 python3 $ROOT/docs/results/s1127d/probe_uniform.py "$(basename $t)" d128:1024,2048,4096,16384 \
    d64:1024,4096 window 2>&1 | grep -v -i warn | tee -a $OUT/snake_ab.log
done
# h/uniform-bwd: the WS backward's uniform warpgroup index -- GPU tests, then the backward sweep, both trees
tree "$ROOT/.ab/bwd" timeout 240 python3 -m pytest -q -m gpu -n 16 -p no:benchmark tests/backward 2>&1 | tail -2
for t in "$ROOT" "$ROOT/.ab/bwd"; do
  tree "$t" timeout 120 python3 scripts/sweep.py --sweeps flash --direction backward --flash-configs 128:32,64:48 \
    --dtypes bf16 --seqlens 4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot \
    --out $OUT/bwd_$(basename $t) > /dev/null 2>&1; grep -A6 "^| size" $OUT/bwd_$(basename $t)/results.md | grep "^| [0-9]"
done
# h/poly-exp2: part of the exponentials on the FMA pipe -- D64 bf16 and fp8 D128, poly_every 0 / 6 / 8 / 12
tree "$ROOT/.ab/poly" timeout 300 python3 docs/results/s1127d/probe_poly.py 2>&1 | grep -v -i warn | tee $OUT/poly.log
# Then, with the branches that won merged: retune the WS tables (the entries were chosen before the uniform index,
# when the persistent kernel's key loop was ~9 % slower):
#   python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 && cp numba_attn/forward/tuned/sm90.json $OUT/
#   python3 scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 64,128 --backend wgmma_ws --time-limit 120
