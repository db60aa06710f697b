#!/usr/bin/env bash
# The kind end-to-end run, for a machine with Docker and kind:
#   e2e/kind/run.sh            create the cluster, build and load images, helm install, run the suite
#   KEEP_CLUSTER=1 e2e/kind/run.sh   leave the cluster up afterwards
# Logs of every pod are collected into e2e/kind/logs/ when the suite fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cluster=pd-operator
export KUBECONFIG=${KUBECONFIG:-$root/e2e/kind/kubeconfig}
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "$tool is required" >&2; exit 2; }
done

if ! kind get clusters | grep -qx "$cluster"; then
  kind create cluster --config "$root/e2e/kind/cluster.yaml" --kubeconfig "$KUBECONFIG" --wait 120s
fi
cleanup() {
  status=$?
  if [[ $status -ne 0 ]]; then collect_logs; fi
  if [[ -z "${KEEP_CLUSTER:-}" ]]; then kind delete cluster --name "$cluster"; fi
  exit $status
}
collect_logs() {
  local dir="$root/e2e/kind/logs"
  mkdir -p "$dir"
  kubectl get all,pdservices -A -o wide > "$dir/objects.txt" 2>&1 || true
  kubectl get events -A --sort-by=.lastTimestamp > "$dir/events.txt" 2>&1 || true
  for pod in $(kubectl get pods -A -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name}{"\n"}{end}'); do
    kubectl logs -n "${pod%%/*}" "${pod##*/}" --all-containers > "$dir/${pod//\//_}.log" 2>&1 || true
  done
  echo "logs in $dir"
}
trap cleanup EXIT

"$root/images/build.sh" --only operator --kind-load "$cluster"
version=$(sed -n 's/^appVersion: "\(.*\)"/\1/p' "$root/charts/pd-operator/Chart.yaml")
helm upgrade --install pd-operator "$root/charts/pd-operator" \
  --namespace pd-system --create-namespace --wait --timeout 5m \
  --set image.pullPolicy=Never
kubectl -n pd-system rollout status deploy/pd-operator --timeout=180s

cd "$root"
PD_E2E_KIND=1 PD_E2E_IMAGE="ghcr.io/pd-operator/pd-operator:$version" \
  .venv/bin/python -m pytest -m kind tests/e2e/kind -v
