# Shared by the bench/prefix_cache_*.sh scripts: the model, and starting and stopping
# `tandem serve` or separate workers and a router. Source it after setting BIN (the tandem
# binary) and OUT (where logs go).
# MODEL (default /tmp/prefix-small) is written with the small preset when missing.
MODEL=${MODEL:-/tmp/prefix-small}
[ -f $MODEL/config.json ] || $BIN synth-model --out $MODEL --preset small

# wait_for LOG REGEX: prints the first match of REGEX in LOG once it appears (up to 5 minutes).
wait_for() {
  local i found
  for i in $(seq 1 600); do
    found=$(grep -s -o -E "$2" $1 | head -1)
    [ -n "$found" ] && { echo "$found"; return 0; }
    sleep 0.5
  done
  echo "bench: no '$2' in $1" >&2
  return 1
}

# start_serve LOG FLAGS...: `tandem serve FLAGS` on a free port; sets PID and URL.
start_serve() {
  local log=$1; shift
  $BIN serve --model $MODEL --served-model-name prefix-small --port 0 "$@" > $log 2>&1 &
  PID=$!
  URL=$(wait_for $log "http://127.0.0.1:[0-9]+")
}

# start_worker LOG prefill|decode FLAGS...: a worker on free ports; appends its pid to PIDS and
# sets ADDR (its control plane) and METRICS (its /metrics URL).
start_worker() {
  local log=$1 role=$2; shift 2
  $BIN $role --model $MODEL --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 "$@" > $log 2>&1 &
  PIDS="$PIDS $!"
  ADDR=$(wait_for $log "listening on [0-9.:]+" | cut -d' ' -f3)
  METRICS=http://127.0.0.1:$(wait_for $log "metrics on port [0-9]+" | cut -d' ' -f4)/metrics
}

# start_router LOG PREFILL DECODE FLAGS...: `tandem router` on a free port; appends its pid to
# PIDS and sets URL.
start_router() {
  local log=$1 prefill=$2 decode=$3; shift 3
  $BIN router --model $MODEL --served-model-name prefix-small --port 0 --prefill $prefill \
    --decode $decode "$@" > $log 2>&1 &
  PIDS="$PIDS $!"
  URL=$(wait_for $log "http://127.0.0.1:[0-9]+")
}

# stop PID...: SIGINT (finish what runs) and wait, last started first.
stop() {
  local p
  for p in $(echo "$@" | tr ' ' '\n' | tac); do kill -INT $p 2>/dev/null; wait $p || true; done
}

# metric URL NAME: the value of series NAME on URL's /metrics (0 when absent).
metric() {
  curl -s $1 | awk -v n="$2" '$1 == n { print $2; found = 1 } END { if (!found) print 0 }'
}
