#!/usr/bin/env bash
# Real vLLM for the GPU machine (../shared/reference/vllm-on-the-gpu.md), prepared here: vLLM's CUDA wheel for
# CPython 3.12 on manylinux x86_64 at the project's pin, stripped of the compiled parts that cannot load on that
# machine's torch 2.11, packed as tar.xz and split, plus the wheels vLLM needs there (pinned in
# scripts/gpu-vllm-requirements.txt), laid out as .gpu-vllm/piece-1, piece-2, ...: one folder per GPU machine
# call, each small enough to travel next to the tree. scripts/gpu-vllm.sh installs them there. Idempotent: what is
# already downloaded or packed is kept. Prints the calls to make.
#   usage: scripts/fetch-gpu-vllm.sh [--dry-run]   (--dry-run: print the pieces' sizes, write nothing)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.gpu-vllm"
python=${PYTHON:-$root/.venv/bin/python}
[[ -x $python ]] || python=python3
version=0.32.0
# llguidance publishes manylinux_2_31 wheels only; the GPU machine's glibc runs them (it ran there by hand).
platforms=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform any)
download() { # download DIR ARGS...: wheels only, for the GPU machine's interpreter, no dependency resolution
    local dir=$1
    shift
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dir" "$@"
}

# What the tree adds to every call: tracked and untracked files that git does not ignore.
tree_bytes=$(cd "$root" && git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')

mkdir -p "$dest/download" "$dest/wheels"
shopt -s nullglob
wheel=("$dest"/download/vllm-"$version"-*.whl)
if ((${#wheel[@]} == 0)); then
    if [[ ${1:-} == --dry-run ]]; then
        echo "dry run: vLLM $version's wheel is not downloaded yet (.gpu-vllm/download); nothing to size" >&2
        exit 1
    fi
    download "$dest/download" "vllm==$version"
    wheel=("$dest"/download/vllm-"$version"-*.whl)
fi
# A wheel named in the requirements but absent from wheels/ is fetched; the others are kept.
mapfile -t wanted < <(grep -Ev '^\s*(#|$)' "$root/scripts/gpu-vllm-requirements.txt")
missing=()
for requirement in "${wanted[@]}"; do
    name=${requirement%%==*}
    stem=$(tr '[:upper:]-.' '[:lower:]__' <<<"$name")
    present=()
    for candidate in "$dest"/wheels/*.whl; do
        base=$(basename "$candidate" | tr '[:upper:]' '[:lower:]')
        [[ $base == "$stem-${requirement#*==}-"* ]] && present+=("$candidate")
    done
    ((${#present[@]})) || missing+=("$requirement")
done
if ((${#missing[@]})); then
    if [[ ${1:-} == --dry-run ]]; then
        echo "dry run: not downloaded yet: ${missing[*]}" >&2
        exit 1
    fi
    download "$dest/wheels" "${missing[@]}"
fi

if [[ ${1:-} == --dry-run ]]; then
    # The archive's size: the one packed last, else the size measured when it was first made (66.5 MiB).
    archive="$dest/build/vllm-$version-stripped.tar.xz"
    if [[ -f $archive ]]; then bytes=$(stat -c %s "$archive"); else bytes=69730304; fi
    echo "tree $tree_bytes bytes, archive $bytes bytes; the pieces (folder, bytes, files):"
    "$python" "$root/scripts/gpu_vllm.py" plan --wheels "$dest/wheels" --tree-bytes "$tree_bytes" --archive-bytes "$bytes"
    exit 0
fi
mapfile -t pieces < <("$python" "$root/scripts/gpu_vllm.py" pack --root "$dest" --wheel "${wheel[0]}" \
    --wheels "$dest/wheels" --tree-bytes "$tree_bytes")
echo
echo "The tree travels with every call: $((tree_bytes / 1024)) KiB. The GPU machine calls, back to back (the machine"
echo "keeps /tmp only while it stays up, ~30 s idle), each from the repository root:"
n=0
for line in "${pieces[@]}"; do
    n=$((n + 1))
    read -r folder bytes <<<"$line"
    printf '  %d. carry .gpu-vllm/%s (%d MiB + tree): scripts/gpu-vllm.sh /tmp/pd-vllm\n' "$n" "$folder" $(((bytes + 1048575) / 1048576))
done
echo "  $((n + 1)). carry .whl (scripts/fetch-gpu-wheels.sh): PD_GPU_SUITE_STEPS=vllm scripts/gpu-suite.sh \$OUT/vllm"
echo "The call that completes the pieces installs vLLM into /tmp/pd-vllm and prints READY or NOT READY."
