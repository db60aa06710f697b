#!/usr/bin/env bash
# Build the operator and engine images, tagged with the project version (= the chart's appVersion).
#   images/build.sh                         build both
#   images/build.sh --only operator         build one
#   images/build.sh --kind-load CLUSTER     also load them into a kind cluster
#   REGISTRY=ghcr.io/me images/build.sh     change the repository prefix
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml" | awk 'NR == 1')
app_version=$(sed -n 's/^appVersion: "\(.*\)"/\1/p' "$root/charts/pd-operator/Chart.yaml")
if [[ "$version" != "$app_version" ]]; then
  echo "pyproject version $version != chart appVersion $app_version" >&2; exit 1
fi
registry=${REGISTRY:-ghcr.io/pd-operator}
only="" kind_cluster=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --only) only=$2; shift 2 ;;
    --kind-load) kind_cluster=$2; shift 2 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
declare -A images=([operator]="$registry/pd-operator:$version" [engine]="$registry/pd-engine:$version")
for name in operator engine; do
  [[ -n "$only" && "$only" != "$name" ]] && continue
  echo "building ${images[$name]}"
  docker build --build-arg VERSION="$version" -f "$root/images/$name/Dockerfile" -t "${images[$name]}" "$root"
  if [[ -n "$kind_cluster" ]]; then
    kind load docker-image --name "$kind_cluster" "${images[$name]}"
  fi
done
