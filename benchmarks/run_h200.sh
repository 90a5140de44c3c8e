#!/usr/bin/env bash
# What one H200 session runs (device machine, repo root): install, then the parts asked for, results
# and logs under $OUT (default benchmarks/results).
# Usage: bash benchmarks/run_h200.sh <git-sha> [parts]
#   t: every GPU test          p: bench prefix     l: bench layer     e: bench engine
#   d: the GPU demo            m: bench mla        k: bench topk + bench indexer
# Default parts: tpld. Install with `python -m pip` (a bare `pip` there belongs to another Python).
set -uo pipefail
SHA=$1
PARTS=${2:-tpld}
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
python -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | grep -v WARNING
bench() { python -m dsa bench "$1" --out "$OUT" --git-sha "$SHA" --reps "${2:-20}" 2>&1 | tee "$OUT/$1.log" | grep -v "^ "; }
[[ $PARTS == *t* ]] && { python -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -80 > "$OUT/gpu-tests.log"; tail -25 "$OUT/gpu-tests.log"; }
[[ $PARTS == *p* ]] && bench prefix
[[ $PARTS == *l* ]] && bench layer
[[ $PARTS == *e* ]] && bench engine
[[ $PARTS == *m* ]] && bench mla
[[ $PARTS == *k* ]] && { bench topk; bench indexer; }
[[ $PARTS == *d* ]] && python -m dsa demo --json "$OUT/demo-h200.json" 2>&1 | grep -v "demo:"
exit 0
