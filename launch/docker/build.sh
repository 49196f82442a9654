#!/usr/bin/env bash
# Build (and optionally push) the GPU or TPU image of jaxagent from the repository root.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: launch/docker/build.sh [--dry-run] [--push] [--tag TAG] gpu|tpu

Runs `docker build -f launch/docker/Dockerfile.KIND -t TAG REPO_ROOT` (and `docker push TAG`).

  --dry-run  print the docker commands instead of running them
  --push     push the image after building
  --tag TAG  image tag (default: jaxagent:KIND)
USAGE
}

dry_run=0
push=0
tag=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry_run=1; shift ;;
    --push) push=1; shift ;;
    --tag) tag="$2"; shift 2 ;;
    *) break ;;
  esac
done
kind="${1:-}"
if [[ "$kind" != gpu && "$kind" != tpu ]]; then
  echo "build.sh: KIND must be gpu or tpu, got '${kind}'" >&2
  exit 2
fi
root="$(cd "$(dirname "$0")/../.." && pwd)"
tag="${tag:-jaxagent:$kind}"
build=(docker build -f "$root/launch/docker/Dockerfile.$kind" -t "$tag" "$root")
push_cmd=(docker push "$tag")
if [[ $dry_run -eq 1 ]]; then
  echo "${build[*]}"
  [[ $push -eq 0 ]] || echo "${push_cmd[*]}"
  exit 0
fi
"${build[@]}"
[[ $push -eq 0 ]] || "${push_cmd[@]}"
