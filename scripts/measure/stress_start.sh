#!/usr/bin/env bash
# Start tokenfuse's commands N times each, count the starts that abort, and keep every start's stderr.
#
#   scripts/measure/stress_start.sh N [COMMAND ...]     COMMAND: generate score eval serve (default: all four)
#
# Each start runs with PYTHONFAULTHANDLER=1, so an abort prints the Python stack of every thread (the
# native call it died in included), with glibc's fatal message on stderr (LIBC_FATAL_STDERR_=1).
# The commands, on the default ensemble (the three bundled models on llama.cpp):
#   generate  tokenfuse generate "Question: What is the capital of France?\nAnswer:" --max-new-tokens 4
#   score     tokenfuse score on a 300-byte text file
#   eval      tokenfuse eval --tasks text --limit 1 on a small text data set (two documents a split),
#             each start into a fresh --out
#   serve     tokenfuse serve on a free port, then one /v1/completions request (4 tokens), then SIGTERM
# A start counts as an abort when it dies of SIGABRT (rc 134) or its stderr holds one of glibc's heap
# messages ("munmap_chunk()", "free(): ", "double free", "corrupted", "malloc(): "); any other
# non-zero exit is counted as a failure. The table at the end: starts, aborts, failures and the
# median seconds of a start, per command.
#
# Environment:
#   TOKENFUSE=CMD   the command to start (default .venv/bin/tokenfuse); with PYTHONPATH=<tree>/src a
#                   worktree of another commit runs on the same .venv
#   LOAD=K          K busy processes beside the starts (a CPU-bound Python loop each, ended at the end)
#   OUT=DIR         where the logs go (default /tmp/stress-start-<time>); DIR/summary.tsv has one line
#                   a start: command, index, rc, seconds, verdict
#   MALLOC_CHECK_=3 (glibc's own checks) and the like pass through to every start.
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${1:?usage: scripts/measure/stress_start.sh N [generate score eval serve]}
shift
COMMANDS=("$@")
[ ${#COMMANDS[@]} -gt 0 ] || COMMANDS=(generate score eval serve)
TOKENFUSE=${TOKENFUSE:-.venv/bin/tokenfuse}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/stress-start-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONFAULTHANDLER=1 LIBC_FATAL_STDERR_=1

# inputs: a small text file to score and a small text data set (made here, nothing downloaded)
printf 'The quick brown fox jumps over the lazy dog. %.0s' {1..6} > "$OUT/doc.txt"
mkdir -p "$OUT/data/text"
for split in dev test; do
  : > "$OUT/data/text/$split.jsonl"
  for d in prose code; do
    printf '{"id": "%s-%s", "domain": "%s", "source": "stress_start.sh", "text": "A short %s document for the %s split: def f(x): return x + 1\\n"}\n' \
      "$split" "$d" "$d" "$d" "$split" >> "$OUT/data/text/$split.jsonl"
  done
done

BURNERS=()
for _ in $(seq "${LOAD:-0}"); do
  "$PY" -c 'import time
t = time.time() + 6 * 3600
while time.time() < t: pass' &
  BURNERS+=($!)
done
cleanup() { [ ${#BURNERS[@]} -eq 0 ] || kill "${BURNERS[@]}" 2>/dev/null; }
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

run_serve() {  # start the server, send one request once it answers, stop it; the server's rc
  local port log=$1 pid rc
  port=$(free_port)
  "$TOKENFUSE" serve --port "$port" --quiet 2> "$log" > /dev/null &
  pid=$!
  for _ in $(seq 600); do  # up to 120 s to answer
    kill -0 "$pid" 2>/dev/null || break
    if curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null 2>&1; then
      curl -sf "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
        -d '{"prompt": "Question: What is the capital of France?\nAnswer:", "max_tokens": 4}' > "$log.response" \
        || echo "stress_start: the request failed" >> "$log"
      kill -TERM "$pid"
      break
    fi
    sleep 0.2
  done
  kill -0 "$pid" 2>/dev/null && [ ! -s "$log.response" ] && { echo "stress_start: no answer in 120 s" >> "$log"; kill -KILL "$pid"; }
  wait "$pid"
  rc=$?
  [ -s "$log.response" ] || { [ "$rc" = 0 ] && rc=1; }
  [ "$rc" = 143 ] && [ -s "$log.response" ] && rc=0  # ended by our SIGTERM after answering
  return "$rc"
}

start() {  # one start of command $1, index $2; its rc
  local log="$OUT/$1-$2.stderr"
  case $1 in
    generate) "$TOKENFUSE" generate $'Question: What is the capital of France?\nAnswer:' --max-new-tokens 4 \
                > "$OUT/$1-$2.stdout" 2> "$log" ;;
    score) "$TOKENFUSE" score "$OUT/doc.txt" > "$OUT/$1-$2.stdout" 2> "$log" ;;
    eval) "$TOKENFUSE" eval --tasks text --limit 1 --data "$OUT/data" --out "$OUT/eval-$2" --quiet \
            > "$OUT/$1-$2.stdout" 2> "$log"
          rm -rf "$OUT/eval-$2" ;;
    serve) run_serve "$log" ;;
    *) echo "unknown command $1 (generate, score, eval, serve)" >&2; exit 2 ;;
  esac
}

printf 'command\tindex\trc\tseconds\tverdict\n' > "$OUT/summary.tsv"
for i in $(seq "$N"); do
  for c in "${COMMANDS[@]}"; do
    t0=$(date +%s%N)
    start "$c" "$i"
    rc=$?
    ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    verdict=ok
    if [ "$rc" = 134 ] || grep -qE 'munmap_chunk\(\)|free\(\): |double free|corrupted|malloc\(\): ' "$OUT/$c-$i.stderr"; then
      verdict=abort
    elif [ "$rc" != 0 ]; then
      verdict=fail
    fi
    printf '%s\t%s\t%s\t%d.%03d\t%s\n' "$c" "$i" "$rc" $((ms / 1000)) $((ms % 1000)) "$verdict" >> "$OUT/summary.tsv"
    [ "$verdict" = ok ] && rm -f "$OUT/$c-$i.stdout" "$OUT/$c-$i.stderr.response"
    [ "$verdict" = ok ] || echo "start $i of $c: $verdict (rc $rc), stderr in $OUT/$c-$i.stderr" >&2
  done
done

"$PY" - "$OUT/summary.tsv" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
print(f"{'command':<10}{'starts':>8}{'aborts':>8}{'failures':>10}{'median s':>10}")
for c in dict.fromkeys(r["command"] for r in rows):
    mine = [r for r in rows if r["command"] == c]
    n = lambda v: sum(r["verdict"] == v for r in mine)
    print(f"{c:<10}{len(mine):>8}{n('abort'):>8}{n('fail'):>10}{statistics.median(float(r['seconds']) for r in mine):>10.2f}")
print(f"logs: {sys.argv[1].rsplit('/', 1)[0]}")
EOF
