#!/usr/bin/env bash
# What the wave-3 H200 sessions ran (device machine, repo root), results and logs under $OUT.
# Usage: bash benchmarks/run_wave3.sh <parts>
#   t: the GPU tests of the changed paths (compiles, warm-up, graphs, syncs, model)   T: every GPU test
#   s: dsa serve --preset demo-gpu started cold (empty Triton cache), start-to-ready, then dsa bench serve:
#      one 32K prompt, a randomized run (200 requests, prompts 1-32768, max_tokens 1-256, concurrency 1-64),
#      64 x 8K; then a second start (warm Triton cache) and its start-to-ready
#   r: a cold start and the randomized run alone (kernel compiles after ready)
#   m: tests/test_model_gpu.py alone
#   k: a soak (dsa bench serve --soak: SOAK requests of the mix, default 2000, concurrency 64; 4000 took 155 s
#      on the H200, so SOAK=8000 is the 5-minute soak of issue #26) against a cold server
#   K: the long soak detached (setsid): SOAK requests (default 24000) against a server bench serve starts with
#      the default pool (issue #37 target b: the pool fills at ~16,700 requests of this mix; 20,000 took 696 s
#      after a 33 s start); W: wait for it (WAIT seconds, default 540) and copy soak-long.{json,log} and its
#      memory figure to $OUT: `SOAK=24000 ... K`, then `... W`
#      in the next calls until the log says "wrote"
#   x: SIGTERM under load: 64 streams of 4000 tokens, SIGTERM after 15 s (--shutdown-timeout 5): the
#      exit code and seconds, and how every stream ended
#   w: the serving workloads of issue #25 (64 x 8K, 16 x 32K, 16 questions on one 32K document, ITL at 32K)
#   o: with launch_probe.py beside it (not part of the project): host and device time per call of the
#      bench-layer DSA ops, base and new (after g, which installs the base)
#   c: the prefill chunk budget (issue #25 item 5): for --max-batch-tokens 2048, 4096, 8192, 16384 a warm
#      server, 64 x 8K (all done, TTFT) and 32 requests of 1K-16K prompts with 256 new tokens (TTFT, ITL)
#   h: host memory of an in-process Engine under the soak's mix (benchmarks/host_memory_engine.py, issue #37):
#      HM requests (default 2000) on demo-gpu with a pool of HM_BLOCKS (default 16384: full within the first
#      quarter), the MHA prefill's SDPA without cuDNN (the fix) and with it (--cudnn-sdpa); HM_FLAGS adds flags
#      (e.g. --tracemalloc)
#   p: host memory of the step's pinned copies, pinned anew per step against dsa.engine.staging (issue #26)
#   g: speed guards: bench layer and bench engine (--quick) of .base (the branch point, unpacked by the
#      caller from `git archive f0020de`) and of this tree, in the same run
# Wheels of the serve extra: .whl (see the device README); every part bounded by a timeout.
set -uo pipefail
PARTS=${1:-tsg}
OUT=${OUT:-benchmarks/results}
export PYTHONUNBUFFERED=1
LOG=$OUT/wave3.log
export PYTHONPATH=/tmp/site
if [[ $PARTS != W ]]; then  # W alone installs nothing: the detached soak it waits for runs from these files
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN
  python3 -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | grep -v WARNING
fi
say() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
serve_up() {  # name [dsa serve flags]: start dsa serve on port 8123, wait for /health, log the seconds
  local t0=$(date +%s%N)
  python3 -m dsa serve --preset demo-gpu --port 8123 "${@:2}" > "/tmp/$1.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 400); do
    curl -sf http://127.0.0.1:8123/health > /dev/null && break
    kill -0 $SERVER 2>/dev/null || break
    sleep 0.5
  done
  say "$1: ready after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  grep -E "compiled|Error|error" "/tmp/$1.log" | tail -5 | tee -a "$LOG"
}
serve_down() {
  kill -TERM $SERVER; wait $SERVER; say "server exit code $?"
  grep -E "compiled after warm-up|Traceback|Error" "/tmp/$1.log" | head -20 >> "$LOG"
}
load() {  # name, seconds, bench serve arguments...
  local name=$1 secs=$2; shift 2
  say "bench serve $name: $*"
  timeout "$secs" python3 -m dsa bench serve --url http://127.0.0.1:8123 --ignore-eos --json "$OUT/serve-$name.json" \
    "$@" 2>&1 | grep -v "it/s\]" | tail -14 | tee -a "$LOG"
}
if [[ $PARTS == *t* || $PARTS == *T* ]]; then
  say "GPU tests"
  FILES="tests/test_compiles_gpu.py tests/test_warmup_gpu.py tests/test_graphs_gpu.py tests/test_guards_gpu.py tests/test_model_gpu.py"
  [[ $PARTS == *T* ]] && FILES=""
  X="-x"; [[ $PARTS == *T* ]] && X=""
  timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider $X -s $FILES 2>&1 | grep -v "it/s\]" | tail -40 | tee -a "$LOG"
fi
if [[ $PARTS == *s* ]]; then
  rm -rf ~/.triton/cache
  serve_up cold
  load 32k 60 --num-requests 1 --concurrency 1 --input-len 32000 --max-tokens 256
  load random 200 --num-requests 200 --input-len-range 1 32768 --max-tokens-range 1 256 --concurrency-range 1 64
  load 64x8k 120 --num-requests 64 --concurrency 64 --input-len 8000 --max-tokens 128
  curl -s http://127.0.0.1:8123/metrics | grep -E "compiles|preempt" | tee -a "$LOG"
  serve_down cold
  serve_up warm
  serve_down warm
fi
if [[ $PARTS == *r* ]]; then
  rm -rf ~/.triton/cache
  serve_up cold
  load random 200 --num-requests 200 --input-len-range 1 32768 --max-tokens-range 1 256 --concurrency-range 1 64
  curl -s http://127.0.0.1:8123/metrics | grep -E "^dsa_(kernel|preempt)" | tee -a "$LOG"
  serve_down cold
fi
if [[ $PARTS == *m* ]]; then
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_model_gpu.py 2>&1 | tail -3 | tee -a "$LOG"
fi
if [[ $PARTS == *k* ]]; then  # SOAK requests (default 2000); SOAK_BLOCKS: a pool that fills early
  serve_up soak ${SOAK_BLOCKS:+--num-blocks $SOAK_BLOCKS}
  say "soak"
  timeout $(( ${SOAK:-2000} / 20 + 150 )) python3 -m dsa bench serve --url http://127.0.0.1:8123 --soak --num-requests ${SOAK:-2000} --concurrency 64 \
    --input-len-range 16 4096 --max-tokens-range 1 128 --json "$OUT/soak.json" 2>&1 | grep -v "req/s\]" | tail -24 \
    | tee -a "$LOG"
  curl -s http://127.0.0.1:8123/metrics | grep -E "^dsa_(resident|host_structure|gc_|kernel_compiles_after)" | tee -a "$LOG"
  serve_down soak
fi
if [[ $PARTS == *K* ]]; then  # the long soak, detached (it outlives the call): SOAK requests (default 24000) on
  # the default pool, the server started by bench serve itself; W waits for it in later calls
  say "soak, detached: ${SOAK:-24000} requests"
  rm -f /tmp/soak-long.json /tmp/soak-long-memory.png
  setsid nohup python3 -m dsa bench serve --preset demo-gpu --soak --num-requests ${SOAK:-24000} --concurrency 64 \
    --input-len-range 16 4096 --max-tokens-range 1 128 --ready-timeout 400 --json /tmp/soak-long.json \
    > /tmp/soak-long.log 2>&1 &
  echo $! > /tmp/soak-long.pid
  sleep 30; grep -v "req/s\]" /tmp/soak-long.log | tail -3
fi
if [[ $PARTS == *W* ]]; then  # wait for the detached soak (WAIT seconds at most, default 540); its files to $OUT
  t0=$SECONDS
  while kill -0 "$(cat /tmp/soak-long.pid)" 2>/dev/null && [ $((SECONDS - t0)) -lt ${WAIT:-540} ]; do sleep 10; done
  tr '\r' '\n' < /tmp/soak-long.log | grep -v "req/s\]" | tail -12 | tee -a "$LOG"
  for f in /tmp/soak-long.json /tmp/soak-long-memory.png /tmp/soak-long.log; do [ -f "$f" ] && cp "$f" "$OUT/"; done
fi
if [[ $PARTS == *x* ]]; then
  serve_up sigterm --shutdown-timeout 5
  python3 -m dsa bench serve --url http://127.0.0.1:8123 --num-requests 64 --concurrency 64 --input-len 2000 \
    --max-tokens 4000 --ignore-eos --json "$OUT/sigterm.json" > /tmp/sigterm-bench.log 2>&1 &
  BENCH=$!
  sleep 15
  t0=$(date +%s%N); kill -TERM $SERVER; wait $SERVER; rc=$?
  say "SIGTERM under load: exit code $rc after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
  wait $BENCH
  grep -E "requests|error" /tmp/sigterm-bench.log | head -5 | tee -a "$LOG"
  python3 -c "import json, collections; d = json.load(open('$OUT/sigterm.json')); print('finish reasons', \
collections.Counter(r['finish_reason'] for r in d['rows']), 'errors', sum(r['error'] is not None for r in d['rows']))" \
    | tee -a "$LOG"
  grep -cE "finish=abort \(shutdown\)" /tmp/sigterm.log | sed 's/^/log lines finish=abort (shutdown): /' | tee -a "$LOG"
fi
if [[ $PARTS == *w* ]]; then
  serve_up warm
  load 64x8k 120 --num-requests 64 --concurrency 64 --input-len 8000 --max-tokens 128
  load 16x32k 120 --num-requests 16 --concurrency 16 --input-len 32000 --max-tokens 128
  curl -s http://127.0.0.1:8123/metrics | grep -E "^dsa_(prefix_cache|preempt)" | tee -a "$LOG"
  load shared 60 --shared-prefix 16 --num-requests 16 --concurrency 16 --input-len 32000 --max-tokens 32
  curl -s http://127.0.0.1:8123/metrics | grep -E "^dsa_(prefix_cache|preempt|kernel)" | tee -a "$LOG"
  load itl 60 --num-requests 1 --concurrency 1 --input-len 32000 --max-tokens 256
  serve_down warm
fi
if [[ $PARTS == *c* ]]; then
  for chunk in 2048 4096 8192 16384; do
    serve_up chunk$chunk --max-batch-tokens $chunk
    load chunk$chunk-64x8k 120 --num-requests 64 --concurrency 64 --input-len 8000 --max-tokens 128
    load chunk$chunk-mixed 120 --num-requests 32 --concurrency 32 --input-len-range 1000 16000 --max-tokens 256
    serve_down chunk$chunk
  done
fi
if [[ $PARTS == *h* ]]; then
  for v in "" "--cudnn-sdpa"; do
    say "host_memory_engine ${v:-(cuDNN attention off)} ${HM_FLAGS:-}"
    timeout 300 python3 benchmarks/host_memory_engine.py --device cuda --preset demo-gpu --num-blocks ${HM_BLOCKS:-16384} \
      --requests ${HM:-2000} $v ${HM_FLAGS:-} --json "$OUT/host-memory-engine-h200${v:+-cudnn}.json" 2>&1 \
      | grep -Ev "leaked|nanobind|skipped rem" | tail -40 | tee -a "$LOG"
  done
fi
if [[ $PARTS == *p* ]]; then
  say "pinned copies: a buffer pinned per step against PinnedBuffers"
  timeout 120 python3 benchmarks/pinned_memory.py --steps 4000 --json "$OUT/pinned-memory.json" 2>&1 | tail -12 \
    | tee -a "$LOG"
fi
if [[ $PARTS == *g* ]]; then  # the editable install would shadow PYTHONPATH: off while the base runs
  python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/base ./.base 2>&1 | grep -v WARN
  python3 -m pip uninstall -y -q deepseek-sparse-attention 2>&1 | grep -v WARN
  for side in base new; do
    mkdir -p "$OUT/$side"
    if [[ $side == new ]]; then  # from the checkout (cwd): the editable install
      python3 -m pip install --no-build-isolation --no-deps -q -e . 2>&1 | grep -v WARNING; PP=/tmp/site; DIR=.
    else PP=/tmp/base:/tmp/site; DIR=/tmp; fi  # from /tmp: the checkout's dsa/ would come first on sys.path
    (cd $DIR && PYTHONPATH=$PP python3 -c "import dsa, dsa.kernels; print('$side runs', dsa.__file__, dsa.kernels.__file__)") | tee -a "$LOG"
    for op in layer engine; do
      say "bench $op ($side)"
      (cd $DIR && PYTHONPATH=$PP timeout 150 python3 -m dsa bench $op --quick --reps 20 --out "$OUT/$side" 2>&1) \
        | grep -E "^(B=|dsa |dense |layer|engine|wrote|Traceback|[A-Za-z]*Error)" | tail -12 | tee -a "$LOG"
    done
  done
fi
if [[ $PARTS == *o* && -f launch_probe.py ]]; then  # host time per launch of the DSA ops, base and new
  cp launch_probe.py /tmp/ && (cd /tmp && PYTHONPATH=/tmp/base:/tmp/site timeout 60 python3 launch_probe.py base 2>&1) \
    | tail -2 | tee -a "$LOG"
  PYTHONPATH=/tmp/site timeout 60 python3 launch_probe.py new 2>&1 | tail -2 | tee -a "$LOG"
fi
exit 0
