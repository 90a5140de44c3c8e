#!/usr/bin/env bash
# What one H200 session runs (device machine, repo root): install, then the parts asked for, results
# and logs under $OUT (default benchmarks/results).
# Usage: bash benchmarks/run_h200.sh <git-sha> [parts]
#   t: every GPU test   p: bench prefix   l: bench layer   e: bench engine   d: the GPU demo
#   m: bench mla        k: bench topk     i: bench indexer
#   g: bench long at 128K-1M on demo-gpu (+ dense at 128K), ~5 min      (issue #38; each of g, s, q
#   G: bench long at 128K and 1M only (no dense rows): the 1M time to first token and decode's ratio to 128K, ~4 min
#   s: one 1M-token request through dsa serve --max-model-len, ~4 min    fills one 10-minute call)
#   c: the prefill chunk for long prompts (issue #38 item 2): bench long at 512K (no dense rows) with
#      --max-batch-tokens 4096, 8192, 16384, 32768, each into $OUT/chunk-N, ~5 min
#   q: a smoke run of both (32K-256K, and a 128K request on a 1M-limit server), ~5 min
#   v: bench engine --speculative-tokens 2 --quick (issue #39, B = 1 at the longest context): the trained
#      default with its MTP module into $OUT/spec-default, demo-gpu with the test drafter at acceptance 0.7
#      into $OUT/spec-demo-gpu (each a warm pass after a first), ~5 min
#   V: the batch crossover of speculation (issue #39): the trained default at its longest context, B = 1, 4, 16, 64
#      (--spec-batch) into $OUT/spec-default-batch, ~4 min
#   P: benchmarks/profile_spec_step.py (issue #39): torch.profiler over a warm B = 1 pass, plain and
#      speculating, the trained default into $OUT/profile-default, demo-gpu (test drafter, p = 0.7) into
#      $OUT/profile-demo-gpu, ~4 min
#   x: benchmarks/prefill_indexer_split.py (issue #38): one chunked ragged-logits call at 64K, 256K, 512K and 1M keys ($SPLIT_LENGTHS)
#      split into the logits and the top-k's kernels, and their knobs, into $OUT/prefill-indexer-split.json, ~4 min
#   r: the ragged-logits GPU tests (the Gluon kernel beside the portable one, up to 1M keys), ~1 min
#   L: benchmarks/profile_long_decode.py (issue #38): a B = 1 decode step's device time at 128K, 512K and 1M keys
#      (eager, graph replay, torch.profiler's kernels) on demo-gpu with random caches, into $OUT/profile-long-decode.json, ~3 min
#   D: benchmarks/spec_divergence.py (issue #39): where speculating runs' greedy tokens leave the plain run's,
#      per drafter, graphs and eager, into $OUT/spec-divergence.json, ~2 min
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
serve_long() {  # prompt tokens, result file, seconds allowed
  timeout "$3" python -m dsa bench serve --preset demo-gpu --max-model-len 1049600 --num-requests 1 \
    --concurrency 1 --input-len "$1" --max-tokens 32 --ignore-eos --ready-timeout 400 --request-timeout 400 \
    --json "$OUT/$2" 2>&1 | grep -v "req/s]\|it/s]" | tail -20
}
spec() {  # name [bench engine flags]
  timeout 300 python -m dsa bench engine --speculative-tokens 2 --quick --out "$OUT/spec-$1" --git-sha "$SHA" "${@:2}" \
    2>&1 | tee -a "$OUT/bench.log" | grep -E "^(default|demo|wrote|Traceback|[A-Za-z]*Error)"
}
[[ $PARTS == *t* ]] && { timeout 300 python -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -80 > "$OUT/gpu-tests.log"
                         tail -30 "$OUT/gpu-tests.log"; }
[[ $PARTS == *r* ]] && timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_kernels_gpu.py \
  -k ragged -rs 2>&1 | tail -30 | tee "$OUT/gpu-tests-ragged.log"
[[ $PARTS == *D* ]] && timeout 200 python benchmarks/spec_divergence.py --out "$OUT/spec-divergence.json" 2>&1 | tail -5
[[ $PARTS == *L* ]] && timeout 300 python benchmarks/profile_long_decode.py --out "$OUT/profile-long-decode.json" 2>&1 | tail -20
[[ $PARTS == *p* ]] && bench prefix 70
[[ $PARTS == *l* ]] && bench layer 90
[[ $PARTS == *e* ]] && bench engine 110
[[ $PARTS == *d* ]] && timeout 50 python -m dsa demo --json "$OUT/demo-h200.json" 2>&1 | grep -v "tok/s]"
[[ $PARTS == *m* ]] && bench mla 240
[[ $PARTS == *k* ]] && bench topk 90
[[ $PARTS == *i* ]] && bench indexer 90
[[ $PARTS == *v* ]] && { spec default; spec demo-gpu --preset demo-gpu --draft-acceptance 0.7; }
[[ $PARTS == *V* ]] && spec default-batch --spec-batch 1,4,16,64
[[ $PARTS == *P* ]] && { timeout 150 python benchmarks/profile_spec_step.py --new 64 --out "$OUT/profile-default" \
                           2>&1 | grep -v "^USDT" | tail -60
                         timeout 200 python benchmarks/profile_spec_step.py --preset demo-gpu --draft-acceptance 0.7 \
                           --new 64 --out "$OUT/profile-demo-gpu" 2>&1 | grep -v "^USDT" | tail -60; }
[[ $PARTS == *g* ]] && timeout 560 python -m dsa bench long --lengths 131072,262144,524288,1048576 --out "$OUT" \
  --git-sha "$SHA" 2>&1 | tee -a "$OUT/bench-long.log" | grep -v "^long_prefill"
[[ $PARTS == *G* ]] && timeout 400 python -m dsa bench long --lengths 131072,1048576 --dense-up-to 1 --out "$OUT" \
  --git-sha "$SHA" 2>&1 | tee -a "$OUT/bench-long.log" | grep -v "^long_prefill"
[[ $PARTS == *x* ]] && timeout 300 python benchmarks/prefill_indexer_split.py --lengths "${SPLIT_LENGTHS:-65536,262144,524288,1048576}" \
  --out "$OUT/prefill-indexer-split.json" \
  2>&1 | tee -a "$OUT/bench.log" | tail -40
[[ $PARTS == *c* ]] && for mbt in 4096 8192 16384 32768; do
  timeout 150 python -m dsa bench long --lengths 524288 --dense-up-to 1 --max-batch-tokens $mbt \
    --out "$OUT/chunk-$mbt" --git-sha "$SHA" 2>&1 | tee -a "$OUT/bench-long.log" | grep -v "^long_prefill" | tail -3
done
[[ $PARTS == *s* ]] && serve_long 1048576 "serve-1m-h200-$(date -u +%F).json" 560
[[ $PARTS == *q* ]] && { timeout 300 python -m dsa bench long --lengths 32768,131072,262144 --dense-up-to 32768 \
  --out "$OUT" --git-sha "$SHA" 2>&1 | grep -v "^long_prefill"; serve_long 131072 "serve-128k-on-1m-h200.json" 240; }
exit 0
