#!/usr/bin/env bash
# The wheels the GPU machine lacks (it has torch, numpy and pytest but no network), at the versions pinned in
# constraints.txt, for CPython 3.12 on manylinux x86_64, into .whl/ (ignored by git). Run here, from anywhere;
# scripts/gpu-suite.sh installs them there. Idempotent: a wheel already present is not fetched again.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.whl"
python=${PYTHON:-$root/.venv/bin/python}
[[ -x $python ]] || python=python3
packages=(nixl-cu13 nixl pydantic pydantic_core annotated-types typing-inspection msgspec kopf python-json-logger iso8601 pytest-asyncio
    kubernetes websocket-client requests-oauthlib oauthlib durationpy aiohttp-retry cbor2 pyzmq pytest-timeout)

# PEP 503 names: case, '-', '_' and '.' do not matter.
normalise() { tr '[:upper:]' '[:lower:]' <<<"$1" | sed -E 's/[-_.]+/-/g'; }

pinned() {
    local want line name
    want=$(normalise "$1")
    while IFS= read -r line; do
        [[ $line =~ ^([A-Za-z0-9._-]+)==([^[:space:]#]+) ]] || continue
        name=$(normalise "${BASH_REMATCH[1]}")
        if [[ $name == "$want" ]]; then
            echo "${BASH_REMATCH[2]}"
            return
        fi
    done <"$root/constraints.txt"
    echo "fetch-gpu-wheels: $1 is not pinned in constraints.txt" >&2
    return 1
}

mkdir -p "$dest"
shopt -s nullglob nocaseglob
missing=()
for package in "${packages[@]}"; do
    version=$(pinned "$package")
    stem=$(normalise "$package" | tr - _)
    present=("$dest/$stem-$version-"*.whl)
    ((${#present[@]})) || missing+=("$package==$version")
done
if ((${#missing[@]})); then
    "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$dest" "${missing[@]}"
fi

# nixl-cu13 ships the NIXL expert-parallel library too (~110 MB unpacked): not used, and it would push the tree past
# the 64 MiB a GPU machine call can carry.
for wheel in "$dest"/nixl_cu13-"$(pinned nixl-cu13)"-*.whl; do
    # grep reads the whole listing (-q would stop early, and pipefail would count the lister's broken pipe)
    if python3 -m zipfile -l "$wheel" | grep '^nixl_ep_cu13/' >/dev/null; then
        zip -q -d "$wheel" 'nixl_ep_cu13/*'
    fi
done
echo "GPU wheels in $dest:"
ls -1 "$dest"
