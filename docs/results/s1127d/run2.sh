# second call, same machine (kernels cached): window, D64 4k/16k and D128 16k for both trees, alternating
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export PREWARM=0
new() { PYTHONPATH=/tmp/site:$ROOT timeout 150 python3 docs/results/s1127d/probe_uniform.py new "$@" 2>&1 | grep -v -i warn | tee -a $OUT/probe2_new.log; }
base() { (cd .ab/base && PYTHONPATH=/tmp/site:$ROOT/.ab/base timeout 150 python3 $ROOT/docs/results/s1127d/probe_uniform.py base "$@" 2>&1 | grep -v -i warn | tee -a $OUT/probe2_base.log); }
new window; base window
new d64:4096,16384 d128:16384; base d64:4096,16384 d128:16384
