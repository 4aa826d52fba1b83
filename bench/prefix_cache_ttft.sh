#!/bin/bash
# The same ~2,000-token prompt (760 words of the bench's vocabulary: 1,974 tokens of the small
# synthetic model) sent twice, one after the other, through `tandem serve` (router + prefill +
# decode workers), with prefix caching on and then off; the second TTFT over the first is what
# bench/results/prefix-cache-*.md records.
# usage: bench/prefix_cache_ttft.sh build/bin/tandem OUT_DIR [WORDS]
# MODEL (default /tmp/prefix-small) is written with the small preset when missing.
set -e
BIN=$1; OUT=$2; WORDS=${3:-760}
mkdir -p $OUT
. $(dirname $0)/serve_lib.sh
for mode in on off; do
  flag=""; [ $mode = off ] && flag="--no-enable-prefix-caching"
  start_serve $OUT/serve-$mode.log --threads 2 --max-num-batched-tokens 512 $flag
  $BIN bench --url $URL --model prefix-small --workload multi-turn --num-requests 2 --turns 1 \
    --system-prompt-len $WORDS --input-len 0 --output-len 4 --max-concurrency 1 --no-progress \
    --json $OUT/ttft-$mode.json > $OUT/ttft-$mode.txt 2>&1 || true
  stop $PID
done
