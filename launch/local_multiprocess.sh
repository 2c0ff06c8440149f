#!/usr/bin/env bash
# N local JAX processes on CPU joined by jax.distributed (rl_jax.distributed.maybe_initialize).
#
# Usage:
#   launch/local_multiprocess.sh NUM_PROCESSES [ARGS...]
#   launch/local_multiprocess.sh 2 --config=configs/countdown_tiny.py:test --workdir=/tmp/rl_mp
#   RL_JAX_MODULE=rl_jax.distributed launch/local_multiprocess.sh 2     # set-up smoke test
#
# Environment (all optional):
#   RL_JAX_PORT            coordinator port on 127.0.0.1 (default: a free one)
#   DEVICES_PER_PROCESS    CPU devices each process simulates (default 1)
#   RL_JAX_MODULE          module to run (default rl_jax.main)
#   PYTHON                 interpreter (default python)
#   LOG_DIR                per-process logs (default: a fresh temp dir); process 0 also prints here
#   TIMEOUT_S              kill every process after this many seconds (default: none)
set -euo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[0-9]+$ || "$1" -lt 1 ]]; then
  sed -n '2,16p' "$0" >&2
  exit 2
fi
NUM="$1"; shift
PYTHON="${PYTHON:-python}"
MODULE="${RL_JAX_MODULE:-rl_jax.main}"
DEVICES="${DEVICES_PER_PROCESS:-1}"
LOG_DIR="${LOG_DIR:-$(mktemp -d /tmp/rl_jax_mp.XXXXXX)}"
mkdir -p "$LOG_DIR"
# A port the kernel just handed out is almost surely still free a moment later.
PORT="${RL_JAX_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"

pids=()
tail_pid=""
cleanup() {
  # Only the processes this script started, by id (the log tail too: `tail -f` never ends by itself).
  for pid in ${pids[@]+"${pids[@]}"} $tail_pid; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
# Ctrl-C / kill (a preemption): forward the signal and wait. Each process finishes its step, every
# process agrees on it, checkpoints and exits 75 (rl_jax.preempt), which this script then returns.
# A second signal stops them at once.
forwarded=""
forward() {
  if [[ -n "$forwarded" ]]; then cleanup; exit 130; fi
  forwarded="$1"
  echo "[local_multiprocess] SIG$1: forwarded to every process; waiting for their checkpoint" >&2
  for pid in ${pids[@]+"${pids[@]}"}; do kill -s "$1" "$pid" 2>/dev/null || true; done
}
trap 'forward INT' INT
trap 'forward TERM' TERM

# Created before any process starts so that `tail -f` below never races a log file into existence.
for ((i = 0; i < NUM; i++)); do : >"$LOG_DIR/process_$i.log"; done
for ((i = 0; i < NUM; i++)); do
  env JAX_PLATFORMS=cpu \
      XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES}" \
      RL_JAX_COORDINATOR="127.0.0.1:${PORT}" \
      RL_JAX_NUM_PROCESSES="$NUM" \
      RL_JAX_PROCESS_ID="$i" \
      ${TIMEOUT_S:+timeout "$TIMEOUT_S"} "$PYTHON" -m "$MODULE" "$@" >"$LOG_DIR/process_$i.log" 2>&1 &
  pids+=("$!")
done
echo "[local_multiprocess] $NUM processes of $MODULE, coordinator 127.0.0.1:$PORT, logs in $LOG_DIR" >&2
tail -n +1 -f "$LOG_DIR/process_0.log" &
tail_pid=$!

# Wait for all; the first failure takes the others down (a peer would otherwise hang in a collective).
status=0
running=("${pids[@]}")
while (( ${#running[@]} > 0 )); do
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then still+=("$pid"); continue; fi
    set +e; wait "$pid"; rc=$?; set -e
    if (( rc != 0 && status == 0 )); then
      status=$rc
      if [[ -n "$forwarded" ]]; then
        echo "[local_multiprocess] process pid $pid exited with status $rc; waiting for the others" >&2
      else
        echo "[local_multiprocess] process pid $pid exited with status $rc; stopping the others" >&2
      fi
    fi
  done
  # Preempted: the others are checkpointing the same step (a collective write); let them finish.
  (( status != 0 )) && [[ -z "$forwarded" ]] && break
  running=(${still[@]+"${still[@]}"})
  (( ${#running[@]} > 0 )) && sleep 0.5
done
kill "$tail_pid" 2>/dev/null || true
tail_pid=""
if (( status != 0 )); then
  for ((i = 1; i < NUM; i++)); do
    echo "--- process $i (last lines) ---" >&2
    tail -n 20 "$LOG_DIR/process_$i.log" >&2 || true
  done
fi
exit "$status"
