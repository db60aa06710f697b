#!/usr/bin/env bash
# On the GPU machine, once per call, from the repository root with that call's .gpu-vllm/piece-N carried along
# (scripts/fetch-gpu-vllm.sh prepares them here and prints the calls): copies the piece to DEST, outside the tree,
# where it survives between calls while the machine stays up. The call that brings the last piece reassembles
# vLLM, installs it and its wheels into DEST/site-packages (pip --target, no network), applies the start-up
# workarounds to that copy only (vllm_flash_attn's import guard; the site settings in DEST/site.env), and checks
# `import vllm` with CUDA. A later call without pieces checks again. Prints READY / WAITING / NOT READY.
# `. DEST/activate.sh` then puts that vLLM on PYTHONPATH and points pdctl at DEST/site.env.
#   usage: scripts/gpu-vllm.sh DEST   (e.g. /tmp/pd-vllm)
set -euo pipefail
if (($# != 1)); then
    echo "usage: $0 DEST" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
exec "${PYTHON:-python3}" "$root/scripts/gpu_vllm.py" install --tree "$root" --dest "$1"
