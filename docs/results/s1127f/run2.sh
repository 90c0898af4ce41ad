# Call 2: the persistent form on main, the branch and its first commit in turn (main and the branch twice), then fp8's default and
# persistent forms on main and the branch.
ROOT=$PWD
export NUMBA_ATTN_CACHE_DIR=$ROOT/.gpu/cache
tree() { local d=$1; shift; (cd "$d" && PYTHONPATH=/tmp/site:$d "$@"); }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
for pass in 1 2; do
  trees="$ROOT $ROOT/.ab/carry $ROOT/.ab/carry1"; [ $pass = 2 ] && trees="$ROOT $ROOT/.ab/carry"
  for t in $trees; do
    tree "$t" timeout 120 python3 $ROOT/docs/results/s1127f/probe_carry.py "$(basename $t)$pass" \
      d128:1024,2048,4096 d64:1024,4096 2>&1 | grep -v -i warn | tee -a $OUT/carry_ab2.log
  done
done
for t in "$ROOT" "$ROOT/.ab/carry"; do
  tree "$t" timeout 80 python3 $ROOT/docs/results/s1127e/probe_fp8_persistent.py 2>&1 | grep -v -i warn \
    | sed "s|^|$(basename $t) |" | tee -a $OUT/fp8_ab.log
done
