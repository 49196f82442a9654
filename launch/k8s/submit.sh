#!/usr/bin/env bash
# Render launch/k8s/jobset.yaml and submit it with kubectl (JobSet controller required).
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: launch/k8s/submit.sh [--dry-run] --image IMAGE [--name NAME] [--processes N]
                            [--accelerator RESOURCE] [--per-pod K] [--pvc CLAIM]
                            [--sandbox bwrap|docker|process] -- COMMAND...

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
  --sandbox BACKEND       the run's rewards.backend, which decides what the pods get
                          (docs/sandbox.md, Kubernetes): bwrap a privileged trainer container
                          and an emptyDir at /sandbox; docker a privileged dockerd sidecar from
                          the same image, sharing /sandbox and its socket; process nothing.
                          Default: the command's rewards.backend=... override, else bwrap (give
                          it where a --config file sets rewards.backend)

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
sandbox=""
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
    --sandbox) sandbox="$2"; shift 2 ;;
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

for arg in "$@"; do  # the backend the command's config override picks
  if [[ "$arg" == rewards.backend=* ]]; then
    if [[ -n "$sandbox" && "$sandbox" != "${arg#*=}" ]]; then
      echo "submit.sh: --sandbox $sandbox but the command sets $arg; they must agree" >&2
      exit 2
    fi
    sandbox="${arg#*=}"
  fi
done
sandbox="${sandbox:-bwrap}"

# What each backend needs in the pod, as YAML at the indentation of its `# ${SANDBOX_...}` line.
sandbox_env=""; sandbox_security=""; sandbox_mounts=""; sandbox_sidecar=""; sandbox_volumes=""
mount_sandbox='- name: sandbox
  mountPath: /sandbox       # the sandboxes'"'"' host-side work dirs (TMPDIR)'
case "$sandbox" in
  bwrap)
    sandbox_env='- name: TMPDIR
  value: /sandbox'
    sandbox_security='securityContext:
  privileged: true          # bwrap: namespaces, mounts and a fresh /proc (docs/sandbox.md)'
    sandbox_mounts="$mount_sandbox"
    sandbox_volumes='- name: sandbox
  emptyDir: {}'
    ;;
  docker)
    sandbox_env='- name: TMPDIR
  value: /sandbox
- name: DOCKER_HOST
  value: unix:///sandbox/docker.sock'
    sandbox_mounts="$mount_sandbox"
    sandbox_sidecar="initContainers:
  - name: dockerd  # a native sidecar (Kubernetes >= 1.29): up before the trainer, ends with it
    image: ${image}  # the trainer's image: the harness and pytest it binds lie at the same paths
    restartPolicy: Always
    command: [dockerd, --host=unix:///sandbox/docker.sock, --iptables=false, --bridge=none]
    securityContext:
      privileged: true
    startupProbe:
      exec:
        command: [docker, --host=unix:///sandbox/docker.sock, version]
      periodSeconds: 2
      failureThreshold: 60
    volumeMounts:
      - name: sandbox
        mountPath: /sandbox   # the same path as the trainer's: the FIFOs and work dirs it binds
      - name: docker-data
        mountPath: /var/lib/docker"
    sandbox_volumes='- name: sandbox
  emptyDir: {}
- name: docker-data         # the engine'"'"'s images and containers, on the node'"'"'s disk (overlay2)
  emptyDir: {}'
    ;;
  process) ;;
  *)
    echo "submit.sh: --sandbox (the config's rewards.backend) must be bwrap, docker or process, got '$sandbox'" >&2
    exit 2
    ;;
esac

command="$(printf '%q ' "$@")"
command="${command//\\/\\\\}"   # the command sits in a YAML double-quoted string
command="${command//\"/\\\"}"
template="$(dirname "$0")/jobset.yaml"
manifest="$(NAME="$name" IMAGE="$image" NUM_PROCESSES="$processes" ACCELERATOR="$accelerator" \
  ACCELERATORS_PER_POD="$per_pod" PVC="$pvc" COMMAND="$command" SANDBOX_ENV="$sandbox_env" \
  SANDBOX_SECURITY="$sandbox_security" SANDBOX_MOUNTS="$sandbox_mounts" \
  SANDBOX_SIDECAR="$sandbox_sidecar" SANDBOX_VOLUMES="$sandbox_volumes" \
  awk '/^ *# \$\{SANDBOX_[A-Z]+\}$/ {
         indent = substr($0, 1, index($0, "#") - 1)
         key = substr($0, index($0, "{") + 1); key = substr(key, 1, length(key) - 1)
         n = split(ENVIRON[key], lines, "\n")
         for (i = 1; i <= n; i++) print indent lines[i]
         next }
       { while (match($0, /\$\{[A-Z_]+\}/)) {
           key = substr($0, RSTART + 2, RLENGTH - 3)
           $0 = substr($0, 1, RSTART - 1) ENVIRON[key] substr($0, RSTART + RLENGTH) }
         print }' "$template")"
if [[ $dry_run -eq 1 ]]; then
  echo "$manifest"
  exit 0
fi
echo "$manifest" | kubectl apply -f -
