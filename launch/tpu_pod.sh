#!/usr/bin/env bash
# Run COMMAND on every worker of a Cloud TPU VM pod (one process per host; jax.distributed
# finds the pod by itself), forwarding chosen environment variables and collecting logs.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: launch/tpu_pod.sh [--dry-run] --name TPU --zone ZONE [--project P] [--workdir DIR]
                         [--env VAR]... [--logdir DIR] -- COMMAND...

Runs `cd DIR && VAR=value... COMMAND` on all workers with
  gcloud compute tpus tpu-vm ssh TPU --zone=ZONE --worker=all --command=...
Each worker's output is also written to DIR/logs/HOSTNAME.log on that worker
and copied back to --logdir (default: ./tpu_logs/TPU) with `gcloud ... scp --worker=all`.

  --dry-run     print the gcloud commands instead of running them
  --name TPU    the TPU VM (pod slice) name
  --zone ZONE   its zone
  --project P   GCP project (default: gcloud's)
  --workdir DIR directory of the jaxagent checkout on the workers (default: jaxagent, in the home directory)
  --env VAR     forward this variable's local value to every worker (repeatable),
                e.g. --env WANDB_API_KEY --env HF_TOKEN
  --logdir DIR  where to collect the workers' logs

example: launch/tpu_pod.sh --name my-v5p-64 --zone us-east5-a -- \
           jaxagent train --config configs/qwen2.5-coder-7b-humaneval-grpo.yaml mesh.fsdp=-1
USAGE
}

dry_run=0
name=""
zone=""
project=""
workdir="jaxagent"  # relative to the home directory ssh lands in
logdir=""
forward=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --project) project="$2"; shift 2 ;;
    --workdir) workdir="$2"; shift 2 ;;
    --env) forward+=("$2"); shift 2 ;;
    --logdir) logdir="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "tpu_pod.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ -z "$name" || -z "$zone" || $# -eq 0 ]]; then
  echo "tpu_pod.sh: --name, --zone and a COMMAND after -- are required" >&2
  exit 2
fi
logdir="${logdir:-./tpu_logs/$name}"

exports=""
for var in "${forward[@]}"; do
  exports+="export $var=$(printf '%q' "${!var-}"); "
done
remote="cd $workdir && mkdir -p logs && ${exports}$(printf '%q ' "$@")"
# shellcheck disable=SC2016  # expanded on the worker, not here
remote+='2>&1 | tee "logs/$(hostname).log"'
gcloud_args=(--zone="$zone" --worker=all)
[[ -n "$project" ]] && gcloud_args+=(--project="$project")
run_cmd=(gcloud compute tpus tpu-vm ssh "$name" "${gcloud_args[@]}" --command="$remote")
fetch_cmd=(gcloud compute tpus tpu-vm scp "${gcloud_args[@]}"
  "$name:$workdir/logs/*" "$logdir/")

if [[ $dry_run -eq 1 ]]; then
  echo "gcloud compute tpus tpu-vm ssh $name ${gcloud_args[*]} --command='$remote'"
  echo "${fetch_cmd[*]}"
  exit 0
fi
mkdir -p "$logdir"
status=0
"${run_cmd[@]}" || status=$?
"${fetch_cmd[@]}" || echo "tpu_pod.sh: could not copy logs back to $logdir" >&2
exit "$status"
