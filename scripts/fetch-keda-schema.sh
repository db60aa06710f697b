#!/usr/bin/env bash
# KEDA's ScaledObject schema for the render tests: @kubernetes-models/keda (KEDA's CRDs compiled to
# validators) at the versions tests/k8s/keda/package-lock.json pins, from the npm registry. Idempotent;
# installs into .cache/keda-schema.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.cache/keda-schema"
if [[ -f "$dest/node_modules/@kubernetes-models/keda/package.json" ]] \
  && cmp -s "$root/tests/k8s/keda/package-lock.json" "$dest/package-lock.json"; then
  cp "$root/tests/k8s/keda/check.mjs" "$dest/"
  exit 0
fi
mkdir -p "$dest"
cp "$root/tests/k8s/keda/package.json" "$root/tests/k8s/keda/package-lock.json" "$root/tests/k8s/keda/check.mjs" "$dest/"
(cd "$dest" && npm ci --silent --no-audit --no-fund --loglevel=error)
echo "KEDA schema in $dest"
