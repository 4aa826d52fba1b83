#!/bin/bash
# 4 conversations of 4 turns (a shared 300-word system prompt, 40-word messages, 16-token
# answers, 2 conversations at a time) through `tandem serve`, prefix caching on and then off.
# usage: bench/prefix_cache_multi_turn.sh build/bin/tandem OUT_DIR
# MODEL (default /tmp/prefix-small) is written with the small preset when missing.
set -e
BIN=$1; OUT=$2
mkdir -p $OUT
MODEL=${MODEL:-/tmp/prefix-small}
[ -f $MODEL/config.json ] || $BIN synth-model --out $MODEL --preset small
for mode in on off; do
  flag=""; [ $mode = off ] && flag="--no-enable-prefix-caching"
  $BIN serve --model $MODEL --served-model-name prefix-small --port 0 --threads 2 --max-num-batched-tokens 512 $flag > $OUT/serve-$mode.log 2>&1 &
  pid=$!
  for i in $(seq 1 600); do url=$(grep -o "http://127.0.0.1:[0-9]*" $OUT/serve-$mode.log | head -1); [ -n "$url" ] && break; sleep 0.5; done
  $BIN bench --url $url --model prefix-small --workload multi-turn --num-requests 4 --turns 4 \
    --system-prompt-len 300 --input-len 40 --output-len 16 --max-concurrency 2 --no-progress \
    --json $OUT/mt-$mode.json > $OUT/mt-$mode.txt 2>&1 || true
  kill -INT $pid; wait $pid || true
done
