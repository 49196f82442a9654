#!/usr/bin/env bash
# Run COMMAND as NPROC processes on this machine, each with DEVICES_PER_PROC CPU devices,
# joined by jax.distributed (gloo CPU collectives): a multi-host run without the hosts.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: launch/local_multihost.sh [--dry-run] [--port PORT] [--logdir DIR] NPROC DEVICES_PER_PROC -- COMMAND...

Starts NPROC copies of COMMAND with
  JAX_PLATFORMS=cpu, XLA_FLAGS=--xla_force_host_platform_device_count=DEVICES_PER_PROC,
  JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT, JAX_NUM_PROCESSES=NPROC, JAX_PROCESS_ID=i.
Process 0 prints to this terminal; process i logs to DIR/process_i.log (default: a temp dir).
If any process fails, the others are stopped and its exit status is returned.

  --dry-run    print the commands instead of running them
  --port PORT  coordinator port (default: a random free-looking port in 20000-39999)
  --logdir DIR where the other processes' logs go

example: launch/local_multihost.sh 2 2 -- jaxagent train mesh.data=2 mesh.fsdp=2
USAGE
}

dry_run=0
port=$((20000 + RANDOM % 20000))
logdir=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --port) port="$2"; shift 2 ;;
    --logdir) logdir="$2"; shift 2 ;;
    *) break ;;
  esac
done
if [[ $# -lt 4 || "$3" != "--" ]]; then
  usage >&2
  exit 2
fi
nproc="$1"
devices="$2"
shift 3
for n in "$nproc" "$devices"; do
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
    echo "local_multihost.sh: NPROC and DEVICES_PER_PROC must be positive integers, got '$n'" >&2
    exit 2
  fi
done
logdir="${logdir:-$(mktemp -d -t jaxagent-multihost.XXXXXX)}"

# The environment of process $1, in the array `envs`.
env_for() {
  envs=("JAX_PLATFORMS=cpu" "XLA_FLAGS=--xla_force_host_platform_device_count=$devices"
    "JAX_COORDINATOR_ADDRESS=127.0.0.1:$port" "JAX_NUM_PROCESSES=$nproc" "JAX_PROCESS_ID=$1")
}

if [[ $dry_run -eq 1 ]]; then
  for ((i = 0; i < nproc; i++)); do
    out="(this terminal)"
    [[ $i -gt 0 ]] && out="> $logdir/process_$i.log"
    env_for "$i"
    echo "${envs[*]} $(printf '%q ' "$@")$out"
  done
  exit 0
fi

mkdir -p "$logdir"
pids=()
# shellcheck disable=SC2329  # invoked by the trap
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM
for ((i = 0; i < nproc; i++)); do
  env_for "$i"
  if [[ $i -eq 0 ]]; then
    env "${envs[@]}" "$@" &
  else
    env "${envs[@]}" "$@" >"$logdir/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done

# Wait for all; on the first failure stop the rest and report which one failed.
status=0
declare -A index_of
for ((i = 0; i < nproc; i++)); do index_of[${pids[$i]}]=$i; done
live=("${pids[@]}")
while [[ ${#live[@]} -gt 0 ]]; do
  set +e
  wait -n -p done_pid "${live[@]}"
  code=$?
  set -e
  rest=()
  for pid in "${live[@]}"; do [[ "$pid" != "$done_pid" ]] && rest+=("$pid"); done
  live=("${rest[@]}")
  if [[ $code -ne 0 ]]; then
    echo "local_multihost.sh: process ${index_of[$done_pid]} exited with status $code;" \
      "stopping the others (logs: $logdir)" >&2
    status=$code
    break
  fi
done
exit "$status"
