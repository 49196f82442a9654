#!/usr/bin/env bash
# Render launch/k8s/jobset.yaml and submit it with kubectl (JobSet controller required).
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: launch/k8s/submit.sh [--dry-run] --image IMAGE [--name NAME] [--processes N]
                            [--accelerator RESOURCE] [--per-pod K] [--pvc CLAIM] -- COMMAND...

Renders the JobSet (N indexed pods; pod 0 is the jax.distributed coordinator) and pipes it to
`kubectl apply -f -`. COMMAND runs in every pod; give it a workdir under /runs (a shared
volume), e.g. workdir=/runs/exp1.

  --dry-run               print the rendered manifest instead of applying it
  --image IMAGE           container image (launch/docker/ builds one)
  --name NAME             JobSet name (default: jaxagent)
  --processes N           pods, one jax process each (default: 2)
  --accelerator RESOURCE  e.g. nvidia.com/gpu (default) or google.com/tpu
  --per-pod K             accelerators per pod (default: 8)
  --pvc CLAIM             PersistentVolumeClaim mounted at /runs (default: jaxagent-runs)

example: launch/k8s/submit.sh --image ghcr.io/me/jaxagent:gpu --processes 4 -- \
           jaxagent train --config configs/x.yaml workdir=/runs/x mesh.fsdp=-1 mesh.dcn_data=4
USAGE
}

dry_run=0
name=jaxagent
image=""
processes=2
accelerator=nvidia.com/gpu
per_pod=8
pvc=jaxagent-runs
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --name) name="$2"; shift 2 ;;
    --image) image="$2"; shift 2 ;;
    --processes) processes="$2"; shift 2 ;;
    --accelerator) accelerator="$2"; shift 2 ;;
    --per-pod) per_pod="$2"; shift 2 ;;
    --pvc) pvc="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "submit.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [[ -z "$image" || $# -eq 0 ]]; then
  echo "submit.sh: --image and a COMMAND after -- are required" >&2
  exit 2
fi
if ! [[ "$processes" =~ ^[1-9][0-9]*$ ]]; then
  echo "submit.sh: --processes must be a positive integer, got '$processes'" >&2
  exit 2
fi

command="$(printf '%q ' "$@")"
command="${command//\\/\\\\}"   # the command sits in a YAML double-quoted string
command="${command//\"/\\\"}"
template="$(dirname "$0")/jobset.yaml"
manifest="$(NAME="$name" IMAGE="$image" NUM_PROCESSES="$processes" ACCELERATOR="$accelerator" \
  ACCELERATORS_PER_POD="$per_pod" PVC="$pvc" COMMAND="$command" \
  awk '{ while (match($0, /\$\{[A-Z_]+\}/)) {
           key = substr($0, RSTART + 2, RLENGTH - 3)
           $0 = substr($0, 1, RSTART - 1) ENVIRON[key] substr($0, RSTART + RLENGTH) }
         print }' "$template")"
if [[ $dry_run -eq 1 ]]; then
  echo "$manifest"
  exit 0
fi
echo "$manifest" | kubectl apply -f -
