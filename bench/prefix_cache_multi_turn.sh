#!/bin/bash
# Multi-turn conversations (each turn resends the whole history), two experiments:
#
# caching: 4 conversations of 4 turns (a shared 300-word system prompt, 40-word messages,
#   16-token answers, 2 conversations at a time) through `tandem serve`, prefix caching on and
#   then off.
# routing: 2 prefill workers + 1 decode worker + `tandem router` as processes (threads 1 each),
#   8 conversations of 10 turns (a shared 100-word system prompt, 20-word messages, 16-token
#   answers, all 8 at a time), `--routing kv-aware` and then `--routing load`. PREFILL_KV_BYTES
#   sets the prefill workers' --kv-cache-bytes (default: theirs, 512 MiB, where nothing is
#   evicted; 50331648, 48 MiB, holds about 6,100 tokens of the small model: more than half of
#   the conversations' final histories, less than all of them). The prompt tokens the prefill workers
#   computed (tandem_prefix_cache_queries_tokens_total minus
#   tandem_prefix_cache_hits_tokens_total, summed over both) go to OUT_DIR/routing-MODE.tokens.
#
#   CONVERSATIONS, TURNS, CONCURRENCY, SYSTEM_LEN, INPUT_LEN, OUTPUT_LEN and THINK_TIME (unset:
#   a conversation holds its slot throughout; set: `tandem bench --think-time`, turns of other
#   conversations run in between) change the routing workload from the default above.
#
#   bench/results/kv-routing-bounded-cache-2026-11-27.md sweeps PREFILL_KV_BYTES with
#   CONVERSATIONS=32 TURNS=10 CONCURRENCY=8 THINK_TIME=0; with 134217728 (128 MiB per prefill
#   worker) kv-aware routing computed under half the prefill tokens of load routing.
#
# usage: bench/prefix_cache_multi_turn.sh build/bin/tandem OUT_DIR [caching|routing|all]
# MODEL (default /tmp/prefix-small) is written with the small preset when missing.
set -e
BIN=$1; OUT=$2; WHAT=${3:-all}
mkdir -p $OUT
. $(dirname $0)/serve_lib.sh

if [ $WHAT = caching ] || [ $WHAT = all ]; then
  for mode in on off; do
    flag=""; [ $mode = off ] && flag="--no-enable-prefix-caching"
    start_serve $OUT/serve-$mode.log --threads 2 --max-num-batched-tokens 512 $flag
    $BIN bench --url $URL --model prefix-small --workload multi-turn --num-requests 4 --turns 4 \
      --system-prompt-len 300 --input-len 40 --output-len 16 --max-concurrency 2 --no-progress \
      --json $OUT/mt-$mode.json > $OUT/mt-$mode.txt 2>&1 || true
    stop $PID
  done
fi

if [ $WHAT = routing ] || [ $WHAT = all ]; then
  ENGINE="--threads 1 --max-num-batched-tokens 512"
  PREFILL_KV_BYTES=${PREFILL_KV_BYTES:-0}
  PREFILL="$ENGINE"
  [ $PREFILL_KV_BYTES != 0 ] && PREFILL="$ENGINE --kv-cache-bytes $PREFILL_KV_BYTES"
  for routing in kv-aware load; do
    PIDS=""
    start_worker $OUT/routing-$routing-p0.log prefill $PREFILL --worker-id p0; P0=$ADDR; M0=$METRICS
    start_worker $OUT/routing-$routing-p1.log prefill $PREFILL --worker-id p1; P1=$ADDR; M1=$METRICS
    start_worker $OUT/routing-$routing-d0.log decode $ENGINE --worker-id d0; D0=$ADDR
    start_router $OUT/routing-$routing-router.log $P0,$P1 $D0 --routing $routing
    THINK=""; [ -n "${THINK_TIME:-}" ] && THINK="--think-time $THINK_TIME"
    $BIN bench --url $URL --model prefix-small --workload multi-turn \
      --num-requests ${CONVERSATIONS:-8} --turns ${TURNS:-10} --system-prompt-len ${SYSTEM_LEN:-100} \
      --input-len ${INPUT_LEN:-20} --output-len ${OUTPUT_LEN:-16} \
      --max-concurrency ${CONCURRENCY:-8} $THINK --no-progress \
      --json $OUT/routing-$routing.json > $OUT/routing-$routing.txt 2>&1 || true
    computed=0
    for m in $M0 $M1; do
      q=$(metric $m tandem_prefix_cache_queries_tokens_total)
      h=$(metric $m tandem_prefix_cache_hits_tokens_total)
      echo "$m queries $q hits $h" >> $OUT/routing-$routing.tokens
      computed=$((computed + ${q%.*} - ${h%.*}))
    done
    echo "computed $computed" >> $OUT/routing-$routing.tokens
    curl -s $URL/metrics | grep -E "^tandem_router_(routing_decisions_total|kv_index_blocks)" \
      >> $OUT/routing-$routing.tokens || true
    stop $PIDS
  done
fi
