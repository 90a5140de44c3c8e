#!/usr/bin/env bash
# Speed guard on one GPU: `dsa bench layer --quick` and `dsa bench engine --quick` of a base tree and of
# this checkout, alternated ROUNDS times in one run, then benchmarks/guard_compare.py gates the
# graph-replay rows (new / base <= 1 + TOLERANCE) and reports the eager and wall rows.
#
#   mkdir -p .base && git archive BASE -- . ':!dsa/data/default' ':!dsa/data/indexers' ':!benchmarks/results' \
#       ':!benchmarks/figures' | tar -x -C .base        # the code only: the benches run random presets
#   OUT=... bash benchmarks/guard.sh [ROUNDS] [NAME]    # on the GPU machine; .base carried (it is ignored)
#
# Writes $OUT/guard-NAME.json (every run's rows and the comparison) and $OUT/guard-NAME.log; the per-run
# JSON files stay in /tmp/guard. Exit status 1 when a gated row is slower than the tolerance.
set -uo pipefail
ROUNDS=${1:-3}
NAME=${2:-h200}
OUT=${OUT:-benchmarks/results}
RUNS=/tmp/guard
LOG=$OUT/guard-$NAME.log
mkdir -p "$OUT" && rm -rf $RUNS && mkdir -p $RUNS
say() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
[ -f .base/pyproject.toml ] || { echo "guard.sh: no .base/pyproject.toml (unpack the base tree first)" >&2; exit 2; }
# both sides installed the same way, into their own folders, each run from /tmp with only its folder on
# the path (an editable install would come first on the path for both: removed for the run)
python3 -m pip uninstall -y -q deepseek-sparse-attention 2>&1 | grep -v WARN
rm -rf /tmp/base /tmp/new
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/base ./.base 2>&1 | grep -v WARN
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/new . 2>&1 | grep -v WARN
for round in $(seq "$ROUNDS"); do
  for side in base new; do
    for op in layer engine; do
      say "round $round: bench $op ($side)"
      mkdir -p $RUNS/$side/r$round
      (cd /tmp && PYTHONPATH=/tmp/$side timeout 200 python3 -m dsa bench $op --quick --reps 20 --out $RUNS/$side/r$round 2>&1) \
        | grep -E "^(B=|dsa |dense |wrote|Traceback|[A-Za-z]*Error)" | tail -8 | tee -a "$LOG"
    done
  done
done
(cd /tmp && for side in base new; do PYTHONPATH=/tmp/$side python3 -c "import dsa, dsa.kernels; print('$side ran', dsa.__file__, dsa.kernels.__file__)"; done) | tee -a "$LOG"
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v WARN
python3 benchmarks/guard_compare.py $RUNS --json "$OUT/guard-$NAME.json" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
