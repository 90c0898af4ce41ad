#!/usr/bin/env bash
# Same-lease A/B of a change: the sweep of numba_attn's own calls on the tree before (A, a copy of it in BASE_DIR)
# and on this tree (B), alternating A B A B so that the spread between the two A runs shows the noise; then the
# table of B/A per case (scripts/ab_compare.py) and the kernels whose PTX differs (scripts/ptx_dump.py).
#   bash scripts/ab_sweep.sh BASE_DIR OUT_DIR [ROUNDS] [-- extra sweep options]
# AB_FIRST_ROUND=N starts at round N (rounds before it already in OUT_DIR: one call per round fits a time limit);
# AB_BUDGET sets the sweep's --budget (seconds of timed calls per case, default 0.5).
# BASE_DIR holds numba_attn/, reference/ and scripts/ of the tree before (e.g. `git archive REV | tar -x -C BASE_DIR`).
set -uo pipefail
mkdir -p "$2"
base=$(cd "$1" && pwd); out=$(cd "$2" && pwd); rounds=${3:-2}; shift 3 || shift $#
[ "${1:-}" = "--" ] && shift
here=$(pwd)
sweep_args=(--providers =numba_attn --budget "${AB_BUDGET:-0.5}" --no-plot "$@")
first=${AB_FIRST_ROUND:-1}
for round in $(seq "$first" "$rounds"); do
  for side in a b; do
    tree=$([ $side = a ] && echo "$base" || echo "$here")
    run=(python3 scripts/sweep.py)
    # the first round also writes the PTX of every kernel the sweep compiled
    [ "$round" = 1 ] && run=(python3 "$here/scripts/ptx_dump.py" --out "$out/ptx_$side" -- scripts/sweep.py)
    echo "== round $round, side $side ($tree) $(date -u +%H:%M:%S)"
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" "${run[@]}" "${sweep_args[@]}" --out "$out/${side}${round}") \
      > "$out/${side}${round}.log" 2>&1 || { echo "sweep failed:"; tail -20 "$out/${side}${round}.log"; }
  done
done
for round in $(seq 1 "$rounds"); do
  [ -f "$out/a$round/results.json" ] && [ -f "$out/b$round/results.json" ] || continue
  python3 scripts/ab_compare.py "$out/a$round/results.json" "$out/b$round/results.json" > "$out/ab_round$round.md"
  tail -1 "$out/ab_round$round.md"
done
if [ "$rounds" -ge 2 ]; then
  list() { local side=$1 r files=(); for r in $(seq 1 "$rounds"); do files+=("$out/$side$r/results.json"); done; (IFS=,; echo "${files[*]}"); }
  python3 scripts/ab_compare.py "$(list a)" "$(list b)" > "$out/ab_best.md"
  echo "best of $rounds rounds, B against A: $(tail -1 "$out/ab_best.md")"
  python3 scripts/ab_compare.py "$out/a1/results.json" "$out/a2/results.json" > "$out/aa.md"
  echo "A against A (noise): $(tail -1 "$out/aa.md")"
  python3 scripts/ab_compare.py "$out/b1/results.json" "$out/b2/results.json" > "$out/bb.md"
  echo "B against B (noise): $(tail -1 "$out/bb.md")"
fi
[ -d "$out/ptx_a" ] && python3 scripts/ptx_dump.py --compare "$out/ptx_a" "$out/ptx_b" | tee "$out/ptx_compare.txt"
