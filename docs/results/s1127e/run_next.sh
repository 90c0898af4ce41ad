# For the next session: h/carry-tail (41b982a: the persistent WS forward carries each block's last P V and epilogue
# into the next block's first step; ec9e98c: its causal rounds in snake order; cd25f0f: persistent forms of head
# dim 64's tuned shapes among the candidates; simulator and offline SASS only so far), then the 1k-2k rows of #30.
# Here first:  mkdir -p .ab/carry .ab/carry1 && git archive h/carry-tail numba_attn scripts tests reference \
#              pyproject.toml | tar -x -C .ab/carry && git archive 41b982a numba_attn scripts | tar -x -C .ab/carry1
#              (then carry [".whl", ".ab"]; .ab/carry1, the carried tails without the snake, is for call 2)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache
tree() { local d=$1; shift; (cd "$d" && PYTHONPATH=/tmp/site:$d "$@"); }
# call 1 (~550 s): the branch's GPU tests, then persistent forced on both trees. Calls replayed: since fdcf71f a
# forced configuration has a replay plan of its own (before, every forced configuration of a shape replayed the
# first one's plan).
tree "$ROOT/.ab/carry" timeout 260 python3 -m pytest -q -m gpu -n 16 -p no:benchmark tests/forward/test_flash_wgmma_ws.py \
  tests/forward/test_flash_fp8_ws.py tests/forward/test_flash_window.py 2>&1 | tail -3
for t in "$ROOT" "$ROOT/.ab/carry"; do
  tree "$t" env NUMBA_ATTN_REPLAY=1 timeout 140 python3 $ROOT/docs/results/s1127d/probe_uniform.py "$(basename $t)" \
    d128:1024,2048,4096,16384 d64:1024,2048,4096 window 2>&1 | grep -v -i warn | tee -a $OUT/carry_ab.log
done
# call 2: the same probe on .ab/carry1 (which part pays); fp8's default and persistent forms on both trees:
#   for t in "$ROOT" "$ROOT/.ab/carry"; do tree "$t" timeout 150 python3 $ROOT/docs/results/s1127e/probe_fp8_persistent.py; done
# then, if the branch is merged: retune the WS tables (persistent entries may win more keys now), then the
# alternating-rounds probe of the 1k-2k rows and the sweep against cuDNN, and issue #30's fp8 probe
#   python3 scripts/prewarm_ws.py 64:bfloat16,float16 128:bfloat16,float16 && cp numba_attn/forward/tuned/sm90.json $OUT/
#   python3 scripts/tune_defaults.py --merge --out $OUT/sm90.json --headdims 128 64 --backend wgmma_ws --time-limit 85
#   cp $OUT/sm90.json numba_attn/forward/tuned/ && python3 docs/results/s1127e/probe_small.py rounds=5
#   python3 scripts/sweep.py --sweeps flash --direction forward --flash-configs 128:32,64:48 --dtypes bf16 \
#     --seqlens 1k,2k,4k,16k --providers "=numba_attn,=torch-sdpa-cudnn" --budget 0.3 --no-plot --out $OUT/sweep
