#!/usr/bin/env bash
# What one H200 session runs (device machine, repo root): install, then the parts asked for, results
# and logs under $OUT (default benchmarks/results).
# Usage: bash benchmarks/run_h200.sh <git-sha> [parts]
#   t: every GPU test   p: bench prefix   l: bench layer   e: bench engine   d: the GPU demo
#   m: bench mla        k: bench topk     i: bench indexer
# Each part is bounded by a timeout; bench output is appended to $OUT/bench.log.
# Default parts: tpld. Install with `python -m pip` (a bare `pip` there belongs to another Python).
set -uo pipefail
SHA=$1
PARTS=${2:-tpld}
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
python -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | grep -v WARNING
bench() {  # op, seconds allowed
  timeout "$2" python -m dsa bench "$1" --out "$OUT" --git-sha "$SHA" --reps 20 2>&1 | tee -a "$OUT/bench.log" \
    | grep -E "^(B=|dsa |dense |cached|uncached|wrote|Traceback|[A-Za-z]*Error)"
}
[[ $PARTS == *t* ]] && { timeout 250 python -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -80 > "$OUT/gpu-tests.log"
                         tail -30 "$OUT/gpu-tests.log"; }
[[ $PARTS == *p* ]] && bench prefix 70
[[ $PARTS == *l* ]] && bench layer 90
[[ $PARTS == *e* ]] && bench engine 110
[[ $PARTS == *d* ]] && timeout 50 python -m dsa demo --json "$OUT/demo-h200.json" 2>&1 | grep -v "tok/s]"
[[ $PARTS == *m* ]] && bench mla 120
[[ $PARTS == *k* ]] && bench topk 90
[[ $PARTS == *i* ]] && bench indexer 90
exit 0
