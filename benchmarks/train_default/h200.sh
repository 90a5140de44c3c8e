#!/usr/bin/env bash
# The trained default's run on one H200 (no network there), in calls of at most 10 minutes each:
#
#   bash benchmarks/train_default/h200.sh receive PART...   # copy carried data parts to /tmp/xfer, sha256-checked
#   bash benchmarks/train_default/h200.sh smoke              # every stage at the real shapes, 3 steps each (~2 min)
#   bash benchmarks/train_default/h200.sh start [ARGS...]    # join the parts, tokenize, check, train detached
#   bash benchmarks/train_default/h200.sh wait SECONDS       # hold the machine, show the log, copy results to $OUT
#   bash benchmarks/train_default/h200.sh collect            # the export as parts of <= 15 MiB, train.json, plot, log
#
# More indexer warm-up for the shipped default (`train.py refit`), with the token ids of `train.py prepare
# --tokenizer dsa/data/default/tokenizer.json` packed as .xfer/refit-data.tar.xz (+ refit-data.sha256):
#
#   bash benchmarks/train_default/h200.sh refit-start [ARGS...]  # unpack, check, refit detached
#   bash benchmarks/train_default/h200.sh refit-wait SECONDS      # hold the machine; when done, results to $OUT
#   bash benchmarks/train_default/h200.sh check [NAME CKPT]       # demo (JSON to $OUT) and generate on the default
#   bash benchmarks/train_default/h200.sh gpu-tests               # pytest -m gpu
#
# On a CPU machine with network: fetch the text (benchmarks/quality/fetch_text.py), train the tokenizer
# (`train.py prepare --only-tokenizer`), then `h200.sh pack TEXT_DIR TOKENIZER_JSON` writes the text and the
# tokenizer as xz parts into .xfer/ (ignored by git), carried over a few calls; the H200 tokenizes them with
# that tokenizer (`prepare --tokenizer`, 16 cores). The machine stays warm between calls, so /tmp persists.
set -euo pipefail
cd "$(dirname "$0")/../.."
XFER=/tmp/xfer DATA=/tmp/train-data RUN=/tmp/train-run
OUT=${OUT:-/tmp/out}
py=${PY:-python3}

case "${1:-}" in
pack)  # CPU side: TEXT_DIR (train/, heldout/, manifest.json) + TOKENIZER -> .xfer/text.tar.xz.partNN + SHA256SUMS
    src=$2; mkdir -p .xfer; rm -f .xfer/text.tar.xz.part* .xfer/SHA256SUMS
    cp "$3" "$src/tokenizer.json"
    tar -C "$src" -cf - train heldout manifest.json tokenizer.json | xz -T0 -9 | split -b 30M -d - .xfer/text.tar.xz.part
    (cd .xfer && sha256sum text.tar.xz.part* > SHA256SUMS && sha256sum -c SHA256SUMS >/dev/null)
    ls -la .xfer ;;
receive)
    shift; mkdir -p $XFER
    for f in "$@"; do cp "$f" $XFER/; done
    cp .xfer/SHA256SUMS $XFER/
    (cd $XFER && for f in "$@"; do grep " $(basename "$f")\$" SHA256SUMS | sha256sum -c -; done) ;;
smoke)
    $py -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
    rm -rf /tmp/smoke && mkdir -p /tmp/smoke/text/train /tmp/smoke/text/heldout
    $py - <<'PY'
import glob
docs = [open(f, encoding="utf-8").read() for f in sorted(glob.glob("dsa/**/*.py", recursive=True))]
open("/tmp/smoke/text/train/code.txt", "w").write("\n<|endoftext|>\n".join(docs * 3))
open("/tmp/smoke/text/heldout/readme.txt", "w").write("\n<|endoftext|>\n".join([open("README.md").read()] * 8))
PY
    $py benchmarks/train_default/train.py prepare --text /tmp/smoke/text --out /tmp/smoke/data --vocab 4096
    $py benchmarks/train_default/train.py train --data /tmp/smoke/data --out /tmp/smoke/out --max-steps 3 \
        --eval-windows 2 --recall-queries 16 --sample-tokens 8 --heldout-every 2 --log-every 1 "${@:2}"
    nvidia-smi --query-gpu=memory.used --format=csv ;;
start)
    shift
    $py -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
    (cd $XFER && sha256sum -c SHA256SUMS)
    rm -rf $DATA /tmp/train-text && mkdir -p $DATA /tmp/train-text $RUN
    cat $XFER/text.tar.xz.part* | xz -d -T0 | tar -C /tmp/train-text -xf -
    $py benchmarks/train_default/train.py prepare --text /tmp/train-text --out $DATA --tokenizer /tmp/train-text/tokenizer.json
    setsid nohup $py benchmarks/train_default/train.py train --data $DATA --out $RUN "$@" > $RUN/log 2>&1 < /dev/null &
    sleep 45; tail -5 $RUN/log ;;
wait)
    sleep "$2"
    grep -v '^\[' $RUN/log | tail -20; tail -3 $RUN/log
    mkdir -p $OUT; cp $RUN/log $OUT/train.log
    [ -f $RUN/checkpoint.pt ] && cp $RUN/checkpoint.pt /tmp/ckpt.pt && split -b 15M -d /tmp/ckpt.pt $OUT/checkpoint.pt.part
    ls -la $OUT ;;
collect)
    mkdir -p $OUT
    cp $RUN/log $OUT/train.log; cp $RUN/train.json $RUN/train_loss.png $DATA/data_manifest.json $OUT/
    tar -C $RUN -cf /tmp/model.tar model && split -b 15M -d /tmp/model.tar $OUT/model.tar.part
    (cd $OUT && sha256sum /tmp/model.tar | sed 's|/tmp/||' > model.tar.sha256)
    ls -la $OUT ;;
refit-start)
    shift
    $py -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
    (cd .xfer && sha256sum -c refit-data.sha256)
    rm -rf /tmp/refit-data /tmp/refit-run && mkdir -p /tmp/refit-data /tmp/refit-run
    xz -d -T0 < .xfer/refit-data.tar.xz | tar -C /tmp/refit-data -xf -
    cp -r dsa/data/default /tmp/refit-source  # the export as this call found it
    setsid nohup $py benchmarks/train_default/train.py refit --from /tmp/refit-source --data /tmp/refit-data \
        --out /tmp/refit-run "$@" > /tmp/refit-run/log 2>&1 < /dev/null &
    sleep 20; tail -5 /tmp/refit-run/log ;;
refit-wait)
    for _ in $(seq "$2"); do [ -f /tmp/refit-run/refit.json ] && break; sleep 1; done
    grep -v '^\[warmup\] {' /tmp/refit-run/log | cut -c1-400 | tail -12
    mkdir -p $OUT; cp /tmp/refit-run/log $OUT/refit.log
    if [ -f /tmp/refit-run/refit.json ]; then
        cp /tmp/refit-run/refit.json $OUT/
        tar -C /tmp/refit-run -cf /tmp/refit-model.tar model && split -b 15M -d /tmp/refit-model.tar $OUT/model.tar.part
        (cd /tmp && sha256sum refit-model.tar) > $OUT/model.tar.sha256
    fi
    ls -la $OUT ;;
check)  # [NAME CHECKPOINT]: demo and generate on the embedded default, or on CHECKPOINT (results named NAME)
    $py -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
    mkdir -p $OUT; name=${2:-default}; ckpt=${3:+--checkpoint $3}
    $py -m dsa demo $ckpt --json $OUT/demo-h200-$name.json 2>&1 | grep -v "it/s\|step/s" | tail -25
    $py -m dsa generate $ckpt --prompt "Once upon a time" --max-tokens 64 --seed 0 2>&1 | tail -8 ;;
gpu-tests)
    $py -m pip install -q --no-build-isolation --no-deps -e . >/dev/null
    $py -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -15 ;;
*) echo "usage: $0 pack TEXT_DIR TOKENIZER | receive PART... | smoke | start [ARGS...] | wait SECONDS | collect |" \
        "refit-start [ARGS...] | refit-wait SECONDS | check [NAME CKPT] | gpu-tests" >&2; exit 2 ;;
esac
