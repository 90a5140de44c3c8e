#!/usr/bin/env bash
# Issue #38's long-prompt runs on one H200 (device machine, repo root): install, then the parts
# asked for; results under $OUT (default benchmarks/results), each bounded by a timeout that fits
# one 10-minute device call.
# Usage: bash benchmarks/run_long_h200.sh <git-sha> [parts]
#   l: dsa bench long at 128K, 256K, 512K and 1M on demo-gpu (+ dense at 128K)   ~5 min
#   s: one 1M-token request through dsa serve --max-model-len, by dsa bench serve  ~4 min
#   q: a smoke run of both (32K-256K, and a 128K request on a 1M-limit server)      ~5 min
# Default parts: l (run s in a second call).
set -uo pipefail
SHA=$1
PARTS=${2:-l}
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
python -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | grep -v WARNING
mkdir -p "$OUT"
serve() {  # prompt tokens, result file, seconds allowed
  timeout "$3" python -m dsa bench serve --preset demo-gpu --max-model-len 1049600 --num-requests 1 \
    --concurrency 1 --input-len "$1" --max-tokens 32 --ignore-eos --ready-timeout 400 --request-timeout 400 \
    --json "$OUT/$2" 2>&1 | grep -v "req/s]\|it/s]" | tail -20
}
[[ $PARTS == *l* ]] && timeout 560 python -m dsa bench long --lengths 131072,262144,524288,1048576 --out "$OUT" \
  --git-sha "$SHA" 2>&1 | tee -a "$OUT/bench-long.log" | grep -v "^long_prefill"
[[ $PARTS == *s* ]] && serve 1048576 "serve-1m-h200-$(date -u +%F).json" 560
[[ $PARTS == *q* ]] && { timeout 300 python -m dsa bench long --lengths 32768,131072,262144 --dense-up-to 32768 \
  --out "$OUT" --git-sha "$SHA" 2>&1 | grep -v "^long_prefill"; serve 131072 "serve-128k-on-1m-h200.json" 240; }
exit 0
