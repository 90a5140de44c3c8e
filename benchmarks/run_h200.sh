#!/usr/bin/env bash
# What one H200 session runs (device machine, repo root): install, every GPU test, then the benchmarks,
# the GPU demo and a recall run, results under $OUT. Usage: bash benchmarks/run_h200.sh <git-sha> [part]
#   part "a": GPU tests + bench mla + bench layer;  part "b": bench crossover + demo + recall at 32K
set -uo pipefail
SHA=$1
PART=${2:-ab}
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
python -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | grep -v WARNING
if [[ $PART == *a* ]]; then
  python -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -60 > "$OUT/gpu-tests.log"; tail -15 "$OUT/gpu-tests.log"
  python -m dsa bench mla --out "$OUT" --git-sha "$SHA" --reps 20
  python -m dsa bench layer --out "$OUT" --git-sha "$SHA" --reps 20
fi
if [[ $PART == *b* ]]; then
  python -m dsa bench crossover --out "$OUT" --git-sha "$SHA" --reps 10
  python -m dsa demo --json "$OUT/demo-h200.json" 2>&1 | grep -v "demo:"
  python -m dsa recall --preset demo-gpu --context 32768 --queries 32 --out /tmp/recall && cp /tmp/recall/recall.json "$OUT/recall-demo-gpu-32k.json"
fi
if [[ $PART == *c* ]]; then  # a re-run of named GPU tests: bash benchmarks/run_h200.sh SHA c "tests/x.py::t ..."
  python -m pytest -q -p no:cacheprovider ${3} 2>&1 | tail -30
fi
