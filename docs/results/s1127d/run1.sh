python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
ROOT=$PWD
export PYTHONPATH=/tmp/site:$ROOT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 180 python3 docs/results/s1127d/probe_uniform.py new 2>&1 | grep -v -i warn | tee $OUT/probe_new.log
cd .ab/base && PYTHONPATH=/tmp/site:$ROOT/.ab/base timeout 180 python3 $ROOT/docs/results/s1127d/probe_uniform.py base 2>&1 | grep -v -i warn | tee $OUT/probe_base.log
cd $ROOT && timeout 200 python3 -m pytest -q -m gpu -n 16 -p no:benchmark tests/forward/test_flash_wgmma_ws.py 2>&1 | tail -5
